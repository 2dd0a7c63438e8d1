"""Tiny random DFlash drafts for tests, in all three forms a user may have:

    zlab_dir = build_zlab_draft(root, target.hparams, target_layer_ids=(1, 3), block_size=8)
    forms = draft_forms(root, target.hparams, target_gguf=path)   # {"z-lab": dir, "dflash": gguf,
                                                                  #  "qwen35-dflash-draft": gguf}

The z-lab directory is what z-lab publishes (`config.json` with `architectures: ["DFlashDraftModel"]`
and a `dflash_config`, `model.safetensors` with z-lab's tensor names), written here with numpy; the
`dflash` GGUF comes from our converter (`daemons.convert.convert_dflash_to_gguf`); the
`qwen35-dflash-draft` GGUF is written here with the reference's (Luce) key and tensor names. All three
hold the same float32 weights, so the loaded drafts must propose identical tokens.

The weights are random: linear layers with unit-variance outputs, plain RMSNorm weights around 1,
so every part of the draft influences its logits (a dropped norm, a wrong head order or RoPE position
changes the proposals) while the draft predicts nothing useful (acceptance ~ chance).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

MASK_TOKEN_ID = 1010          # a padding row of the tiny targets' 1024-entry vocabulary (like Qwen's <|MASK|>)


def build_zlab_draft(root: str | Path, target_hp: Any, *, name: str = "draft", n_layer: int = 2, n_head: int = 4,
                     n_head_kv: int = 2, head_dim: int = 16, n_ff: int = 96, block_size: int = 8,
                     target_layer_ids: Sequence[int] = (1, 3), mask_token_id: int = MASK_TOKEN_ID,
                     rope_theta: float = 1e6, seed: int = 0, sliding_window: int | None = None,
                     layer_types: Sequence[str] | None = None, extra_config: dict[str, Any] | None = None,
                     extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write a z-lab DFlash draft directory for a target with hparams `target_hp` (n_embd, n_layer,
    n_vocab) under root/name; returns the directory."""
    from safetensors.numpy import save_file

    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    emb = int(target_hp.n_embd)
    n_feat = len(target_layer_ids)

    def lin(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    t = {"fc.weight": lin(emb, n_feat * emb), "hidden_norm.weight": norm(emb), "norm.weight": norm(emb)}
    for il in range(n_layer):
        p = f"layers.{il}."
        t.update({p + "input_layernorm.weight": norm(emb), p + "post_attention_layernorm.weight": norm(emb),
                  p + "self_attn.q_proj.weight": lin(n_head * head_dim, emb),
                  p + "self_attn.k_proj.weight": lin(n_head_kv * head_dim, emb),
                  p + "self_attn.v_proj.weight": lin(n_head_kv * head_dim, emb),
                  p + "self_attn.o_proj.weight": lin(emb, n_head * head_dim, 0.5),
                  p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
                  p + "mlp.gate_proj.weight": lin(n_ff, emb), p + "mlp.up_proj.weight": lin(n_ff, emb),
                  p + "mlp.down_proj.weight": lin(emb, n_ff, 0.5)})
    t.update(extra_tensors or {})
    save_file(t, str(d / "model.safetensors"))
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": emb,
        "num_hidden_layers": n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_head_kv,
        "head_dim": head_dim, "intermediate_size": n_ff, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "max_position_embeddings": 4096,
        "vocab_size": int(target_hp.n_vocab), "num_target_layers": int(target_hp.n_layer),
        "block_size": block_size, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    }
    if sliding_window is not None:
        config.update(use_sliding_window=True, sliding_window=sliding_window,
                      layer_types=list(layer_types or ["sliding_attention"] * n_layer))
    config.update(extra_config or {})
    (d / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return d


_LUCE_NAMES = {"fc.weight": "dflash.fc.weight", "enc.output_norm.weight": "dflash.hidden_norm.weight"}


def write_luce_gguf(zlab_dir: str | Path, out_path: str | Path, *, with_layer_ids: bool = True,
                    n_target_layers: int | None = None) -> Path:
    """The same draft as a `qwen35-dflash-draft` GGUF with the reference's key and tensor names (norms
    F32, matrices F32 here so the weights stay identical). `with_layer_ids=False` leaves out
    `dflash.target_layer_ids`, as the reference's converter does for Qwen drafts."""
    from daemons.dflash import _read_zlab
    from daemons.gguf_writer import TensorData, write_gguf

    cfg, tensors = _read_zlab(Path(zlab_dir))
    a = "qwen35-dflash-draft"
    md: dict[str, Any] = {
        "general.name": "tiny-dflash-draft",
        f"{a}.context_length": 4096, f"{a}.embedding_length": cfg.n_embd, f"{a}.block_count": cfg.n_layer,
        f"{a}.feed_forward_length": cfg.n_ff, f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv, f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim, f"{a}.vocab_size": cfg.n_vocab,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps, f"{a}.rope.freq_base": cfg.rope_theta,
        f"{a}.dflash.n_target_layers": n_target_layers or cfg.n_features, f"{a}.dflash.block_size": cfg.block_size,
        f"{a}.dflash.mask_token_id": cfg.mask_token_id,
    }
    if with_layer_ids:
        md[f"{a}.dflash.target_layer_ids"] = list(cfg.target_layer_ids)
    if any(cfg.swa_layers):
        md[f"{a}.attention.sliding_window"] = int(cfg.sliding_window)
        md[f"{a}.attention.sliding_window_pattern"] = list(cfg.swa_layers)
    out = [TensorData(_LUCE_NAMES.get(name, name), t.dequantize()) for name, t in sorted(tensors.items())]
    write_gguf(out_path, a, md, out)
    return Path(out_path)


def draft_forms(root: str | Path, target_hp: Any, *, target_gguf: str | Path | None = None,
                name: str = "draft", **draft_kwargs: Any) -> dict[str, Path]:
    """One random draft in all three forms: {"z-lab": dir, "dflash": gguf, "qwen35-dflash-draft": gguf}."""
    from daemons.convert import convert_dflash_to_gguf

    zdir = build_zlab_draft(root, target_hp, name=name, **draft_kwargs)
    dflash = Path(root) / f"{name}-dflash-f32.gguf"
    convert_dflash_to_gguf(zdir, dflash, "f32", target_gguf=target_gguf)
    luce = write_luce_gguf(zdir, Path(root) / f"{name}-luce.gguf")
    return {"z-lab": zdir, "dflash": dflash, "qwen35-dflash-draft": luce}
