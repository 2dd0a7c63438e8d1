"""CPU versions of the GPU step's kernels (kernels/mma_matmul.cu, kernels/fused.cu), in numpy.

Each function computes what its kernel computes, from natural-layout inputs, with the CPU
backend's own operations where the kernel fuses several of them; tests/test_fused_kernels.py holds
every kernel (on the GPU, and under the CPU emulator in the CPU suite) equal to these. The
activation layout (`act_layout`) is reproduced bit for bit: it is a format, not arithmetic.
"""
from __future__ import annotations

import numpy as np

from kernels import deltanet, ggml_quants
from kernels.cpu_backend import CPUBackend

__all__ = ["to_fixed", "fixed_values", "act_pos", "act_layout", "act_values", "mm_ref", "prep_rows_ref",
           "gdn_conv_ref", "gdn_recur_ref", "gdn_out_ref", "attn_ref", "swiglu_ref"]

_CPU = CPUBackend()


FIXED_ONE = 2.0 ** 32            # tc_common.cuh red_add_fixed: residual adds in 64-bit fixed point
FIXED_LIMIT = 1 << 59


def to_fixed(v: np.ndarray) -> np.ndarray:
    """What one mm_tc ADD part adds for its partial sums v: round(v * 2^32) (nearest, ties to even)."""
    return np.rint(np.asarray(v, np.float32).astype(np.float64) * FIXED_ONE).astype(np.int64)


def fixed_values(acc: np.ndarray) -> np.ndarray:
    """An accumulator's values as prep_rows folds them (float32; NaN where a part was not finite)."""
    acc = np.asarray(acc, np.int64)
    out = (acc.astype(np.float64) * (1.0 / FIXED_ONE)).astype(np.float32)
    out[(acc >= FIXED_LIMIT) | (acc <= -FIXED_LIMIT)] = np.nan
    return out


def act_pos(n: np.ndarray) -> np.ndarray:
    """Stored position of natural column n (tc_common.cuh act_pos)."""
    n = np.asarray(n)
    w = n & 255
    return (n & ~255) | (((w >> 3) & 7) << 5) | ((w >> 6) << 3) | (w & 7)


def _xs_pos(j: np.ndarray) -> np.ndarray:
    j = np.asarray(j)
    return (j >> 3) * 16 + ((j & 7) >> 1) * 4 + (j & 1)


def act_layout(vals: np.ndarray, ld16: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """f32 rows [T, K] -> (x16 uint16 [T, ld16], xs uint16 [T, ld16 // 16]) exactly as the kernels
    write them: f16 (round to nearest even), permuted; block sums of the rounded values (each group
    of 8 summed in order in f32, four groups as (g0 + g1) + (g2 + g3)) as hi = f16(s), lo = f16(s - hi)."""
    vals = np.asarray(vals, dtype=np.float32)
    T, K = vals.shape
    if K % 8:
        raise ValueError("K must be a multiple of 8")
    ld16 = ld16 or -(-K // 256) * 256
    h = vals.astype(np.float16)
    x16 = np.zeros((T, ld16), dtype=np.uint16)
    x16[:, act_pos(np.arange(K))] = h.view(np.uint16)
    hf = h.astype(np.float32)
    n_groups = K // 8
    gsum = np.zeros((T, -(-n_groups // 4) * 4), dtype=np.float32)
    for e in range(8):
        gsum[:, :n_groups] = (gsum[:, :n_groups] + hf[:, e::8][:, :n_groups]).astype(np.float32)
    g4 = gsum.reshape(T, -1, 4)
    s = ((g4[:, :, 0] + g4[:, :, 1]).astype(np.float32) + (g4[:, :, 2] + g4[:, :, 3]).astype(np.float32)).astype(np.float32)
    hi = s.astype(np.float16)
    lo = (s - hi.astype(np.float32)).astype(np.float16)
    xs = np.zeros((T, ld16 // 16), dtype=np.uint16)
    j = np.arange(s.shape[1])
    xs[:, _xs_pos(j)] = hi.view(np.uint16)
    xs[:, _xs_pos(j) + 2] = lo.view(np.uint16)
    return x16, xs


def act_values(x16: np.ndarray, K: int) -> np.ndarray:
    """The f32 values of act16 rows, natural order (inverse of the permutation)."""
    return np.asarray(x16).view(np.float16)[:, act_pos(np.arange(K))].astype(np.float32)


def mm_ref(x: np.ndarray, raw: np.ndarray, qtype: int, n_in: int) -> np.ndarray:
    """x [T, n_in] (the f16-rounded activations, as f32) @ dequant(W).T in float64, as float32."""
    w = ggml_quants.dequantize(np.asarray(raw), qtype, n_in).astype(np.float64)
    return (np.asarray(x, np.float64) @ w.T).astype(np.float32)


def prep_rows_ref(x: np.ndarray, w: np.ndarray | None, eps: float, norm: bool) -> np.ndarray:
    """The f32 values prep_rows rounds to f16: RMSNorm(x; w) (or x)."""
    x = np.asarray(x, np.float32)
    return _CPU.rms_norm(x, w, eps) if norm else x


def swiglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return _CPU.silu_mul(gate, up)


def gdn_conv_ref(qkv: np.ndarray, conv_state: np.ndarray, conv_w: np.ndarray, ab: np.ndarray, dt_bias, ssm_a,
                 nk: int, nv: int, dk: int, dv: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(rec [T, R], new conv state): q | k (L2-normalised) | v | g | beta, as qwen35._deltanet forms them."""
    T = qkv.shape[0]
    y, new_state = _CPU.causal_conv1d_silu(qkv, conv_state, conv_w)
    q = deltanet.l2_normalize(y[:, :nk * dk].reshape(T, nk, dk), eps).reshape(T, -1)
    k = deltanet.l2_normalize(y[:, nk * dk:2 * nk * dk].reshape(T, nk, dk), eps).reshape(T, -1)
    v = y[:, 2 * nk * dk:]
    alpha = ab[:, :nv] + dt_bias
    beta = 1.0 / (1.0 + np.exp(-ab[:, nv:2 * nv]))
    sp = np.where(alpha > 20.0, alpha, np.log1p(np.exp(np.minimum(alpha, 20.0))))
    g = (ssm_a * sp).astype(np.float32)
    return np.concatenate([q, k, v, g, beta.astype(np.float32)], axis=1).astype(np.float32), new_state


def gdn_recur_ref(rec: np.ndarray, state: np.ndarray, nk: int, nv: int, dk: int, dv: int) -> np.ndarray:
    """o [T, nv*dv]; `state` [nv, dv, dk] (Sᵀ per head) is advanced in place."""
    T = rec.shape[0]
    C = 2 * nk * dk + nv * dv
    q = rec[:, :nk * dk].reshape(T, nk, dk)
    k = rec[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
    v = rec[:, 2 * nk * dk:C].reshape(T, nv, dv)
    g = np.ascontiguousarray(rec[:, C:C + nv])
    beta = np.ascontiguousarray(rec[:, C + nv:C + 2 * nv])
    o = _CPU.deltanet_recurrent(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), g, beta,
                                state)
    return o.reshape(T, nv * dv)


def gdn_out_ref(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float, nv: int, dv: int) -> np.ndarray:
    T = o.shape[0]
    return _CPU.gated_rms_norm(o.reshape(T, nv, dv), w, z.reshape(T, nv, dv), eps).reshape(T, nv * dv)


def attn_ref(qg: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm, k_norm, eps: float, k_cache: np.ndarray,
             v_cache: np.ndarray, n_past: int, H: int, Hkv: int, D: int, n_rot: int, theta: float) -> np.ndarray:
    """Gated attention output before W_o ([T, H*D]); writes rows n_past.. of the caches, as
    qwen35._attention does (row by row, as a decode step would)."""
    T = qg.shape[0]
    qg3 = qg.reshape(T, H, 2 * D)
    pos = np.arange(n_past, n_past + T)
    q = _CPU.rope_neox(_CPU.rms_norm(qg3[:, :, :D], q_norm, eps), pos, n_rot, theta)
    kk = _CPU.rope_neox(_CPU.rms_norm(k.reshape(T, Hkv, D), k_norm, eps), pos, n_rot, theta)
    k_cache[:, n_past:n_past + T] = kk.transpose(1, 0, 2)
    v_cache[:, n_past:n_past + T] = v.reshape(T, Hkv, D).transpose(1, 0, 2)
    o = np.concatenate([_CPU.attention(q[t:t + 1], k_cache, v_cache, pos[t:t + 1], n_past + t + 1, 1.0 / np.sqrt(D))
                        for t in range(T)], axis=0)
    return _CPU.sigmoid_mul(o.reshape(T, H * D), qg3[:, :, D:].reshape(T, H * D))
