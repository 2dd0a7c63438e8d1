"""Synthetic GGUF files: a real architecture's layout and metadata with random weights.

Used by tests (fixture files without torch) and by benchmarks, so anyone can measure a machine on a
model of a real shape without downloading weights. The layout is llama.cpp's qwen35 layout (the
same one `dflashd convert` writes); the tokenizer is a byte-level vocabulary (256 byte tokens, a few
merges) plus the Qwen special tokens, so text round-trips.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGMLQuantizationType as QT

from daemons.gguf_writer import TensorData, Typed, write_gguf

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class Qwen35Shape:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_k_heads: int       # ssm.group_count
    n_v_heads: int       # ssm.time_step_rank
    ssm_head_dim: int    # ssm.state_size (d_k = d_v)
    n_rot: int
    full_attention_interval: int = 4
    conv_kernel: int = 4
    context_length: int = 4096
    rope_theta: float = 1e7
    tied_output: bool = False


PRESETS = {
    # a few KB: fast fixture for format tests
    "tiny": Qwen35Shape(n_embd=32, n_layer=4, n_ff=64, n_head=2, n_head_kv=1, head_dim=16,
                        n_k_heads=2, n_v_heads=4, ssm_head_dim=8, n_rot=8),
    # Qwen3.5/3.6-27B (math spec §1)
    "qwen35-27b": Qwen35Shape(n_embd=5120, n_layer=64, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256,
                              n_k_heads=16, n_v_heads=48, ssm_head_dim=128, n_rot=64),
}


BYTE_MERGES = ("Ġ t", "h e", "i n", "Ġt he", "e r", "o n")


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """GPT-2 byte-to-unicode tokens for all 256 bytes, a few merges (llama.cpp requires the merges
    key) and their tokens, then the special tokens (type 3 = control). Returns (tokens, types, merges)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    merged = [m.replace(" ", "") for m in BYTE_MERGES]
    tokens = [chr(table[b]) for b in range(256)] + merged + list(SPECIAL_TOKENS)
    types = [1] * (256 + len(merged)) + [3] * len(SPECIAL_TOKENS)
    return tokens, types, list(BYTE_MERGES)


def qwen35_metadata(shape: Qwen35Shape, tokens: list[str], token_types: list[int], merges: list[str],
                    *, name: str = "synthetic-qwen35", chat_template: str | None = CHATML_TEMPLATE) -> dict:
    a = "qwen35"
    s = shape
    md = {
        "general.name": name,
        f"{a}.context_length": s.context_length,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.block_count": s.n_layer,
        f"{a}.feed_forward_length": s.n_ff,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.attention.key_length": s.head_dim,
        f"{a}.attention.value_length": s.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": float(s.rope_theta),
        f"{a}.rope.dimension_count": s.n_rot,
        f"{a}.rope.dimension_sections": [s.n_rot // 2 // 3 + 1, s.n_rot // 2 // 3 + 1,
                                          s.n_rot // 2 - 2 * (s.n_rot // 2 // 3 + 1), 0],
        f"{a}.full_attention_interval": s.full_attention_interval,
        f"{a}.ssm.conv_kernel": s.conv_kernel,
        f"{a}.ssm.inner_size": s.n_v_heads * s.ssm_head_dim,
        f"{a}.ssm.state_size": s.ssm_head_dim,
        f"{a}.ssm.time_step_rank": s.n_v_heads,
        f"{a}.ssm.group_count": s.n_k_heads,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(token_types, _vt("ARRAY"), _vt("INT32")),
        "tokenizer.ggml.merges": Typed(merges, _vt("ARRAY"), _vt("STRING")),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>") if "<|im_end|>" in tokens else len(tokens) - 1,
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        md["tokenizer.chat_template"] = chat_template
    return md


def _vt(name: str):
    from gguf import GGUFValueType
    return getattr(GGUFValueType, name)


def qwen35_tensor_shapes(shape: Qwen35Shape, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the qwen35 layout with its numpy shape (ggml ne reversed)."""
    s = shape
    d_inner = s.n_v_heads * s.ssm_head_dim
    conv_ch = 2 * s.n_k_heads * s.ssm_head_dim + d_inner
    out = {"token_embd.weight": (n_vocab, s.n_embd), "output_norm.weight": (s.n_embd,)}
    if not s.tied_output:
        out["output.weight"] = (n_vocab, s.n_embd)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (s.n_embd,)
        out[p + "post_attention_norm.weight"] = (s.n_embd,)
        out[p + "ffn_gate.weight"] = (s.n_ff, s.n_embd)
        out[p + "ffn_up.weight"] = (s.n_ff, s.n_embd)
        out[p + "ffn_down.weight"] = (s.n_embd, s.n_ff)
        if (i + 1) % s.full_attention_interval == 0:
            out[p + "attn_q.weight"] = (2 * s.n_head * s.head_dim, s.n_embd)
            out[p + "attn_k.weight"] = (s.n_head_kv * s.head_dim, s.n_embd)
            out[p + "attn_v.weight"] = (s.n_head_kv * s.head_dim, s.n_embd)
            out[p + "attn_q_norm.weight"] = (s.head_dim,)
            out[p + "attn_k_norm.weight"] = (s.head_dim,)
            out[p + "attn_output.weight"] = (s.n_embd, s.n_head * s.head_dim)
        else:
            out[p + "attn_qkv.weight"] = (conv_ch, s.n_embd)
            out[p + "attn_gate.weight"] = (d_inner, s.n_embd)
            out[p + "ssm_conv1d.weight"] = (conv_ch, s.conv_kernel)
            out[p + "ssm_a"] = (s.n_v_heads,)
            out[p + "ssm_dt.bias"] = (s.n_v_heads,)
            out[p + "ssm_alpha.weight"] = (s.n_v_heads, s.n_embd)
            out[p + "ssm_beta.weight"] = (s.n_v_heads, s.n_embd)
            out[p + "ssm_norm.weight"] = (s.ssm_head_dim,)
            out[p + "ssm_out.weight"] = (s.n_embd, d_inner)
    return out


def write_synthetic_qwen35(path: str | os.PathLike, preset: str | Qwen35Shape = "tiny", *,
                           qtype: QT = QT.F32, seed: int = 0, **shape_overrides) -> Qwen35Shape:
    """A qwen35 GGUF with random weights scaled like a trained model's (norms near 1, ssm_a < 0).
    Matrices are stored as `qtype` (F32, F16, BF16, Q8_0, Q4_0); 1-D tensors and the conv stay F32
    as llama.cpp's converter keeps them."""
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    if shape_overrides:
        shape = replace(shape, **shape_overrides)
    rng = np.random.default_rng(seed)
    tokens, types, merges = byte_vocab()
    md = qwen35_metadata(shape, tokens, types, merges)
    tensors = []
    for name, shp in qwen35_tensor_shapes(shape, len(tokens)).items():
        if name.endswith("ssm_a"):
            x = -np.exp(rng.uniform(-1.0, 1.0, shp))
        elif len(shp) == 1 and "norm" in name:
            x = 1.0 + 0.1 * rng.standard_normal(shp)
        elif len(shp) == 1:
            x = 0.5 * rng.standard_normal(shp)
        else:
            x = rng.standard_normal(shp) / np.sqrt(shp[-1])
        keep_f32 = len(shp) == 1 or "ssm_conv1d" in name
        tensors.append(TensorData(name, x.astype(np.float32), QT.F32 if keep_f32 else qtype))
    write_gguf(path, "qwen35", md, tensors)
    return shape
