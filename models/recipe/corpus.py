"""The training corpus: the local Python installation's standard library (sources and text docs),
split into train and held-out parts by file, and turned into chat documents.

Split rule: a file is held out iff `sha256(SPLIT_SALT + relative path)` read as a fraction lies below
`heldout_fraction`. The rule depends on nothing but the path, so a file keeps its side whatever else
is in the installation (the GPU machine's 3.12 stdlib and this machine's 3.11 differ; the manifest
records the version), and no held-out file is ever seen in training, not even through the
tokenizer, which is trained on the train split only.

Documents (what the chat template turns into training text; see `models/recipe/README.md`):
- a **file document** per file: the user message is the file's head (shebang, comments and the
  module docstring, or its first lines), the assistant turn is the rest of the file: the model learns
  to continue the start of a Python file as code;
- a **function document** per function or class with a docstring: the user message is a request
  made from the docstring's first sentence ("Write a Python function that returns ..." for an
  imperative "Return ...", or the sentence itself), the assistant turn is the definition's source:
  the model learns to answer a plain-English request with code (the demo's prompt is such a request).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["SourceFile", "Document", "Corpus", "build_corpus", "split_of", "file_documents", "chatml",
           "CHAT_TEMPLATE", "SPLIT_SALT"]

SPLIT_SALT = "dflashd-recipe-split-v1:"
_MICRO_SALT = "dflashd-recipe-micro-v1:"
TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 1 << 20          # larger files are data (unicode tables, generated code)
MAX_LINE_CHARS = 1000             # a longer line is a data blob (base64, hex dumps), not code or prose
MAX_FUNCTION_CHARS = 4000

# The chat template shipped in the tokenizer (and so in the GGUF): ChatML, as Qwen's, without tools
# or thinking. `chatml` below renders exactly what this renders (the recipe's tests check it).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
END_OF_DOCUMENT = "<|endoftext|>"


def chatml(messages: Iterable[tuple[str, str]], add_generation_prompt: bool = False) -> str:
    """What CHAT_TEMPLATE renders for [(role, content), ...], without jinja (fast, for the corpus)."""
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def split_of(relpath: str, heldout_fraction: float) -> str:
    """'heldout' or 'train' for a file, from its relative path alone."""
    return "heldout" if _fraction(SPLIT_SALT + relpath) < heldout_fraction else "train"


def _fraction(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class SourceFile:
    relpath: str                 # posix path relative to the stdlib directory
    text: str
    split: str                   # "train" or "heldout"

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Document:
    """One chat exchange: `user` asks, `assistant` answers (code)."""
    kind: str                    # "file" or "function"
    source: str                  # relpath of the file it came from
    user: str
    assistant: str

    def prompt(self) -> str:
        """The rendered prompt up to the assistant's turn (what a chat request sends)."""
        return chatml([("user", self.user)], add_generation_prompt=True)

    def text(self) -> str:
        """The whole exchange, then the end-of-document token (training text)."""
        return chatml([("user", self.user), ("assistant", self.assistant)]) + END_OF_DOCUMENT


@dataclass
class Corpus:
    stdlib_dir: str
    heldout_fraction: float
    files: list[SourceFile]
    skipped: dict[str, int] = field(default_factory=dict)
    _docs: dict[str, list[Document]] = field(default_factory=dict, repr=False)

    def split(self, name: str) -> list[SourceFile]:
        return [f for f in self.files if f.split == name]

    def file_docs(self, f: SourceFile) -> list[Document]:
        if f.relpath not in self._docs:
            self._docs[f.relpath] = file_documents(f)
        return self._docs[f.relpath]

    def documents(self, name: str) -> list[Document]:
        return [d for f in self.split(name) for d in self.file_docs(f)]

    def manifest(self) -> dict:
        out: dict = {
            "python_version": sys.version.split()[0],
            "stdlib_dir": self.stdlib_dir,
            "split_rule": f"heldout iff sha256('{SPLIT_SALT}' + relpath)[:8] / 2**64 < {self.heldout_fraction}",
            "heldout_fraction": self.heldout_fraction,
            "suffixes": list(TEXT_SUFFIXES),
            "skipped": dict(self.skipped),
        }
        for name in ("train", "heldout"):
            files = self.split(name)
            docs = [d for f in files for d in self.file_docs(f)]
            out[name] = {
                "n_files": len(files), "bytes": sum(f.nbytes for f in files),
                "n_documents": len(docs), "n_function_documents": sum(d.kind == "function" for d in docs),
                "files": [[f.relpath, f.nbytes] for f in files],
            }
        return out

    def write_manifest(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.manifest(), indent=1), encoding="utf-8")


def _walk(stdlib_dir: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(TEXT_SUFFIXES):
                yield Path(root) / name


def build_corpus(stdlib_dir: str | os.PathLike | None = None, heldout_fraction: float = 0.05,
                 micro_bytes: int | None = None) -> Corpus:
    """Read the standard library under `stdlib_dir` (default: this interpreter's). `micro_bytes`
    keeps a deterministic subset of about that many bytes of `.py` files (chosen by another hash of
    the path, so the subset does not favour either split) for the CPU test run."""
    d = Path(stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve()
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no standard library directory here")
    skipped: dict[str, int] = {}
    files: list[SourceFile] = []
    paths = list(_walk(d))
    if micro_bytes is not None:
        paths = sorted((p for p in paths if p.suffix == ".py"), key=lambda p: _fraction(_MICRO_SALT + p.relative_to(d).as_posix()))
    total = 0
    for p in paths:
        rel = p.relative_to(d).as_posix()
        try:
            size = p.stat().st_size
        except OSError:
            skipped["unreadable"] = skipped.get("unreadable", 0) + 1
            continue
        if size > MAX_FILE_BYTES:
            skipped["larger than 1 MiB"] = skipped.get("larger than 1 MiB", 0) + 1
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            skipped["not UTF-8"] = skipped.get("not UTF-8", 0) + 1
            continue
        text = text.replace("\r\n", "\n")
        if not text.strip():
            skipped["empty"] = skipped.get("empty", 0) + 1
            continue
        if max(map(len, text.split("\n"))) > MAX_LINE_CHARS:
            skipped[f"a line over {MAX_LINE_CHARS} chars"] = skipped.get(f"a line over {MAX_LINE_CHARS} chars", 0) + 1
            continue
        if "<|" in text and "|>" in text:      # would collide with the chat special tokens
            skipped["contains <|...|>"] = skipped.get("contains <|...|>", 0) + 1
            continue
        files.append(SourceFile(rel, text, split_of(rel, heldout_fraction)))
        total += len(text)
        if micro_bytes is not None and total >= micro_bytes:
            break
    files.sort(key=lambda f: f.relpath)
    return Corpus(str(d), heldout_fraction, files, skipped)


# ------------------------------------------------------------------------------------------------
# documents
# ------------------------------------------------------------------------------------------------

_HEAD_LINES = 12


def _parse(f: SourceFile) -> ast.Module | None:
    if not f.relpath.endswith(".py"):
        return None
    try:
        return ast.parse(f.text)
    except (SyntaxError, ValueError):
        return None


def _split_head(f: SourceFile, tree: ast.Module | None) -> tuple[str, str] | None:
    """(head, rest) of a file: for Python, the leading comments plus the module docstring when there
    is one (else the first lines); for text, the first paragraph (at most _HEAD_LINES lines)."""
    lines = f.text.split("\n")
    cut = None
    if tree is not None and tree.body and isinstance(tree.body[0], ast.Expr) \
            and isinstance(getattr(tree.body[0], "value", None), ast.Constant) \
            and isinstance(tree.body[0].value.value, str):
        cut = tree.body[0].end_lineno
        if cut is not None and cut > 40:          # a long docstring: the first lines make the request
            cut = None
    if cut is None:
        cut = next((i for i, line in enumerate(lines[:_HEAD_LINES]) if i >= 2 and not line.strip()), None)
        cut = cut if cut is not None else min(_HEAD_LINES, max(1, len(lines) // 4))
    head = "\n".join(lines[:cut]).strip("\n")
    rest = "\n".join(lines[cut:]).lstrip("\n")
    if not head.strip() or not rest.strip():
        return None
    return head, rest


_VERB = re.compile(r"^([A-Z][a-z]+)\b(.*)$", re.S)
# docstrings of this form are not imperative sentences; keep them as they are
_NOT_VERBS = {"The", "This", "A", "An", "If", "Internal", "Helper", "Private", "See", "Like", "Same",
              "Base", "Class", "Mixin", "Abstract", "Test", "Tests", "Deprecated", "Used", "Called", "In",
              "For", "When", "Note", "Utility", "Simple", "Wrapper", "Dummy", "Default", "Generic", "Decorator",
              "Context", "Exception", "Error", "Support", "Raised", "Subclass", "Descriptor", "Implementation"}


def _third_person(verb: str) -> str:
    v = verb.lower()
    if v.endswith("s") and not v.endswith("ss"):      # already third person ("Returns ...")
        return v
    if v.endswith(("s", "sh", "ch", "x", "z")):
        return v + "es"
    if v.endswith("y") and len(v) > 1 and v[-2] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def _request(kind: str, docstring: str, key: str) -> str:
    """The user's request for a definition: 'Write a Python function that returns ...' made from an
    imperative first sentence (two in three documents, chosen by hash), else the sentence itself."""
    para = " ".join(docstring.strip().split("\n\n")[0].split())
    m = re.search(r"[.!?](\s|$)", para)
    sentence = para[:m.end()].strip() if m else para
    m = _VERB.match(sentence)
    if m and m.group(1) not in _NOT_VERBS and kind == "function" and _fraction("req:" + key) < 2 / 3:
        rest = m.group(2)
        return f"Write a Python function that {_third_person(m.group(1))}{rest}"
    return sentence


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, nested ones included (definitions only occur in statement lists, so this
    finds them all without visiting expressions)."""
    for node in body:
        yield node
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(node, name, None)
            if isinstance(inner, list):
                yield from _statements(inner)
        for handler in getattr(node, "handlers", None) or []:
            yield from _statements(handler.body)
        for case in getattr(node, "cases", None) or []:
            yield from _statements(case.body)


def _definitions(f: SourceFile, tree: ast.Module) -> Iterator[Document]:
    lines = f.text.split("\n")
    for node in _statements(tree.body):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc.strip()) < 12:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        src_lines = lines[first - 1:node.end_lineno]
        indent = node.col_offset
        if any(line.strip() and len(line) - len(line.lstrip()) < indent for line in src_lines):
            src = textwrap.dedent("\n".join(src_lines))
        else:
            src = "\n".join(line[indent:] for line in src_lines)
        if len(src) > MAX_FUNCTION_CHARS:
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        yield Document("function", f.relpath, _request(kind, doc, f"{f.relpath}:{node.lineno}"), src.rstrip() + "\n")


def file_documents(f: SourceFile) -> list[Document]:
    """The file document and, for Python files, one function document per documented definition."""
    out: list[Document] = []
    tree = _parse(f)
    hr = _split_head(f, tree)
    if hr is not None:
        out.append(Document("file", f.relpath, hr[0], hr[1]))
    if tree is not None:
        out.extend(_definitions(f, tree))
    return out
