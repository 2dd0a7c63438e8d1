"""Chat templates (`tokenizer.chat_template`) rendered the way HF transformers renders them.

The template is Jinja2 source shipped inside the model file, i.e. untrusted input.  It runs in
jinja2's `ImmutableSandboxedEnvironment` (no access to private attributes, no mutation of lists
and dicts passed in), made stricter in one way: touching a forbidden attribute fails at once
(jinja2 itself would hand back an undefined value that prints as "").  Otherwise it has the same
settings, globals and filters transformers' `apply_chat_template` provides, so that a template
renders to the same string here and there:

* `trim_blocks=True, lstrip_blocks=True`, the `loopcontrols` extension (`{% break %}`,
  `{% continue %}`) and the `{% generation %}...{% endgeneration %}` block (rendered as its body);
* `raise_exception(message)`, `strftime_now(format)`;
* `tojson` with `json.dumps` semantics: non-ASCII kept (ensure_ascii=False), no HTML escaping,
  optional `indent`, `separators`, `sort_keys`;
* variables: `messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token`,
  `enable_thinking` when given, and any extra keyword.

Every failure (syntax error, sandbox violation, `raise_exception`, a runtime error inside the
template) raises `ChatTemplateError` with a one-line message.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "ChatTemplate"]


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, unsafe, or failed while rendering."""


def _raise_exception(message: Any) -> None:
    # Templates call this to reject conversations they cannot format (e.g. an unknown role).
    raise TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' and sorts keys; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering it is just its body, evaluated in its own scope as a call block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _token_text(md: Mapping[str, Any], id_key: str) -> str:
    """The vocabulary text of the token whose id is stored under `id_key`, or "" if there is none."""
    token_id, tokens = md.get(id_key), md.get("tokenizer.ggml.tokens")
    if isinstance(token_id, bool) or not isinstance(token_id, int) or not isinstance(tokens, Sequence):
        return ""
    if 0 <= token_id < len(tokens) and isinstance(tokens[token_id], str):
        return tokens[token_id]
    return ""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The sandbox jinja2 ships turns a forbidden attribute (`x.__class__`) into an undefined value
    that only fails once it is used, and prints as "" otherwise.  Here the access itself fails, so
    a template probing for a way out is refused even when it only prints what it found."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe.")


class ChatTemplate:
    """A compiled chat template.  `bos_token`/`eos_token` are the texts the template sees under
    those names (transformers passes the tokenizer's special-token strings)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat template must be a string, got {type(source).__name__}")
        if not source.strip():
            raise ChatTemplateError("chat template is empty")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _StrictSandbox(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template syntax error at line {exc.lineno}: {_one_line(exc.message or '')}"
            ) from None
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {_one_line(str(exc))}") from None

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], bos_token: str | None = None, eos_token: str | None = None
    ) -> "ChatTemplate":
        """The template stored under `tokenizer.chat_template` in GGUF metadata.

        `bos_token`/`eos_token` default to the texts of the file's BOS/EOS tokens (what
        transformers passes from the tokenizer), or "" where the file has none."""
        source = md.get("tokenizer.chat_template")
        if source is None:
            raise ChatTemplateError("model has no chat template")
        if isinstance(source, bytes):
            try:
                source = source.decode("utf-8")
            except UnicodeDecodeError:
                raise ChatTemplateError("tokenizer.chat_template is not valid UTF-8") from None
        if bos_token is None:
            bos_token = _token_text(md, "tokenizer.ggml.bos_token_id")
        if eos_token is None:
            eos_token = _token_text(md, "tokenizer.ggml.eos_token_id")
        return cls(source, bos_token=bos_token, eos_token=eos_token)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation.  `tools` are JSON-schema dicts; `enable_thinking` is passed to the
        template only when it is not None (templates test `enable_thinking is defined`)."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
                raise ChatTemplateError(f"tools must be a list of dicts, got {type(tools).__name__}")
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ChatTemplateError(f"tools[{i}] must be a dict (a JSON schema), got {type(tool).__name__}")
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables.update(extra)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template blocked by the sandbox: {_one_line(str(exc))}") from None
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {_one_line(str(exc))}") from None
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except Exception as exc:  # a template can trip any Python error (TypeError, KeyError, ...)
            raise ChatTemplateError(
                f"chat template failed: {type(exc).__name__}: {_one_line(str(exc))}"
            ) from None
