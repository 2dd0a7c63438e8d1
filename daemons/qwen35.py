"""The qwen35 model (Qwen3.5 / Qwen3.6 dense): Gated DeltaNet layers + gated full attention.

Written once against `kernels.backend.Backend` (CPU by default). Math: ../shared/design/
qwen35-dflash-ddtree-math.md §1-§4; the GGUF layout is llama.cpp's (see `daemons.convert`).

Layer `il` is full attention iff `(il + 1) % full_attention_interval == 0` (or as
`attention.recurrent_layers` says, when present); all others are Gated DeltaNet. Each layer is

    h  = x + Mixer(RMSNorm(x; attn_norm))
    x' = h + W_down(silu(W_gate h̃) ⊙ W_up h̃),   h̃ = RMSNorm(h; post_attention_norm)

and `logits = W_out RMSNorm(x; output_norm)` with W_out = `output.weight`, or `token_embd.weight`
when the file has no output matrix (tied embeddings, the small Qwen3.5 models). Norm weights in the
GGUF already hold HF's `1 + w`, so RMSNorm multiplies by them directly.

Decisions where the sources differ (math spec §9):
- RoPE angles: `p · θ^(−2i/n_rot)` in float64, reduced mod 2π, then cos/sin in float32. HF computes
  the angle in float32, which drifts by ~1e-2 rad at p ~ 1e5; float64 is exact to the position
  range we serve. M-RoPE sections collapse to plain partial NeoX RoPE for text (t = h = w = p).
- L2 norm of DeltaNet q/k: `x / sqrt(Σx² + eps)`, HF's form and current llama.cpp's (see
  `kernels.deltanet`), not the older `x / max(‖x‖, eps)`.
- V heads are in GGUF tiled order: v-head h reads k-head `h % n_k_heads`.
- The DeltaNet state is float32 and can be checkpointed per token (`kernels.deltanet`).

The state (`Qwen35State`) is explicit: a KV cache per attention layer, a conv state and a delta-rule
state per DeltaNet layer, and `n_past`. `forward` advances it; `copy`, `to_host` and `from_host`
snapshot and restore it.

Speculative decoding (`daemons.speculative`) verifies a block of tokens with `verify` and keeps an
accepted prefix with `rollback`. Rollback uses per-token float32 checkpoints, not snapshot-and-replay:
`verify` runs the DeltaNet recurrence token by token and stores the state after every token, and keeps
the conv inputs of the block, so any prefix's recurrent state is read back exactly (no second
forward); KV rows past the kept prefix are left in place, since causal attention never reads a row
beyond the query's position and the next block overwrites them. `verify` also computes every row
exactly as a one-token `forward` would (batch invariance, see its docstring), so greedy speculative
output is token-for-token the greedy autoregressive output, and the rolled-back state is bit-for-bit
the state autoregressive decoding of the same tokens reaches.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import numpy as np

from daemons.gguf_reader import GGUFFile, GGUFMetadataError, GGUFTensorError
from daemons.sampling import top_candidates
from kernels.ggml_quants import SUPPORTED_TYPES

__all__ = ["ARCH", "Qwen35HParams", "Qwen35State", "Qwen35Model", "VerifyRecord", "ModelInputError",
           "StateError", "check_file", "capture_layer_ids"]

ARCH = "qwen35"
_FLOAT_TYPES = (0, 1, 30)                       # F32, F16, BF16: small tensors (norms, biases, conv)
_MATRIX_TYPES = tuple(int(t) for t in SUPPORTED_TYPES)


class ModelInputError(ValueError):
    """Bad arguments to the model: token ids out of range, context overflow, unknown option."""


class StateError(ValueError):
    """A state snapshot does not fit this model (wrong keys, shapes or length)."""


def capture_layer_ids(n_layer: int, n_capture: int = 5) -> list[int]:
    """DFlash target-feature layers: `1 + k·⌊(n_layer − 2)/4⌋` for k < n_capture (math spec §4)."""
    step = (n_layer - 2) // 4
    return [1 + k * step for k in range(n_capture)]


# ------------------------------------------------------------------------------------------------
# hyperparameters
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Qwen35HParams:
    n_vocab: int
    n_embd: int
    n_ff: int
    n_layer: int                 # layers of the main pass (block_count minus MTP layers)
    n_head: int
    n_head_kv: int
    head_dim: int                # attention.key_length == value_length
    n_rot: int                   # rope.dimension_count
    rope_theta: float
    rope_sections: tuple[int, ...]
    rms_eps: float
    recurrent: tuple[bool, ...]  # per main-pass layer: True = Gated DeltaNet
    conv_kernel: int             # ssm.conv_kernel
    ssm_inner: int               # ssm.inner_size = n_v_heads * d_v
    ssm_d_state: int             # ssm.state_size = d_k
    ssm_n_k_heads: int           # ssm.group_count
    ssm_n_v_heads: int           # ssm.time_step_rank
    context_length: int
    n_nextn: int = 0             # nextn_predict_layers (MTP blocks stored after the main layers)

    @property
    def d_k(self) -> int:
        return self.ssm_d_state

    @property
    def d_v(self) -> int:
        return self.ssm_inner // self.ssm_n_v_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.ssm_n_k_heads * self.d_k + self.ssm_inner

    @property
    def attention_layers(self) -> list[int]:
        return [il for il, r in enumerate(self.recurrent) if not r]

    @property
    def deltanet_layers(self) -> list[int]:
        return [il for il, r in enumerate(self.recurrent) if r]

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Qwen35HParams":
        """Read and validate the `qwen35.*` keys (GGUFMetadataError on a bad value); n_vocab comes
        from `token_embd.weight` (GGUFTensorError if it is missing)."""
        arch = f.get_str("general.architecture")
        if arch != ARCH:
            raise GGUFMetadataError(f.path, f"general.architecture is '{arch}', expected '{ARCH}'")
        a = ARCH

        def pos(key: str, default: int | None = None) -> int:
            return f.get_int(f"{a}.{key}", default, minimum=1)

        n_embd = pos("embedding_length")
        block_count = pos("block_count")
        n_nextn = f.get_int(f"{a}.nextn_predict_layers", 0, minimum=0)
        if n_nextn >= block_count:
            raise GGUFMetadataError(f.path, f"{a}.nextn_predict_layers = {n_nextn} leaves no main layers "
                                            f"of block_count {block_count}")
        n_layer = block_count - n_nextn
        n_head = pos("attention.head_count")
        n_head_kv = pos("attention.head_count_kv")
        head_dim = pos("attention.key_length")
        value_length = pos("attention.value_length", head_dim)
        n_rot = f.get_int(f"{a}.rope.dimension_count", head_dim, minimum=2)
        ssm_d_state = pos("ssm.state_size")
        ssm_inner = pos("ssm.inner_size")
        n_v = pos("ssm.time_step_rank")
        n_k = pos("ssm.group_count")
        conv_kernel = pos("ssm.conv_kernel")
        eps = f.get_float(f"{a}.attention.layer_norm_rms_epsilon")
        theta = f.get_float(f"{a}.rope.freq_base", 10000.0)

        def bad(msg: str) -> GGUFMetadataError:
            return GGUFMetadataError(f.path, msg)

        if value_length != head_dim:
            raise bad(f"{a}.attention.value_length {value_length} differs from key_length {head_dim} "
                      f"(qwen35 attention needs them equal)")
        if n_head % n_head_kv:
            raise bad(f"{a}.attention.head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        if n_rot % 2 or n_rot > head_dim:
            raise bad(f"{a}.rope.dimension_count {n_rot} must be even and at most key_length {head_dim}")
        if n_v % n_k:
            raise bad(f"{a}.ssm.time_step_rank {n_v} (value heads) is not a multiple of "
                      f"ssm.group_count {n_k} (key heads)")
        if ssm_inner % n_v:
            raise bad(f"{a}.ssm.inner_size {ssm_inner} is not a multiple of ssm.time_step_rank {n_v}")
        if conv_kernel < 2:
            raise bad(f"{a}.ssm.conv_kernel {conv_kernel} must be at least 2")
        if not 0.0 < eps < 1.0:
            raise bad(f"{a}.attention.layer_norm_rms_epsilon {eps} must lie in (0, 1)")
        if theta <= 0.0:
            raise bad(f"{a}.rope.freq_base {theta} must be positive")
        sections = tuple(int(s) for s in f.get_array(f"{a}.rope.dimension_sections", [n_rot // 2, 0, 0, 0]))
        # Sections only split the rotary pairs between M-RoPE position streams; for text all streams
        # carry the same position, so they do not change the result (HF's defaults even exceed small
        # n_rot). Only their form is checked.
        if not sections or any(s < 0 for s in sections):
            raise bad(f"{a}.rope.dimension_sections {list(sections)} must be non-negative integers")

        key = f"{a}.attention.recurrent_layers"
        if key in f:
            flags = f.get_array(key)
            if len(flags) < n_layer or not all(isinstance(v, bool) for v in flags):
                raise bad(f"{key} must be {block_count} booleans, got {len(flags)} values")
            recurrent = tuple(bool(v) for v in flags[:n_layer])
        else:
            interval = f.get_int(f"{a}.full_attention_interval", 4, minimum=1)
            recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))

        embd = f.tensor("token_embd.weight")
        if len(embd.ne) != 2 or embd.ne[0] != n_embd:
            raise GGUFTensorError(f.path, f"tensor 'token_embd.weight' has shape {list(embd.ne)}, "
                                          f"expected [{n_embd}, n_vocab]")
        return cls(n_vocab=int(embd.ne[1]), n_embd=n_embd, n_ff=pos("feed_forward_length"), n_layer=n_layer,
                   n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot, rope_theta=theta,
                   rope_sections=sections, rms_eps=eps, recurrent=recurrent, conv_kernel=conv_kernel,
                   ssm_inner=ssm_inner, ssm_d_state=ssm_d_state, ssm_n_k_heads=n_k, ssm_n_v_heads=n_v,
                   context_length=f.get_int(f"{a}.context_length", 0, minimum=0), n_nextn=n_nextn)


def _tensor_specs(hp: Qwen35HParams, tied: bool) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, ggml ne, allowed types) of every tensor the main pass reads."""
    d, ff = hp.n_embd, hp.n_ff
    specs = [("token_embd.weight", (d, hp.n_vocab), _MATRIX_TYPES),
             ("output_norm.weight", (d,), _FLOAT_TYPES)]
    if not tied:
        specs.append(("output.weight", (d, hp.n_vocab), _MATRIX_TYPES))
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        specs += [(p + "attn_norm.weight", (d,), _FLOAT_TYPES),
                  (p + "post_attention_norm.weight", (d,), _FLOAT_TYPES),
                  (p + "ffn_gate.weight", (d, ff), _MATRIX_TYPES),
                  (p + "ffn_up.weight", (d, ff), _MATRIX_TYPES),
                  (p + "ffn_down.weight", (ff, d), _MATRIX_TYPES)]
        if hp.recurrent[il]:
            C, nv = hp.conv_channels, hp.ssm_n_v_heads
            specs += [(p + "attn_qkv.weight", (d, C), _MATRIX_TYPES),
                      (p + "attn_gate.weight", (d, hp.ssm_inner), _MATRIX_TYPES),
                      (p + "ssm_conv1d.weight", (hp.conv_kernel, C), _FLOAT_TYPES),
                      (p + "ssm_a", (nv,), _FLOAT_TYPES),
                      (p + "ssm_dt.bias", (nv,), _FLOAT_TYPES),
                      (p + "ssm_alpha.weight", (d, nv), _MATRIX_TYPES),
                      (p + "ssm_beta.weight", (d, nv), _MATRIX_TYPES),
                      (p + "ssm_norm.weight", (hp.d_v,), _FLOAT_TYPES),
                      (p + "ssm_out.weight", (hp.ssm_inner, d), _MATRIX_TYPES)]
        else:
            hd = hp.head_dim
            specs += [(p + "attn_q.weight", (d, 2 * hp.n_head * hd), _MATRIX_TYPES),
                      (p + "attn_k.weight", (d, hp.n_head_kv * hd), _MATRIX_TYPES),
                      (p + "attn_v.weight", (d, hp.n_head_kv * hd), _MATRIX_TYPES),
                      (p + "attn_q_norm.weight", (hd,), _FLOAT_TYPES),
                      (p + "attn_k_norm.weight", (hd,), _FLOAT_TYPES),
                      (p + "attn_output.weight", (hp.n_head * hd, d), _MATRIX_TYPES)]
    return specs


def check_file(f: GGUFFile) -> Qwen35HParams:
    """Validate a qwen35 file completely (metadata and the shape and type of every tensor the model
    reads) without loading anything; raises GGUFMetadataError / GGUFTensorError."""
    hp = Qwen35HParams.from_gguf(f)
    tied = "output.weight" not in f.tensors
    for name, ne, types in _tensor_specs(hp, tied):
        f.expect_tensor(name, ne, types=types)
    return hp


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------

@dataclass
class _AttentionWeights:
    wq: Any          # [d -> 2·n_head·D]: per head h, rows [h·2D, h·2D+D) = q_h, then D rows of gate_h
    wk: Any
    wv: Any
    wo: Any
    q_norm: Any
    k_norm: Any


@dataclass
class _DeltaNetWeights:
    w_qkv: Any       # [d -> C]: q (n_k·d_k) | k (n_k·d_k) | v (n_v·d_v), v heads tiled
    w_gate: Any      # z [d -> n_v·d_v]
    w_alpha: Any
    w_beta: Any
    conv: Any        # [C, K] float32, tap K-1 is the newest input
    ssm_a: Any       # -exp(A_log) [n_v]
    dt_bias: Any
    ssm_norm: Any    # [d_v], plain weight (not 1+w)
    w_out: Any


@dataclass
class _Layer:
    attn_norm: Any
    post_norm: Any
    ffn_gate: Any
    ffn_up: Any
    ffn_down: Any
    mixer: _AttentionWeights | _DeltaNetWeights


# ------------------------------------------------------------------------------------------------
# state
# ------------------------------------------------------------------------------------------------

class Qwen35State:
    """Everything a sequence carries between forward calls, as backend arrays:
    `k_cache[il]`, `v_cache[il]` [n_head_kv, max_ctx, head_dim] per attention layer,
    `conv[il]` [conv_kernel-1, C] (row 0 oldest) and `ssm[il]` [n_v, d_v, d_k] per DeltaNet layer (the
    delta rule's S transposed per head, kernels/deltanet.py),
    and `n_past`, the number of tokens already processed."""

    def __init__(self, hp: Qwen35HParams, backend: Any, max_ctx: int):
        if max_ctx < 1:
            raise ModelInputError(f"max_ctx must be positive, got {max_ctx}")
        xp = backend.xp
        self.hparams, self.backend, self.max_ctx, self.n_past = hp, backend, int(max_ctx), 0
        self.k_cache = {il: xp.zeros((hp.n_head_kv, max_ctx, hp.head_dim), dtype=xp.float32)
                        for il in hp.attention_layers}
        self.v_cache = {il: xp.zeros((hp.n_head_kv, max_ctx, hp.head_dim), dtype=xp.float32)
                        for il in hp.attention_layers}
        self.conv = {il: xp.zeros((hp.conv_kernel - 1, hp.conv_channels), dtype=xp.float32)
                     for il in hp.deltanet_layers}
        self.ssm = {il: xp.zeros((hp.ssm_n_v_heads, hp.d_v, hp.d_k), dtype=xp.float32)
                    for il in hp.deltanet_layers}

    def _arrays(self) -> dict[str, Any]:
        out = {}
        for il in self.k_cache:
            out[f"k.{il}"], out[f"v.{il}"] = self.k_cache[il], self.v_cache[il]
        for il in self.conv:
            out[f"conv.{il}"], out[f"ssm.{il}"] = self.conv[il], self.ssm[il]
        return out

    def copy(self) -> "Qwen35State":
        """An independent copy on the same device."""
        new = Qwen35State.__new__(Qwen35State)
        new.hparams, new.backend, new.max_ctx, new.n_past = self.hparams, self.backend, self.max_ctx, self.n_past
        new.k_cache = {il: a.copy() for il, a in self.k_cache.items()}
        new.v_cache = {il: a.copy() for il, a in self.v_cache.items()}
        new.conv = {il: a.copy() for il, a in self.conv.items()}
        new.ssm = {il: a.copy() for il, a in self.ssm.items()}
        return new

    def copy_from(self, other: "Qwen35State") -> "Qwen35State":
        """Overwrite this state with `other`'s contents in place (same model and max_ctx); returns
        self. Its arrays stay where they are, so a GPU step bound to this state stays bound (a fresh
        `copy()` is a new set of arrays the step must bind anew)."""
        if other.hparams is not self.hparams and other.hparams != self.hparams:
            raise StateError("copy_from: the state was created for a different model")
        if other.max_ctx != self.max_ctx:
            raise StateError(f"copy_from: max_ctx {other.max_ctx} into a state of max_ctx {self.max_ctx}")
        theirs = other._arrays()
        for name, a in self._arrays().items():
            a[...] = theirs[name]
        self.n_past = other.n_past
        return self

    def to_host(self) -> dict[str, np.ndarray]:
        """A host snapshot: `n_past`, and per layer `k.{il}`/`v.{il}` (only the first n_past cache
        rows), `conv.{il}`, `ssm.{il}`, all numpy float32 copies."""
        n = self.n_past
        snap = {"n_past": np.array(n, dtype=np.int64)}
        for name, arr in self._arrays().items():
            part = arr[:, :n] if name[0] in "kv" else arr
            snap[name] = np.array(self.backend.to_host(part), dtype=np.float32, copy=True)
        return snap

    def from_host(self, snapshot: dict[str, np.ndarray]) -> "Qwen35State":
        """Restore a `to_host` snapshot into this state (any max_ctx ≥ its n_past); returns self."""
        try:
            n = int(np.asarray(snapshot["n_past"]))
        except (KeyError, TypeError, ValueError):
            raise StateError("snapshot has no integer 'n_past'") from None
        if not 0 <= n <= self.max_ctx:
            raise StateError(f"snapshot n_past {n} does not fit a state of max_ctx {self.max_ctx}")
        arrays = self._arrays()
        missing = sorted(set(arrays) - set(snapshot))
        extra = sorted(set(snapshot) - set(arrays) - {"n_past"})
        if missing or extra:
            raise StateError(f"snapshot does not match this model: missing {missing[:4]}, unexpected {extra[:4]}")
        for name, arr in arrays.items():
            src = np.asarray(snapshot[name], dtype=np.float32)
            want = (arr.shape[0], n, arr.shape[2]) if name[0] in "kv" else tuple(arr.shape)
            if src.shape != want:
                raise StateError(f"snapshot '{name}' has shape {list(src.shape)}, expected {list(want)}")
        for name, arr in arrays.items():
            src = self.backend.asarray(np.asarray(snapshot[name], dtype=np.float32))
            if name[0] in "kv":
                arr[:, :n] = src
                arr[:, n:] = 0
            else:
                arr[...] = src
        self.n_past = n
        return self


@dataclass
class VerifyRecord:
    """What `Qwen35Model.verify` keeps so that `rollback` can cut the state back to any prefix of the
    block: the state's n_past before the block, and per DeltaNet layer the delta-rule state before the
    block, the float32 state after each token [T, H_v, d_v, d_k] (memory: T times one layer's state),
    and the conv inputs [K-1+T, C] (the conv state before the block followed by the block's inputs)."""

    n_past0: int
    n_tokens: int
    ssm_before: dict[int, Any]
    ssm_after: dict[int, Any]          # views [T, ...] of ssm_buffers
    conv_inputs: dict[int, Any]
    ssm_buffers: dict[int, Any]        # [capacity >= T, H_v, d_v, d_k], reusable by the next verify


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------

class Qwen35Model:
    """A loaded qwen35 GGUF. `forward` / `prefill` run tokens through it, advancing a state."""

    def __init__(self, gguf: GGUFFile, hparams: Qwen35HParams, backend: Any):
        self.gguf, self.hparams, self.backend = gguf, hparams, backend
        self.path = gguf.path
        b = backend
        vec = lambda name: b.load_vector(gguf.tensor(name))   # noqa: E731
        # Matrices that are only multiplied may take a backend-specific layout (the GPU's
        # tensor-core units); the embedding table is read by rows, so it keeps the file's layout.
        # A file whose matrices are all float (F32/F16/BF16) is a reference run: it keeps the plain
        # layout and float32 activations (the tensor-core path rounds activations to f16).
        load_mm = getattr(b, "load_matmul_weight", None)
        if load_mm is not None and all(int(gguf.tensor(n).qtype) in _FLOAT_TYPES
                                       for n, ne, _ in _tensor_specs(hparams, "output.weight" not in gguf.tensors)
                                       if len(ne) == 2 and "conv1d" not in n):
            load_mm = None
        mat = (lambda name: load_mm(gguf.tensor(name))) if load_mm else (lambda name: b.load_weight(gguf.tensor(name)))
        self.token_embd = b.load_weight(gguf.tensor("token_embd.weight"))
        self.tied_output = "output.weight" not in gguf.tensors
        if self.tied_output:
            self.output = mat("token_embd.weight") if load_mm else self.token_embd
        else:
            self.output = mat("output.weight")
        self.output_norm = vec("output_norm.weight")
        self.layers: list[_Layer] = []
        for il in range(hparams.n_layer):
            p = f"blk.{il}."
            if hparams.recurrent[il]:
                mixer: _AttentionWeights | _DeltaNetWeights = _DeltaNetWeights(
                    w_qkv=mat(p + "attn_qkv.weight"), w_gate=mat(p + "attn_gate.weight"),
                    w_alpha=mat(p + "ssm_alpha.weight"), w_beta=mat(p + "ssm_beta.weight"),
                    conv=vec(p + "ssm_conv1d.weight"), ssm_a=vec(p + "ssm_a"), dt_bias=vec(p + "ssm_dt.bias"),
                    ssm_norm=vec(p + "ssm_norm.weight"), w_out=mat(p + "ssm_out.weight"))
            else:
                mixer = _AttentionWeights(
                    wq=mat(p + "attn_q.weight"), wk=mat(p + "attn_k.weight"), wv=mat(p + "attn_v.weight"),
                    wo=mat(p + "attn_output.weight"), q_norm=vec(p + "attn_q_norm.weight"),
                    k_norm=vec(p + "attn_k_norm.weight"))
            self.layers.append(_Layer(attn_norm=vec(p + "attn_norm.weight"),
                                      post_norm=vec(p + "post_attention_norm.weight"),
                                      ffn_gate=mat(p + "ffn_gate.weight"), ffn_up=mat(p + "ffn_up.weight"),
                                      ffn_down=mat(p + "ffn_down.weight"), mixer=mixer))
        # On a GPU whose weights all took the tensor-core layout, steps run as captured graphs of
        # fused kernels (daemons/qwen35_gpu.py); otherwise through the backend's operations below.
        from daemons.qwen35_gpu import Qwen35GpuStep, step_supported
        self.gpu_step: Qwen35GpuStep | None = Qwen35GpuStep(self) if step_supported(self) else None

    @classmethod
    def load(cls, path: str | os.PathLike, backend: Any = None) -> "Qwen35Model":
        """Open, fully validate (`check_file`) and load a qwen35 GGUF; weights stay memory-mapped
        in their stored quantisation. `backend` defaults to the CPU backend."""
        if backend is None:
            from kernels import get_backend
            backend = get_backend("cpu")
        f = GGUFFile(path)
        try:
            hp = check_file(f)
        except Exception:
            f.close()
            raise
        return cls(f, hp, backend)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.gguf.metadata

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    def weight_nbytes(self) -> int:
        return sum(t.nbytes for t in self.gguf.tensors.values())

    def new_state(self, max_ctx: int | None = None) -> Qwen35State:
        """A fresh (empty) state holding up to `max_ctx` tokens (default: the file's
        context_length, or 4096 if the file does not say)."""
        if max_ctx is None:
            max_ctx = self.hparams.context_length or 4096
        return Qwen35State(self.hparams, self.backend, int(max_ctx))

    # -- running --------------------------------------------------------------------------------
    @property
    def device_topk_max(self) -> int:
        """The largest top_k for which `forward(..., logits="topk_last")` selects the candidates on
        the device (only they cross to the host); 0 without a GPU step (the call then works from the
        host logits, no cheaper than sampling them)."""
        from kernels.fused_gpu import TOPK_MAX
        return min(TOPK_MAX, self.n_vocab) if self.gpu_step is not None else 0

    def forward(self, token_ids: Sequence[int], state: Qwen35State, logits: str = "last",
                capture_layers: Collection[int] | None = None, deltanet_mode: str = "auto", top_k: int = 0):
        """Run `token_ids` (positions state.n_past, n_past+1, ...) in one batch and advance `state`.

        logits: "last" -> float32 host [1, vocab]; "all" -> [T, vocab]; "none" -> None (skips the
        LM head, for prompt chunks whose logits nobody reads); "argmax" -> int64 [T] greedy ids of
        every row, "argmax_last" -> [1] (on a GPU only the ids cross to the host); "topk_last" ->
        (int64 ids ascending, float32 values) of the `top_k` largest logits of the last row
        (daemons/sampling.py top_candidates; the row [1, vocab] itself when it holds a NaN or +inf).
        capture_layers: layer ids whose output x' (after the FFN residual, HF `hidden_states[il+1]`)
        is returned too; then the result is `(logits, {il: float32 host [T, n_embd]})`.
        deltanet_mode: "auto" (chunked form for T > 1, recurrence for one token), "recurrent" or
        "chunked"."""
        if logits not in ("last", "all", "none", "argmax", "argmax_last", "topk_last"):
            raise ModelInputError(
                f"logits must be 'last', 'all', 'none', 'argmax', 'argmax_last' or 'topk_last', got {logits!r}")
        if logits == "topk_last" and not 1 <= top_k <= self.n_vocab:
            raise ModelInputError(f"top_k must be in 1..{self.n_vocab} for logits='topk_last', got {top_k!r}")
        if deltanet_mode not in ("auto", "recurrent", "chunked"):
            raise ModelInputError(f"deltanet_mode must be 'auto', 'recurrent' or 'chunked', got {deltanet_mode!r}")
        ids = self._check_call(token_ids, state, capture_layers)
        if self.gpu_step is not None and len(ids) < getattr(self.backend, "wide_batch_min", math.inf):
            return self._gpu_forward(ids, state, logits, capture_layers, top_k)
        # (a GPU step's model forwards wide batches, prefill chunks of `wide_batch_min` tokens or
        # more, through the backend operations below: their matmuls are cuBLAS GEMMs on f16
        # dequantised weights, compute-bound where the step's kernels re-read the weights every
        # 32 tokens)
        if logits == "topk_last":
            out = self.forward(ids, state, logits="last", capture_layers=capture_layers, deltanet_mode=deltanet_mode)
            lg, cap = out if capture_layers is not None else (out, None)
            res = lg if not (lg < np.inf).all() else top_candidates(lg[0], top_k)   # NaN / +inf: the row
            return (res, cap) if capture_layers is not None else res
        if logits in ("argmax", "argmax_last"):
            out = self.forward(ids, state, logits="all" if logits == "argmax" else "last",
                               capture_layers=capture_layers, deltanet_mode=deltanet_mode)
            lg, cap = out if capture_layers is not None else (out, None)
            am = np.argmax(lg, axis=-1).astype(np.int64)
            return (am, cap) if capture_layers is not None else am
        use_chunked = deltanet_mode == "chunked" or (deltanet_mode == "auto" and len(ids) > 1)
        out, captured = self._run(ids, state, logits, capture_layers, use_chunked, record=None)
        return (out, captured) if capture_layers is not None else out

    def verify(self, token_ids: Sequence[int], state: Qwen35State, capture_layers: Collection[int] | None = None,
               reuse: VerifyRecord | None = None, logits: str = "all",
               top_k: int = 0) -> tuple[Any, dict[int, np.ndarray], Any]:
        """Forward a speculative block (positions state.n_past ...) and advance `state` by all of it;
        returns (logits float32 [T, vocab], {il: captured layer output [T, n_embd]}, record). Keep a
        prefix of the block with `rollback(state, record, n_keep)`.

        Every row is computed as a one-token `forward` at its position computes it, so its logits
        and the states it leaves are bit-identical to autoregressive decoding: the DeltaNet runs the
        token-by-token recurrence (storing each token's float32 state), attention runs row by row
        over kv_len = position + 1 (the softmax then sums exactly the keys a decode step sums), and
        the matrix products are the backend's batch-invariant ones (CPU: the fused kernel, T <= 32).

        `reuse`: an earlier record of this model whose checkpoint buffers may be overwritten (the
        caller is done rolling back with it); saves allocating T states per layer every step.
        `logits="argmax"` returns the int64 greedy id of every row instead of the logits;
        `logits="topk"` a list with, per row, the `top_k` largest logits as (int64 ids ascending,
        float32 values) (daemons/sampling.py top_candidates; the row [vocab] itself when it holds a
        NaN or +inf) — on a GPU step selected on the device, so a sampled verify copies those only.

        On a GPU step (daemons/qwen35_gpu.py) the record is a `GpuVerifyRecord`: the block's inputs
        stay in the engine's buffers until the next verify, and `rollback` replays the kept prefix."""
        ids = self._check_call(token_ids, state, capture_layers)
        if logits not in ("all", "argmax", "topk"):
            raise ModelInputError(f"verify logits must be 'all', 'argmax' or 'topk', got {logits!r}")
        if logits == "topk" and not 1 <= top_k <= self.n_vocab:
            raise ModelInputError(f"top_k must be in 1..{self.n_vocab} for logits='topk', got {top_k!r}")
        if self.gpu_step is not None:
            from daemons.qwen35_gpu import MAX_T
            if len(ids) > MAX_T:
                raise ModelInputError(f"a verify block holds at most {MAX_T} tokens on the GPU, got {len(ids)}")
            if logits == "topk" and top_k > self.device_topk_max:
                raise ModelInputError(f"top_k={top_k}: the device selects at most {self.device_topk_max}")
            return self.gpu_step.verify(ids, state, logits=logits, capture=capture_layers or (), top_k=top_k)
        hp, xp = self.hparams, self.backend.xp
        T = len(ids)
        layers = hp.deltanet_layers
        if reuse is not None and all(il in reuse.ssm_buffers and reuse.ssm_buffers[il].shape[0] >= T for il in layers):
            buffers = reuse.ssm_buffers
        else:
            buffers = {il: xp.empty((T, hp.ssm_n_v_heads, hp.d_v, hp.d_k), dtype=xp.float32) for il in layers}
        record = VerifyRecord(n_past0=state.n_past, n_tokens=T,
                              ssm_before={il: state.ssm[il].copy() for il in layers},
                              ssm_after={il: buffers[il][:T] for il in layers}, conv_inputs={},
                              ssm_buffers=buffers)
        out, captured = self._run(ids, state, "all", capture_layers, False, record=record)
        if logits == "argmax":
            out = np.argmax(out, axis=-1).astype(np.int64)
        elif logits == "topk":
            out = [row.copy() if not (row < np.inf).all() else top_candidates(row, top_k) for row in out]
        return out, captured, record

    def rollback(self, state: Qwen35State, record: VerifyRecord, n_keep: int) -> None:
        """Cut `state` back to the first `n_keep` tokens (0..T) of the block `record` describes; the
        state must not have moved since that `verify` except by earlier rollbacks of the same block.
        Conv and DeltaNet states become exactly those after token n_keep-1; KV rows past the kept
        prefix stay in place (never read: attention is causal) and are overwritten later."""
        if not 0 <= n_keep <= record.n_tokens:
            raise ModelInputError(f"rollback keeps {n_keep} tokens of a {record.n_tokens}-token block")
        if self.gpu_step is not None:
            try:
                self.gpu_step.commit(state, record, n_keep)
            except ValueError as exc:
                raise StateError(str(exc)) from None
            return
        if not record.n_past0 <= state.n_past <= record.n_past0 + record.n_tokens:
            raise StateError(f"state holds {state.n_past} tokens; it cannot be the state of the verified block "
                             f"at positions {record.n_past0}..{record.n_past0 + record.n_tokens - 1}")
        xp, km1 = self.backend.xp, self.hparams.conv_kernel - 1
        for il in self.hparams.deltanet_layers:
            src = record.ssm_after[il][n_keep - 1] if n_keep else record.ssm_before[il]
            state.ssm[il][...] = src
            state.conv[il] = xp.ascontiguousarray(record.conv_inputs[il][n_keep:n_keep + km1]).copy()
        state.n_past = record.n_past0 + n_keep

    def _check_call(self, token_ids: Sequence[int], state: Qwen35State,
                    capture_layers: Collection[int] | None) -> np.ndarray:
        hp = self.hparams
        ids = self._check_ids(token_ids)
        if state.hparams is not hp and state.hparams != hp:
            raise StateError("state was created for a different model")
        if state.n_past + len(ids) > state.max_ctx:
            raise ModelInputError(f"context overflow: {state.n_past} tokens in the state + {len(ids)} new > "
                                  f"max_ctx {state.max_ctx}")
        bad = [int(i) for i in (capture_layers or ()) if not 0 <= int(i) < hp.n_layer]
        if bad:
            raise ModelInputError(f"capture layer {bad[0]} outside 0..{hp.n_layer - 1}")
        return ids

    def _run(self, ids: np.ndarray, state: Qwen35State, logits: str, capture_layers: Collection[int] | None,
             use_chunked: bool, record: VerifyRecord | None) -> tuple[Any, dict[int, np.ndarray]]:
        """The layer stack. With `record` (verify): row-exact attention, recurrent DeltaNet with
        per-token checkpoints and conv inputs stored into the record."""
        hp, b = self.hparams, self.backend
        T = len(ids)
        capture = set(int(i) for i in capture_layers) if capture_layers is not None else set()
        positions = np.arange(state.n_past, state.n_past + T, dtype=np.int64)
        x = b.embed(self.token_embd, ids)                                     # [T, d]
        captured: dict[int, np.ndarray] = {}
        for il, layer in enumerate(self.layers):
            xn = b.rms_norm(x, layer.attn_norm, hp.rms_eps)
            if isinstance(layer.mixer, _AttentionWeights):
                mixed = self._attention(il, layer.mixer, xn, positions, state, row_exact=record is not None)
            else:
                mixed = self._deltanet(il, layer.mixer, xn, state, use_chunked, record)
            h = x + mixed
            hn = b.rms_norm(h, layer.post_norm, hp.rms_eps)
            x = h + b.matmul(b.silu_mul(b.matmul(hn, layer.ffn_gate), b.matmul(hn, layer.ffn_up)), layer.ffn_down)
            if il in capture:
                captured[il] = np.array(b.to_host(x), dtype=np.float32, copy=True)
        state.n_past += T

        out = None
        if logits != "none":
            sel = x if logits == "all" else x[T - 1:T]
            out = np.asarray(b.to_host(b.matmul(b.rms_norm(sel, self.output_norm, hp.rms_eps), self.output)),
                             dtype=np.float32)
        return out, captured

    def _gpu_forward(self, ids: np.ndarray, state: Qwen35State, logits: str, capture_layers: Collection[int] | None,
                     top_k: int = 0):
        """`forward` on the GPU step: chunks of at most 32 tokens, each one graph launch."""
        from daemons.qwen35_gpu import MAX_T
        step = self.gpu_step
        cap = tuple(capture_layers) if capture_layers is not None else ()
        outs, caps = [], {}
        T = len(ids)
        for c0 in range(0, T, MAX_T):
            part = ids[c0:c0 + MAX_T]
            last = c0 + MAX_T >= T
            want = logits if (logits in ("all", "argmax") or last) else "none"
            out, cap_part = step.step(part, state, "advance", want, cap, top_k=top_k)
            if out is not None:
                outs.append(out)
            for il, a in cap_part.items():
                caps.setdefault(il, []).append(a)
        if logits == "none":
            res = None
        elif logits in ("all", "argmax"):
            res = np.concatenate(outs, axis=0)
        else:
            res = outs[-1]
        if capture_layers is not None:
            return res, {il: np.concatenate(parts, axis=0) for il, parts in caps.items()}
        return res

    def prefill(self, token_ids: Sequence[int], state: Qwen35State, chunk: int = 512, logits: str = "last",
                capture_layers: Collection[int] | None = None):
        """`forward` over a long prompt in chunks of `chunk` tokens (bounded activation memory).
        Returns what `forward` would for the whole prompt: logits "last" [1, V], "all" [T, V] or
        "none"; with capture_layers, `(logits, {il: [T, n_embd]})`."""
        ids = self._check_ids(token_ids)
        if chunk < 1:
            raise ModelInputError(f"chunk must be positive, got {chunk}")
        if state.n_past + len(ids) > state.max_ctx:
            raise ModelInputError(f"context overflow: {state.n_past} tokens in the state + {len(ids)} new > "
                                  f"max_ctx {state.max_ctx}")
        all_logits, caps = [], {}
        last = None
        for c0 in range(0, len(ids), chunk):
            part = ids[c0:c0 + chunk]
            is_last = c0 + chunk >= len(ids)
            want = logits if (logits == "all" or is_last) else "none"
            res = self.forward(part, state, logits=want, capture_layers=capture_layers)
            lg, cap = res if capture_layers is not None else (res, None)
            if logits == "all":
                all_logits.append(lg)
            last = lg
            if cap is not None:
                for il, arr in cap.items():
                    caps.setdefault(il, []).append(arr)
        out = np.concatenate(all_logits, axis=0) if logits == "all" else last
        if capture_layers is not None:
            return out, {il: np.concatenate(parts, axis=0) for il, parts in caps.items()}
        return out

    # -- layers ---------------------------------------------------------------------------------
    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        try:
            ids = np.asarray(token_ids)
        except (TypeError, ValueError):
            raise ModelInputError("token ids must be a sequence of integers") from None
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ModelInputError(f"token ids must be a non-empty 1-D integer sequence, got "
                                  f"{ids.dtype}{list(ids.shape)}")
        ids = ids.astype(np.int64)
        bad = (ids < 0) | (ids >= self.hparams.n_vocab)
        if bad.any():
            raise ModelInputError(f"token id {int(ids[np.argmax(bad)])} outside 0..{self.hparams.n_vocab - 1}")
        return ids

    def _attention(self, il: int, w: _AttentionWeights, xn: Any, positions: np.ndarray,
                   state: Qwen35State, row_exact: bool = False) -> Any:
        hp, b = self.hparams, self.backend
        T, H, Hkv, D = xn.shape[0], hp.n_head, hp.n_head_kv, hp.head_dim
        qg = b.matmul(xn, w.wq).reshape(T, H, 2 * D)
        q = b.rms_norm(qg[:, :, :D], w.q_norm, hp.rms_eps)
        gate = qg[:, :, D:].reshape(T, H * D)
        k = b.rms_norm(b.matmul(xn, w.wk).reshape(T, Hkv, D), w.k_norm, hp.rms_eps)
        v = b.matmul(xn, w.wv).reshape(T, Hkv, D)
        q = b.rope_neox(q, positions, hp.n_rot, hp.rope_theta)
        k = b.rope_neox(k, positions, hp.n_rot, hp.rope_theta)
        p0 = state.n_past
        state.k_cache[il][:, p0:p0 + T] = k.transpose(1, 0, 2)
        state.v_cache[il][:, p0:p0 + T] = v.transpose(1, 0, 2)
        scale = 1.0 / math.sqrt(D)
        if row_exact and T > 1:
            # one call per row over exactly the keys a decode step at that position would see
            o = b.xp.concatenate([b.attention(q[t:t + 1], state.k_cache[il], state.v_cache[il], positions[t:t + 1],
                                              p0 + t + 1, scale) for t in range(T)], axis=0)
        else:
            o = b.attention(q, state.k_cache[il], state.v_cache[il], positions, p0 + T, scale)
        return b.matmul(b.sigmoid_mul(o.reshape(T, H * D), gate), w.wo)

    def _deltanet(self, il: int, w: _DeltaNetWeights, xn: Any, state: Qwen35State, chunked: bool,
                  record: VerifyRecord | None = None) -> Any:
        hp, b, xp = self.hparams, self.backend, self.backend.xp
        T = xn.shape[0]
        nk, nv, dk, dv = hp.ssm_n_k_heads, hp.ssm_n_v_heads, hp.d_k, hp.d_v
        qkv = b.matmul(xn, w.w_qkv)                                            # [T, C]
        z = b.matmul(xn, w.w_gate).reshape(T, nv, dv)
        beta_logit = b.matmul(xn, w.w_beta)                                    # [T, nv]
        alpha = b.matmul(xn, w.w_alpha) + w.dt_bias
        if record is not None:
            record.conv_inputs[il] = xp.concatenate([state.conv[il], qkv], axis=0)
        conv_out, new_conv = b.causal_conv1d_silu(qkv, state.conv[il], w.conv)
        state.conv[il][...] = new_conv       # in place: a GPU step's state table points at this array
        q = b.l2_norm(conv_out[:, :nk * dk].reshape(T, nk, dk), hp.rms_eps)
        k = b.l2_norm(conv_out[:, nk * dk:2 * nk * dk].reshape(T, nk, dk), hp.rms_eps)
        v = conv_out[:, 2 * nk * dk:].reshape(T, nv, dv)
        beta = 1.0 / (1.0 + xp.exp(-beta_logit))
        # softplus with torch's/ggml's threshold: x itself above 20
        softplus = xp.where(alpha > 20.0, alpha, xp.log1p(xp.exp(xp.minimum(alpha, 20.0))))
        g = (w.ssm_a * softplus).astype(xp.float32)                           # log-decay <= 0
        if record is not None:
            o = b.deltanet_recurrent(q, k, v, g, beta.astype(xp.float32), state.ssm[il],
                                     checkpoints=record.ssm_after[il])
        else:
            run = b.deltanet_chunked if chunked else b.deltanet_recurrent
            o = run(q, k, v, g, beta.astype(xp.float32), state.ssm[il])       # [T, nv, dv]
        y = b.gated_rms_norm(o, w.ssm_norm, z, hp.rms_eps).reshape(T, nv * dv)
        return b.matmul(y, w.w_out)


# The architecture registry loads every architecture module through `Model.load(path, backend)`.
Model = Qwen35Model
