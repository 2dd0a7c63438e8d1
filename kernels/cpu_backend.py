"""The CPU backend: `kernels.backend.Backend` with numpy + numba.

Weights stay in their GGUF quantisation (`kernels.matmul.QuantizedWeight`, a view on the
memory-mapped file) and are dequantised block by block inside `kernels.matmul.matmul`. The
delta rule runs in `kernels.deltanet` (numba recurrence, numpy chunked form). Everything else
here is small numpy code on float32 activations; reductions that decide a normalisation
(RMSNorm, L2 norm) sum in float64, as ggml's CPU path does.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from kernels import deltanet
from kernels.backend import BackendError
from kernels.matmul import QuantizedWeight, embedding_rows, matmul

__all__ = ["CPUBackend"]

_TWO_PI = 2.0 * math.pi


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


class CPUBackend:
    """numpy/numba implementation of `kernels.backend.Backend` (see that module for the contract)."""

    name = "cpu"
    device = "cpu"
    xp = np

    def __init__(self, n_threads: int | None = None):
        if n_threads is not None:
            import numba
            if n_threads < 1:
                raise BackendError(f"n_threads must be positive, got {n_threads}")
            numba.set_num_threads(min(int(n_threads), numba.config.NUMBA_NUM_THREADS))

    def __repr__(self) -> str:
        return "CPUBackend()"

    # -- data movement ------------------------------------------------------------------------
    def asarray(self, host_array: Any, dtype: Any = None) -> np.ndarray:
        return np.array(host_array, dtype=dtype, copy=True)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def load_weight(self, tensor: Any) -> QuantizedWeight:
        if len(tensor.ne) != 2:
            raise BackendError(f"weight '{tensor.name}' must be a matrix, has shape {list(tensor.ne)}")
        return QuantizedWeight(tensor.raw, tensor.qtype, n_out=tensor.ne[1], n_in=tensor.ne[0])

    def load_vector(self, tensor: Any) -> np.ndarray:
        return np.ascontiguousarray(tensor.dequantize(), dtype=np.float32)

    def weight_nbytes(self, weight: QuantizedWeight) -> int:
        return weight.nbytes

    # -- linear algebra -------------------------------------------------------------------------
    def matmul(self, x: Any, weight: QuantizedWeight) -> np.ndarray:
        return matmul(np.ascontiguousarray(x, dtype=np.float32), weight)

    def embed(self, weight: QuantizedWeight, token_ids: Sequence[int]) -> np.ndarray:
        return embedding_rows(weight, np.asarray(token_ids, dtype=np.int64).reshape(-1))

    # -- elementwise and normalisation --------------------------------------------------------
    def rms_norm(self, x: Any, weight: Any | None, eps: float) -> np.ndarray:
        x = _f32(x)
        ms = np.einsum("...i,...i->...", x, x, dtype=np.float64) / x.shape[-1]
        y = x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)[..., None]
        return y if weight is None else y * _f32(weight)

    def l2_norm(self, x: Any, eps: float) -> np.ndarray:
        return deltanet.l2_normalize(x, eps)

    def rope_neox(self, x: Any, positions: Any, n_rot: int, theta: float) -> np.ndarray:
        x = _f32(x)
        if x.ndim != 3:
            raise BackendError(f"rope_neox expects x[T, H, D], got shape {list(x.shape)}")
        T, _, D = x.shape
        if n_rot % 2 or not 0 < n_rot <= D:
            raise BackendError(f"rope_neox: n_rot={n_rot} must be even and in 1..{D}")
        pos = np.asarray(positions, dtype=np.float64).reshape(-1)
        if pos.shape[0] != T:
            raise BackendError(f"rope_neox: {pos.shape[0]} positions for {T} tokens")
        half = n_rot // 2
        inv_freq = float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
        angle = np.remainder(pos[:, None] * inv_freq[None, :], _TWO_PI).astype(np.float32)  # [T, half]
        cos = np.cos(angle)[:, None, :]
        sin = np.sin(angle)[:, None, :]
        out = x.copy()
        x1, x2 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:n_rot] = x1 * sin + x2 * cos
        return out

    def silu_mul(self, gate: Any, up: Any) -> np.ndarray:
        gate = _f32(gate)
        return gate / (1.0 + np.exp(-gate)) * _f32(up)

    def sigmoid_mul(self, x: Any, gate: Any) -> np.ndarray:
        return _f32(x) / (1.0 + np.exp(-_f32(gate)))

    def gated_rms_norm(self, x: Any, weight: Any, z: Any, eps: float) -> np.ndarray:
        return self.silu_mul(z, self.rms_norm(x, weight, eps))

    # -- recurrent mixers -----------------------------------------------------------------------
    def causal_conv1d_silu(self, x: Any, conv_state: Any, weight: Any) -> tuple[np.ndarray, np.ndarray]:
        x, conv_state, weight = _f32(x), _f32(conv_state), _f32(weight)
        T, C = x.shape
        K = weight.shape[1]
        if weight.shape[0] != C or conv_state.shape != (K - 1, C):
            raise BackendError(f"causal_conv1d_silu: x[{T}, {C}], conv_state{list(conv_state.shape)} and "
                               f"weight{list(weight.shape)} do not match (need state[{K - 1}, {C}], weight[{C}, K])")
        X = np.concatenate([conv_state, x], axis=0)                   # [K-1+T, C], oldest first
        y = X[0:T] * weight[:, 0]
        for j in range(1, K):
            y += X[j:j + T] * weight[:, j]
        y = y / (1.0 + np.exp(-y))
        return y, np.ascontiguousarray(X[T:T + K - 1])

    def deltanet_recurrent(self, q, k, v, g, beta, state, checkpoints=None) -> np.ndarray:
        return deltanet.deltanet_recurrent(q, k, v, g, beta, state, checkpoints)

    def deltanet_chunked(self, q, k, v, g, beta, state, chunk_size: int = 64) -> np.ndarray:
        return deltanet.deltanet_chunked(q, k, v, g, beta, state, chunk_size)

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q: Any, k_cache: Any, v_cache: Any, q_positions: Any, kv_len: int,
                  scale: float, mask: Any | None = None) -> np.ndarray:
        q = _f32(q)
        T, H_q, D = q.shape
        H_kv = k_cache.shape[0]
        if H_q % H_kv:
            raise BackendError(f"attention: {H_q} query heads is not a multiple of {H_kv} kv heads")
        if not 0 < kv_len <= k_cache.shape[1]:
            raise BackendError(f"attention: kv_len {kv_len} outside 1..{k_cache.shape[1]}")
        group = H_q // H_kv
        K = k_cache[:, :kv_len]                                       # [H_kv, L, D]
        V = v_cache[:, :kv_len]
        # [H_kv, group*T, D]: query heads h = kv*group + r, as HF repeat_kv / ggml `iq2 / group`.
        qg = q.transpose(1, 0, 2).reshape(H_kv, group * T, D)
        scores = np.matmul(qg, K.transpose(0, 2, 1)) * np.float32(scale)   # [H_kv, group*T, L]
        scores = scores.reshape(H_kv, group, T, kv_len)
        pos = np.asarray(q_positions, dtype=np.int64).reshape(T)
        allowed = np.arange(kv_len)[None, :] <= pos[:, None]          # [T, L]
        if mask is not None:
            allowed = allowed & np.asarray(mask, dtype=bool).reshape(T, kv_len)
        scores = np.where(allowed, scores, -np.inf)
        row_max = scores.max(axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)        # fully masked rows -> zeros
        p = np.exp(scores - row_max)
        denom = p.sum(axis=-1, keepdims=True)
        p = p / np.where(denom > 0, denom, 1.0)
        out = np.matmul(p.reshape(H_kv, group * T, kv_len).astype(np.float32), V)   # [H_kv, group*T, D]
        return np.ascontiguousarray(out.reshape(H_q, T, D).transpose(1, 0, 2))

    # -- sampling support -----------------------------------------------------------------------
    def argmax(self, logits: Any) -> np.ndarray:
        # np.argmax returns the first maximum: the lowest index on ties.
        return np.argmax(np.atleast_2d(np.asarray(logits)), axis=-1)
