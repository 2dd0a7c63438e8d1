"""DFlash block-diffusion draft models (z-lab `DFlashDraftModel`), their three file forms, and the
draft KV ring.

Math: ../shared/design/qwen35-dflash-ddtree-math.md §5. A DFlash draft is a small dense transformer
(Qwen3 layers) that fills a block `[ℓ, M, M, ..., M]` (ℓ the pending token, M the mask token, B tokens
at positions n..n+B-1) in one forward pass. It sees the target only through features: the outputs of
a few target layers at every committed position p < n, concatenated in the order of the draft's
`target_layer_ids`, fused by `T_p = RMSNorm(fc · F_p; hidden_norm)`. Every draft layer attends over the
context keys/values `[W_k T_p ; W_v T_p]` (k_norm, RoPE at the absolute position p) followed by the
block's own keys/values, with plain (not 1+w) Qwen3 RMSNorms, full-head NeoX RoPE (or
`rope.dimension_count` dims), GQA, SwiGLU. The draft has no embedding or LM head of its own: it uses
the target's `token_embd` and `output` (a file that ships its own is used as is). Row i ≥ 1 of
`output · RMSNorm(h; output_norm)` is the proposal for position n+i (z-lab's `output_multiplier` and
`final_logit_softcapping` applied when the file has them).

**Files.** One model, three forms, all read into the same `DFlashConfig` and canonical tensor names
(llama.cpp's):
- z-lab directory: `config.json` (`architectures: ["DFlashDraftModel"]`, a `dflash_config` with
  `mask_token_id`, `target_layer_ids`, `block_size`) and `*.safetensors` (`fc`, `hidden_norm`, `norm`,
  `layers.N.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
  mlp.{gate,up,down}_proj}`); BF16/F16/F32 tensors are used in place (memory-mapped, not widened).
- llama.cpp's `dflash` GGUF (what `convert_hf_to_gguf.py` writes): `dflash.*` hyperparameters,
  `dflash.block_size`, `dflash.target_layers` (**stored +1**: llama.cpp extracts `hidden_states[id+1]`),
  `tokenizer.ggml.mask_token_id`, optional `dflash.attention.causal`, `dflash.attention.sliding_window`
  + `sliding_window_pattern`, `dflash.logit_scale`, `dflash.final_logit_softcapping`,
  `dflash.embedding_scale`; tensors `fc`, `enc.output_norm` (hidden_norm), `output_norm`, `blk.N.*`.
- the reference's (Luce) `qwen35-dflash-draft` GGUF: `qwen35-dflash-draft.*` hyperparameters,
  `.dflash.block_size`, `.dflash.mask_token_id`, `.dflash.n_target_layers`, optional
  `.dflash.target_layer_ids` (HF layer ids), `.attention.sliding_window(_pattern)`; tensors
  `dflash.fc`, `dflash.hidden_norm`, `output_norm`, `blk.N.*`.
Mask token id, block size and target layer ids come from the file, and `DFlashDraft.load` checks
them against the target (`DFlashConfig.bind`). One exception, documented: Luce's own converter does not
write `target_layer_ids` for Qwen drafts (its loader recomputes them from the target's depth), so for
such a file the ids are derived with z-lab's `build_target_layer_ids(target_layers, n_target_layers)`
rule (evenly spaced over [1, n_layer-3]) and `layer_ids_source` says so.

**DFlash2** drafts (z-lab `DFlash2DraftModel`: a grouped dynamic causal conv around every mixer and
FFN, and a CandidateSelector lattice walk instead of per-position argmax) are recognised in every
form and refused with `DraftModelError` naming the parts this implementation lacks.

**Masks.** Within the block, a full-attention layer is bidirectional and a sliding-window layer causal
(z-lab's default; a file's `is_causal` / `attention.causal` overrides it for every layer). Context keys
are visible to every block row; a sliding-window layer additionally follows z-lab's per-row window
(key position kp visible to query position qp iff qp - kp < W; and kp - qp < W for non-causal
layers). [Design FLAG: lucebox anchors one window at n for all rows; we follow the z-lab reference.]

**Draft KV ring** (`DraftKVRing`). Context K/V depend only on the position, so each position's rows are
computed once (when the position first enters the window) and kept: capacity C slots with
slot = p mod C, per layer K and V of shape [H_kv, B + C, D] (the first B rows are the block's scratch
rows, written each step; slot s is row B + s), `slot_pos[s]` = the absolute position a slot holds (-1 = empty), RoPE at
absolute positions. The attention mask is explicit: slot s is visible iff its position lies in the
window [n - min(n, C), n); empty slots, stale positions and anything beyond are masked (and rows past
the highest occupied slot are not even read, so a short context costs little). A ring larger
than the context is therefore exactly the unwindowed draft, and a smaller one exactly the draft whose
context is the last C positions (`DFlashDraft.block_logits_direct` computes that directly). Features
arrive through a `FeatureRing` of the same capacity (slot = p mod C) and are turned into K/V only when
the draft runs, so a long prompt costs C rows of draft work, not its length.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from daemons.gguf_reader import GGUFFile, GGUFTensor
from kernels.ggml_quants import SUPPORTED_TYPES

__all__ = ["DraftModelError", "DFlashConfig", "DFlashDraft", "DraftKVRing", "FeatureRing", "DFlashDrafter",
           "DraftProposal", "check_file", "read_config", "zlab_target_layer_ids", "FORMAT_ZLAB", "FORMAT_DFLASH",
           "FORMAT_LUCE"]

FORMAT_ZLAB = "z-lab"                   # directory: config.json + *.safetensors
FORMAT_DFLASH = "dflash"                # llama.cpp's GGUF architecture
FORMAT_LUCE = "qwen35-dflash-draft"     # the reference's (Luce) GGUF architecture

_FLOAT_TYPES = (0, 1, 30)               # F32, F16, BF16
_MATRIX_TYPES = tuple(int(t) for t in SUPPORTED_TYPES)
_ST_QTYPES = {"F32": 0, "F16": 1, "BF16": 30}
# Rows of features turned into context K/V per batch: bounds the activation memory of a long prompt.
_CONTEXT_CHUNK = 512

_DFLASH2_WHAT = ("the grouped dynamic causal conv (attention_conv / mlp_conv) and the CandidateSelector "
                 "lattice walk (predecessor/successor codebooks); only DFlash v1 drafts are implemented")


class DraftModelError(ValueError):
    """A draft file that cannot be used: unreadable, not a DFlash draft, an unsupported variant, or
    not matching the target. The message is one line and names the file."""


def zlab_target_layer_ids(n_target_layers: int, n_features: int) -> list[int]:
    """z-lab's default choice of target layers (`build_target_layer_ids`): one layer in the middle, or
    `n_features` layers evenly spaced over [1, n_target_layers - 3], rounded half to even."""
    if n_features == 1:
        return [n_target_layers // 2]
    lo, hi = 1, n_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (n_features - 1))) for i in range(n_features)]


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DFlashConfig:
    """A draft's hyperparameters, whatever form it came in. `target_layer_ids` are HF layer ids (the
    draft reads the output of target layer id, HF `hidden_states[id + 1]`); None until `bind` derives
    them for a Luce file that lacks them."""

    path: str
    format: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_rot: int
    rope_theta: float
    rms_eps: float
    block_size: int
    mask_token_id: int
    n_features: int                          # target layers fused by fc
    fc_in: int                               # fc input width (n_features * target n_embd)
    target_layer_ids: tuple[int, ...] | None
    swa_layers: tuple[bool, ...]
    sliding_window: int | None
    causal_layers: tuple[bool, ...]
    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float = 0.0
    n_vocab: int | None = None               # declared vocabulary size, if the file says
    target_n_layer: int | None = None        # declared target depth (z-lab num_target_layers)
    layer_ids_source: str = "file"

    def error(self, msg: str) -> DraftModelError:
        return DraftModelError(f"{self.path}: {msg}")

    def bind(self, target_hparams: Any) -> "DFlashConfig":
        """This config checked against a target (any hparams with n_embd, n_layer, n_vocab): the draft
        must share the target's width, read existing layers with the right fc width, and use a mask
        token inside the target's vocabulary. Derives missing target layer ids (Luce files, see the
        module docstring). Raises DraftModelError naming the first mismatch."""
        t_embd, t_layers, t_vocab = int(target_hparams.n_embd), int(target_hparams.n_layer), int(target_hparams.n_vocab)
        ids, source = self.target_layer_ids, self.layer_ids_source
        if ids is None:
            ids = tuple(zlab_target_layer_ids(t_layers, self.n_features))
            source = f"derived from the target's {t_layers} layers (z-lab build_target_layer_ids)"
        if len(ids) != self.n_features:
            raise self.error(f"{len(ids)} target layer ids {list(ids)} for {self.n_features} fused features")
        bad = [i for i in ids if not 0 <= i < t_layers]
        if bad:
            raise self.error(f"target layer id {bad[0]} does not exist in the target (layers 0..{t_layers - 1}); "
                             f"the draft was made for a different model")
        if self.target_n_layer is not None and self.target_n_layer != t_layers:
            raise self.error(f"draft was trained on a {self.target_n_layer}-layer target, this target has {t_layers}")
        if self.n_embd != t_embd:
            raise self.error(f"draft width {self.n_embd} differs from the target's embedding width {t_embd} "
                             f"(the draft uses the target's token embeddings and output head)")
        if self.fc_in != self.n_features * t_embd:
            raise self.error(f"fc reads {self.fc_in} features, but {self.n_features} target layers of width {t_embd} "
                             f"give {self.n_features * t_embd}")
        if not 0 <= self.mask_token_id < t_vocab:
            raise self.error(f"mask token id {self.mask_token_id} lies outside the target's vocabulary "
                             f"(0..{t_vocab - 1})")
        if self.n_vocab is not None and self.n_vocab != t_vocab:
            raise self.error(f"draft vocabulary {self.n_vocab} differs from the target's {t_vocab}")
        return replace(self, target_layer_ids=tuple(int(i) for i in ids), layer_ids_source=source)

    def expected_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """canonical tensor name -> (numpy shape, allowed GGML types) of every tensor the draft needs."""
        d, hd = self.n_embd, self.head_dim
        out = {"fc.weight": ((d, self.fc_in), _MATRIX_TYPES),
               "enc.output_norm.weight": ((d,), _FLOAT_TYPES),
               "output_norm.weight": ((d,), _FLOAT_TYPES)}
        for il in range(self.n_layer):
            p = f"blk.{il}."
            out.update({p + "attn_norm.weight": ((d,), _FLOAT_TYPES), p + "ffn_norm.weight": ((d,), _FLOAT_TYPES),
                        p + "attn_q.weight": ((self.n_head * hd, d), _MATRIX_TYPES),
                        p + "attn_k.weight": ((self.n_head_kv * hd, d), _MATRIX_TYPES),
                        p + "attn_v.weight": ((self.n_head_kv * hd, d), _MATRIX_TYPES),
                        p + "attn_output.weight": ((d, self.n_head * hd), _MATRIX_TYPES),
                        p + "attn_q_norm.weight": ((hd,), _FLOAT_TYPES), p + "attn_k_norm.weight": ((hd,), _FLOAT_TYPES),
                        p + "ffn_gate.weight": ((self.n_ff, d), _MATRIX_TYPES),
                        p + "ffn_up.weight": ((self.n_ff, d), _MATRIX_TYPES),
                        p + "ffn_down.weight": ((d, self.n_ff), _MATRIX_TYPES)})
        return out


def _check_values(c: DFlashConfig) -> DFlashConfig:
    """Range checks shared by every form."""
    for name in ("n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "n_features", "fc_in"):
        if getattr(c, name) < 1:
            raise c.error(f"{name} must be positive, got {getattr(c, name)}")
    if c.n_head % c.n_head_kv:
        raise c.error(f"{c.n_head} attention heads is not a multiple of {c.n_head_kv} kv heads")
    if c.n_rot % 2 or not 0 < c.n_rot <= c.head_dim:
        raise c.error(f"rope dimension count {c.n_rot} must be even and in 2..{c.head_dim}")
    if c.block_size < 2:
        raise c.error(f"block size {c.block_size} must be at least 2 (the anchor plus one proposal)")
    if c.mask_token_id < 0:
        raise c.error(f"mask token id {c.mask_token_id} is negative")
    if not 0.0 < c.rms_eps < 1.0 or not c.rope_theta > 0.0:
        raise c.error(f"rms eps {c.rms_eps} must lie in (0, 1) and rope theta {c.rope_theta} be positive")
    if c.target_layer_ids is not None and len(set(c.target_layer_ids)) != len(c.target_layer_ids):
        raise c.error(f"target layer ids {list(c.target_layer_ids)} repeat a layer")
    if len(c.swa_layers) != c.n_layer or len(c.causal_layers) != c.n_layer:
        raise c.error(f"per-layer attention flags must list {c.n_layer} layers")
    if any(c.swa_layers) and not (c.sliding_window or 0) > 0:
        raise c.error("sliding-window layers need a positive sliding window")
    if c.fc_in % c.n_features:
        raise c.error(f"fc input width {c.fc_in} is not a multiple of {c.n_features} target layers")
    if c.logit_softcap < 0 or not c.logit_scale > 0 or not c.embedding_scale > 0:
        raise c.error("logit scale and embedding scale must be positive and the softcap non-negative")
    return c


# -- z-lab directory -----------------------------------------------------------------------------

def _zlab_files(path: Path) -> tuple[Path, dict[str, Any], dict[str, tuple[Any, str]]]:
    from daemons.convert import ConvertError, read_safetensors
    d = path.parent if path.is_file() else path
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftModelError(f"{d}: no config.json (a z-lab DFlash draft directory holds config.json and "
                              f"model.safetensors)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftModelError(f"{cfg_path}: cannot parse: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise DraftModelError(f"{cfg_path}: not a JSON object")
    try:
        tensors = read_safetensors(d)
    except ConvertError as e:
        raise DraftModelError(str(e)) from None
    return d, cfg, tensors


_ZLAB_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_ZLAB_TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                   "norm.weight": "output_norm.weight", "embed_tokens.weight": "token_embd.weight",
                   "lm_head.weight": "output.weight"}
_DFLASH2_MARKERS = ("attention_conv", "mlp_conv", "candidate_selector", "attn_conv", "ffn_conv", "selector")


def _zlab_canonical(name: str) -> str | None:
    n = name[6:] if name.startswith("model.") else name
    if n in _ZLAB_TOP_NAMES:
        return _ZLAB_TOP_NAMES[n]
    parts = n.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _ZLAB_LAYER_NAMES:
        return f"blk.{int(parts[1])}.{_ZLAB_LAYER_NAMES[parts[2]]}"
    return None


def _zlab_config(d: Path, cfg: dict[str, Any], tensor_names: Sequence[str]) -> DFlashConfig:
    where = str(d)

    def bad(msg: str) -> DraftModelError:
        return DraftModelError(f"{where}/config.json: {msg}")

    archs = cfg.get("architectures") or []
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise bad("dflash_config is not an object")
    dflash2_keys = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k in dcfg]
    dflash2_tensors = [n for n in tensor_names if any(m in n for m in _DFLASH2_MARKERS)]
    if "DFlash2DraftModel" in archs or dflash2_keys or dflash2_tensors:
        what = dflash2_tensors[0] if dflash2_tensors else (dflash2_keys or archs)[0]
        raise DraftModelError(f"{where}: DFlash2 draft (found '{what}') is not supported: missing {_DFLASH2_WHAT}")
    if archs and "DFlashDraftModel" not in archs:
        raise bad(f"architectures {archs} is not a DFlash draft (expected DFlashDraftModel)")

    def value(name: str, default: Any = None) -> Any:
        # z-lab's _draft_value: dflash_config first, then the top level
        return dcfg.get(name, cfg.get(name, default))

    def integer(name: str, default: Any = None) -> int:
        v = cfg.get(name, default)
        if v is None:
            raise bad(f"missing '{name}'")
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"'{name}' must be an integer, got {v!r}")
        return v

    def number(v: Any, name: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise bad(f"'{name}' must be a finite number, got {v!r}")
        return float(v)

    n_embd = integer("hidden_size")
    n_layer = integer("num_hidden_layers")
    n_head = integer("num_attention_heads")
    n_ff = integer("intermediate_size")
    n_head_kv = integer("num_key_value_heads", n_head)
    head_dim = integer("head_dim", n_embd // max(n_head, 1))
    if cfg.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act '{cfg.get('hidden_act')}' is not supported (DFlash drafts use silu)")
    if cfg.get("attention_bias", False):
        raise bad("attention_bias = true is not supported (DFlash drafts have no attention biases)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise bad("rope_parameters is not an object")
    if rope.get("rope_type", "default") not in ("default", None):
        raise bad(f"rope_type '{rope.get('rope_type')}' is not supported (plain RoPE only)")
    theta = number(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta")
    partial = number(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)), "partial_rotary_factor")
    mask = value("mask_token_id")
    if mask is None:
        raise bad("missing dflash_config.mask_token_id")
    ids = value("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad(f"dflash_config.target_layer_ids must be a non-empty list of integers, got {ids!r}")
    block = value("block_size", 16)             # the reference's own default
    if isinstance(mask, bool) or not isinstance(mask, int) or isinstance(block, bool) or not isinstance(block, int):
        raise bad(f"mask_token_id and block_size must be integers, got {mask!r} and {block!r}")
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layer
    if not isinstance(layer_types, list) or len(layer_types) != n_layer:
        raise bad(f"layer_types must list {n_layer} layers")
    use_swa = bool(cfg.get("use_sliding_window", False) or dcfg.get("use_swa", False))
    window = dcfg.get("swa_window_size") or cfg.get("sliding_window")
    if dcfg.get("use_swa", False):
        swa = [True] * n_layer
    elif use_swa and window:
        swa = [t == "sliding_attention" for t in layer_types]
    else:
        swa = [False] * n_layer
    causal_all = cfg.get("is_causal")
    if causal_all is None:
        causal_all = dcfg.get("causal")
    causal = [bool(causal_all)] * n_layer if causal_all is not None else list(swa)
    softcap = value("final_logit_softcapping")
    return _check_values(DFlashConfig(
        path=where, format=FORMAT_ZLAB, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=n_ff, n_rot=int(round(head_dim * partial)), rope_theta=theta,
        rms_eps=number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"), block_size=block, mask_token_id=mask,
        n_features=len(ids), fc_in=len(ids) * n_embd, target_layer_ids=tuple(ids),
        swa_layers=tuple(swa), sliding_window=int(window) if any(swa) else None, causal_layers=tuple(causal),
        embedding_scale=number(value("input_embedding_scale", 1.0), "input_embedding_scale"),
        logit_scale=number(value("output_multiplier", 1.0), "output_multiplier"),
        logit_softcap=number(softcap, "final_logit_softcapping") if softcap else 0.0,
        n_vocab=cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None,
        target_n_layer=cfg.get("num_target_layers") if isinstance(cfg.get("num_target_layers"), int) else None))


def _st_tensor(st: Any, key: str) -> GGUFTensor:
    """A safetensors tensor as a GGUFTensor over the mapped bytes (F32/F16/BF16 kept as stored)."""
    from daemons.convert import ConvertError
    try:
        dtype, shape, view, offset = st.raw(key)
    except ConvertError as e:
        raise DraftModelError(str(e)) from None
    if not shape:
        shape = (1,)
    n_rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return GGUFTensor(name=key, qtype=_ST_QTYPES[dtype], ne=tuple(reversed(shape)), offset=offset,
                      nbytes=int(view.size), raw=view.reshape(n_rows, -1))


def _read_zlab(path: Path) -> tuple[DFlashConfig, dict[str, GGUFTensor]]:
    d, cfg, tensors = _zlab_files(path)
    config = _zlab_config(d, cfg, list(tensors))
    canonical: dict[str, GGUFTensor] = {}
    for name, (st, key) in tensors.items():
        cname = _zlab_canonical(name)
        if cname is None:
            raise DraftModelError(f"{d}: unexpected tensor '{name}' for a DFlash draft")
        canonical[cname] = _st_tensor(st, key)
    fc = canonical.get("fc.weight")
    if fc is not None and len(fc.ne) == 2:
        config = _check_values(replace(config, fc_in=int(fc.ne[0])))
    return config, canonical


# -- GGUF forms ----------------------------------------------------------------------------------

_GGUF_LAYER = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down")


def _gguf_canonical(fmt: str, name: str) -> str | None:
    if fmt == FORMAT_LUCE:
        name = {"dflash.fc.weight": "fc.weight", "dflash.hidden_norm.weight": "enc.output_norm.weight"}.get(name, name)
    if name in ("fc.weight", "enc.output_norm.weight", "output_norm.weight", "token_embd.weight", "output.weight"):
        return name
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER and parts[3] == "weight":
        return name
    return None


def _gguf_config(f: GGUFFile) -> DFlashConfig:
    fmt = f.architecture
    if fmt not in (FORMAT_DFLASH, FORMAT_LUCE):
        raise DraftModelError(f"{f.path}: architecture '{fmt}' is not a DFlash draft "
                              f"(expected '{FORMAT_DFLASH}' or '{FORMAT_LUCE}')")
    a = fmt
    dflash2 = [n for n in f.tensors if any(m in n for m in _DFLASH2_MARKERS)]
    dflash2 += [k for k in (f"{a}.selector_rank", f"{a}.conv_kernel_size", f"{a}.dflash.selector_rank") if k in f]
    if dflash2:
        raise DraftModelError(f"{f.path}: DFlash2 draft (found '{dflash2[0]}') is not supported: missing {_DFLASH2_WHAT}")
    for marker, what in (("d2t", "a reduced draft vocabulary (d2t)"), ("markov_w1", "a DSpark Markov head"),
                         ("attn_sinks", "attention sinks"), ("hc_head", "hyper-connections (DSpark DSV4)")):
        hit = next((n for n in f.tensors if marker in n), None)
        if hit is not None:
            raise DraftModelError(f"{f.path}: tensor '{hit}': drafts with {what} are not supported")

    def pos(key: str, default: int | None = None) -> int:
        return f.get_int(f"{a}.{key}", default, minimum=1)

    n_embd, n_head = pos("embedding_length"), pos("attention.head_count")
    head_dim = pos("attention.key_length", n_embd // n_head)
    if pos("attention.value_length", head_dim) != head_dim:
        raise DraftModelError(f"{f.path}: attention.value_length differs from key_length")
    n_layer = pos("block_count")
    if fmt == FORMAT_DFLASH:
        stored = f.get_array(f"{a}.target_layers")
        if not stored or not all(isinstance(i, int) and i >= 1 for i in stored):
            raise DraftModelError(f"{f.path}: {a}.target_layers must be positive integers (llama.cpp stores "
                                  f"layer id + 1), got {stored}")
        ids: tuple[int, ...] | None = tuple(int(i) - 1 for i in stored)
        n_features = len(ids)
        mask = f.get_int("tokenizer.ggml.mask_token_id", minimum=0)
        block = f.get_int(f"{a}.block_size", minimum=1)
        causal_key = f"{a}.attention.causal"
    else:
        n_features = pos("dflash.n_target_layers")
        raw_ids = f.get(f"{a}.dflash.target_layer_ids")
        ids = None
        if raw_ids is not None:
            raw_ids = f.get_array(f"{a}.dflash.target_layer_ids", length=n_features)
            if not all(isinstance(i, int) and i >= 0 for i in raw_ids):
                raise DraftModelError(f"{f.path}: {a}.dflash.target_layer_ids must be non-negative integers")
            ids = tuple(int(i) for i in raw_ids)
        mask = f.get_int(f"{a}.dflash.mask_token_id", minimum=0)
        block = f.get_int(f"{a}.dflash.block_size", minimum=1)
        causal_key = None
    window = f.get_int(f"{a}.attention.sliding_window", 0, minimum=0)
    if window:
        pattern = f.get_array(f"{a}.attention.sliding_window_pattern", length=n_layer)
        swa = tuple(bool(v) for v in pattern)
    else:
        swa = (False,) * n_layer
    if causal_key is not None and causal_key in f:
        causal = (bool(f.get(causal_key)),) * n_layer
    else:
        causal = swa
    fc = f.tensors.get("fc.weight" if fmt == FORMAT_DFLASH else "dflash.fc.weight")

    def scale(key: str, default: float) -> float:
        v = f.get_float(f"{a}.{key}", default)
        return default if v == 0.0 else v          # llama.cpp reads 0 as "not set"

    return _check_values(DFlashConfig(
        path=f.path, format=fmt, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=pos("attention.head_count_kv", n_head), head_dim=head_dim, n_ff=pos("feed_forward_length"),
        n_rot=f.get_int(f"{a}.rope.dimension_count", head_dim, minimum=2), rope_theta=f.get_float(f"{a}.rope.freq_base"),
        rms_eps=f.get_float(f"{a}.attention.layer_norm_rms_epsilon"), block_size=block, mask_token_id=mask,
        n_features=n_features, fc_in=int(fc.ne[0]) if fc is not None else n_features * n_embd,
        target_layer_ids=ids, swa_layers=swa, sliding_window=window or None, causal_layers=causal,
        embedding_scale=scale("embedding_scale", 1.0), logit_scale=scale("logit_scale", 1.0),
        logit_softcap=f.get_float(f"{a}.final_logit_softcapping", 0.0),
        n_vocab=f.get_int(f"{a}.vocab_size", minimum=1) if f"{a}.vocab_size" in f else None))


def _read_gguf(f: GGUFFile) -> tuple[DFlashConfig, dict[str, GGUFTensor]]:
    config = _gguf_config(f)
    canonical = {}
    for name, t in f.tensors.items():
        cname = _gguf_canonical(config.format, name)
        if cname is None:
            raise DraftModelError(f"{f.path}: unexpected tensor '{name}' for a {config.format} draft")
        canonical[cname] = t
    return config, canonical


def _check_tensors(config: DFlashConfig, tensors: dict[str, GGUFTensor]) -> None:
    expected = config.expected_shapes()
    for name, (shape, types) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise config.error(f"missing tensor '{name}' (canonical name)")
        if tuple(reversed(t.ne)) != shape:
            raise config.error(f"tensor '{t.name}' has shape {list(reversed(t.ne))}, expected {list(shape)}")
        if t.qtype not in types:
            raise config.error(f"tensor '{t.name}' has unsupported type {t.type_name}")
    for name in ("token_embd.weight", "output.weight"):
        t = tensors.get(name)
        if t is not None and (len(t.ne) != 2 or t.ne[0] != config.n_embd or t.qtype not in _MATRIX_TYPES):
            raise config.error(f"tensor '{t.name}' must be a [{config.n_embd}, n_vocab] matrix")
    extra = sorted(set(tensors) - set(expected) - {"token_embd.weight", "output.weight"})
    if extra:
        raise config.error(f"unexpected tensor '{extra[0]}' (the config has {config.n_layer} layers)")


def read_config(path: str | os.PathLike) -> tuple[DFlashConfig, dict[str, GGUFTensor], GGUFFile | None]:
    """Open a draft in any of the three forms: (config, canonical name -> tensor, the open GGUF file or
    None for a z-lab directory). Tensors are checked for names, shapes and types; nothing is loaded."""
    p = Path(path)
    if p.is_dir() or (p.is_file() and p.suffix == ".safetensors"):
        config, tensors = _read_zlab(p)
        _check_tensors(config, tensors)
        return config, tensors, None
    if not p.exists():
        raise DraftModelError(f"{p}: no such file or directory")
    f = GGUFFile(p)
    try:
        config, tensors = _read_gguf(f)
        _check_tensors(config, tensors)
    except Exception:
        f.close()
        raise
    return config, tensors, f


def check_file(gguf: GGUFFile) -> DFlashConfig:
    """Validate a draft GGUF on its own (metadata, tensor names, shapes, types); the architecture
    registry calls this for `dflashd inspect`. Raises DraftModelError."""
    config, tensors = _read_gguf(gguf)
    _check_tensors(config, tensors)
    return config


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------

@dataclass
class _DraftLayer:
    attn_norm: Any
    ffn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    q_norm: Any
    k_norm: Any
    ffn_gate: Any
    ffn_up: Any
    ffn_down: Any


@dataclass
class _Context:
    """Keys/values a block attends to: per layer K, V [H_kv, >= B + L, D] whose first B rows are the
    block's scratch and next L rows context (positions `pos` [L], -1 = empty); context rows with a
    position outside [lo, n) are masked, rows past B + L are not read."""

    k: list[Any]
    v: list[Any]
    pos: np.ndarray
    lo: int


class DFlashDraft:
    """A loaded DFlash v1 draft bound to its target model (whose token_embd and output it shares)."""

    def __init__(self, config: DFlashConfig, tensors: dict[str, GGUFTensor], target: Any, backend: Any,
                 gguf: GGUFFile | None = None):
        self.config, self.target, self.backend, self._gguf = config, target, backend, gguf
        b = backend
        vec, mat = b.load_vector, b.load_weight
        self.fc = mat(tensors["fc.weight"])
        self.hidden_norm = vec(tensors["enc.output_norm.weight"])
        self.output_norm = vec(tensors["output_norm.weight"])
        self.token_embd = mat(tensors["token_embd.weight"]) if "token_embd.weight" in tensors else target.token_embd
        self.output = mat(tensors["output.weight"]) if "output.weight" in tensors else target.output
        self.layers = []
        for il in range(config.n_layer):
            p = f"blk.{il}."
            self.layers.append(_DraftLayer(
                attn_norm=vec(tensors[p + "attn_norm.weight"]), ffn_norm=vec(tensors[p + "ffn_norm.weight"]),
                wq=mat(tensors[p + "attn_q.weight"]), wk=mat(tensors[p + "attn_k.weight"]),
                wv=mat(tensors[p + "attn_v.weight"]), wo=mat(tensors[p + "attn_output.weight"]),
                q_norm=vec(tensors[p + "attn_q_norm.weight"]), k_norm=vec(tensors[p + "attn_k_norm.weight"]),
                ffn_gate=mat(tensors[p + "ffn_gate.weight"]), ffn_up=mat(tensors[p + "ffn_up.weight"]),
                ffn_down=mat(tensors[p + "ffn_down.weight"])))

    @classmethod
    def load(cls, path: str | os.PathLike, target: Any, backend: Any = None) -> "DFlashDraft":
        """Load a draft (z-lab directory or `.safetensors` file, `dflash` GGUF, or `qwen35-dflash-draft`
        GGUF) for `target` (a loaded target model with `hparams`, `token_embd`, `output`), checked
        against it. `backend` defaults to the target's."""
        config, tensors, f = read_config(path)
        try:
            config = config.bind(target.hparams)
            out_w = tensors.get("output.weight")
            if out_w is not None and out_w.ne[1] != target.hparams.n_vocab:
                raise config.error(f"the draft's own output head has {out_w.ne[1]} rows, the target's vocabulary "
                                   f"{target.hparams.n_vocab}")
            return cls(config, tensors, target, backend if backend is not None else target.backend, f)
        except Exception:
            if f is not None:
                f.close()
            raise

    # -- properties ---------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        assert self.config.target_layer_ids is not None    # bound configs always have them
        return self.config.target_layer_ids

    @property
    def feature_width(self) -> int:
        return self.config.fc_in

    # -- computation --------------------------------------------------------------------------------
    def context_kv(self, features: Any, positions: np.ndarray) -> list[tuple[Any, Any]]:
        """Context keys/values of `positions` from their target features [m, fc_in]: per layer
        (K, V) [H_kv, m, D], K after k_norm and RoPE at the absolute positions."""
        c, b = self.config, self.backend
        m = len(positions)
        outs: list[tuple[list[Any], list[Any]]] = [([], []) for _ in self.layers]
        for r0 in range(0, m, _CONTEXT_CHUNK):
            feats = b.asarray(np.asarray(features[r0:r0 + _CONTEXT_CHUNK], dtype=np.float32))
            pos = positions[r0:r0 + _CONTEXT_CHUNK]
            t = b.rms_norm(b.matmul(feats, self.fc), self.hidden_norm, c.rms_eps)
            for il, layer in enumerate(self.layers):
                k = b.rms_norm(b.matmul(t, layer.wk).reshape(len(pos), c.n_head_kv, c.head_dim), layer.k_norm, c.rms_eps)
                k = b.rope_neox(k, pos, c.n_rot, c.rope_theta)
                v = b.matmul(t, layer.wv).reshape(len(pos), c.n_head_kv, c.head_dim)
                outs[il][0].append(k.transpose(1, 0, 2))
                outs[il][1].append(v.transpose(1, 0, 2))
        xp = b.xp
        return [(xp.concatenate(ks, axis=1), xp.concatenate(vs, axis=1)) for ks, vs in outs]

    def _masks(self, n: int, ctx: _Context) -> dict[tuple[bool, int | None], np.ndarray]:
        """Boolean masks [B, B + L] per distinct (causal, window) among the layers."""
        c = self.config
        B = c.block_size
        q = n + np.arange(B, dtype=np.int64)[:, None]                 # query positions
        ctx_ok = (ctx.pos >= 0) & (ctx.pos >= ctx.lo) & (ctx.pos < n)
        kpos = np.concatenate([n + np.arange(B, dtype=np.int64), ctx.pos])[None, :]
        base = np.concatenate([np.ones(B, dtype=bool), ctx_ok])[None, :]
        masks = {}
        for causal, swa in zip(c.causal_layers, c.swa_layers):
            window = c.sliding_window if swa else None
            key = (causal, window)
            if key in masks:
                continue
            m = np.broadcast_to(base, (B, base.shape[1])).copy()
            if causal:
                m &= kpos <= q
            if window is not None:
                m &= (q - kpos) < window
                if not causal:
                    m &= (kpos - q) < window
            masks[key] = m
        return masks

    def block_logits(self, anchor: int, n: int, ctx: _Context) -> np.ndarray:
        """Draft logits float32 [B-1, vocab] for positions n+1..n+B-1, given the pending token `anchor`
        at position n and the context `ctx` (whose scratch rows this overwrites)."""
        c, b = self.config, self.backend
        B, H, Hkv, D = c.block_size, c.n_head, c.n_head_kv, c.head_dim
        L = len(ctx.pos)
        qpos = np.arange(n, n + B, dtype=np.int64)
        h = b.embed(self.token_embd, [int(anchor)] + [c.mask_token_id] * (B - 1))
        if c.embedding_scale != 1.0:
            h = h * np.float32(c.embedding_scale)
        masks = self._masks(n, ctx)
        # the mask does all the masking: every key index is <= this position
        unmasked = np.full(B, B + L - 1, dtype=np.int64)
        scale = 1.0 / math.sqrt(D)
        for il, layer in enumerate(self.layers):
            hn = b.rms_norm(h, layer.attn_norm, c.rms_eps)
            q = b.rms_norm(b.matmul(hn, layer.wq).reshape(B, H, D), layer.q_norm, c.rms_eps)
            q = b.rope_neox(q, qpos, c.n_rot, c.rope_theta)
            k = b.rms_norm(b.matmul(hn, layer.wk).reshape(B, Hkv, D), layer.k_norm, c.rms_eps)
            k = b.rope_neox(k, qpos, c.n_rot, c.rope_theta)
            v = b.matmul(hn, layer.wv).reshape(B, Hkv, D)
            ctx.k[il][:, :B] = k.transpose(1, 0, 2)
            ctx.v[il][:, :B] = v.transpose(1, 0, 2)
            mask = masks[(c.causal_layers[il], c.sliding_window if c.swa_layers[il] else None)]
            o = b.attention(q, ctx.k[il], ctx.v[il], unmasked, B + L, scale, mask=mask)
            h = h + b.matmul(o.reshape(B, H * D), layer.wo)
            hn = b.rms_norm(h, layer.ffn_norm, c.rms_eps)
            h = h + b.matmul(b.silu_mul(b.matmul(hn, layer.ffn_gate), b.matmul(hn, layer.ffn_up)), layer.ffn_down)
        out = b.rms_norm(h[1:], self.output_norm, c.rms_eps)
        logits = np.array(b.to_host(b.matmul(out, self.output)), dtype=np.float32)
        if c.logit_scale != 1.0:
            logits *= np.float32(c.logit_scale)
        if c.logit_softcap > 0.0:
            cap = np.float32(c.logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def block_logits_direct(self, anchor: int, n: int, features: Any, positions: Sequence[int]) -> np.ndarray:
        """The same draft computed in one shot, without a ring: context = the given positions (with
        their features [m, fc_in]), K/V computed afresh. The reference the ring must reproduce."""
        b, c = self.backend, self.config
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        ks, vs = [], []
        if len(pos):
            kv = self.context_kv(features, pos)
        for il in range(c.n_layer):
            k = b.xp.zeros((c.n_head_kv, len(pos) + c.block_size, c.head_dim), dtype=b.xp.float32)
            v = b.xp.zeros_like(k)
            if len(pos):
                k[:, c.block_size:], v[:, c.block_size:] = kv[il]
            ks.append(k)
            vs.append(v)
        return self.block_logits(anchor, n, _Context(ks, vs, pos, lo=int(pos.min()) if len(pos) else n))

    def close(self) -> None:
        if self._gguf is not None:
            self._gguf.close()
            self._gguf = None


# ------------------------------------------------------------------------------------------------
# rings
# ------------------------------------------------------------------------------------------------

class FeatureRing:
    """Target features by position: `capacity` rows of width `width`, slot = position mod capacity,
    `slot_pos` the position each slot holds (-1 = none). A write that crosses the wrap point lands in
    two pieces; writing more than `capacity` rows keeps the last `capacity`."""

    def __init__(self, capacity: int, width: int):
        if capacity < 1:
            raise ValueError(f"feature ring capacity must be positive, got {capacity}")
        self.capacity, self.width = int(capacity), int(width)
        self.rows = np.zeros((self.capacity, self.width), dtype=np.float32)
        self.slot_pos = np.full(self.capacity, -1, dtype=np.int64)

    def reset(self) -> None:
        self.slot_pos[:] = -1

    def write(self, start: int, rows: Any) -> None:
        rows = np.asarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"features must be [m, {self.width}], got {list(rows.shape)}")
        skip = max(0, rows.shape[0] - self.capacity)
        pos = np.arange(start + skip, start + rows.shape[0], dtype=np.int64)
        slots = pos % self.capacity
        self.rows[slots] = rows[skip:]
        self.slot_pos[slots] = pos

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [stop-start, width], present [stop-start] bool) for positions start..stop-1."""
        pos = np.arange(start, stop, dtype=np.int64)
        slots = pos % self.capacity
        return self.rows[slots], self.slot_pos[slots] == pos


class DraftKVRing:
    """The draft's context K/V by position (see the module docstring): per layer K and V
    [H_kv, B + capacity, D], the first B rows the block's scratch, slot s (= position mod capacity)
    at row B + s."""

    def __init__(self, draft: DFlashDraft, capacity: int):
        if capacity < 1:
            raise ValueError(f"draft KV ring capacity must be positive, got {capacity}")
        c, xp = draft.config, draft.backend.xp
        self.draft, self.capacity = draft, int(capacity)
        self.block_size = c.block_size
        shape = (c.n_head_kv, c.block_size + self.capacity, c.head_dim)
        self.k = [xp.zeros(shape, dtype=xp.float32) for _ in range(c.n_layer)]
        self.v = [xp.zeros(shape, dtype=xp.float32) for _ in range(c.n_layer)]
        self.slot_pos = np.full(self.capacity, -1, dtype=np.int64)
        self.rows_computed = 0          # context rows computed so far (each position once)

    def reset(self) -> None:
        self.slot_pos[:] = -1

    def truncate(self, n: int) -> None:
        """Forget positions >= n (their tokens were rolled back)."""
        self.slot_pos[self.slot_pos >= n] = -1

    def append(self, positions: np.ndarray, features: Any) -> None:
        """Compute and store the K/V rows of `positions` (ascending) from their features; only the
        last `capacity` positions are computed (earlier ones would be overwritten at once)."""
        positions = np.asarray(positions, dtype=np.int64)
        skip = max(0, len(positions) - self.capacity)
        positions, features = positions[skip:], features[skip:]
        if not len(positions):
            return
        slots = positions % self.capacity
        rows = self.block_size + slots
        for il, (k, v) in enumerate(self.draft.context_kv(features, positions)):
            self.k[il][:, rows] = k
            self.v[il][:, rows] = v
        self.slot_pos[slots] = positions
        self.rows_computed += len(positions)

    def block_logits(self, anchor: int, n: int) -> np.ndarray:
        """Draft logits [B-1, vocab] at position n over the window [n - min(n, capacity), n)."""
        lo = n - min(n, self.capacity)
        # attend over the slots in use only: up to the highest occupied one (all of them once wrapped)
        occupied = np.flatnonzero(self.slot_pos >= 0)
        used = int(occupied[-1]) + 1 if len(occupied) else 0
        return self.draft.block_logits(anchor, n, _Context(self.k, self.v, self.slot_pos[:used], lo))


# ------------------------------------------------------------------------------------------------
# the drafter: what the speculative loop talks to
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftProposal:
    """Proposed tokens for positions n+1..n+k and, per token, the draft's top-1 minus top-2
    probability (the dynamic-length signal; None when the proposer has no distribution)."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...] | None = None


def top2_margins(logits: np.ndarray) -> np.ndarray:
    """Per row of logits [k, V]: softmax top-1 minus top-2 probability (float64)."""
    x = np.asarray(logits, dtype=np.float64)
    if x.shape[-1] < 2:
        return np.ones(x.shape[0])
    top2 = np.partition(x, -2, axis=-1)[:, -2:]
    z = np.exp(x - top2[:, 1:2]).sum(axis=-1)
    return (1.0 - np.exp(top2[:, 0] - top2[:, 1])) / z


class DFlashDrafter:
    """One sequence's DFlash drafting: target features go into a `FeatureRing`, the draft's context
    K/V into a `DraftKVRing` (both `context_window` positions; slot = position mod capacity), and
    `propose` runs the draft block. Implements `daemons.speculative.Drafter`."""

    def __init__(self, draft: DFlashDraft, context_window: int = 4096):
        self.draft = draft
        self.capture_layers = draft.target_layer_ids
        self.max_draft = draft.block_size - 1
        self.context_window = int(context_window)
        self.features = FeatureRing(self.context_window, draft.feature_width)
        self.ring = DraftKVRing(draft, self.context_window)
        self._next = 0                                 # positions < _next are in the KV ring (or absent)

    def start(self, n_cached: int) -> None:
        """A new sequence; positions < n_cached are in the target state but have no features (their
        context is simply absent from the draft's window)."""
        self.features.reset()
        self.ring.reset()
        self._next = int(n_cached)

    def observe(self, start: int, token_ids: Sequence[int], features: Any) -> None:
        """Positions start.. (the tokens `token_ids`) are committed in the target; `features` holds
        their captured target-layer outputs, concatenated in `capture_layers` order [m, fc_in]."""
        if features is None:
            return
        self.features.write(start, features)

    def propose(self, n: int, anchor: int, max_tokens: int) -> DraftProposal:
        """Up to `max_tokens` (<= block_size - 1) greedy draft tokens after `anchor` at position n."""
        if self._next > n:                             # rewound: drop rows of positions >= n
            self.ring.truncate(n)
            self._next = n
        p0 = max(self._next, n - self.context_window)
        if p0 < n:
            rows, present = self.features.read(p0, n)
            pos = np.arange(p0, n, dtype=np.int64)
            self.ring.append(pos[present], rows[present])
        self._next = n
        logits = self.ring.block_logits(anchor, n)[:max(0, min(max_tokens, self.max_draft))]
        tokens = tuple(int(t) for t in np.argmax(logits, axis=-1))
        return DraftProposal(tokens, tuple(float(m) for m in top2_margins(logits)))
