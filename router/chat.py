"""Prompts in, structured answers out: the text side of the router.

The router reads each model's GGUF metadata itself (`ModelText.from_gguf`) so that it can render a
conversation with the model's own chat template, tokenize it (the worker receives token ids and
never sees JSON), count tokens for `count_tokens`, and check a prompt against the context before any
worker is bothered.

On the way back, `OutputParser` splits the model's text into reasoning (`<think>...</think>`),
content and Qwen-style tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).  It
is incremental: streaming feeds it each TOKENS chunk and it holds back only text that could still
turn out to be the start of a marker, so a client never sees half a `<tool_call>` tag as content.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from daemons.chat_template import ChatTemplate, ChatTemplateError
from daemons.gguf_reader import GGUFFile
from daemons.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ChatError", "ModelText", "ToolCall", "ParsedOutput", "OutputParser", "parse_output",
    "normalize_messages", "new_call_id", "prompt_opens_reasoning",
    "THINK_OPEN", "THINK_CLOSE", "TOOL_OPEN", "TOOL_CLOSE",
]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                     "eos_token", "enable_thinking"})


class ChatError(ValueError):
    """A conversation the model's template or tokenizer cannot take (a 400 for the client)."""


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class ModelText:
    """What the router knows about one model's text side, read from its GGUF file."""

    path: Path | None
    architecture: str
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    template_problem: str | None  # why there is no template (chat requests then get a 400)
    n_ctx_train: int | None
    name: str | None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "ModelText":
        """Metadata only: no tensor is read.  Raises GGUFError / TokenizerError for unusable files."""
        with GGUFFile(path) as g:
            md = g.metadata
            arch = g.architecture
        tok = Tokenizer.from_metadata(md, source=os.fspath(path))
        template, problem = None, None
        try:
            template = ChatTemplate.from_metadata(md)
        except ChatTemplateError as e:
            problem = str(e)
        n_ctx = md.get(f"{arch}.context_length")
        return cls(path=Path(path), architecture=arch, tokenizer=tok, template=template,
                   template_problem=problem, n_ctx_train=n_ctx if isinstance(n_ctx, int) else None,
                   name=md.get("general.name") if isinstance(md.get("general.name"), str) else None)

    # ---- prompts ----------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, enable_thinking: bool | None = None,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        if self.template is None:
            raise ChatError(f"this model cannot chat: {self.template_problem or 'the router has no chat template for it'}")
        extra = dict(template_kwargs or {})
        for k in extra:
            if k in _RESERVED_TEMPLATE_VARS or not k.isidentifier():
                raise ChatError(f"chat_template_kwargs may not set {k!r}")
        if "enable_thinking" in (template_kwargs or {}):
            raise ChatError("set enable_thinking directly, not through chat_template_kwargs")
        try:
            return self.template.render(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                        enable_thinking=enable_thinking, **extra)
        except ChatTemplateError as e:
            raise ChatError(str(e)) from None

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt: special tokens written in it are parsed (the template writes
        `<|im_start|>` as text), BOS is added where the model asks for it and the text lacks it."""
        if self.tokenizer is None:
            raise ChatError("the router has no tokenizer for this model")
        try:
            ids = self.tokenizer.encode(text, add_special=False, parse_special=True)
        except TokenizerError as e:
            raise ChatError(str(e)) from None
        tok = self.tokenizer
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.tokenizer.stop_ids if self.tokenizer is not None else frozenset()


def _text_of(content: Any, where: str) -> str:
    """OpenAI message content (a string, null, or a list of parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            parts.append(part.get("text", ""))
        else:
            raise ChatError(f"{where}.content[{i}]: content of type {kind!r} is not supported (text only)")
    return "\n".join(parts)


def _arguments_object(arguments: Any) -> Any:
    """Templates (Qwen's among them) write `arguments | tojson`: give them the object, not the JSON
    string the OpenAI API carries, or the prompt holds an escaped string instead of the call."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the dicts chat templates expect (transformers' conventions):
    string content, `developer` as `system`, tool-call arguments as objects."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m["role"]
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text_of(m.get("content"), where)}
        if role == "assistant":
            if m.get("reasoning_content"):
                msg["reasoning_content"] = m["reasoning_content"]
            calls = m.get("tool_calls") or []
            if calls:
                msg["tool_calls"] = [
                    {"id": c.get("id") or new_call_id(), "type": "function",
                     "function": {"name": c["function"]["name"],
                                  "arguments": _arguments_object(c["function"].get("arguments", "{}"))}}
                    for c in calls]
        if role == "tool":
            if m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
            if m.get("name"):
                msg["name"] = m["name"]
        if m.get("name") and role in ("user", "system", "developer"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


# ---- output parsing --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def arguments_object(self) -> Any:
        return json.loads(self.arguments)


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def _parse_call(body: str, id_prefix: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` -> ToolCall, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(id_prefix), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def _held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class OutputParser:
    """Incremental split of model output into reasoning, content and tool calls.

    `feed(text)` and `finish()` return events: ("reasoning", str), ("content", str) or
    ("tool_call", ToolCall).  `in_reasoning=True` starts inside a think block (the prompt already
    opened `<think>`); `parse_tools=False` leaves `<tool_call>` text as content (no tools offered).
    """

    def __init__(self, *, parse_tools: bool, in_reasoning: bool = False, split_reasoning: bool = True,
                 id_prefix: str = "call_"):
        self.parse_tools = parse_tools
        self.split_reasoning = split_reasoning
        self.id_prefix = id_prefix
        self._mode = "reasoning" if (in_reasoning and split_reasoning) else "content"
        self._buf = ""
        self._content_started = False  # a <think> opening is only recognised before any content
        self._strip_leading = False  # drop the blank line the model writes after </think>

    def _markers(self) -> list[str]:
        if self._mode == "reasoning":
            return [THINK_CLOSE]
        if self._mode == "tool":
            return [TOOL_CLOSE]
        markers = []
        if self.parse_tools:
            markers.append(TOOL_OPEN)
        if self.split_reasoning and not self._content_started:
            markers.append(THINK_OPEN)
        return markers

    def _emit_text(self, kind: str, text: str, out: list) -> None:
        if kind == "content":
            if self._strip_leading:
                text = text.lstrip("\n")
                if not text:
                    return
                self._strip_leading = False
            self._content_started = self._content_started or bool(text.strip())
        if text:
            if out and out[-1][0] == kind and isinstance(out[-1][1], str):
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        self._buf += text
        while True:
            markers = self._markers()
            hits = [(self._buf.find(m), m) for m in markers]
            hits = [(i, m) for i, m in hits if i >= 0]
            if not hits:
                break
            i, marker = min(hits)
            before, self._buf = self._buf[:i], self._buf[i + len(marker):]
            if self._mode == "tool":
                call = _parse_call(before.strip(), self.id_prefix)
                if call is None:  # not a real call: give the client the text as written
                    self._mode = "content"
                    self._emit_text("content", TOOL_OPEN + before + TOOL_CLOSE, out)
                else:
                    self._mode = "content"
                    out.append(("tool_call", call))
                    self._strip_leading = True
            elif marker == THINK_CLOSE:
                self._emit_text("reasoning", before, out)
                self._mode = "content"
                self._strip_leading = True
            elif marker == THINK_OPEN:
                if before.strip():  # content already began: the tag is just text
                    self._emit_text("content", before + THINK_OPEN, out)
                else:
                    self._mode = "reasoning"
            else:  # TOOL_OPEN
                self._emit_text("content", before, out)
                self._mode = "tool"
        if self._mode != "tool":
            keep = _held_suffix(self._buf, self._markers())
            # Leading whitespace may precede <think>: hold it until the first non-blank text.
            if self._mode == "content" and not self._content_started and self.split_reasoning and not self._buf.strip():
                keep = len(self._buf)
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            self._emit_text(self._mode, ready, out)
        return out

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        rest, self._buf = self._buf, ""
        if self._mode == "tool":
            call = _parse_call(rest.strip(), self.id_prefix)  # a call cut off right before its close tag
            if call is not None:
                out.append(("tool_call", call))
            else:
                self._emit_text("content", TOOL_OPEN + rest, out)
        elif self._mode == "reasoning":
            self._emit_text("reasoning", rest, out)
        else:
            if not self._content_started:
                rest = rest.strip()
            self._emit_text("content", rest, out)
        self._mode = "content"
        return out


def parse_output(text: str, *, parse_tools: bool, in_reasoning: bool = False,
                 split_reasoning: bool = True, id_prefix: str = "call_") -> ParsedOutput:
    parser = OutputParser(parse_tools=parse_tools, in_reasoning=in_reasoning, split_reasoning=split_reasoning,
                          id_prefix=id_prefix)
    result = ParsedOutput()
    for kind, value in parser.feed(text) + parser.finish():
        if kind == "content":
            result.content += value
        elif kind == "reasoning":
            result.reasoning += value
        else:
            result.tool_calls.append(value)
    return result


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open think block (Qwen3 thinking templates write
    `<think>\\n` into the generation prompt), so the output starts with reasoning."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)

