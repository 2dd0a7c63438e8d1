"""Gated DeltaNet kernels (kernels/deltanet.py) against the math spec §3.6 and each other.

Guards: a wrong order of decay / read / write / output, the wrong k-head for a v-head (tiled
`h % H_k`, not grouped `h // r`), a chunked form that drifts from the recurrence (within a chunk,
across chunk boundaries, in a short last chunk, from a non-zero initial state, under strong decay),
and per-token checkpoints that are not the state after that token; a state stored untransposed
(it is Sᵀ per head, [H_v, d_v, d_k], what the GPU kernels read as whole lines).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from kernels import deltanet
from kernels.cpu_backend import CPUBackend


def reference_f64(q, k, v, g, beta, S0):
    """Math spec §3.6 in float64, literally: per token and v-head h (k-head h % H_k)
    S ← e^g S; δ = β (v − Sᵀk); S ← S + k δᵀ; o = Sᵀ q / √d_k. S0 and the states returned after
    each token are stored as the kernels store them (Sᵀ per head). Returns (o, states)."""
    T, H_k, d_k = q.shape
    H_v = v.shape[1]
    S = S0.transpose(0, 2, 1).astype(np.float64)             # [H_v, d_k, d_v]
    o = np.zeros(v.shape, dtype=np.float64)
    states = np.zeros((T,) + S0.shape)
    for t in range(T):
        for h in range(H_v):
            kk = k[t, h % H_k].astype(np.float64)
            qq = q[t, h % H_k].astype(np.float64)
            S[h] *= math.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S[h].T @ kk)
            S[h] += np.outer(kk, delta)
            o[t, h] = S[h].T @ qq / math.sqrt(d_k)
        states[t] = S.transpose(0, 2, 1)
    return o, states


def random_inputs(rng, T, H_k=2, H_v=4, d_k=16, d_v=8, strong_decay=False):
    q = deltanet.l2_normalize(rng.standard_normal((T, H_k, d_k)).astype(np.float32), 1e-6)
    k = deltanet.l2_normalize(rng.standard_normal((T, H_k, d_k)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, H_v, d_v)).astype(np.float32)
    g = -rng.uniform(0.0, 1.5, size=(T, H_v)).astype(np.float32)
    if strong_decay:  # e^g underflows in float32 for a few tokens: the chunked form must not divide by Γ
        g[rng.random((T, H_v)) < 0.1] = -60.0
    beta = rng.uniform(0.05, 1.0, size=(T, H_v)).astype(np.float32)
    S0 = (0.5 * rng.standard_normal((H_v, d_v, d_k))).astype(np.float32)      # stored: Sᵀ per head
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (64, 64), (100, 64), (200, 64), (50, 16), (33, 1)])
def test_chunked_equals_recurrent(T, chunk):
    rng = np.random.default_rng(T * 1000 + chunk)
    q, k, v, g, beta, S0 = random_inputs(rng, T)
    s_rec, s_chk = S0.copy(), S0.copy()
    o_rec = deltanet.deltanet_recurrent(q, k, v, g, beta, s_rec)
    o_chk = deltanet.deltanet_chunked(q, k, v, g, beta, s_chk, chunk_size=chunk)
    assert np.abs(o_chk - o_rec).max() <= 1e-4
    assert np.abs(s_chk - s_rec).max() <= 1e-4
    # the state moved: a kernel that ignored it or the inputs would pass the equality above
    assert np.abs(s_rec - S0).max() > 1e-2


def test_chunked_equals_recurrent_under_strong_decay_and_in_pieces():
    rng = np.random.default_rng(7)
    q, k, v, g, beta, S0 = random_inputs(rng, 150, H_k=3, H_v=6, d_k=8, d_v=12, strong_decay=True)
    s_rec = S0.copy()
    o_rec = deltanet.deltanet_recurrent(q, k, v, g, beta, s_rec)
    # a prompt processed as two prefill calls (state carried between them) equals one pass
    s_chk = S0.copy()
    o1 = deltanet.deltanet_chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], s_chk)
    o2 = deltanet.deltanet_chunked(q[70:], k[70:], v[70:], g[70:], beta[70:], s_chk)
    assert np.isfinite(o1).all() and np.isfinite(o2).all()
    assert np.abs(np.concatenate([o1, o2]) - o_rec).max() <= 1e-4
    assert np.abs(s_chk - s_rec).max() <= 1e-4


@pytest.mark.parametrize("H_k,H_v,d_k,d_v", [(2, 4, 16, 8), (1, 3, 8, 8), (4, 4, 8, 16)])
def test_recurrent_matches_float64_reference(H_k, H_v, d_k, d_v):
    rng = np.random.default_rng(H_k * 100 + H_v)
    T = 40
    q, k, v, g, beta, S0 = random_inputs(rng, T, H_k, H_v, d_k, d_v)
    state = S0.copy()
    ckpt = np.zeros((T, H_v, d_v, d_k), dtype=np.float32)
    o = deltanet.deltanet_recurrent(q, k, v, g, beta, state, checkpoints=ckpt)
    o_ref, states_ref = reference_f64(q, k, v, g, beta, S0)
    assert np.abs(o - o_ref).max() <= 1e-5 * max(1.0, np.abs(o_ref).max())
    assert np.abs(state - states_ref[-1]).max() <= 1e-5 * max(1.0, np.abs(states_ref).max())
    # checkpoint t is the state right after token t
    assert np.abs(ckpt - states_ref).max() <= 1e-5 * max(1.0, np.abs(states_ref).max())
    np.testing.assert_array_equal(ckpt[-1], state)


def test_checkpoints_equal_replaying_the_prefix():
    """Rolling back to checkpoint t and continuing gives the same outputs as never having gone
    past t (what speculative decoding relies on)."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta, S0 = random_inputs(rng, 12)
    state = S0.copy()
    ckpt = np.zeros((12,) + S0.shape, dtype=np.float32)
    deltanet.deltanet_recurrent(q, k, v, g, beta, state, checkpoints=ckpt)
    for t in (0, 5, 10):
        replay = S0.copy()
        deltanet.deltanet_recurrent(q[:t + 1], k[:t + 1], v[:t + 1], g[:t + 1], beta[:t + 1], replay)
        np.testing.assert_array_equal(ckpt[t], replay)


def test_v_head_reads_tiled_k_head():
    """With H_v = 2·H_k, v-head h must read k-head h % H_k (GGUF tiled order): zeroing k-head 0's
    keys must silence exactly v-heads 0 and 2 (grouped order would silence 0 and 1)."""
    rng = np.random.default_rng(5)
    q, k, v, g, beta, _ = random_inputs(rng, 6, H_k=2, H_v=4)
    k[:, 0] = 0.0
    o = deltanet.deltanet_recurrent(q, k, v, g, beta, np.zeros((4, 8, 16), np.float32))
    assert np.abs(o[:, [0, 2]]).max() == 0.0
    assert np.abs(o[:, [1, 3]]).min(axis=(0, 2)).max() > 0.0 and np.abs(o[:, [1, 3]]).max() > 1e-3


@pytest.mark.parametrize("run", [deltanet.deltanet_recurrent, deltanet.deltanet_chunked])
def test_state_is_stored_transposed(run):
    """From a zero state one token leaves S = k δᵀ with δ = β v: stored as Sᵀ, state[h][j, i] =
    β v_j k_i (the layout every backend, the GPU step and snapshots share)."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta, _ = random_inputs(rng, 1, H_k=1, H_v=2, d_k=16, d_v=8)
    state = np.zeros((2, 8, 16), np.float32)
    run(q, k, v, g, beta, state)
    for h in range(2):
        np.testing.assert_allclose(state[h], np.outer(beta[0, h] * v[0, h], k[0, 0]), rtol=1e-5, atol=1e-6)


def test_l2_normalize_form():
    """x / sqrt(Σx² + eps) (HF / current llama.cpp), finite on zero vectors."""
    x = np.array([[3.0, 4.0], [0.0, 0.0], [1e-4, 0.0]], dtype=np.float32)
    y = deltanet.l2_normalize(x, 1e-6)
    np.testing.assert_allclose(y[0], [0.6, 0.8], rtol=1e-6)
    assert (y[1] == 0).all()
    np.testing.assert_allclose(y[2, 0], 1e-4 / math.sqrt(1e-8 + 1e-6), rtol=1e-6)  # not 1.0 (max form)
    np.testing.assert_array_equal(CPUBackend().l2_norm(x, 1e-6), y)


def test_bad_shapes_raise():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, S0 = random_inputs(rng, 4)
    with pytest.raises(ValueError, match="value heads"):
        deltanet.deltanet_recurrent(q, k, v[:, :3], g[:, :3], beta[:, :3], S0[:3].copy())
    with pytest.raises(ValueError, match="state"):
        deltanet.deltanet_chunked(q, k, v, g, beta, S0[:, :, :4].copy())
    with pytest.raises(ValueError, match="checkpoints"):
        deltanet.deltanet_recurrent(q, k, v, g, beta, S0.copy(), checkpoints=np.zeros((3, 4, 16, 8), np.float32))
