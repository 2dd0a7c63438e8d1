"""What a GGUF file is: the facts `dflashd inspect` prints, and the full validation a worker applies
before loading it (format, architecture, per-architecture tensor checks, tokenizer, chat template)."""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

from daemons import architectures
from daemons.gguf_reader import GGUFFile

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def layer_types(gguf: GGUFFile) -> list[str]:
    """One label per block, read from which tensors the block has (architecture-independent)."""
    blocks: dict[int, set[str]] = {}
    for name in gguf.tensors:
        m = _BLOCK.match(name)
        if m:
            blocks.setdefault(int(m.group(1)), set()).add(m.group(2).split(".")[0])
    labels = []
    for i in sorted(blocks):
        parts = blocks[i]
        if "ssm_a" in parts or "attn_qkv" in parts and "ssm_out" in parts:
            mixer = "deltanet"
        elif "attn_q" in parts or "attn_qkv" in parts:
            mixer = "attention"
        else:
            mixer = "other"
        if "ffn_gate_inp" in parts:
            mixer += "+moe"
        labels.append(mixer)
    return labels


def summarize_runs(labels: list[str]) -> str:
    """'deltanet x3, attention x1' repeated patterns, e.g. '(deltanet x3, attention) x4'."""
    if not labels:
        return "none"
    for period in range(1, len(labels) // 2 + 1):
        if len(labels) % period == 0 and labels == labels[:period] * (len(labels) // period):
            unit = _runs(labels[:period])
            reps = len(labels) // period
            return unit if reps == 1 else f"({unit}) x{reps}"
    return _runs(labels)


def _runs(labels: list[str]) -> str:
    out, prev, n = [], None, 0
    for lab in labels + [None]:
        if lab == prev:
            n += 1
            continue
        if prev is not None:
            out.append(prev if n == 1 else f"{prev} x{n}")
        prev, n = lab, 1
    return ", ".join(out)


def validate(gguf: GGUFFile) -> None:
    """Everything a worker checks before loading: the architecture is known and served, its
    tensors have the right names, shapes and types, and the tokenizer and chat template (if any)
    are usable. Raises the typed errors of the reader, tokenizer and chat-template modules."""
    module = architectures.worker_module(gguf)
    module.check_file(gguf)
    md = gguf.metadata
    if "tokenizer.ggml.model" in md:
        from daemons.tokenizer import Tokenizer
        Tokenizer.from_metadata(md, source=gguf.path)
    if "tokenizer.chat_template" in md:
        from daemons.chat_template import ChatTemplate
        ChatTemplate.from_metadata(md)


def describe(gguf: GGUFFile, *, with_metadata: bool = False) -> dict[str, Any]:
    """The facts `dflashd inspect` shows. Needs only a structurally valid file and a known
    architecture; tensor shapes are not checked here (that is `validate`)."""
    arch = architectures.lookup(gguf)
    md = gguf.metadata
    by_type: Counter[str] = Counter()
    n_params = 0
    for t in gguf.tensors.values():
        by_type[t.type_name] += t.nbytes
        n_params += t.n_elements
    labels = layer_types(gguf)
    tokens = md.get("tokenizer.ggml.tokens")
    info: dict[str, Any] = {
        "file": gguf.path,
        "file_bytes": gguf.file_size,
        "architecture": arch.name,
        "description": arch.description,
        "role": arch.role,
        "served_by": arch.worker,
        "name": md.get("general.name"),
        "parameters": n_params,
        "tensors": len(gguf.tensors),
        "layers": len(labels),
        "layer_types": labels,
        "layer_pattern": summarize_runs(labels),
        "quantization_bytes": dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
        "tokenizer": {
            "model": md.get("tokenizer.ggml.model"),
            "pre": md.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens) if isinstance(tokens, list) else None,
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        },
        "chat_template": isinstance(md.get("tokenizer.chat_template"), str),
    }
    if with_metadata:
        info["metadata"] = md
        info["metadata_types"] = gguf.metadata_types
    return info


def format_human(info: dict[str, Any]) -> str:
    def size(n: int) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if n < 1024 or unit == "GiB":
                return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
            n /= 1024
        return str(n)

    tok = info["tokenizer"]
    lines = [
        f"file:          {info['file']} ({size(info['file_bytes'])})",
        f"architecture:  {info['architecture']} — {info['description']}",
        f"served by:     {info['served_by'] or 'no worker yet'} ({info['role']})",
        f"name:          {info['name'] or '-'}",
        f"parameters:    {info['parameters']:,} in {info['tensors']} tensors",
        f"layers:        {info['layers']}: {info['layer_pattern']}",
        "quantization:  " + ", ".join(f"{k} {size(v)}" for k, v in info["quantization_bytes"].items()),
        f"tokenizer:     {tok['model'] or 'none'}"
        + (f" (pre={tok['pre']}), vocab {tok['vocab_size']}" if tok["model"] else ""),
        f"chat template: {'yes' if info['chat_template'] else 'no'}",
    ]
    return "\n".join(lines)
