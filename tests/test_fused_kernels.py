"""The GPU step's kernels (kernels/mma_matmul.cu, kernels/fused.cu) against their CPU versions
(kernels/fused_ref.py), on two devices: the CPU emulator (tests/emu: the same CUDA sources built for
the CPU, always run) and a real GPU (skipped without one).

What the tests guard:
- the tensor-core weight layout and fragment map: every type's matmul equals a float64 product
  of the CPU dequantiser's weights with the f16-rounded activations (exact for Q4_K / Q5_K / F16 up
  to f32 rounding; Q6_K and Q8_0 round their A operand to f16 once, <= 2^-12 relative; IQ4_XS
  rounds kv * (ls - 32), up to 4064 in magnitude, to f16 once: an error of at most 1 above 2048);
- split-K (several thread blocks per row block, the last one adding in split order) and its
  counters being reset, so a second launch (a graph replay) gives the same bits;
- batch invariance: a row's result does not depend on how many other rows are in the launch;
- the epilogues: residual add in place without touching neighbours, the SwiGLU pair writing the
  next product's f16 rows and block sums;
- the activation format (permutation, f16 rounding, hi/lo block sums) bit for bit;
- the DeltaNet conv/gates, recurrence (advance, verify = no state write + backup, commit = replay
  from the backup), gated norm; the attention's norm + RoPE + cache write, split softmax and gate;
- on the GPU: the hardware MMA against the shuffle-built one (`-DMMA_PORTABLE`, the HIP path),
  which checks the fragment layout the kernels assume.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernels import fused_ref, ggml_quants
from kernels.fused_gpu import (ATT_MAX_SPLITS, ATT_MIN_SPLITS, ATT_SPLIT_CAP_TC, MM_BLOCKS_PER_SM, MODE_ADD,
                               MODE_STORE, MODE_SWIGLU, ActBuffer, FusedGpu, MmWorkspace, att_launch_splits,
                               att_row_splits, prep_block_cols, prep_cluster_cols)
from tests.emu import emu_unavailable_reason
from tests.gpu_helpers import NO_GPU

QT_F16, QT_Q8_0, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ4_XS = 1, 8, 12, 13, 14, 23
# max |got - ref| / max |ref| allowed per type (A rounded to f16 for Q6_K / Q8_0 / IQ4_XS; for
# IQ4_XS on these random blocks the rounding alone gives <= 3.6e-4 over 900 seeded cases, the
# kernel matches a product with its f16-rounded A to ~2e-7)
MM_TOL = {QT_F16: 2e-6, QT_Q4_K: 2e-6, QT_Q5_K: 2e-6, QT_Q6_K: 6e-4, QT_Q8_0: 6e-4, QT_IQ4_XS: 6e-4}
TYPES = (QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_Q8_0, QT_F16, QT_IQ4_XS)


def _devices():
    out = [pytest.param("emu", marks=pytest.mark.skipif(emu_unavailable_reason() is not None,
                                                        reason=f"emulator: {emu_unavailable_reason()}"))]
    out.append(pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None,
                                                                                reason=f"no GPU backend: {NO_GPU}")]))
    return out


@pytest.fixture(scope="module", params=_devices())
def dev(request):
    if request.param == "emu":
        from tests.emu import EmuDevice
        d = EmuDevice()
    else:
        from kernels.cuda_backend import CudaBackend
        d = CudaBackend()
    return request.param, d, FusedGpu(d)


def _h(xp, a):
    return a if xp is np else xp.asnumpy(a)


def _scaled_raw(qtype, n_out, n_in, rng):
    """Random valid blocks, scaled so outputs stay O(1) (f16 activations must not overflow)."""
    return ggml_quants.random_raw(qtype, n_out, n_in, rng, scale_range=(2.0 ** -12, 2.0 ** -9))


def _act(fg, x, K):
    xp = fg.xp
    act = ActBuffer(xp, K)
    x16, xs = fused_ref.act_layout(x, act.ld16)
    act.write_rows(x16, xs)
    return act, fused_ref.act_values(x16, K)


def _rel(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def _mm_run(fg, mode, wg, wu, act, T, ws, variant=(), y0=None):
    """One launch of wg (SwiGLU: wg, wu) in `mode` on act's T rows -> (host output, op): SwiGLU the next
    product's rows and block sums side by side, ADD the int64 fixed-point sums (from 0), STORE the f32 rows
    (into a copy of y0 when given, else NaNs, so a row left unwritten shows)."""
    xp, n_out = fg.xp, wg.n_out
    if mode == MODE_SWIGLU:
        out = ActBuffer(xp, n_out)
        op = fg.op_mm("t", [(wg, None, 0, 0), (wu, None, 0, 0)], act, T, mode, ws, out_act=out, variant=variant)
        op()
        return np.concatenate(out.read_rows(T), axis=1), op
    if mode == MODE_ADD:
        y = xp.zeros((T, n_out), dtype=xp.int64)
    else:
        y = xp.array(y0) if y0 is not None else xp.full((T, n_out), np.nan, dtype=xp.float32)
    op = fg.op_mm("t", [(wg, y, 0, n_out)], act, T, mode, ws, variant=variant)
    op()
    return _h(xp, y), op


def _two_type_add(fg, rng, n_in, T, variants):
    """One ADD launch over a Q4_K matrix and a Q6_K one (mm_tc_parts, each type on its share of the
    grid), on the same T random rows, once per variant: the int64 sums of each run."""
    xp = fg.xp
    raw_a, raw_b = _scaled_raw(QT_Q4_K, 320, n_in, rng), _scaled_raw(QT_Q6_K, 192, n_in, rng)
    wa, wb = fg.repack("a", QT_Q4_K, 320, n_in, raw_a), fg.repack("b", QT_Q6_K, 192, n_in, raw_b)
    ws = MmWorkspace(xp, *fg.workspace_need([wa, wb], MODE_ADD))
    act, _ = _act(fg, rng.standard_normal((T, n_in)).astype(np.float32), n_in)
    out = []
    for v in variants:
        y = xp.zeros((T, 512), dtype=xp.int64)
        fg.op_mm("t", [(wa, y, 0, 512), (wb, y, 320, 512)], act, T, MODE_ADD, ws, variant=v)()
        out.append(_h(xp, y))
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_mm_every_type_and_width(dev, qtype):
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(qtype)
    # n_in 2048 with few rows: several superblock splits; 520 rows: a partial row block
    shapes = [(48, 2048), (520, 512)] if name == "emu" else [(48, 2048), (520, 512), (5120, 4096), (1000, 17408)]
    widths = (1, 8, 9, 23, 32) if name == "emu" else (1, 2, 5, 8, 9, 16, 17, 23, 24, 31, 32)
    if qtype == QT_Q8_0:
        shapes.append((40, 96 if name == "emu" else 160))     # columns not a whole superblock
    for n_out, n_in in shapes:
        raw = _scaled_raw(qtype, n_out, n_in, rng)
        w = fg.repack("w", qtype, n_out, n_in, raw)
        ws = MmWorkspace(xp, *fg.workspace_need([w], MODE_STORE))
        for T in widths:
            x = rng.standard_normal((T, n_in)).astype(np.float32)
            act, xr = _act(fg, x, n_in)
            y = xp.full((T, n_out), np.nan, dtype=xp.float32)
            op = fg.op_mm("t", [(w, y, 0, n_out)], act, T, MODE_STORE, ws)
            op()
            ref = fused_ref.mm_ref(xr, raw, qtype, n_in)
            got = _h(xp, y)
            assert np.isfinite(got).all(), f"{name} type {qtype} {n_out}x{n_in} T={T}: unwritten outputs"
            err = _rel(got, ref)
            assert err <= MM_TOL[qtype], f"{name} type {qtype} {n_out}x{n_in} T={T} grid {op.grid}: {err:.3g}"
            op()                                              # a replay (split-K counters reset)
            assert np.array_equal(_h(xp, y), got), f"{name}: a second launch differs"


@pytest.mark.parametrize("mode", [MODE_STORE, MODE_ADD], ids=["store", "add"])
def test_mm_two_types_in_one_launch(dev, mode):
    """A projection whose matrices have two types (Q4_K_M: a Q6_K attn_qkv beside Q4_K z / alpha /
    beta) runs as one launch, each type on its share of the grid (fused_gpu.mm_parts). Guards: each
    part's rows must be bit-identical to a launch of that part alone on the same number of blocks
    (the same stripes, cut row blocks summed in the same order, the second part's workspace slots
    and counters apart from the first's), whatever the segment order, at every width, on a replay
    too; and within the types' tolerance of the CPU dequantiser."""
    import dataclasses

    from kernels.fused_gpu import mm_parts
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(11 + mode)
    n_in = 2048 if name == "emu" else 5120
    # (type, rows): the Q6_K matrix between two Q4_K ones, so the launch reorders its segments
    mats = ([(QT_Q4_K, 40), (QT_Q6_K, 48), (QT_Q4_K, 33)] if name == "emu" else
            [(QT_Q4_K, 6144), (QT_Q6_K, 10240), (QT_Q4_K, 48), (QT_Q4_K, 48)])
    raws = [_scaled_raw(qt, n, n_in, rng) for qt, n in mats]
    ws_ = [fg.repack(f"w{i}", qt, n, n_in, r) for i, ((qt, n), r) in enumerate(zip(mats, raws))]
    parts = mm_parts(ws_, mode, fg.n_sm)
    assert len(parts) == 2 and min(p[0] for p in parts) >= 2, parts     # stripes cut row blocks in both parts
    ws = MmWorkspace(xp, *fg.workspace_need(ws_, mode))
    ws_alone = MmWorkspace(xp, *fg.workspace_need(ws_, mode))
    dt = xp.int64 if mode == MODE_ADD else xp.float32
    widths = (1, 9, 23) if name == "emu" else (1, 5, 8, 9, 16, 23, 32)
    for T in widths:
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        act, xr = _act(fg, x, n_in)
        ys = [xp.zeros((T, n), dtype=dt) for _, n in mats]
        segs = [(w, y, 0, w.n_out) for w, y in zip(ws_, ys)]
        op = fg.op_mm("t", segs, act, T, mode, ws)
        assert op.grid[0] == sum(p[0] for p in parts)
        op()
        got = [_h(xp, y).copy() for y in ys]
        for (qt, _), r, g in zip(mats, raws, got):
            vals = fused_ref.fixed_values(g) if mode == MODE_ADD else g
            err = _rel(vals, fused_ref.mm_ref(xr, r, qt, n_in))
            assert err <= MM_TOL[qt], f"{name} T={T} type {qt}: {err:.3g}"
        # each part alone, as a single-type launch on that part's blocks
        alone = [xp.zeros((T, n), dtype=dt) for _, n in mats]
        for qt, (blocks, _) in zip(dict.fromkeys(qt for qt, _ in mats), parts):
            sub = [(w, y, 0, w.n_out) for w, y in zip(ws_, alone) if w.qtype == qt]
            one = fg.op_mm("t", sub, act, T, mode, ws_alone)
            dataclasses.replace(one, grid=(blocks,))()
        for i, (a, g) in enumerate(zip(alone, got)):
            assert np.array_equal(_h(xp, a), g), f"{name} T={T} segment {i}: differs from its part launched alone"
        for y in ys:
            y[...] = 0
        op()
        assert all(np.array_equal(_h(xp, y), g) for y, g in zip(ys, got)), f"{name} T={T}: a replay differs"
    with pytest.raises(ValueError, match="two types"):
        w8 = fg.repack("w8", QT_Q8_0, 16, n_in, _scaled_raw(QT_Q8_0, 16, n_in, rng))
        fg.op_mm("t", segs + [(w8, xp.zeros((T, 16), dtype=dt), 0, 16)], act, T, mode, ws)


@pytest.mark.parametrize("qtype", TYPES)
def test_units_to_f16_are_the_dequantised_weights(dev, qtype):
    """units_f16_* (the wide-batch product's weights for cuBLAS): every element is the CPU
    dequantiser's weight rounded to f16 (Q6_K / IQ4_XS: their A operand is rounded to f16 first, as
    the MMA path does, so within 2^-10); rows past n_out and columns past n_in are zero, and a slice
    of tiles is the same rows of the whole."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(40 + qtype)
    n_out, n_in = (40, 96) if qtype == QT_Q8_0 else (40, 512)
    raw = _scaled_raw(qtype, n_out, n_in, rng)
    w = fg.repack("w", qtype, n_out, n_in, raw)
    ld = w.n_sb * 256
    out = xp.full((16 * w.n_tiles, ld), 0xFFFF, dtype=xp.uint16)        # NaN bits: unwritten shows
    fg.units_to_f16(w, out)
    got = _h(xp, out).view(np.float16).astype(np.float64)
    ref = ggml_quants.dequantize(raw, qtype, n_in).astype(np.float64)
    assert (got[n_out:] == 0).all() and (got[:, n_in:] == 0).all()
    g = got[:n_out, :n_in]
    ref16 = ref.astype(np.float16).astype(np.float64)
    if qtype in (QT_Q6_K, QT_IQ4_XS):
        assert (np.abs(g - ref) <= 2.0 ** -10 * np.abs(ref) + 1e-12).all()
    else:
        ulp = np.spacing(np.abs(ref16).astype(np.float16)).astype(np.float64)
        assert (np.abs(g - ref16) <= ulp).all()
        assert (g == ref16).mean() >= 0.99
    part = xp.zeros((16, ld), dtype=xp.uint16)
    fg.units_to_f16(w, part, tile0=1, n_tiles=1)
    assert np.array_equal(_h(xp, part), _h(xp, out)[16:32])
    with pytest.raises(ValueError):
        fg.units_to_f16(w, part, tile0=w.n_tiles - 1, n_tiles=2)


@pytest.mark.parametrize("qtype", (QT_Q4_K, QT_Q6_K, QT_IQ4_XS))
def test_mm_rows_are_batch_invariant(dev, qtype):
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(7)
    n_out, n_in = (64, 2048) if name == "emu" else (3000, 5120)
    raw = _scaled_raw(qtype, n_out, n_in, rng)
    w = fg.repack("w", qtype, n_out, n_in, raw)
    ws = MmWorkspace(xp, *fg.workspace_need([w], MODE_STORE))
    x = rng.standard_normal((32, n_in)).astype(np.float32)
    outs = {}
    for T in (1, 3, 9, 23, 32):
        act, _ = _act(fg, x[:T], n_in)
        y = xp.zeros((T, n_out), dtype=xp.float32)
        fg.op_mm("t", [(w, y, 0, n_out)], act, T, MODE_STORE, ws)()
        outs[T] = _h(xp, y)
    for T, y in outs.items():
        assert np.array_equal(y, outs[32][:T]), f"{name}: rows of a {T}-row launch differ from the same rows of 32"


@pytest.mark.parametrize("variant", [("TC_NO_TMA=1",), ("TC_NO_TMA=1", "MM_ISSUER_WARP=0")],
                         ids=["software-pipeline", "software-pipeline-warp0-issues"])
def test_mm_software_pipeline_equals_tma(dev, variant):
    """The build pre-Hopper GPUs run (no TMA: software mbarriers in shared memory, the issuer warp
    copying the stages itself), and with warp 0 as the issuer as on HIP, forced on this GPU: every
    mode, type and width bit-identical to the TMA build (same arithmetic in the same order; what
    differs is who fills the stages and how their completion is counted)."""
    name, d, fg = dev
    if name == "emu":
        pytest.skip("the emulator has its own mbarrier model; this holds the GPU's two builds equal")
    xp = fg.xp
    rng = np.random.default_rng(21)
    n_in, n_out = 2048, 1000
    for qtype in (QT_Q4_K, QT_Q6_K, QT_Q8_0):
        raw_g, raw_u = _scaled_raw(qtype, n_out, n_in, rng), _scaled_raw(qtype, n_out, n_in, rng)
        wg, wu = fg.repack("g", qtype, n_out, n_in, raw_g), fg.repack("u", qtype, n_out, n_in, raw_u)
        ws = MmWorkspace(xp, *fg.workspace_need([wg, wu], MODE_SWIGLU))
        for T in (1, 6, 9, 23):
            act, _ = _act(fg, rng.standard_normal((T, n_in)).astype(np.float32), n_in)
            base = rng.standard_normal((T, n_out)).astype(np.float32)
            for mode in (MODE_STORE, MODE_ADD, MODE_SWIGLU):
                got = [_mm_run(fg, mode, wg, wu, act, T, ws, v, base)[0] for v in ((), variant)]
                assert np.array_equal(got[0], got[1]), f"type {qtype} T={T} mode {mode}: {variant} differs from TMA"


def test_mm_cut_row_blocks_sum_alike_in_either_arrival_order(dev):
    """A row block cut between stripes is summed by whichever of its parts arrives last: the
    stripe ending on it (at its end), or the stripe starting on it (whose early arrival turns out
    last only at its own end). The emulator runs blocks in grid order (later stripes last: the
    starting stripe sums) and last to first (the ending stripe sums); both must give the same
    bits, and the reference, in every epilogue. Shape: 13 row blocks of 5 superblocks over 16
    stripes of ~4 superblocks (row blocks of 2 and of 3 parts)."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(23)
    n_out, n_in = 832, 1280
    raw_g, raw_u = _scaled_raw(QT_Q4_K, n_out, n_in, rng), _scaled_raw(QT_Q4_K, n_out, n_in, rng)
    wg, wu = fg.repack("g", QT_Q4_K, n_out, n_in, raw_g), fg.repack("u", QT_Q4_K, n_out, n_in, raw_u)
    ws = MmWorkspace(xp, *fg.workspace_need([wg, wu], MODE_SWIGLU))
    orders = (False, True) if name == "emu" else (False,)
    try:
        for T in (1, 23):
            x = rng.standard_normal((T, n_in)).astype(np.float32)
            act, xr = _act(fg, x, n_in)
            base = rng.standard_normal((T, n_out)).astype(np.float32)
            ref_g = fused_ref.mm_ref(xr, raw_g, QT_Q4_K, n_in)
            for mode in (MODE_STORE, MODE_ADD, MODE_SWIGLU):
                got = []
                for reverse in orders:
                    if name == "emu":
                        d.block_order(reverse)
                    if mode == MODE_SWIGLU:
                        out = ActBuffer(xp, n_out)
                        op = fg.op_mm("t", [(wg, None, 0, 0), (wu, None, 0, 0)], act, T, mode, ws, out_act=out)
                        op()
                        got.append(fused_ref.act_values(out.read_rows(T)[0], n_out))
                        ref = fused_ref.swiglu_ref(ref_g, fused_ref.mm_ref(xr, raw_u, QT_Q4_K, n_in))
                    elif mode == MODE_ADD:                # into the fixed-point accumulator
                        acc = xp.zeros((T, n_out), dtype=xp.int64)
                        op = fg.op_mm("t", [(wg, acc, 0, n_out)], act, T, mode, ws)
                        op()
                        got.append(fused_ref.fixed_values(_h(xp, acc)))
                        ref = ref_g
                    else:
                        y = xp.array(base)
                        op = fg.op_mm("t", [(wg, y, 0, n_out)], act, T, mode, ws)
                        op()
                        got.append(_h(xp, y))
                        ref = ref_g
                    assert op.grid[0] == 4 * MM_BLOCKS_PER_SM or name != "emu", op.grid   # emulator: 4 SMs
                    err = _rel(got[-1], ref)
                    assert err <= 2e-3, f"{name} T={T} mode {mode} reverse={reverse}: {err:.3g}"
                assert all(np.array_equal(g, got[0]) for g in got), f"T={T} mode {mode}: arrival order changed bits"
    finally:
        if name == "emu":
            d.block_order(False)


def _tail_partials_stored(xp, ws, op, n_rb, n_sb, T):
    """For each stripe of `op` (n_rb row blocks of n_sb superblocks, T rows) that ends on a row block of two
    parts starting in it: whether it stored its partial of that row block (the workspace's slot 1 of its
    block; the test fills the workspace with NaN first). A stripe that prefetched the other part stores none."""
    G, W, n_el = op.grid[0], n_rb * n_sb, T * 64
    owner = lambda f: ((f + 1) * G - 1) // W                                     # noqa: E731
    tails = [b for b in range(G) for f0, f1 in [(b * W // G, (b + 1) * W // G)]
             if f1 % n_sb and (f1 // n_sb) * n_sb >= f0 and owner((f1 // n_sb) * n_sb + n_sb - 1) == b + 1]
    part = _h(xp, ws.ws)
    return [not np.isnan(part[(2 * b + 1) * n_el:(2 * b + 2) * n_el]).all() for b in tails]


def test_mm_tail_prefetch_sums_cut_row_blocks_as_the_exchange_does(dev):
    """mma_matmul.cu's MM_TAIL_PREFETCH (the default since the forty-second session: decode and verify
    W=16/23 0.3-0.7 ms faster on the 27B): a SwiGLU stripe whose last row block the next stripe finishes
    polls that part's count a few superblocks before its end and, if it has arrived, copies its partial
    early (a bulk copy into static shared memory; decode's one-row build into registers) and sums it after
    the loop without storing its own or counting itself. Bugs it guards: a changed order of the sum, a lost
    part, a counter left set, and a misaligned bulk copy (the first GPU run of this build failed with
    "misaligned address": its shared destination was a float array; the emulator now checks a bulk copy's
    alignment and builds without GNU unique symbols, which had bound a variant build's __shared__ objects to
    the default build's). Against the build without the prefetch (MM_TAIL_PREFETCH=0: the exchange
    alone), bit for bit. The emulator runs blocks in grid order (the next stripe has not run: the
    exchange) and last to first (it has: the early copy); only in the second did the stripes store no
    partial of their last row block (the path ran). Shape: 26 SwiGLU row blocks of 5 superblocks over 16
    stripes of ~8."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(41)
    n_out, n_in = 832, 1280
    raw_g, raw_u = _scaled_raw(QT_Q4_K, n_out, n_in, rng), _scaled_raw(QT_Q4_K, n_out, n_in, rng)
    wg, wu = fg.repack("g", QT_Q4_K, n_out, n_in, raw_g), fg.repack("u", QT_Q4_K, n_out, n_in, raw_u)
    ws = MmWorkspace(xp, *fg.workspace_need([wg, wu], MODE_SWIGLU))
    orders = (False, True) if name == "emu" else (False,)
    n_sb, n_rb = n_in // 256, (n_out // 16 + 1) // 2
    try:
        for T in (1, 9, 23):
            act, _ = _act(fg, rng.standard_normal((T, n_in)).astype(np.float32), n_in)
            for reverse in orders:
                if name == "emu":
                    d.block_order(reverse)
                want, _ = _mm_run(fg, MODE_SWIGLU, wg, wu, act, T, ws, ("MM_TAIL_PREFETCH=0",))
                for variant in ((), ("MM_TAIL_PREFETCH=1",)):
                    ws.ws[...] = np.nan
                    got, op = _mm_run(fg, MODE_SWIGLU, wg, wu, act, T, ws, variant)
                    assert np.array_equal(got, want), f"T={T} reverse={reverse} {variant}: the prefetch changed bits"
                    assert not _h(xp, ws.counters).any(), "a row block's counter was left set"
                if name != "emu":
                    continue
                stored = _tail_partials_stored(xp, ws, op, n_rb, n_sb, T)
                assert len(stored) >= 8, stored
                assert all(stored) if not reverse else not any(stored), (T, reverse, stored)
    finally:
        if name == "emu":
            d.block_order(False)


def test_mm_one_row_build_equals_the_general_build(dev, monkeypatch):
    """Decode's products run mma_matmul.cu's MM_ONE_ROW build (fused_gpu.ONE_ROW_BUILD: T = 1 a constant, so
    the staged rows' offsets fold into the loads): every output bit-identical to the build for 1..8 rows
    at T = 1, in every epilogue, with cut row blocks, and for a two-type launch."""
    from kernels import fused_gpu
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(37)
    n_out, n_in = 832, 1280
    for qtype in (QT_Q4_K, QT_Q6_K, QT_Q8_0):
        raw_g, raw_u = _scaled_raw(qtype, n_out, n_in, rng), _scaled_raw(qtype, n_out, n_in, rng)
        wg, wu = fg.repack("g", qtype, n_out, n_in, raw_g), fg.repack("u", qtype, n_out, n_in, raw_u)
        ws = MmWorkspace(xp, *fg.workspace_need([wg, wu], MODE_SWIGLU))
        act, _ = _act(fg, rng.standard_normal((1, n_in)).astype(np.float32), n_in)
        for mode in (MODE_STORE, MODE_ADD, MODE_SWIGLU):
            got, kernels = [], []
            for one_row in (True, False):
                monkeypatch.setattr(fused_gpu, "ONE_ROW_BUILD", one_row)
                out, op = _mm_run(fg, mode, wg, wu, act, 1, ws)
                got.append(out)
                kernels.append(op.kernel)
            assert kernels[0] is not kernels[1]              # two builds
            assert np.array_equal(got[0], got[1]), f"{name} type {qtype} mode {mode}: the one-row build differs"
    got = []
    for one_row in (True, False):
        monkeypatch.setattr(fused_gpu, "ONE_ROW_BUILD", one_row)
        got += _two_type_add(fg, np.random.default_rng(41), n_in, 1, ((),))
    assert np.array_equal(got[0], got[1]), f"{name}: a two-type launch's one-row build differs"


def test_mm_fixed_width_build_equals_the_general_build(dev, monkeypatch):
    """Verify widths over 8 rows may run mma_matmul.cu's MM_T_CONST build (fused_gpu.WIDE_T_CONST: the
    launch's row count a constant, so the stage's offsets fold into the loads): every output bit-identical
    to the general build, in every epilogue, with cut row blocks (on the GPU at 9, 16, 23 and 32 rows: 2, 3
    and 4 column tiles; on the emulator at 23), and for a two-type launch."""
    from kernels import fused_gpu
    name, d, fg = dev
    xp = fg.xp
    monkeypatch.setattr(fused_gpu, "WIDE_T_CONST_EMU", True)    # (the emulator otherwise runs the general build)
    rng = np.random.default_rng(43)
    n_out, n_in = 832, 1280
    for qtype in (QT_Q4_K, QT_Q6_K):
        raw_g, raw_u = _scaled_raw(qtype, n_out, n_in, rng), _scaled_raw(qtype, n_out, n_in, rng)
        wg, wu = fg.repack("g", qtype, n_out, n_in, raw_g), fg.repack("u", qtype, n_out, n_in, raw_u)
        ws = MmWorkspace(xp, *fg.workspace_need([wg, wu], MODE_SWIGLU))
        for T in ((23,) if name == "emu" else (9, 16, 23, 32)):       # (emulator: a C++ build a width)
            act, _ = _act(fg, rng.standard_normal((T, n_in)).astype(np.float32), n_in)
            base = rng.standard_normal((T, n_out)).astype(np.float32)
            for mode in (MODE_STORE, MODE_ADD, MODE_SWIGLU):
                got, kernels = [], []
                for fixed in (True, False):
                    monkeypatch.setattr(fused_gpu, "WIDE_T_CONST", fixed)
                    out, op = _mm_run(fg, mode, wg, wu, act, T, ws, (), base)
                    got.append(out)
                    kernels.append(op.kernel)
                assert kernels[0] is not kernels[1]              # two builds
                assert np.array_equal(got[0], got[1], equal_nan=True), \
                    f"{name} type {qtype} T={T} mode {mode}: the fixed-width build differs"
    monkeypatch.setattr(fused_gpu, "WIDE_T_CONST", False)       # a launch of two types (mm_tc_parts)
    got = _two_type_add(fg, np.random.default_rng(47), n_in, 23, ((), ("MM_T_CONST=23",)))
    assert np.array_equal(got[0], got[1]), f"{name}: a two-type launch's fixed-width build differs"


def _chain_device(dev, emu_sms: int):
    """The dev fixture for an mm_chain test: (name, device, FusedGpu, xp); on the emulator a FusedGpu that
    counts `emu_sms` multiprocessors, so a chain's grid (four blocks each at most) is small enough for the
    emulator to run its blocks side by side."""
    name, d, fg = dev
    if name == "emu":
        fg = FusedGpu(d)
        fg.n_sm = emu_sms
    return name, d, fg, fg.xp


def _chain_against_launches(fg, ops, outputs, what):
    """Run `ops` as launches in order, then as one mm_chain, each from the outputs' state on entry: the
    launches' outputs (host copies), after asserting the chain's are the same bits."""
    xp = fg.xp
    start = [_h(xp, a).copy() for a in outputs]
    results = []
    for fn in (lambda: [op() for op in ops], fg.op_mm_chain("chain", ops)):
        for a, a0 in zip(outputs, start):
            a[...] = xp.asarray(a0)
        fn()
        results.append([_h(xp, a).copy() for a in outputs])
    for i, (g, ref) in enumerate(zip(results[1], results[0])):
        assert np.array_equal(g, ref), f"{what}: output {i} of the chain differs from the launches in order"
    return results[0], start


@pytest.mark.parametrize("spread", [1, 3, "flag"])
def test_mm_chain_runs_products_and_preps_as_their_launches(dev, spread, monkeypatch):
    """mma_matmul.cu's mm_chain (an A/B candidate, not in the step by default): decode's one-row products
    and RMSNorm preps as phases of one persistent launch, every block walking each product's stripe in turn
    with its pipeline carried over (ring, barriers, cursors), waiting for the previous phase's count
    before copying its rows; a prep's blocks each sum the whole row in prep_rows' order. Bugs it guards: a
    slot or parity off by one between products (wrong units summed, or a hang), a phase reading rows or
    sums the previous one had not yet written (the emulator's second run skews the blocks' speeds), the
    issuer's and the computing warps' segments mixed up, a prep's sum in another order, a residual fold or
    clear lost, counters left set (a replay would differ). The chain is the step's residual flow over two
    layers: prep (x + pending sum, norm) -> gate|up (SwiGLU Q4_K) -> ffn_down (ADD Q6_K into the next
    sum) -> prep (folds it) -> gate|up -> ffn_down (ADD Q4_K) -> a two-type STORE reading the second
    gate|up's rows; grids of 4 to 8 blocks with cut row blocks. Every output bit-identical to the launches
    in order, twice; with the counts of finished blocks on one line or spread over three
    (fused_gpu.MM_CHAIN_SPREAD), or with the waiters looking at a flag the last arrival raises
    (fused_gpu.MM_CHAIN_FLAG); counts and flags cleared after each run."""
    from kernels import fused_gpu
    monkeypatch.setattr(fused_gpu, "MM_CHAIN_SPREAD", 1 if spread == "flag" else spread)
    monkeypatch.setattr(fused_gpu, "MM_CHAIN_FLAG", spread == "flag")
    name, d, fg, xp = _chain_device(dev, 2)  # grids of <= 8 blocks: the emulator runs them side by side
    rng = np.random.default_rng(59)
    n_in, n_ff = 1280, 1024
    def w(label, qt, n_out, k):
        return fg.repack(label, qt, n_out, k, _scaled_raw(qt, n_out, k, rng))
    g0, u0, g1, u1 = (w(f"{c}{i}", QT_Q4_K, n_ff, n_in) for i in (0, 1) for c in "gu")
    d0, d1 = w("d0", QT_Q6_K, n_in, n_ff), w("d1", QT_Q4_K, n_in, n_ff)
    sa, sb = w("sa", QT_Q4_K, 192, n_ff), w("sb", QT_Q6_K, 64, n_ff)       # 4 row blocks: a grid of 4
    need = [fg.workspace_need(ws_, m) for ws_, m in (([g0, u0], MODE_SWIGLU), ([d0], MODE_ADD), ([sa, sb], MODE_STORE))]
    ws = MmWorkspace(xp, max(n for n, _ in need), max(c for _, c in need))
    norm_w = [xp.asarray(rng.uniform(0.5, 1.5, n_in).astype(np.float32)) for _ in range(2)]
    xs = [xp.asarray(rng.standard_normal((1, n_in)).astype(np.float32)), xp.zeros((1, n_in), dtype=xp.float32)]
    accs = [xp.asarray(rng.integers(-2 ** 33, 2 ** 33, (1, n_in))), xp.asarray(rng.integers(-9, 9, (1, n_in)))]
    act0, act1, ff0, ff1 = ActBuffer(xp, n_in), ActBuffer(xp, n_in), ActBuffer(xp, n_ff), ActBuffer(xp, n_ff)
    y = xp.zeros((1, 256), dtype=xp.float32)
    ops = [fg.op_prep_rows("prep0", xs[0], n_in, 0, norm_w[0], 1e-6, n_in, True, act0, 1, acc=accs[0],
                           x_out=xs[1], acc_zero=accs[1]),
           fg.op_mm("gu0", [(g0, None, 0, 0), (u0, None, 0, 0)], act0, 1, MODE_SWIGLU, ws, out_act=ff0),
           fg.op_mm("down0", [(d0, accs[1], 0, n_in)], ff0, 1, MODE_ADD, ws),
           fg.op_prep_rows("prep1", xs[1], n_in, 0, norm_w[1], 1e-6, n_in, True, act1, 1, acc=accs[1],
                           x_out=xs[0], acc_zero=accs[0]),
           fg.op_mm("gu1", [(g1, None, 0, 0), (u1, None, 0, 0)], act1, 1, MODE_SWIGLU, ws, out_act=ff1),
           fg.op_mm("down1", [(d1, accs[0], 0, n_in)], ff1, 1, MODE_ADD, ws),
           fg.op_mm("store", [(sa, y, 0, 256), (sb, y, 192, 256)], ff1, 1, MODE_STORE, ws)]
    grids = [op.grid[0] for op in ops if op.mm_kind]
    if name == "emu":
        assert max(grids) == 8 and min(grids) < 8, grids      # a product on fewer blocks than the chain
    outputs = xs + accs + [act0.x16, act0.buf, act1.x16, act1.buf, ff0.x16, ff0.buf, ff1.x16, ff1.buf, y]
    start = [_h(xp, a).copy() for a in outputs]

    def run(fn):
        for a, a0 in zip(outputs, start):
            a[...] = xp.asarray(a0)
        fn()
        return [_h(xp, a).copy() for a in outputs]

    def in_order():
        for op in ops:
            op()
    want = run(in_order)
    chain = fg.op_mm_chain("chain", ops)
    assert chain.grid[0] == max(grids)
    try:
        for rep in range(2):
            if name == "emu":
                d.skew_blocks(rep == 1)          # the second run: blocks at three speeds (emu.cpp emu_skew)
            got = run(chain)
            for i, (g, ref) in enumerate(zip(got, want)):
                assert np.array_equal(g, ref), f"{name} run {rep}: output {i} differs from the launches in order"
            assert not _h(xp, chain.args[2]).any(), "the chain's phase counts were left set"
            assert not _h(xp, ws.counters).any(), "a row block's counter was left set"
    finally:
        if name == "emu":
            d.skew_blocks(False)
    # the preps folded and cleared the sums (each cleared, then added into by the ffn_down after it)
    assert not np.array_equal(want[0], start[0]) and not np.array_equal(want[2], start[2])


def test_mm_chain_give_up_records_the_wait_that_never_ended(dev, monkeypatch):
    """fused_gpu.MM_CHAIN_GIVE_UP (a failure hunt: tests/bench/chain_step_check_gpu.py --give-up, GPU_NOTES
    fortieth session): a chain whose first phase's count can never reach the grid (set far below zero before
    the launch) ends instead of trapping, and FusedGpu.chain_stuck names the phase waited for (0), a block of
    the second product's grid, and the count it saw; the record is cleared by reading it, and the device runs
    the next chain (counts cleared by the last block) to the launches' bits. GPU only (on the emulator a wait
    that never ends is an error of its own: emu.cpp emu_fail); each wait gives up after seconds."""
    from kernels import fused_gpu
    name, d, fg = dev
    if name == "emu":
        pytest.skip("the give-up record is a CUDA module global; the emulator fails a wait that never ends")
    monkeypatch.setattr(fused_gpu, "MM_CHAIN_GIVE_UP", True)
    xp = fg.xp
    rng = np.random.default_rng(61)
    n_in, n_ff = 1280, 1024
    g, u = (fg.repack(c, QT_Q4_K, n_ff, n_in, _scaled_raw(QT_Q4_K, n_ff, n_in, rng)) for c in "gu")
    dw = fg.repack("d", QT_Q6_K, n_in, n_ff, _scaled_raw(QT_Q6_K, n_in, n_ff, rng))
    need = [fg.workspace_need(w, m) for w, m in (([g, u], MODE_SWIGLU), ([dw], MODE_ADD))]
    ws = MmWorkspace(xp, max(n for n, _ in need), max(c for _, c in need))
    act, _ = _act(fg, rng.standard_normal((1, n_in)).astype(np.float32), n_in)
    ff = ActBuffer(xp, n_ff)
    acc = xp.zeros((1, n_in), dtype=xp.int64)
    ops = [fg.op_mm("gu", [(g, None, 0, 0), (u, None, 0, 0)], act, 1, MODE_SWIGLU, ws, out_act=ff),
           fg.op_mm("down", [(dw, acc, 0, n_in)], ff, 1, MODE_ADD, ws)]
    for op in ops:
        op()
    want = _h(xp, acc).copy()
    chain = fg.op_mm_chain("chain", ops)
    done = chain.args[2]
    done[0] = -(1 << 30)                         # phase 0's count: never the grid's
    acc[...] = 0
    chain()
    d.synchronize()
    rec = fg.chain_stuck(chain)
    assert rec is not None, "no wait gave up"
    assert rec["phase_waited_for"] == 0 and rec["spread"] == 1 and rec["grid"] == chain.grid[0]
    assert 0 <= rec["block"] < ops[1].grid[0] and rec["thread"] == 128    # the second product's issuer, lane 0
    assert rec["counts"][0] < 0 and rec["expected"] == [chain.grid[0]]
    # every block started and arrived past phase 0 (its count alone was wrong), on as many multiprocessors
    assert rec["started"] == chain.grid[0] and rec["not_started"] == [] and rec["started_behind"] == []
    assert 1 <= rec["sms"] <= min(chain.grid[0], fg.n_sm)
    assert sum(n * k for n, k in rec["blocks_a_sm"].items()) == chain.grid[0]
    assert fg.chain_stuck(chain) is None, "the record was not cleared"
    assert not _h(xp, done).any(), "the last block left counts set"
    acc[...] = 0
    ws.counters[...] = 0                         # (the run that gave up overlapped its products: results wrong)
    chain()
    assert np.array_equal(_h(xp, acc), want), "the chain after a give-up differs from the launches"
    assert fg.chain_stuck(chain) is None
    assert np.abs(want[-1]).max() > 0


def test_mm_chain_prep_sums_in_prep_rows_order(dev):
    """A prep phase of mm_chain sums a row's squares in prep_rows' order (256-column chunks, each the
    xor-tree sums of its eight 32-column runs in order, the chunks in order): a float sum in another order
    changes the rounded scale of a row now and then, so 12 rows of 20 chunks with a wide dynamic range, each
    a prep phase of one chain, must all give prep_rows' act16 rows, block sums and folded x bit for bit
    (a chain whose prep added the chunks last to first differed in about a third of such rows)."""
    name, d, fg, xp = _chain_device(dev, 5)  # the prep's 20 blocks (a chunk each) side by side
    rng = np.random.default_rng(61)
    K, n_rows = 5120, 12
    wt = fg.repack("w", QT_Q4_K, 64, K, _scaled_raw(QT_Q4_K, 64, K, rng))
    ws = MmWorkspace(xp, *fg.workspace_need([wt], MODE_STORE))
    norm_w = xp.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
    x = rng.standard_normal((n_rows, K)) * 10.0 ** rng.uniform(-2, 2, (n_rows, K // 256)).repeat(256, axis=1)
    xs = [xp.asarray(x[i:i + 1].astype(np.float32)) for i in range(n_rows)]
    accs = [xp.asarray(rng.integers(-2 ** 31, 2 ** 31, (1, K))) for _ in range(n_rows)]
    outs = [xp.zeros((1, K), dtype=xp.float32) for _ in range(n_rows)]
    zero = xp.ones((1, K), dtype=xp.int64)
    acts = [ActBuffer(xp, K) for _ in range(n_rows)]
    y = xp.zeros((1, 64), dtype=xp.float32)
    ops = [fg.op_prep_rows(f"prep{i}", xs[i], K, 0, norm_w, 1e-6, K, True, acts[i], 1, acc=accs[i], x_out=outs[i],
                           acc_zero=zero) for i in range(n_rows)]
    ops.append(fg.op_mm("mm", [(wt, y, 0, 64)], acts[-1], 1, MODE_STORE, ws))
    outputs = outs + [a.x16 for a in acts] + [a.buf for a in acts] + [y, zero]
    ref, _ = _chain_against_launches(fg, ops, outputs, f"{name} preps")
    assert not ref[-1].any()


@pytest.mark.parametrize("dv", [128, 96])
def test_mm_chain_gated_norm_equals_gdn_out_prep(dev, dv):
    """A gated-norm phase of mm_chain (CHAIN_STEP 3: DeltaNet's output norm before its output product)
    gives gdn_out_prep's bits: each head's sum of squares in its order, y = norm * w * silu(z), z's fixed-point
    sums cleared, the act16 row and block sums; heads of 128 columns (two a 256-column block) and of 96
    (heads across blocks, the last block short). Then a product reads the rows in the same chain."""
    name, d, fg, xp = _chain_device(dev, 2)
    rng = np.random.default_rng(67)
    nv = 6
    K = nv * dv
    K_pad = -(-K // 256) * 256                   # the product's columns: whole superblocks (zero past K)
    wt = fg.repack("w", QT_Q4_K, 64, K_pad, _scaled_raw(QT_Q4_K, 64, K_pad, rng))
    ws = MmWorkspace(xp, *fg.workspace_need([wt], MODE_STORE))
    o = xp.asarray((rng.standard_normal((1, K)) * 10.0 ** rng.uniform(-1, 1, (1, K))).astype(np.float32))
    ldz = K + 8
    z = xp.asarray(rng.integers(-2 ** 33, 2 ** 33, (1, ldz)))
    w = xp.asarray(rng.uniform(0.5, 1.5, dv).astype(np.float32))
    act = ActBuffer(xp, K_pad)
    y = xp.zeros((1, 64), dtype=xp.float32)
    ops = [fg.op_gdn_out_prep("gnorm", o, z, ldz, w, 1e-6, nv, dv, act, 1),
           fg.op_mm("mm", [(wt, y, 0, 64)], act, 1, MODE_STORE, ws)]
    assert ops[0].chain_phase, "a one-row gated norm is a chain phase"
    ref, _ = _chain_against_launches(fg, ops, [z, act.x16, act.buf, y], f"{name} gated norm dv={dv}")
    assert not ref[0][0, :K].any() and ref[0][0, K:].any()    # z read and cleared, the rest kept
    assert np.abs(ref[3]).max() > 0


@pytest.mark.parametrize("dk", [32, 128])
def test_mm_chain_recurrence_equals_gdn_recur(dev, dk):
    """A recurrence phase of mm_chain (CHAIN_STEP 3: DeltaNet's gdn_recur for one token, 16 value columns a
    block where the launch has 32) gives gdn_recur's bits: the output row and the state written in place
    (advance), or the state left and its backup written (a verify table); d_k 32 and 128 (dn_token<4> and
    <16>, the 27B's). A product follows it in the chain."""
    name, d, fg, xp = _chain_device(dev, 4)
    rng = np.random.default_rng(71)
    nk, nv, dv = 1, 2, dk                        # (16 blocks of 16 columns at d_v = 128)
    C = 2 * nk * dk + nv * dv
    R = C + 2 * nv
    rec_h = rng.standard_normal((1, R)).astype(np.float32)
    rec_h[0, :2 * nk * dk] /= np.sqrt(dk)                     # q, k about unit norm (as gdn_conv leaves them)
    rec_h[0, C:C + nv] = -np.abs(rec_h[0, C:C + nv])          # log decays
    rec_h[0, C + nv:] = 1.0 / (1.0 + np.exp(-rec_h[0, C + nv:]))
    S_h = rng.standard_normal((nv, dv, dk)).astype(np.float32)
    wt = fg.repack("w", QT_Q4_K, 64, 256, _scaled_raw(QT_Q4_K, 64, 256, rng))
    ws = MmWorkspace(xp, *fg.workspace_need([wt], MODE_STORE))
    act, _ = _act(fg, rng.standard_normal((1, 256)).astype(np.float32), 256)
    y = xp.zeros((1, 64), dtype=xp.float32)
    rec = xp.asarray(rec_h)
    for mode in ("advance", "verify"):
        S, bak, o = xp.array(S_h), xp.zeros(S_h.shape, dtype=xp.float32), xp.zeros((1, nv * dv), dtype=xp.float32)
        ptrs = [fg.ptr(rec), fg.ptr(S), fg.ptr(S), 0] if mode == "advance" else [fg.ptr(rec), fg.ptr(S), 0, fg.ptr(bak)]
        tbl = xp.asarray(np.array(ptrs, dtype=np.uint64))
        ops = [fg.op_gdn_recur("r", tbl, 1, 1, None, o, nk, nv, dk, dv),
               fg.op_mm("mm", [(wt, y, 0, 64)], act, 1, MODE_STORE, ws)]
        assert ops[0].chain_phase, "one token of one slot is a chain phase"
        ref, _ = _chain_against_launches(fg, ops, [S, bak, o, y], f"{name} recurrence dk={dk} {mode}")
        assert ref[2].any()
        if mode == "advance":
            assert not np.array_equal(ref[0], S_h)
        else:
            assert np.array_equal(ref[0], S_h) and np.array_equal(ref[1], S_h)


@pytest.mark.parametrize("save", [False, True])
def test_mm_chain_conv_equals_gdn_conv(dev, save):
    """A conv phase of mm_chain (CHAIN_STEP 3: DeltaNet's gdn_conv for the one token a decode step advances
    the conv state by) gives gdn_conv's bits: the record row (q and k L2-normalised, v, the gates), the
    state shifted by the token, the other parity's sums cleared and the read ones kept; with state_save (a
    GreedyChain step's backup of the old state) too. A product follows it in the chain."""
    name, d, fg, xp = _chain_device(dev, 4)
    rng = np.random.default_rng(73)
    c = _dn_case(rng, 1, dk=128, dv=128, nk=1, nv=2)
    C, nk, nv, dk, dv, kc = c["C"], c["nk"], c["nv"], c["dk"], c["dv"], c["kc"]
    R = C + 2 * nv
    wt = fg.repack("w", QT_Q4_K, 64, 256, _scaled_raw(QT_Q4_K, 64, 256, rng))
    ws = MmWorkspace(xp, *fg.workspace_need([wt], MODE_STORE))
    act, _ = _act(fg, rng.standard_normal((1, 256)).astype(np.float32), 256)
    y = xp.zeros((1, 64), dtype=xp.float32)
    conv_state, saved = xp.array(c["state"]), xp.zeros((kc - 1, C), dtype=xp.float32)
    tbl = xp.asarray(np.array([0, fg.ptr(conv_state)], dtype=np.uint64))     # the state at slot 1
    rec = xp.zeros((1, R), dtype=xp.float32)
    qkv, ab = _fx(xp, c["qkv"]), _fx(xp, c["ab"])
    qkv_other, ab_other = xp.ones((1, C), dtype=xp.int64), xp.ones((1, 2 * nv), dtype=xp.int64)
    ops = [fg.op_gdn_conv("c", qkv, C, tbl, 1, xp.array(c["conv_w"]), ab, xp.array(c["dt_bias"]), xp.array(c["ssm_a"]),
                          rec, 1, nk, nv, dk, dv, kc, 1e-6, write_state=True, state_save=saved if save else None,
                          clear=(qkv_other, ab_other)),
           fg.op_mm("mm", [(wt, y, 0, 64)], act, 1, MODE_STORE, ws)]
    assert ops[0].chain_phase, "one token that advances the state is a chain phase"
    ref, start = _chain_against_launches(fg, ops, [conv_state, saved, rec, qkv, ab, qkv_other, ab_other, y],
                                         f"{name} conv save={save}")
    assert not np.array_equal(ref[0], start[0]) and ref[2].any() and not ref[5].any() and not ref[6].any()
    assert np.array_equal(ref[1], start[0]) if save else not ref[1].any()


def test_mm_segments_and_residual_add(dev):
    """ADD: every part of a row block adds round(partial * 2^32) into the int64 accumulator, which
    prep_rows folds into the residual (x + acc, written to the other x buffer, the next
    accumulator cleared); segments of one launch land at their offsets and nothing else changes.
    A second launch adds the same sums again (no counter or workspace state between launches)."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(3)
    n_in, T = 512, 5
    raws = [_scaled_raw(QT_Q4_K, n, n_in, rng) for n in (40, 16, 33)]
    ws_ = [fg.repack(f"w{i}", QT_Q4_K, r.shape[0], n_in, r) for i, r in enumerate(raws)]
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    act, xr = _act(fg, x, n_in)
    ldy = 104
    base = rng.standard_normal((T, ldy)).astype(np.float32)
    acc = xp.zeros((T, ldy), dtype=xp.int64)
    ws = MmWorkspace(xp, *fg.workspace_need(ws_, MODE_ADD))
    segs = [(ws_[0], acc, 0, ldy), (ws_[1], acc, 45, ldy), (ws_[2], acc, 61, ldy)]
    fg.op_mm("t", segs, act, T, MODE_ADD, ws)()
    once = _h(xp, acc).copy()
    exp = np.zeros((T, ldy), np.float32)
    exp[:, 0:40] = fused_ref.mm_ref(xr, raws[0], QT_Q4_K, n_in)
    exp[:, 45:61] = fused_ref.mm_ref(xr, raws[1], QT_Q4_K, n_in)
    exp[:, 61:94] = fused_ref.mm_ref(xr, raws[2], QT_Q4_K, n_in)
    assert _rel(fused_ref.fixed_values(once), exp) <= 1e-6
    untouched = np.r_[40:45, 94:104]
    assert (once[:, untouched] == 0).all(), "ADD wrote outside its segments"
    fg.op_mm("t", segs, act, T, MODE_ADD, ws)()
    assert np.array_equal(_h(xp, acc), 2 * once)
    with pytest.raises(ValueError, match="int64"):
        fg.op_mm("t", [(ws_[0], xp.zeros((T, ldy), dtype=xp.float32), 0, ldy)], act, T, MODE_ADD, ws)
    # the fold: x + acc into the other buffer, the next accumulator cleared, act from the sum
    acc[...] = xp.asarray(once)
    xd, x_out = xp.array(base), xp.full((T, ldy), np.nan, dtype=xp.float32)
    nxt = xp.full((T, ldy), 7, dtype=xp.int64)
    act_o = ActBuffer(xp, ldy)
    fg.op_prep_rows("p", xd, ldy, 0, None, 0.0, ldy, False, act_o, T, acc=acc, x_out=x_out, acc_zero=nxt)()
    folded = base + fused_ref.fixed_values(once)
    assert np.array_equal(_h(xp, x_out), folded)
    assert (_h(xp, nxt) == 0).all() and np.array_equal(_h(xp, xd), base) and np.array_equal(_h(xp, acc), once)
    e16, _ = fused_ref.act_layout(folded)
    assert np.array_equal(act_o.read_rows(T)[0][:, :e16.shape[1]], e16)
    # a non-finite partial poisons its element: the fold gives NaN there (the step's health check)
    poison = once.copy()
    poison[1, 3] += np.int64(1) << np.int64(60)
    acc[...] = xp.asarray(poison)
    fg.op_prep_rows("p", xd, ldy, 0, None, 0.0, ldy, False, act_o, T, acc=acc, x_out=x_out)()
    got = _h(xp, x_out)
    assert np.isnan(got[1, 3]) and np.isfinite(np.delete(got.ravel(), 1 * ldy + 3)).all()


@pytest.mark.parametrize("qtype", (QT_Q4_K, QT_Q6_K, QT_IQ4_XS))
def test_mm_swiglu_epilogue_writes_next_input(dev, qtype):
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(11)
    # T > 24 keeps a row block's result rows in the pipeline stage its last superblock was read
    # from (mma_matmul.cu SRES_IN_STAGE): (512, 512, 28) gives whole row blocks inside a stripe on
    # the emulator. On the H200 the 27B's shape: a build that reused a stage this way without a
    # barrier first (other warps still reading it) gave NaN rows there (1-7 row blocks of 544 at
    # T = 16-32), which the emulator, running the warps in turn, does not show.
    cases = ([(96, 512, 5), (64, 2048, 20), (512, 512, 28)] if name == "emu"
             else [(17408, 5120, 23), (768, 256, 1), (17408, 5120, 32)])
    for n_ff, n_in, T in cases:
        # small weights: silu(gate) * up of large values would overflow f16 (a property of the data)
        rg = ggml_quants.random_raw(qtype, n_ff, n_in, rng, scale_range=(2.0 ** -16, 2.0 ** -13))
        ru = ggml_quants.random_raw(qtype, n_ff, n_in, rng, scale_range=(2.0 ** -16, 2.0 ** -13))
        wg, wu = fg.repack("g", qtype, n_ff, n_in, rg), fg.repack("u", qtype, n_ff, n_in, ru)
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        act, xr = _act(fg, x, n_in)
        out = ActBuffer(xp, n_ff)
        ws = MmWorkspace(xp, *fg.workspace_need([wg, wu], MODE_SWIGLU))
        fg.op_mm("t", [(wg, None, 0, 0), (wu, None, 0, 0)], act, T, MODE_SWIGLU, ws, out_act=out)()
        h = fused_ref.swiglu_ref(fused_ref.mm_ref(xr, rg, qtype, n_in), fused_ref.mm_ref(xr, ru, qtype, n_in))
        o16, oxs = out.read_rows(T)
        got = fused_ref.act_values(o16, n_ff)
        assert _rel(got, h) <= (2e-3 if qtype in (QT_Q6_K, QT_IQ4_XS) else 1e-3)
        # the block sums are the sums of the rounded values the rows hold
        _, xs_exp = fused_ref.act_layout(got, out.ld16)
        hs = lambda a: a.view(np.float16).astype(np.float32)   # noqa: E731
        assert _rel(hs(oxs), hs(xs_exp)) <= 1e-6


def test_prep_rows_layout_and_norm(dev):
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(5)
    for K in (32, 264, 5120):
        T = 3
        x = rng.standard_normal((T + 2, K)).astype(np.float32)
        w = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
        xd, wd = xp.array(x), xp.array(w)
        act = ActBuffer(xp, K)
        fg.op_prep_rows("p", xd, K, 2, None, 0.0, K, False, act, T)()      # rows 2..4, no norm: a format
        e16, exs = fused_ref.act_layout(x[2:])
        g16, gxs = act.read_rows(T)
        assert np.array_equal(g16[:, :e16.shape[1]], e16)
        assert np.array_equal(gxs[:, :exs.shape[1]], exs)
        fg.op_prep_rows("p", xd, K, 0, wd, 1e-6, K, True, act, T)()
        got = fused_ref.act_values(act.read_rows(T)[0], K)
        ref = fused_ref.prep_rows_ref(x[:T], w, 1e-6, True)
        assert _rel(got, ref) <= 1e-3      # f16 rounding of the normed values
        # a residual's pending fixed-point sum folded in: the same bits as the prep of x + acc
        acc = fused_ref.to_fixed(rng.standard_normal((T + 2, K)).astype(np.float32))
        folded = x + fused_ref.fixed_values(acc)
        x_out = xp.zeros((T + 2, K), dtype=xp.float32)
        def shifted(a):                   # rows 4 bytes off 16: the sum of squares' scalar path
            buf = xp.zeros(a.size + 1, dtype=xp.float32)
            buf[1:] = xp.asarray(a).ravel()
            return buf[1:].reshape(a.shape)

        for xin, fin in ((xd, xp.array(folded)), (shifted(x), shifted(folded))):
            fg.op_prep_rows("p", fin, K, 1, wd, 1e-6, K, True, act, T)()     # each path's own sum order
            exp16 = act.read_rows(T)
            fg.op_prep_rows("p", xin, K, 1, wd, 1e-6, K, True, act, T, acc=xp.array(acc), x_out=x_out)()
            got16 = act.read_rows(T)
            assert np.array_equal(got16[0], exp16[0]) and np.array_equal(got16[1], exp16[1])
            assert np.array_equal(_h(xp, x_out)[1:T + 1], folded[1:T + 1]) and (_h(xp, x_out)[[0, T + 1]] == 0).all()


def test_prep_rows_column_split_changes_no_bit(dev):
    """A row's RMSNorm prep runs with 1 to 20 column blocks (wider ones for wide batches), each
    block reading its whole row for the sum of squares, or (fused.cu prep_rows_cly<N>, sm_90 and the
    emulator) as one thread-block cluster of 2-8 blocks that share their chunk sums: every split and
    both kernels must give the same act16 rows, block sums, folded x_out and cleared accumulator, so
    that a row's bits never depend on the width it was decoded at. The bug this guards: a sum of
    squares whose order follows the split (a decode row and its verify twin a rounding apart)."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(8)
    for K, T in ((1024, 1), (1024, 3), (1032, 2), (5120, 2), (2304, 1)):
        n_chunks = -(-K // 256)
        x = rng.standard_normal((T, K)).astype(np.float32)
        w = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
        acc = fused_ref.to_fixed(rng.standard_normal((T, K)).astype(np.float32))
        ref = fused_ref.prep_rows_ref(x + fused_ref.fixed_values(acc), w, 1e-6, True)
        splits = [(cb, False) for cb in sorted({-(-n_chunks // 4), 2, 3, n_chunks})]      # 1024 to 256 columns
        if fg.clusters:           # every cluster size this K allows (2..8 blocks of 256-1024 columns)
            splits += [(cb, True) for cb in range(2, 9) if prep_cluster_cols(K, T, cb) is not None]
        if name == "emu" and K == 5120:
            splits = [s for s in splits if s[0] in (5, 7, 20)]        # the emulator's time
        results = []
        for aligned in (True, False):            # rows 16-byte aligned or not: the same loads' order
            for col_blocks, cluster in splits:
                act = ActBuffer(xp, K)
                x_out = xp.zeros((T, K), dtype=xp.float32)
                nxt = xp.full((T, K), 5, dtype=xp.int64)
                xin = xp.array(x) if aligned else xp.concatenate([xp.zeros(1, xp.float32), xp.array(x).ravel()])[1:]
                op = fg.op_prep_rows("p", xin.reshape(T, K), K, 0, xp.array(w), 1e-6, K, True, act, T,
                                     acc=xp.array(acc), x_out=x_out, acc_zero=nxt, col_blocks=col_blocks,
                                     cluster=cluster)
                cols = prep_cluster_cols(K, T, col_blocks) if cluster else prep_block_cols(K, T, col_blocks)
                assert op.grid[1] == -(-K // cols)
                assert ("_cly" in op.kernel.symbol if name == "emu" else True) or not cluster
                op()
                g16, gxs = act.read_rows(T)
                results.append((g16.copy(), gxs.copy(), _h(xp, x_out).copy()))
                assert (_h(xp, nxt) == 0).all(), f"{col_blocks} blocks (cluster {cluster}): the next accumulator not cleared"
        for r, (col_blocks, cluster) in zip(results[1:], (splits * 2)[1:]):
            assert all(np.array_equal(a, b) for a, b in zip(r, results[0])), \
                f"K={K} T={T}: {col_blocks} blocks (cluster {cluster}) changed bits"
        assert np.array_equal(results[0][2], x + fused_ref.fixed_values(acc))
        assert _rel(fused_ref.act_values(results[0][0], K), ref) <= 1e-3
    # the default split widens blocks with the rows: 20 a row at T = 1, 5 at T = 23 (5120 columns);
    # a cluster holds at most 8 blocks: 7 of 768 columns at T = 1
    assert prep_block_cols(5120, 1) == 256 and prep_block_cols(5120, 23) == 1024 and prep_block_cols(32, 23) == 256
    assert prep_cluster_cols(5120, 1) == 768 and prep_cluster_cols(5120, 23) == 1024
    assert prep_cluster_cols(256, 1) is None and prep_cluster_cols(9000, 1) is None


def _on_fixed_grid(a):
    """Values a fixed-point sum holds exactly (multiples of 2^-20): the kernels' float view of
    to_fixed(a) is then a itself, so float references apply unchanged."""
    return (np.round(np.asarray(a, np.float64) * 2.0 ** 20) / 2.0 ** 20).astype(np.float32)


def _fx(xp, a):
    """A fresh int64 fixed-point copy of a (the projections' sums gdn_conv / gdn_out_prep read and clear)."""
    return xp.array(fused_ref.to_fixed(a))


def _dn_case(rng, T, nk=2, nv=4, dk=32, dv=32, kc=4):
    C = 2 * nk * dk + nv * dv
    return dict(T=T, nk=nk, nv=nv, dk=dk, dv=dv, kc=kc, C=C,
                qkv=_on_fixed_grid(rng.standard_normal((T, C))),
                state=rng.standard_normal((kc - 1, C)).astype(np.float32),
                conv_w=(rng.standard_normal((C, kc)) / 2).astype(np.float32),
                ab=_on_fixed_grid(rng.standard_normal((T, 2 * nv))),
                dt_bias=rng.standard_normal(nv).astype(np.float32),
                ssm_a=-np.exp(rng.uniform(-1, 1, nv)).astype(np.float32),
                S=(rng.standard_normal((nv, dv, dk)) * 0.1).astype(np.float32))     # S^T per head


def test_deltanet_conv_recurrence_and_commit(dev):
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(2)
    for dk, T in ((32, 6), (32, 2), (128, 6)) if name == "cuda" else ((32, 6), (32, 2)):
        c = _dn_case(rng, T, dk=dk, dv=dk)       # T = 2 < kc - 1: part of the old conv state stays
        T, C, nk, nv, dv, kc = c["T"], c["C"], c["nk"], c["nv"], c["dv"], c["kc"]
        R = C + 2 * nv
        rec_ref, state_ref = fused_ref.gdn_conv_ref(c["qkv"], c["state"], c["conv_w"], c["ab"], c["dt_bias"],
                                                    c["ssm_a"], nk, nv, dk, dv, 1e-6)
        conv_state = xp.array(c["state"])
        tbl = xp.array(np.array([fg.ptr(conv_state)], dtype=np.uint64))
        rec = xp.zeros((T, R), dtype=xp.float32)
        qkv_fx, ab_fx = _fx(xp, c["qkv"]), _fx(xp, c["ab"])
        args = (qkv_fx, C, tbl, 0, xp.array(c["conv_w"]), ab_fx, xp.array(c["dt_bias"]),
                xp.array(c["ssm_a"]), rec, T, nk, nv, dk, dv, kc, 1e-6)
        fg.op_gdn_conv("c", *args, write_state=True)()
        assert _rel(_h(xp, rec), rec_ref) <= 1e-5
        assert np.array_equal(_h(xp, conv_state), state_ref)
        # the sums it read are cleared for the next layer's matmul
        assert not _h(xp, qkv_fx).any() and not _h(xp, ab_fx).any()
        with pytest.raises(ValueError, match="int64"):
            fg.op_gdn_conv("c", xp.array(c["qkv"]), *args[1:], write_state=True)
        # a row does not depend on how many rows the launch has (verify rows = decode steps)
        rec1 = xp.zeros((1, R), dtype=xp.float32)
        cs1 = xp.array(c["state"])
        tbl1 = xp.array(np.array([fg.ptr(cs1)], dtype=np.uint64))
        fg.op_gdn_conv("c1", _fx(xp, c["qkv"][:1]), C, tbl1, 0, args[4], _fx(xp, c["ab"][:1]), *args[6:8], rec1, 1,
                       *args[10:], write_state=True)()
        assert np.array_equal(_h(xp, rec1)[0], _h(xp, rec)[0])

        # recurrence: advance (in place) against the CPU recurrence
        S_ref = c["S"].copy()
        o_ref = fused_ref.gdn_recur_ref(rec_ref, S_ref, nk, nv, dk, dv)
        recd = xp.array(rec_ref)
        S = xp.array(c["S"])
        o = xp.zeros((T, nv * dv), dtype=xp.float32)
        t_adv = xp.array(np.array([fg.ptr(recd), fg.ptr(S), fg.ptr(S), 0], dtype=np.uint64))
        fg.op_gdn_recur("r", t_adv, 1, T, None, o, nk, nv, dk, dv)()
        assert _rel(_h(xp, o), o_ref) <= 1e-5
        assert _rel(_h(xp, S), S_ref) <= 1e-5

        # verify: same outputs, the state untouched, a backup of it written
        S2 = xp.array(c["S"])
        bak = xp.zeros_like(S2)
        o2 = xp.zeros((T, nv * dv), dtype=xp.float32)
        t_ver = xp.array(np.array([fg.ptr(recd), fg.ptr(S2), 0, fg.ptr(bak)], dtype=np.uint64))
        fg.op_gdn_recur("v", t_ver, 1, T, None, o2, nk, nv, dk, dv)()
        assert np.array_equal(_h(xp, o2), _h(xp, o))
        assert np.array_equal(_h(xp, S2), c["S"]) and np.array_equal(_h(xp, bak), c["S"])

        # commit n tokens from the backup: the state after n advance steps, bit for bit
        params = xp.array(np.array([0, 0] + [0] * 32, dtype=np.int32))
        t_com = xp.array(np.array([fg.ptr(recd), fg.ptr(bak), fg.ptr(S2), 0], dtype=np.uint64))
        for n in (T, 2, 0):
            params[1] = n
            fg.op_gdn_recur("m", t_com, 1, 0, params[1:], None, nk, nv, dk, dv)()
            S3 = xp.array(c["S"])
            if n:
                t3 = xp.array(np.array([fg.ptr(recd), fg.ptr(S3), fg.ptr(S3), 0], dtype=np.uint64))
                fg.op_gdn_recur("a", t3, 1, n, None, xp.zeros((n, nv * dv), dtype=xp.float32), nk, nv, dk, dv)()
            assert np.array_equal(_h(xp, S2), _h(xp, S3)), f"{name}: commit of {n} tokens differs from {n} steps"

        # conv commit from a verify record [kc-1+T, C]: the state and the block's inputs, saved by gdn_conv
        record = xp.full((kc - 1 + T, C), np.nan, dtype=xp.float32)
        cs = xp.array(c["state"])
        tbl2 = xp.array(np.array([fg.ptr(cs)], dtype=np.uint64))
        fg.op_gdn_conv("c", _fx(xp, c["qkv"]), C, tbl2, 0, args[4], _fx(xp, c["ab"]), *args[6:], write_state=False,
                       state_save=record, qkv_save=record[kc - 1:])()
        assert np.array_equal(_h(xp, cs), c["state"])
        assert np.array_equal(_h(xp, record), np.concatenate([c["state"], c["qkv"]], axis=0))
        tcc = xp.array(np.array([fg.ptr(record), fg.ptr(cs)], dtype=np.uint64))
        for n in (T, min(3, T - 1)):
            params[1] = n
            fg.op_gdn_commit_conv("cc", tcc, 1, params, C, kc)()
            X = np.concatenate([c["state"], c["qkv"]], axis=0)
            assert np.array_equal(_h(xp, cs), X[n:n + kc - 1])


def test_deltanet_conv_token_blocks_give_the_same_bits(dev):
    """A verify's gdn_conv in blocks of a few tokens (each token's item reads the kc - 1 input rows
    before it, so a block reads its neighbour's rows): the same record, rows and bits as one block of
    all T, the inputs left as they were and the other buffers cleared instead (the step passes the
    other DeltaNet layer parity's sums). The bug it guards: a block clearing the rows it read while
    the next token block still reads them as its window."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(5)
    for T, tpb in ((23, 4), (9, 1), (5, 2), (2, 1)):
        c = _dn_case(rng, T)
        C, nk, nv, dk, dv, kc = c["C"], c["nk"], c["nv"], c["dk"], c["dv"], c["kc"]
        R = C + 2 * nv
        w = (xp.array(c["conv_w"]), xp.array(c["dt_bias"]), xp.array(c["ssm_a"]))
        outs = []
        for blocks in (None, tpb):
            cs = xp.array(c["state"])
            tbl = xp.array(np.array([fg.ptr(cs)], dtype=np.uint64))
            rec = xp.full((T, R), np.nan, dtype=xp.float32)
            record = xp.full((kc - 1 + T, C), np.nan, dtype=xp.float32)
            qkv_fx, ab_fx = _fx(xp, c["qkv"]), _fx(xp, c["ab"])
            other = (_fx(xp, c["qkv"]), _fx(xp, c["ab"]))
            fg.op_gdn_conv("c", qkv_fx, C, tbl, 0, w[0], ab_fx, w[1], w[2], rec, T, nk, nv, dk, dv, kc, 1e-6,
                           write_state=False, state_save=record, qkv_save=record[kc - 1:], clear=other,
                           tokens_per_block=blocks)()
            assert np.array_equal(_h(xp, qkv_fx), fused_ref.to_fixed(c["qkv"]))        # inputs kept
            assert not _h(xp, other[0]).any() and not _h(xp, other[1]).any()          # the others cleared
            assert np.array_equal(_h(xp, cs), c["state"])
            outs.append((_h(xp, rec), _h(xp, record)))
        assert np.array_equal(outs[0][0], outs[1][0]), f"{name}: T={T} in blocks of {tpb}: other rows"
        assert np.array_equal(outs[0][1], outs[1][1])
        with pytest.raises(ValueError, match="token blocks"):
            fg.op_gdn_conv("c", qkv_fx, C, tbl, 0, w[0], ab_fx, w[1], w[2], rec, T, nk, nv, dk, dv, kc, 1e-6,
                           write_state=True, clear=other, tokens_per_block=1)


# (d_k, d_v, T, nk, nv): gdn_recur stages up to 32 tokens per chunk, so T = 33 and 40 take two;
# gdn_conv walks (token, channel) items, several per thread at d_k = 128 and T = 40 or d_k = 32 and
# T = 150; d_v = 288 / 300 is a head wider than the block (its state loop), and the gate block's
# items per thread per pass are exceeded at T * nv = 150 * 16. gdn_recur stages float4 pieces when
# d_k, d_v and the record's row are multiples of 4: (6, 10) and (8, 8) with one value head (a row
# of 26 floats) take its scalar path.
DN_WIDE_CASES = ((32, 32, 40, 2, 4), (128, 128, 40, 2, 4), (32, 32, 150, 2, 16), (32, 288, 5, 2, 4),
                 (256, 64, 40, 1, 2), (8, 16, 33, 2, 4), (16, 300, 2, 2, 4),
                 (6, 10, 9, 1, 3), (8, 8, 35, 1, 1))


@pytest.mark.parametrize("dk, dv, T, nk, nv", DN_WIDE_CASES)
def test_deltanet_rows_do_not_depend_on_the_launch_width(dev, dk, dv, T, nk, nv):
    """gdn_conv and gdn_recur across their staging chunks and item passes: against the CPU reference,
    and every row (and the state after it) the same bits as a narrower launch's, down to one token
    per launch (verify rows = decode steps)."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(1000 * dk + T)
    c = _dn_case(rng, T, nk=nk, nv=nv, dk=dk, dv=dv)
    C, kc = c["C"], c["kc"]
    R = C + 2 * nv
    X = np.concatenate([c["state"], c["qkv"]], axis=0)
    rec_ref, state_ref = fused_ref.gdn_conv_ref(c["qkv"], c["state"], c["conv_w"], c["ab"], c["dt_bias"],
                                                c["ssm_a"], nk, nv, dk, dv, 1e-6)
    weights = (xp.array(c["conv_w"]), None, xp.array(c["dt_bias"]), xp.array(c["ssm_a"]))

    def conv(n, write_state, save=None):
        cs = xp.array(c["state"])
        tbl = xp.array(np.array([fg.ptr(cs)], dtype=np.uint64))
        rec = xp.zeros((n, R), dtype=xp.float32)
        fg.op_gdn_conv("c", _fx(xp, c["qkv"][:n]), C, tbl, 0, weights[0], _fx(xp, c["ab"][:n]), weights[2],
                       weights[3], rec, n, nk, nv, dk, dv, kc, 1e-6, write_state=write_state, state_save=save)()
        return _h(xp, rec), _h(xp, cs)

    rec, cs = conv(T, True)
    assert _rel(rec, rec_ref) <= 1e-5
    assert np.array_equal(cs, state_ref)
    save = xp.zeros((kc - 1, C), dtype=xp.float32)
    rec_v, cs_v = conv(T, False, save)                      # verify: the state kept, a copy of it saved
    assert np.array_equal(rec_v, rec) and np.array_equal(cs_v, c["state"]) and np.array_equal(_h(xp, save), c["state"])
    for n in sorted({1, 2, T // 2, T - 1} - {0}):
        rec_n, cs_n = conv(n, True)
        assert np.array_equal(rec_n, rec[:n]), f"{name}: conv rows of a {n}-token launch differ from a {T}-token one's"
        assert np.array_equal(cs_n, X[n:n + kc - 1])

    # recurrence: advance against the CPU recurrence, verify, then token by token
    S_ref = c["S"].copy()
    o_ref = fused_ref.gdn_recur_ref(rec_ref, S_ref, nk, nv, dk, dv)
    recd = xp.array(rec_ref)

    def recur(t0, n, S, bak=None, write=True):
        o = xp.zeros((max(n, 1), nv * dv), dtype=xp.float32)
        tbl = xp.array(np.array([fg.ptr(recd) + 4 * R * t0, fg.ptr(S), fg.ptr(S) if write else 0,
                                 0 if bak is None else fg.ptr(bak)], dtype=np.uint64))
        fg.op_gdn_recur("r", tbl, 1, n, None, o, nk, nv, dk, dv)()
        return _h(xp, o)[:n]

    S = xp.array(c["S"])
    o = recur(0, T, S)
    assert _rel(o, o_ref) <= 1e-5
    assert _rel(_h(xp, S), S_ref) <= 1e-5
    S2, bak = xp.array(c["S"]), xp.zeros_like(S)
    assert np.array_equal(recur(0, T, S2, bak, write=False), o)
    assert np.array_equal(_h(xp, S2), c["S"]) and np.array_equal(_h(xp, bak), c["S"])
    S1 = xp.array(c["S"])
    o1 = np.concatenate([recur(t, 1, S1) for t in range(T)], axis=0)
    assert np.array_equal(o1, o), f"{name}: rows of a {T}-token launch differ from one-token steps"
    assert np.array_equal(_h(xp, S1), _h(xp, S))
    # commit of n tokens from the backup (n read on the device) = n advance steps, across the chunks
    params = xp.array(np.zeros(2, dtype=np.int32))
    t_com = xp.array(np.array([fg.ptr(recd), fg.ptr(bak), fg.ptr(S2), 0], dtype=np.uint64))
    for n in sorted({T, T - 1, 17, 33} & set(range(1, T + 1))):
        params[1] = n
        fg.op_gdn_recur("m", t_com, 1, 0, params[1:], None, nk, nv, dk, dv)()
        Sn = xp.array(c["S"])
        on = recur(0, n, Sn)
        assert np.array_equal(on, o[:n])
        assert np.array_equal(_h(xp, S2), _h(xp, Sn)), f"{name}: commit of {n} tokens differs from {n} steps"


def test_deltanet_gated_norm_prep(dev):
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(4)
    T, nv, dv = 3, 4, 64
    o = rng.standard_normal((T, nv * dv)).astype(np.float32)
    z = _on_fixed_grid(rng.standard_normal((T, nv * dv)))
    w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    act = ActBuffer(xp, nv * dv)
    z_fx = _fx(xp, z)                           # the gate projection's fixed-point sum, cleared as read
    fg.op_gdn_out_prep("g", xp.array(o), z_fx, nv * dv, xp.array(w), 1e-6, nv, dv, act, T)()
    got = fused_ref.act_values(act.read_rows(T)[0], nv * dv)
    assert _rel(got, fused_ref.gdn_out_ref(o, z, w, 1e-6, nv, dv)) <= 1e-3
    assert not _h(xp, z_fx).any()


@pytest.mark.parametrize("tc", (False, True), ids=("fma", "tc"))
@pytest.mark.parametrize("n_past", (0, 5, 300, 1100, 4200))
def test_attention_kernels(dev, n_past, tc):
    """Against the numpy reference; the tensor-core launch with the fewest splits that covers its
    rows (att_launch_splits: 64 at 4200 keys), as the step takes it."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(n_past)
    if name == "emu" and n_past > 300:
        pytest.skip("long contexts on the GPU only (emulator time)")
    T, H, Hkv, D, n_rot, theta, ctx = 4, 4, 2, 64, 16, 1e6, n_past + 100
    qg = rng.standard_normal((T, 2 * H * D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv * D)).astype(np.float32)
    qn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    kn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    kc0 = rng.standard_normal((Hkv, ctx, D)).astype(np.float32)
    vc0 = rng.standard_normal((Hkv, ctx, D)).astype(np.float32)
    kc_ref, vc_ref = kc0.copy(), vc0.copy()
    ref = fused_ref.attn_ref(qg, k, v, qn, kn, 1e-6, kc_ref, vc_ref, n_past, H, Hkv, D, n_rot, theta)
    kc, vc = xp.array(kc0), xp.array(vc0)
    tbl = xp.array(np.array([fg.ptr(kc), fg.ptr(vc), ctx], dtype=np.uint64))
    params = xp.array(np.array([n_past, 0] + [0] * 32, dtype=np.int32))
    qgd = xp.array(qg)
    qrot = xp.zeros((T, H, D), dtype=xp.float32)
    part_o = xp.zeros((T, H, ATT_MAX_SPLITS, D), dtype=xp.float32)
    part_ml = xp.zeros((T, H, ATT_MAX_SPLITS, 2), dtype=xp.float32)
    act = ActBuffer(xp, H * D)
    fg.op_attn_qk_rope_kv("a", qgd, xp.array(k), xp.array(v), xp.array(qn), xp.array(kn), 1e-6, params, tbl,
                          0, qrot, H, Hkv, D, n_rot, theta, T)()
    assert _rel(_h(xp, kc), kc_ref) <= 1e-5 and _rel(_h(xp, vc), vc_ref) == 0.0
    splits = att_launch_splits(n_past + T, tc)
    assert splits == (64 if tc and n_past == 4200 else 16)
    fg.op_attn_partial("p", qrot, params, tbl, 0, part_o, part_ml, H, Hkv, D, 1.0 / np.sqrt(D), T, tensor_cores=tc,
                       splits=splits)()
    fg.op_attn_combine_prep("c", part_o, part_ml, qgd, H, D, act, T, splits)()
    got = fused_ref.act_values(act.read_rows(T)[0], H * D)
    assert _rel(got, ref) <= 1e-3


@pytest.mark.parametrize("n_past", (0, 250, 1000))
def test_attention_tensor_cores_rows_do_not_depend_on_the_batch(dev, n_past):
    """attn_partial_tc puts 16 (row, head) pairs of a KV group in one MMA tile, rows of different
    positions (and, across a multiple of 256 keys, different split boundaries) side by side: each
    row must come out with the bits it gets alone at its position, as decode computes it, or
    speculative verify would drift from greedy decoding. Also close to the FMA kernel (operands
    split into two f16 halves: ~f32 accuracy). The one-row runs take attn_partial_tcd (decode's
    kernel), the 8-row block attn_partial_tc."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(n_past + 7)
    T, H, Hkv, D = 8, 12, 2, 64
    ctx = n_past + T + 8
    qh = rng.standard_normal((T, H, D)).astype(np.float32)
    kc = xp.array(rng.standard_normal((Hkv, ctx, D)).astype(np.float32))
    vc = xp.array((3 * rng.standard_normal((Hkv, ctx, D))).astype(np.float32))
    tbl = xp.array(np.array([fg.ptr(kc), fg.ptr(vc), ctx], dtype=np.uint64))
    scale = 1.0 / np.sqrt(D)

    def run(n0, rows, tc):
        params = xp.array(np.array([n0, 0] + [0] * 32, dtype=np.int32))
        n = len(rows)
        part_o = xp.full((n, H, ATT_MAX_SPLITS, D), np.nan, dtype=xp.float32)
        part_ml = xp.full((n, H, ATT_MAX_SPLITS, 2), np.nan, dtype=xp.float32)
        fg.op_attn_partial("p", xp.array(qh[rows]), params, tbl, 0, part_o, part_ml, H, Hkv, D, scale, n,
                           tensor_cores=tc)()
        return _h(xp, part_o), _h(xp, part_ml)

    wide_o, wide_ml = run(n_past, list(range(T)), True)
    for t in (0, 3, T - 1):
        one_o, one_ml = run(n_past + t, [t], True)
        assert np.array_equal(one_o[0], wide_o[t], equal_nan=True), f"{name}: row {t} o differs from its decode"
        assert np.array_equal(one_ml[0], wide_ml[t], equal_nan=True), f"{name}: row {t} (m, l) differs"
    ref_o, ref_ml = run(n_past, list(range(T)), False)
    live = ref_ml[..., 1] > 0
    assert np.array_equal(live, wide_ml[..., 1] > 0)
    assert np.abs(wide_ml[..., 0][live] - ref_ml[..., 0][live]).max() <= 1e-5
    assert _rel(wide_ml[..., 1][live], ref_ml[..., 1][live]) <= 1e-5
    assert _rel(wide_o[live], ref_o[live]) <= 1e-5


@pytest.mark.parametrize("n_past", (0, 500, 1100))
def test_attention_tc_two_mtiles_keep_the_bits(dev, n_past, monkeypatch):
    """fused_gpu.ATT_TC_MTILES = 2 (fused.cu attn_partial_tc2): two m-tiles of a KV group's rows a
    block, four warps on the same staged K / V tiles, walking the union of both m-tiles' key ranges,
    must give every row the bits of one m-tile a block (so verify rows still equal decode steps).
    Bugs it guards: a warp reading the other m-tile's score halves, a tile range cut to the first
    m-tile's rows (the second's last keys never seen), the idle m-tile of an odd count writing rows
    or missing a barrier (a hang). Three m-tiles (39 rows: two blocks, the second half idle) and
    four (48: whole blocks); splits of one, three (~500 keys) and five tiles (~1100)."""
    from kernels import fused_gpu
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(n_past + 13)
    H, Hkv, D = 6, 2, 64
    for T in (13, 16):                              # 39 and 48 (row, head) pairs a KV group
        ctx = n_past + T + 8
        kc = xp.array(rng.standard_normal((Hkv, ctx, D)).astype(np.float32))
        vc = xp.array((2 * rng.standard_normal((Hkv, ctx, D))).astype(np.float32))
        tbl = xp.array(np.array([fg.ptr(kc), fg.ptr(vc), ctx], dtype=np.uint64))
        params = xp.array(np.array([n_past, 0] + [0] * 32, dtype=np.int32))
        q = xp.array(rng.standard_normal((T, H, D)).astype(np.float32))
        outs = []
        for mt in (1, 2):
            monkeypatch.setattr(fused_gpu, "ATT_TC_MTILES", mt)
            part_o = xp.full((T, H, ATT_MAX_SPLITS, D), np.nan, dtype=xp.float32)
            part_ml = xp.full((T, H, ATT_MAX_SPLITS, 2), np.nan, dtype=xp.float32)
            op = fg.op_attn_partial("p", q, params, tbl, 0, part_o, part_ml, H, Hkv, D, 1.0 / np.sqrt(D), T,
                                    tensor_cores=True, decode_kernel=False)
            op()
            outs.append((_h(xp, part_o), _h(xp, part_ml), op.grid))
        assert outs[1][2][2] == -(-outs[0][2][2] // 2), "two m-tiles a block: half the row blocks"
        assert (outs[0][1][..., 1] > 0).any()
        assert np.array_equal(outs[1][0], outs[0][0], equal_nan=True), f"{name}: T={T} o of two m-tiles a block"
        assert np.array_equal(outs[1][1], outs[0][1], equal_nan=True), f"{name}: T={T} (m, l) of two m-tiles a block"
    monkeypatch.setattr(fused_gpu, "ATT_TC_MTILES", 3)
    with pytest.raises(ValueError, match="m-tiles"):
        fg.op_attn_partial("p", q, params, tbl, 0, part_o, part_ml, H, Hkv, D, 1.0 / np.sqrt(D), T,
                           tensor_cores=True, decode_kernel=False)


@pytest.mark.parametrize("n_past", (0, 40, 1100))
def test_attention_decode_kernel_equals_verify_kernel(dev, n_past):
    """attn_partial_tcd (the rows of one tile, as decode has them, with eight warps: score halves of
    two tiles at once, then each warp its own columns of D) must give the bits attn_partial_tc gives
    the same rows, or decode steps would drift from verify rows. At 1100 keys a split has 80 keys:
    three chunks of two tiles a block, the two stages reused."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(n_past + 11)
    H, Hkv, D = 8, 1, 32
    ctx = n_past + 8
    kc = xp.array(rng.standard_normal((Hkv, ctx, D)).astype(np.float32))
    vc = xp.array((2 * rng.standard_normal((Hkv, ctx, D))).astype(np.float32))
    tbl = xp.array(np.array([fg.ptr(kc), fg.ptr(vc), ctx], dtype=np.uint64))
    params = xp.array(np.array([n_past, 0] + [0] * 32, dtype=np.int32))
    for T in (1, 2):                     # 8 and 16 (row, head) pairs
        q = xp.array(rng.standard_normal((T, H, D)).astype(np.float32))
        outs = []
        for tcd in (False, True):
            part_o = xp.full((T, H, ATT_MAX_SPLITS, D), np.nan, dtype=xp.float32)
            part_ml = xp.full((T, H, ATT_MAX_SPLITS, 2), np.nan, dtype=xp.float32)
            fg.op_attn_partial("p", q, params, tbl, 0, part_o, part_ml, H, Hkv, D, 1.0 / np.sqrt(D), T,
                               tensor_cores=True, decode_kernel=tcd)()
            outs.append((_h(xp, part_o), _h(xp, part_ml)))
        assert not np.isnan(outs[0][1][:, :, :ATT_SPLIT_CAP_TC]).any()       # the default: the cap
        assert np.array_equal(outs[1][0], outs[0][0], equal_nan=True), f"{name}: T={T} o of the decode kernel"
        assert np.array_equal(outs[1][1], outs[0][1], equal_nan=True), f"{name}: T={T} (m, l) of the decode kernel"
    with pytest.raises(ValueError, match="16"):
        fg.op_attn_partial("p", xp.zeros((3, H, D), dtype=xp.float32), params, tbl, 0, part_o, part_ml, H, Hkv, D,
                           1.0, 3, tensor_cores=True, decode_kernel=True)


@pytest.mark.parametrize("n_past", (2044, 8188))
def test_attention_rows_keep_their_bits_whatever_the_launch_splits(dev, n_past):
    """A captured step launches as many key splits as its longest row takes (att_launch_splits: a
    power of two, so one graph serves a range of contexts), and from 2049 keys a row takes one split
    more every 128 keys, up to the cap (64: then the splits grow longer than 128 keys). A verify
    block whose rows straddle 2048 (8192) keys, launched with the splits its last row needs or with
    the cap, must give each row the partials and the merged output that row gets alone as a decode
    step launched with its own count: otherwise the growing context or the graph's split count
    would make verify rows drift from decode. Splits past a row's count must be empty (l = 0), and
    the merge must not depend on how many it scans."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(5)
    H, Hkv, D, T = 8, 1, 16, 8
    row_splits = [att_row_splits(n_past + t + 1, True) for t in range(T)]
    assert row_splits == ([16] * 4 + [17] * 4 if n_past == 2044 else [ATT_SPLIT_CAP_TC] * T)
    ctx = n_past + T
    kc = xp.array(rng.standard_normal((Hkv, ctx, D)).astype(np.float32))
    vc = xp.array((2 * rng.standard_normal((Hkv, ctx, D))).astype(np.float32))
    tbl = xp.array(np.array([fg.ptr(kc), fg.ptr(vc), ctx], dtype=np.uint64))
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    qg = rng.standard_normal((T, 2 * H * D)).astype(np.float32)

    def run(n0, rows, splits, tc=True):
        params = xp.array(np.array([n0, 0] + [0] * 32, dtype=np.int32))
        n = len(rows)
        part_o = xp.full((n, H, ATT_MAX_SPLITS, D), np.nan, dtype=xp.float32)
        part_ml = xp.full((n, H, ATT_MAX_SPLITS, 2), np.nan, dtype=xp.float32)
        fg.op_attn_partial("p", xp.array(q[rows]), params, tbl, 0, part_o, part_ml, H, Hkv, D, 0.25, n,
                           tensor_cores=tc, splits=splits)()
        act = ActBuffer(xp, H * D)
        fg.op_attn_combine_prep("c", part_o, part_ml, xp.array(qg[rows]), H, D, act, n, splits)()
        return _h(xp, part_o), _h(xp, part_ml), act.read_rows(n)[0]

    last = att_launch_splits(n_past + T, True)
    assert last == (32 if n_past == 2044 else ATT_SPLIT_CAP_TC)
    wide = {sp: run(n_past, list(range(T)), sp) for sp in sorted({last, ATT_SPLIT_CAP_TC})}
    for sp, (o, ml, out) in wide.items():
        for t in (0, 3, 4, T - 1):
            own = att_launch_splits(n_past + t + 1, True)
            assert own == (16 if t < 4 and n_past == 2044 else last)
            one_o, one_ml, one_out = run(n_past + t, [t], own)
            n_keys = n_past + t + 1
            chunk = -(-(-(-n_keys // att_row_splits(n_keys, True))) // 16) * 16
            n_row = -(-n_keys // chunk)                  # its splits that hold keys (fewer past the cap)
            assert np.array_equal(one_ml[0, :, :own], ml[t, :, :own]), f"{name}: row {t} (m, l), {sp} splits"
            assert np.array_equal(one_o[0, :, :n_row], o[t, :, :n_row]), f"{name}: row {t} o, {sp} splits"
            assert (ml[t, :, n_row:sp, 1] == 0).all(), f"{name}: row {t} has keys past its {n_row} splits"
            assert (ml[t, :, :n_row, 1] > 0).all()
            assert np.array_equal(one_out[0], out[t]), f"{name}: row {t} merged output, {sp} splits"
    # and the merged rows are the attention the FMA kernel (16 splits) computes
    fma = run(n_past, list(range(T)), ATT_MIN_SPLITS, tc=False)[2]
    got = fused_ref.act_values(wide[last][2], H * D)
    assert _rel(got, fused_ref.act_values(fma, H * D)) <= 1e-3
    with pytest.raises(ValueError, match="splits"):
        run(n_past, [0], ATT_SPLIT_CAP_TC * 2)


@pytest.mark.parametrize("n_past", (0, 37, 300))
def test_attention_heads_per_block_keep_the_bits(dev, n_past):
    """attn_partial takes 1..3 query heads of a KV group a block (each key's K and V loaded once
    for them all), and decode and verify may launch it with different counts: a head's partial
    (o, m, l) must be the same bits whatever the count, or verify rows would drift from decode."""
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(n_past + 1)
    T, H, Hkv, D, ctx = 3, 12, 2, 64, 400
    q = xp.array(rng.standard_normal((T, H, D)).astype(np.float32))
    kc = xp.array(rng.standard_normal((Hkv, ctx, D)).astype(np.float32))
    vc = xp.array(rng.standard_normal((Hkv, ctx, D)).astype(np.float32))
    tbl = xp.array(np.array([fg.ptr(kc), fg.ptr(vc), ctx], dtype=np.uint64))
    params = xp.array(np.array([n_past, 0] + [0] * 32, dtype=np.int32))
    outs = {}
    for R in (1, 2, 3):
        part_o = xp.full((T, H, ATT_MAX_SPLITS, D), np.nan, dtype=xp.float32)
        part_ml = xp.full((T, H, ATT_MAX_SPLITS, 2), np.nan, dtype=xp.float32)
        fg.op_attn_partial("p", q, params, tbl, 0, part_o, part_ml, H, Hkv, D, 1.0 / np.sqrt(D), T, heads=R,
                           tensor_cores=False)()
        outs[R] = (_h(xp, part_o), _h(xp, part_ml))
    for R in (2, 3):
        assert np.array_equal(outs[R][0], outs[1][0], equal_nan=True), f"{name}: o with {R} heads a block"
        assert np.array_equal(outs[R][1], outs[1][1], equal_nan=True), f"{name}: (m, l) with {R} heads a block"
    assert not np.isnan(outs[1][1][:, :, :16]).any() and np.isnan(outs[1][1][:, :, 16:]).all()   # 16 splits
    with pytest.raises(ValueError, match="heads a block"):
        fg.op_attn_partial("p", q, params, tbl, 0, part_o, part_ml, H, Hkv, D, 1.0, T, heads=4, tensor_cores=False)


def test_argmax_rows(dev):
    name, d, fg = dev
    xp = fg.xp
    x = np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32)
    x[1, 10] = x[1, 900] = 50.0          # tie: lowest index
    x[2, 7] = np.nan                     # NaN first
    x[3, :] = 1.0
    out = xp.zeros(5, dtype=xp.int32)
    fg.op_argmax("a", xp.array(x), 1000, 1000, out, 5)()
    assert _h(xp, out).tolist() == np.argmax(x, axis=1).tolist()


def test_topk_rows_select_like_the_sampler(dev):
    """topk_row against daemons.sampling.top_candidates (the sampler's own top_k rule): ties at the
    k-th value to the lowest ids, -0.0 tying 0.0, -inf tails, k up to the whole row; NaN / +inf
    counted so the caller can hand the sampler the row to reject."""
    from daemons.sampling import top_candidates
    name, d, fg = dev
    xp = fg.xp
    rng = np.random.default_rng(4)
    V = 3001 if name == "emu" else 248320
    x = rng.standard_normal((6, V)).astype(np.float32)
    x[1, rng.integers(0, V, 200)] = 1.5                    # many ties at the boundary
    x[2, :] = 0.0
    x[2, ::3] = -0.0
    x[3, 100:] = -np.inf                                   # fewer finite values than k
    x[4, :] = np.round(x[4, :] * 4) / 4                    # coarse values: ties everywhere
    x[5, 77] = np.nan
    x[5, 78] = np.inf
    xd = xp.array(x)
    for k in (1, 40, 300, V):
        ids = xp.zeros((6, k), dtype=xp.int32)
        vals = xp.zeros((6, k), dtype=xp.float32)
        meta = xp.full(6, -1, dtype=xp.int32)
        fg.op_topk("k", xd, V, V, k, ids, vals, meta, 6)()
        got_i, got_v, got_m = _h(xp, ids), _h(xp, vals), _h(xp, meta)
        assert got_m.tolist() == [0, 0, 0, 0, 0, 2], f"{name} k={k}: NaN / +inf counts {got_m}"
        for r in range(5):
            ref_i, ref_v = top_candidates(x[r], k)
            assert got_i[r].tolist() == ref_i.tolist(), f"{name} row {r} k={k}: ids differ"
            assert np.array_equal(got_v[r].view(np.uint32), ref_v.view(np.uint32)), f"{name} row {r} k={k}: values"


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU backend: {NO_GPU}")
def test_hardware_mma_matches_shuffle_mma():
    """The fragment layout tc_common.cuh assumes, checked against the hardware: the same matmul with
    mma.sync and with the shuffle-built MMA of the HIP path."""
    from kernels import cuda_backend as cb
    from kernels.cuda_backend import CudaBackend
    gpu = CudaBackend()
    fg = FusedGpu(gpu)
    xp = fg.xp
    rng = np.random.default_rng(1)
    n_out, n_in, T = 256, 1024, 13
    raw = _scaled_raw(QT_Q4_K, n_out, n_in, rng)
    w = fg.repack("w", QT_Q4_K, n_out, n_in, raw)
    ws = MmWorkspace(xp, *fg.workspace_need([w], MODE_STORE))
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    act, xr = _act(fg, x, n_in)
    y_hw = xp.zeros((T, n_out), dtype=xp.float32)
    op = fg.op_mm("t", [(w, y_hw, 0, n_out)], act, T, MODE_STORE, ws)
    op()
    y_sw = xp.zeros((T, n_out), dtype=xp.float32)
    defines = ("MM_QT=12", "MM_NT=2", "MM_MODE=0", "MMA_PORTABLE=1")
    kern = cb._MODULES.get(gpu._cp, "mma_matmul.cu", defines).get_function("mm_tc")
    args = list(op.args)
    seg = np.zeros(1, dtype=__import__("kernels.fused_gpu", fromlist=["SEG_DTYPE"]).SEG_DTYPE)
    seg[0] = (fg.ptr(w.data), fg.ptr(y_sw), n_out, w.n_tiles, n_out, 0)
    args[0] = xp.array(seg.view(np.uint8))
    fg._smem(kern, op.smem)
    kern(op.grid, op.block, tuple(args), shared_mem=op.smem)
    ref = fused_ref.mm_ref(xr, raw, QT_Q4_K, n_in)
    assert _rel(xp.asnumpy(y_hw), ref) <= 2e-6
    assert _rel(xp.asnumpy(y_sw), ref) <= 2e-6


def test_float_rows_as_f16_units_input():
    """as_f16_rows (F32 / BF16 matrices of a quantised file, headed for F16 units): BF16 converts
    exactly in f16's normal range, F32 rounds once to nearest, across the row chunks of a matrix
    too tall for one; a value beyond f16's range (or NaN) anywhere refuses the conversion."""
    from kernels.fused_gpu import QT_BF16, QT_F32, as_f16_rows
    rng = np.random.default_rng(8)
    n_out, n_in = 70_000, 128                     # 35 MB of f32: more than one 32 MB chunk
    x = (rng.standard_normal((n_out, n_in)) * 3).astype(np.float32)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    bf_vals = (bf.astype(np.uint32) << 16).view(np.float32)
    got = as_f16_rows(bf.view(np.uint8), QT_BF16, n_out, n_in).view(np.float16)
    normal = np.abs(bf_vals) >= 2.0 ** -14
    assert np.array_equal(got.astype(np.float32)[normal], bf_vals[normal])
    assert np.array_equal(as_f16_rows(x.view(np.uint8), QT_F32, n_out, n_in).view(np.float16), x.astype(np.float16))
    for bad in (7e4, np.nan, -np.inf):
        y = x.copy()
        y[n_out - 1, 3] = bad                     # in the last chunk
        assert as_f16_rows(y.view(np.uint8), QT_F32, n_out, n_in) is None
