"""Gated DeltaNet on the CPU: the delta-rule recurrence (numba) and its chunked form (numpy).

Math: qwen35 spec §3.4-§3.6. Per v-head h (reading k-head `h % H_k`, the GGUF tiled order) and
token t, with q̂, k̂ L2-normalised and the state S_h ∈ R^{d_k×d_v}:

    S ← exp(g_t[h]) · S                     decay
    δ = β_t[h] · (v_t[h] − Sᵀ k̂_t)          read
    S ← S + k̂_t δᵀ                          write
    o_t[h] = Sᵀ q̂_t / √d_k                  output (reads the updated S)

The state is stored transposed: `state[h]` is S_hᵀ, [d_v, d_k] (row j: value column j's d_k
entries), so that the GPU's lanes, which each hold a run of one column's rows, read and write it
in whole 16-byte pieces (kernels/fused.cu gdn_recur); every backend and snapshot shares it.

`deltanet_recurrent` does exactly that, token by token, and is the ground truth: it is what
decode and speculative verify run (it can store the state after every token for rollback).
`deltanet_chunked` computes the same thing for a long prompt with the chunked/parallel form
(WY representation, as HF's `torch_chunk_gated_delta_rule` and llama.cpp's
`build_delta_net_chunking`), which replaces T rank-1 updates by a few matrix products per chunk.

L2 normalisation: `x / sqrt(Σx² + eps)`. This is HF/FLA's `l2norm` and also what current
llama.cpp computes (`build_gdn_l2_norm` = rms_norm(x, eps/n)/√n, since ggml-org/llama.cpp#28068);
the older ggml form `x / max(‖x‖, eps)` that the math spec §3.4 quotes differs from it by
~eps/‖x‖² relative, which only matters for near-zero vectors. We follow the two oracles we test
against.
"""
from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["l2_normalize", "deltanet_recurrent", "deltanet_chunked", "check_deltanet_shapes"]


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x², last axis) + eps), in float32 with a float64 sum of squares."""
    x = np.asarray(x, dtype=np.float32)
    ss = np.einsum("...i,...i->...", x, x, dtype=np.float64)
    inv = (1.0 / np.sqrt(ss + eps)).astype(np.float32)
    return x * inv[..., None]


def check_deltanet_shapes(q, k, v, g, beta, state) -> tuple[int, int, int, int, int]:
    """Validate the operand shapes; returns (T, H_k, d_k, H_v, d_v)."""
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"deltanet: q and k must both be [T, H_k, d_k], got {q.shape} and {k.shape}")
    T, H_k, d_k = q.shape
    if v.ndim != 3 or v.shape[0] != T:
        raise ValueError(f"deltanet: v must be [T={T}, H_v, d_v], got {v.shape}")
    H_v, d_v = v.shape[1], v.shape[2]
    if H_v % H_k:
        raise ValueError(f"deltanet: {H_v} value heads is not a multiple of {H_k} key heads")
    if g.shape != (T, H_v) or beta.shape != (T, H_v):
        raise ValueError(f"deltanet: g and beta must be [T={T}, H_v={H_v}], got {g.shape} and {beta.shape}")
    if state.shape != (H_v, d_v, d_k) or state.dtype != np.float32:
        raise ValueError(f"deltanet: state must be float32 [H_v={H_v}, d_v={d_v}, d_k={d_k}] (Sᵀ per head), "
                         f"got {state.dtype}{list(state.shape)}")
    return T, H_k, d_k, H_v, d_v


@numba.njit(parallel=True, cache=True)
def _recurrent_kernel(q, k, v, g, beta, state, out, checkpoints, store_checkpoints):
    T, H_k, d_k = q.shape
    H_v, d_v = v.shape[1], v.shape[2]
    scale = np.float32(1.0 / math.sqrt(d_k))
    for h in numba.prange(H_v):
        kh = h % H_k
        # Stored as Sᵀ [d_v, d_k]; worked on as S [d_k, d_v], whose inner loops over the value
        # columns vectorise, and written back once at the end.
        S = np.ascontiguousarray(state[h].T)
        kv = np.empty(d_v, dtype=np.float32)
        delta = np.empty(d_v, dtype=np.float32)
        o = np.empty(d_v, dtype=np.float32)
        for t in range(T):
            decay = np.float32(math.exp(g[t, h]))
            b = beta[t, h]
            # decay and read: kv = (e^g S)ᵀ k
            for j in range(d_v):
                kv[j] = 0.0
            for i in range(d_k):
                ki = k[t, kh, i]
                for j in range(d_v):
                    s = S[i, j] * decay
                    S[i, j] = s
                    kv[j] += s * ki
            for j in range(d_v):
                delta[j] = b * (v[t, h, j] - kv[j])
                o[j] = 0.0
            # write, then output from the updated state
            for i in range(d_k):
                ki = k[t, kh, i]
                qi = q[t, kh, i] * scale
                for j in range(d_v):
                    s = S[i, j] + ki * delta[j]
                    S[i, j] = s
                    o[j] += s * qi
            for j in range(d_v):
                out[t, h, j] = o[j]
            if store_checkpoints:
                for j in range(d_v):
                    for i in range(d_k):
                        checkpoints[t, h, j, i] = S[i, j]
        state[h][:, :] = S.T


def deltanet_recurrent(q, k, v, g, beta, state, checkpoints=None) -> np.ndarray:
    """Token-by-token gated delta rule; see the module docstring and `kernels.backend`.

    q, k [T, H_k, d_k] L2-normalised (q not scaled), v [T, H_v, d_v], g, beta [T, H_v];
    `state` [H_v, d_v, d_k] float32 (Sᵀ per head) is updated in place. Returns o [T, H_v, d_v]
    float32. `checkpoints` [T, H_v, d_v, d_k] float32, when given, receives the state after each token."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    g = np.ascontiguousarray(g, dtype=np.float32)
    beta = np.ascontiguousarray(beta, dtype=np.float32)
    T, H_k, d_k, H_v, d_v = check_deltanet_shapes(q, k, v, g, beta, state)
    if not state.flags.c_contiguous or not state.flags.writeable:
        raise ValueError("deltanet: state must be a writable C-contiguous array (it is updated in place)")
    out = np.empty((T, H_v, d_v), dtype=np.float32)
    if checkpoints is None:
        ckpt = np.empty((0, 0, 0, 0), dtype=np.float32)
        store = False
    else:
        if (checkpoints.shape != (T, H_v, d_v, d_k) or checkpoints.dtype != np.float32
                or not checkpoints.flags.c_contiguous):
            raise ValueError(f"deltanet: checkpoints must be C-contiguous float32 [{T}, {H_v}, {d_v}, {d_k}], "
                             f"got {checkpoints.dtype}{list(checkpoints.shape)}")
        ckpt, store = checkpoints, True
    if T:
        _recurrent_kernel(q, k, v, g, beta, state, out, ckpt, store)
    return out


def deltanet_chunked(q, k, v, g, beta, state, chunk_size: int = 64) -> np.ndarray:
    """The chunked (parallel) form of `deltanet_recurrent`: same arguments and result (to float32
    rounding), `state` updated in place; no per-token states.

    Per head and chunk of C tokens with initial state S₀, q̃ = q̂/√d_k, γ_t = Σ_{s≤t} g_s (within
    the chunk) and Γ_t = e^{γ_t}:
      A_ts = β_t (k̂_t·k̂_s) e^{γ_t−γ_s} for s < t (0 elsewhere); U = (I+A)⁻¹(β⊙V),
      W = (I+A)⁻¹(β⊙Γ⊙K); V' = U − W S₀ (row t is δ_t of the recurrence);
      O = (Γ⊙Q̃) S₀ + [(Q̃Kᵀ) ⊙ D] V' with D_ts = e^{γ_t−γ_s} for s ≤ t;
      S_end = Γ_C S₀ + (K ⊙ e^{γ_C−γ})ᵀ V'.
    e^{γ_t−γ_s} is always taken of a difference (never Γ_t/Γ_s, which underflows). The last
    chunk is simply shorter; no padding is needed. The unit lower-triangular solves and the
    products run in float64 (they are O(C²) per chunk, small next to the projections), which
    keeps the form within 1e-5 of the recurrence even over long prompts."""
    q = np.asarray(q, dtype=np.float32)
    k = np.asarray(k, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    g = np.asarray(g, dtype=np.float32)
    beta = np.asarray(beta, dtype=np.float32)
    T, H_k, d_k, H_v, d_v = check_deltanet_shapes(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"deltanet: chunk_size must be positive, got {chunk_size}")
    out = np.empty((T, H_v, d_v), dtype=np.float32)
    if T == 0:
        return out
    kv_head = np.arange(H_v) % H_k
    # [H_v, T, d]: each v-head with the k-head it reads (tiled order).
    Q = np.ascontiguousarray(q[:, kv_head, :].transpose(1, 0, 2), dtype=np.float64) / math.sqrt(d_k)
    K = np.ascontiguousarray(k[:, kv_head, :].transpose(1, 0, 2), dtype=np.float64)
    V = np.ascontiguousarray(v.transpose(1, 0, 2), dtype=np.float64)
    G = np.ascontiguousarray(g.T, dtype=np.float64)
    B = np.ascontiguousarray(beta.T, dtype=np.float64)
    S = state.transpose(0, 2, 1).astype(np.float64)                  # [H, d_k, d_v]
    for c0 in range(0, T, chunk_size):
        c1 = min(c0 + chunk_size, T)
        C = c1 - c0
        Qc, Kc, Vc, bc = Q[:, c0:c1], K[:, c0:c1], V[:, c0:c1], B[:, c0:c1]
        gamma = np.cumsum(G[:, c0:c1], axis=1)                        # [H, C]
        diff = gamma[:, :, None] - gamma[:, None, :]                  # γ_t − γ_s
        lower_incl = np.tril(np.ones((C, C), dtype=bool))
        decay = np.exp(np.where(lower_incl, diff, -np.inf))           # D (diagonal included)
        strict = np.tril(np.ones((C, C), dtype=bool), -1)
        A = np.where(strict, bc[:, :, None] * (Kc @ Kc.transpose(0, 2, 1)) * decay, 0.0)
        M = A + np.eye(C)
        Gamma = np.exp(gamma)                                         # [H, C]
        rhs = np.concatenate([bc[:, :, None] * Vc, (bc * Gamma)[:, :, None] * Kc], axis=2)
        sol = _unit_lower_solve(M, rhs)
        U, W = sol[:, :, :d_v], sol[:, :, d_v:]
        Vp = U - W @ S                                                # [H, C, d_v]
        O = (Gamma[:, :, None] * Qc) @ S + ((Qc @ Kc.transpose(0, 2, 1)) * decay) @ Vp
        out[c0:c1] = O.transpose(1, 0, 2)
        tail = np.exp(gamma[:, -1:] - gamma)                          # e^{γ_C − γ_t}
        S = np.exp(gamma[:, -1])[:, None, None] * S + (Kc * tail[:, :, None]).transpose(0, 2, 1) @ Vp
    state[...] = S.transpose(0, 2, 1)
    return out


def _unit_lower_solve(M: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve M X = rhs for batched unit lower-triangular M [H, C, C] by forward substitution
    (rows in order; each row is one batched dot product)."""
    X = np.empty_like(rhs)
    C = M.shape[1]
    X[:, 0] = rhs[:, 0]
    for t in range(1, C):
        X[:, t] = rhs[:, t] - np.einsum("hs,hsd->hd", M[:, t, :t], X[:, :t])
    return X
