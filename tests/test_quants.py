"""GGML block formats: our numba dequantisers against gguf-py's numpy ones (an independent
implementation of ggml's reference layouts), quantisation round trips, and typed errors."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kernels import ggml_quants as gq
from kernels.ggml_quants import (
    QUANTIZABLE_TYPES,
    SUPPORTED_TYPES,
    QuantLayoutError,
    UnsupportedQuantType,
    dequantize,
    dequantize_rows,
    quantize,
    random_raw,
    row_bytes,
)

ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
BLOCK_TYPES = [t for t in ALL_TYPES if GGML_QUANT_SIZES[t][0] > 1]

# Byte offsets of the f16 scale fields inside one block, read off ggml-common.h's structs
# (written here independently of kernels/ggml_quants.py so a wrong offset there shows up).
F16_FIELD_OFFSETS = {
    Q.Q8_0: (0,),          # {d; qs[32]}
    Q.Q4_0: (0,),          # {d; qs[16]}
    Q.Q4_1: (0, 2),        # {d; m; qs[16]}
    Q.Q5_0: (0,),          # {d; qh[4]; qs[16]}
    Q.Q5_1: (0, 2),        # {d; m; qh[4]; qs[16]}
    Q.Q4_K: (0, 2),        # {d; dmin; scales[12]; qs[128]}
    Q.Q5_K: (0, 2),        # {d; dmin; scales[12]; qh[32]; qs[128]}
    Q.Q6_K: (208,),        # {ql[128]; qh[64]; scales[16]; d}
    Q.IQ4_XS: (0,),        # {d; scales_h; scales_l[4]; qs[128]}
}


def _random_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 scales of both signs: mostly log-uniform in [2^-14, 4], some exact
    zeros and some subnormals (the decoder's special cases)."""
    mag = np.exp2(rng.uniform(-14.0, 2.0, size=n))
    kind = rng.uniform(size=n)
    mag[kind < 0.05] = 0.0
    sub = (kind >= 0.05) & (kind < 0.10)
    mag[sub] = rng.integers(1, 1024, size=int(sub.sum())) * 2.0 ** -24   # f16 subnormals
    sign = np.where(rng.uniform(size=n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def _random_valid_raw(qtype: Q, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in the type's layout, f16 scale fields replaced by finite values;
    float types get random finite bit patterns (subnormals included)."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    n_bytes = n_cols // block_size * block_bytes
    if qtype in (Q.F16, Q.BF16):
        bits = rng.integers(0, 1 << 16, size=(n_rows, n_cols), dtype=np.uint16)
        exp_mask = 0x7C00 if qtype == Q.F16 else 0x7F80
        bits[(bits & exp_mask) == exp_mask] &= np.uint16(~0x4000 & 0xFFFF)   # no inf/NaN
        return bits.view(np.uint8).reshape(n_rows, n_bytes)
    if qtype == Q.F32:
        bits = rng.integers(0, 1 << 32, size=(n_rows, n_cols), dtype=np.uint32)
        bits[(bits & 0x7F800000) == 0x7F800000] &= np.uint32(~0x40000000 & 0xFFFFFFFF)
        return bits.view(np.uint8).reshape(n_rows, n_bytes)
    n_blocks = n_rows * (n_cols // block_size)
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in F16_FIELD_OFFSETS[qtype]:
        blocks[:, off:off + 2] = _random_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, n_bytes)


def _assert_bitwise_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ref.dtype == np.float32 and ours.shape == ref.shape
    mismatch = ours.view(np.uint32) != ref.view(np.uint32)
    if mismatch.any():
        idx = tuple(int(i) for i in np.argwhere(mismatch)[0])
        pytest.fail(f"{int(mismatch.sum())} elements differ, first at {idx}: ours {ours[idx]!r} ref {ref[idx]!r}")


def test_supported_table_matches_ggml_sizes():
    # Guards a missing type or a hand-typed block size that disagrees with gguf's constants.
    assert set(SUPPORTED_TYPES) == set(ALL_TYPES)
    for qtype, spec in SUPPORTED_TYPES.items():
        assert (spec.block_size, spec.block_bytes) == GGML_QUANT_SIZES[qtype]
        assert spec.f16_fields == F16_FIELD_OFFSETS.get(qtype, ())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_for_bit(qtype):
    # Guards wrong bit layouts (nibble order, high-bit planes, packed 6-bit scales, int8
    # signs, the IQ4_NL table) and float32 arithmetic done in another order or precision.
    # Both sides do the same float32 operations in ggml's order (d*q - m, (d*sc)*q, ...),
    # so no ulp slack is needed: every bit must agree.
    rng = np.random.default_rng(1000 + int(qtype))
    n_rows, n_cols = 7, 512
    raw = _random_valid_raw(qtype, n_rows, n_cols, rng)
    ours = dequantize(raw, qtype, n_cols)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n_rows, n_cols)
    assert np.isfinite(ref).all()
    _assert_bitwise_equal(ours, ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1], ids=lambda t: t.name)
def test_dequantize_odd_block_count(qtype):
    # Guards loops that assume a row holds a multiple of 8 or 256 elements.
    rng = np.random.default_rng(7)
    raw = _random_valid_raw(qtype, 3, 96, rng)
    _assert_bitwise_equal(dequantize(raw, qtype, 96),
                          np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(3, 96))


def test_f16_scale_decoder_exhaustive():
    # Guards the hand-written binary16 decoder used for every block scale: all 65536 bit
    # patterns (subnormals, signed zeros, inf) against numpy's conversion; NaN stays NaN.
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, dtype=np.float32)
    gq._f16_bits_to_f32(bits.view(np.uint8), out, gq._F16_TABLE)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_1, Q.Q6_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_dequantize_rows_is_a_slice_of_dequantize(qtype):
    # Guards off-by-one row offsets and writing outside the given out buffer.
    rng = np.random.default_rng(3)
    n_rows, n_cols = 11, 256
    raw = _random_valid_raw(qtype, n_rows, n_cols, rng)
    full = dequantize(raw, qtype, n_cols)
    for start, stop in [(0, 11), (3, 8), (10, 11), (5, 5)]:
        _assert_bitwise_equal(dequantize_rows(raw, qtype, n_cols, start, stop), full[start:stop])
    backing = np.full((6, n_cols), 123.0, dtype=np.float32)
    out = backing[1:5]
    result = dequantize_rows(raw, qtype, n_cols, 2, 6, out=out)
    assert result is out
    _assert_bitwise_equal(out, full[2:6])
    assert (backing[0] == 123.0).all() and (backing[5] == 123.0).all()


def test_random_raw_helper_gives_finite_values():
    # Guards the benchmark's generator: a wrong f16 offset would leave random (inf/NaN) scales.
    rng = np.random.default_rng(5)
    for qtype in ALL_TYPES:
        assert np.isfinite(dequantize(random_raw(qtype, 4, 512, rng), qtype, 512)).all(), qtype.name


# --- typed errors ------------------------------------------------------------------------

def test_unsupported_types_raise_typed_error():
    with pytest.raises(UnsupportedQuantType, match="Q2_K"):
        row_bytes(Q.Q2_K, 256)
    with pytest.raises(UnsupportedQuantType, match="999"):
        row_bytes(999, 256)
    with pytest.raises(UnsupportedQuantType):
        dequantize(np.zeros((1, 84), np.uint8), Q.Q2_K, 256)
    with pytest.raises(UnsupportedQuantType, match="Q4_K"):
        quantize(np.zeros((1, 256), np.float32), Q.Q4_K)


def test_row_bytes_values_and_bad_lengths():
    assert row_bytes(Q.Q4_K, 512) == 288
    assert row_bytes(Q.Q8_0, 64) == 68
    assert row_bytes(int(Q.F16), 3) == 6
    for qtype, n_cols in [(Q.Q4_K, 100), (Q.Q8_0, 33), (Q.IQ4_XS, 128), (Q.F32, 0)]:
        with pytest.raises(QuantLayoutError, match="multiple of"):
            row_bytes(qtype, n_cols)
    assert issubclass(QuantLayoutError, ValueError) and issubclass(UnsupportedQuantType, ValueError)


def test_bad_raw_and_out_raise_typed_errors():
    raw = np.zeros((2, 144), np.uint8)
    with pytest.raises(QuantLayoutError, match="take 288 bytes"):
        dequantize(raw, Q.Q4_K, 512)                         # row length disagrees
    with pytest.raises(QuantLayoutError, match="uint8"):
        dequantize(raw.astype(np.int16), Q.Q4_K, 256)        # wrong dtype
    with pytest.raises(QuantLayoutError, match="2-D"):
        dequantize(raw.reshape(-1), Q.Q4_K, 256)             # wrong rank
    with pytest.raises(QuantLayoutError, match="row range"):
        dequantize_rows(raw, Q.Q4_K, 256, 1, 3)
    with pytest.raises(QuantLayoutError, match="out must be"):
        dequantize_rows(raw, Q.Q4_K, 256, 0, 2, out=np.empty((2, 255), np.float32))
    with pytest.raises(QuantLayoutError, match="out must be"):
        dequantize_rows(raw, Q.Q4_K, 256, 0, 2, out=np.empty((2, 256), np.float64))
    with pytest.raises(QuantLayoutError, match="2-D float"):
        quantize(np.zeros(32, np.float32), Q.Q8_0)


# --- quantisation round trips ------------------------------------------------------------

def _per_block(x: np.ndarray, block: int) -> np.ndarray:
    return x.reshape(x.shape[0], -1, block)


@pytest.mark.parametrize("qtype", QUANTIZABLE_TYPES, ids=lambda t: t.name)
def test_quantize_round_trip_error_bound(qtype):
    # Guards a quantiser whose bytes our dequantiser (or ggml's) reads differently, and
    # scale/rounding bugs.  Bounds are the format's own: half a step (a full step where the
    # largest value's opposite side clips), plus the f16 rounding of the stored scales.
    rng = np.random.default_rng(11 + int(qtype))
    x = (rng.standard_normal((9, 256)) * rng.uniform(0.01, 3.0, size=(9, 1))).astype(np.float32)
    x[0, :32] = 0.0                                      # an all-zero block
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (9, row_bytes(qtype, 256))
    y = dequantize(raw, qtype, 256)
    err = np.abs(y - x)
    if qtype == Q.F32:
        assert np.array_equal(y, x)
        return
    if qtype == Q.F16:
        assert (err <= np.abs(x) * 2.0 ** -11 + 2.0 ** -25).all()
        return
    if qtype == Q.BF16:
        assert (err <= np.abs(x) * 2.0 ** -8).all()
        return
    xb = _per_block(x, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    lo, hi = xb.min(axis=-1, keepdims=True), xb.max(axis=-1, keepdims=True)
    bound = {
        Q.Q8_0: 0.6 * amax / 127,
        Q.Q4_0: 1.01 * amax / 8,
        Q.Q5_0: 1.01 * amax / 16,
        Q.Q4_1: 0.6 * (hi - lo) / 15 + np.abs(lo) * 2.0 ** -10,
        Q.Q5_1: 0.6 * (hi - lo) / 31 + np.abs(lo) * 2.0 ** -10,
    }[qtype]
    assert (_per_block(err, 32) <= bound + 1e-12).all()
    assert np.array_equal(y[0, :32], np.zeros(32, np.float32))


def test_bf16_rounds_to_nearest_even():
    # Guards truncation instead of ggml's round-to-nearest-even.
    x = np.array([[1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20, -(1.0 + 2.0 ** -8)]],
                 dtype=np.float32)
    y = dequantize(quantize(x, Q.BF16), Q.BF16, 4)
    assert y.tolist() == [[1.0, 1.0 + 2.0 ** -6, 1.0 + 2.0 ** -7, -1.0]]
