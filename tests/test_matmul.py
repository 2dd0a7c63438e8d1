"""Quantised matmul (fused and tiled paths), embedding rows, batch invariance, and that a
memory-mapped weight is never expanded to float32 whole."""

from __future__ import annotations

import tracemalloc

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kernels.ggml_quants import QuantLayoutError, UnsupportedQuantType, dequantize, random_raw, row_bytes
from kernels.matmul import (
    FUSED_MAX_T,
    MatmulShapeError,
    QuantizedWeight,
    RowIndexError,
    embedding_rows,
    matmul,
    tile_rows_for,
)

ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
# Decode and verify widths (fused kernel), the fused/tiled boundary, and a prefill width.
WIDTHS = sorted({1, 2, 3, 8, 17, 64, FUSED_MAX_T, FUSED_MAX_T + 1})

N_OUT, N_IN = 300, 512   # 300 rows: two tiles (256 + a partial 44) on the tiled path


def _weight(qtype: Q, n_out: int, n_in: int, seed: int) -> QuantizedWeight:
    raw = random_raw(qtype, n_out, n_in, np.random.default_rng(seed))
    return QuantizedWeight(raw, qtype, n_out, n_in)


def test_fused_width_covers_verify_batches():
    # Guards lowering FUSED_MAX_T below the widest verify batch: DFlash verifies 16 tokens,
    # a DDTree up to budget + 1 = 23 nodes; wider batches would leave the batch-invariant path.
    assert FUSED_MAX_T >= 23


def test_widths_cover_both_paths():
    assert tile_rows_for(N_IN) < N_OUT < 2 * tile_rows_for(N_IN)
    assert min(WIDTHS) <= FUSED_MAX_T < max(WIDTHS)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_reference(qtype):
    # Guards the fused kernel (row chunking, dot loop, dispatch per type) and the tiled
    # path (tile offsets, the partial last tile, scratch reuse) against x @ W.T in float64.
    w = _weight(qtype, N_OUT, N_IN, seed=int(qtype))
    w_ref = dequantize(w.raw, qtype, N_IN).astype(np.float64)
    rng = np.random.default_rng(100 + int(qtype))
    for n_t in WIDTHS:
        x = rng.standard_normal((n_t, N_IN)).astype(np.float32)
        y = matmul(x, w)
        assert y.shape == (n_t, N_OUT) and y.dtype == np.float32
        ref = x.astype(np.float64) @ w_ref.T
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= 1e-5, f"T={n_t}: relative error {rel:.2e}"


@pytest.mark.parametrize("qtype", [Q.F32, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_fused_path_is_batch_invariant(qtype):
    # Guards the property greedy speculative decoding relies on: a row's result is the same
    # bits whether computed alone (T=1), inside a verify batch, or with another thread count.
    w = _weight(qtype, 150, 768, seed=3)
    x = np.random.default_rng(4).standard_normal((FUSED_MAX_T, 768)).astype(np.float32)
    full = matmul(x, w)
    for t in (0, 5, FUSED_MAX_T - 1):
        assert np.array_equal(matmul(x[t:t + 1], w)[0], full[t])
    assert np.array_equal(matmul(x[3:19], w), full[3:19])
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        single = matmul(x, w)
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(single, full)


def test_matmul_writes_into_out_and_accepts_float64_activations():
    w = _weight(Q.Q4_0, 64, 128, seed=5)
    x = np.random.default_rng(6).standard_normal((2, 128))
    out = np.full((2, 64), np.nan, dtype=np.float32)
    assert matmul(x, w, out=out) is out
    assert np.array_equal(out, matmul(x.astype(np.float32), w))
    assert matmul(np.zeros((0, 128), np.float32), w).shape == (0, 64)


def test_from_float_quantises_then_multiplies():
    # Guards the convenience constructor (type and shape bookkeeping) end to end.
    w_f32 = np.random.default_rng(15).standard_normal((40, 64)).astype(np.float32)
    w = QuantizedWeight.from_float(w_f32, Q.Q8_0)
    assert (w.qtype, w.n_out, w.n_in, w.nbytes) == (Q.Q8_0, 40, 64, 40 * 68)
    x = np.random.default_rng(16).standard_normal((3, 64)).astype(np.float32)
    ref = x.astype(np.float64) @ w_f32.T.astype(np.float64)
    assert np.linalg.norm(matmul(x, w) - ref) / np.linalg.norm(ref) < 1e-2   # Q8_0 rounding


def test_long_rows_stay_accurate():
    # Guards float32 accumulation drift over long rows (ffn_down-sized n_in).
    n_in = 17408
    w = _weight(Q.Q8_0, 8, n_in, seed=8)
    x = np.random.default_rng(9).standard_normal((1, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(w.raw, Q.Q8_0, n_in).astype(np.float64).T
    assert np.linalg.norm(matmul(x, w) - ref) / np.linalg.norm(ref) <= 1e-5


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_embedding_rows_equal_dequantised_rows(qtype):
    # Guards gathering the wrong rows (repeats, order) or reading a neighbour's bytes.
    w = _weight(qtype, 50, 256, seed=10)
    full = dequantize(w.raw, qtype, 256)
    ids = np.array([7, 0, 49, 7, 13])
    assert np.array_equal(embedding_rows(w, ids), full[ids])
    assert embedding_rows(w, np.array([], dtype=np.int64)).shape == (0, 256)


def test_embedding_rows_bad_ids_raise_typed_error():
    w = _weight(Q.Q8_0, 10, 64, seed=11)
    with pytest.raises(RowIndexError, match="10 outside"):
        embedding_rows(w, [1, 10])
    with pytest.raises(RowIndexError, match="-1 outside"):
        embedding_rows(w, [-1])
    with pytest.raises(RowIndexError, match="integer"):
        embedding_rows(w, [1.5])


def test_shape_and_type_errors_are_typed():
    w = _weight(Q.Q8_0, 16, 64, seed=12)
    with pytest.raises(MatmulShapeError, match=r"\(T, 64\)"):
        matmul(np.zeros((2, 32), np.float32), w)
    with pytest.raises(MatmulShapeError, match=r"\(T, 64\)"):
        matmul(np.zeros(64, np.float32), w)
    with pytest.raises(MatmulShapeError, match="floating"):
        matmul(np.zeros((1, 64), np.int32), w)
    with pytest.raises(MatmulShapeError, match="out must be"):
        matmul(np.zeros((1, 64), np.float32), w, out=np.empty((1, 15), np.float32))
    with pytest.raises(QuantLayoutError, match="needs uint8 raw"):
        QuantizedWeight(w.raw[:, :-1], Q.Q8_0, 16, 64)
    with pytest.raises(QuantLayoutError, match="multiple of"):
        QuantizedWeight(w.raw, Q.Q8_0, 16, 60)
    with pytest.raises(UnsupportedQuantType, match="Q3_K"):
        QuantizedWeight(np.zeros((1, 110), np.uint8), Q.Q3_K, 1, 256)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F32], ids=lambda t: t.name)
def test_memmap_weight_is_not_expanded(tmp_path, qtype):
    # Guards any path that copies the whole weight to float32 (or to a private byte copy):
    # peak traced allocation during matmul must stay far below the weight's f32 size.
    n_out, n_in = 4096, 1024
    raw = random_raw(qtype, n_out, n_in, np.random.default_rng(13))
    path = tmp_path / "weight.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=(n_out, row_bytes(qtype, n_in)))
    w = QuantizedWeight(mapped, qtype, n_out, n_in)
    assert np.shares_memory(w._kernel_raw, mapped)
    f32_bytes = n_out * n_in * 4
    rng = np.random.default_rng(14)
    in_memory = QuantizedWeight(raw, qtype, n_out, n_in)
    small = QuantizedWeight(raw[:64], qtype, 64, n_in)
    for n_t in (1, 64):
        x = rng.standard_normal((n_t, n_in)).astype(np.float32)
        matmul(x, small)            # compile outside the traced region; leaves a small scratch
        tracemalloc.start()
        try:
            y = matmul(x, w)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < f32_bytes // 4, f"T={n_t}: peak {peak} bytes vs f32 weight {f32_bytes}"
        assert np.array_equal(y, matmul(x, in_memory))
    assert GGML_QUANT_SIZES[qtype][1] * n_out * n_in // GGML_QUANT_SIZES[qtype][0] == w.nbytes
