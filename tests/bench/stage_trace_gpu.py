"""Where a decode-width matmul's stages spend their time, inside the step's CUDA graph and alone
(issue 8: the T = 1 products run at ~2.5 TB/s in the graph; GPU_NOTES, nineteenth session).

    python3 tests/bench/stage_trace_gpu.py [--reps 4] [--path /tmp/qwen35-27b-q4km.gguf]
        [--variant MM_NO_COMPUTE=1,MM_NO_EXCHANGE=1] [--all-blocks] [--launch ffn_down] [--width 23]

--width W traces the verify step of W tokens instead of the decode step (its launches of ceil(W / 8)
column tiles; gate|up alone then at T = W too). At T > 8 computing warp 0 also issues the copies,
behind a block barrier a stage, with one stage in flight behind the one computed (two stages fit
four blocks a multiprocessor): a wait near 0 beside a long hold says the wide product computes,
a long wait that it waits for its copies (GPU_NOTES, thirty-sixth session).

--launch traces the decode graph's launches whose label holds that text instead of gate|up's, one table
per weight type (ffn_down: its Q4_K and its Q6_K launches, the same shape and stage count, side by side:
GPU_NOTES, twenty-ninth session), and skips the launch alone.

--all-blocks traces every block of the gate|up launches (their first stages only) and prints where
the slow ones sit: by multiprocessor, by a block's arrival rank on its multiprocessor, by its place
in the grid (GPU_NOTES, twenty-second session: the rank decides, the multiprocessor hardly).

Every mm_tc launch is built with -DMM_STAGE_TRACE (kernels/mma_matmul.cu): 8 blocks of each
launch record, in their multiprocessor's clock, when each stage's copy was issued (the issuer warp),
when computing warp 0 began waiting for it, passed that wait and released the stage, and when the
block passed its dependency wait and ended. The gate|up launches (Q4_K SwiGLU) of a replayed decode
step are then set beside the same shape launched alone, 20 times back to back. `--variant` adds
defines to the gate|up launches of both (e.g. the pipeline's copies alone).

Per stage (means over the traced blocks and launches, in microseconds at the clock the records
themselves measure against %globaltimer):
  issue->pass   from the copy's issue to warp 0 passing its wait: the copy's latency whenever the
                warp had to wait (wait > 0), else an upper bound
  wait          how long warp 0 waited for the stage to land (0: it was there before the warp)
  hold          from passing the wait to releasing the stage (warp 0's reads of it)
  refill        from warp 0's release to the issue of the stage's next copy (the other three
                warps' releases and the issuer's own turn)
  between       from warp 0's release to its wait for the next stage (its min term and scaling;
                at T > 8 also the block barrier and its issue of the next copy)
and per block: dep wait (entry to the dependency wait passed), run (that to the block's end).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kernels.fused_gpu as fused_gpu                                    # noqa: E402
from daemons.bench import _sync                                          # noqa: E402
from kernels import cuda_backend as cb                                   # noqa: E402
from kernels import ggml_quants                                          # noqa: E402

from tests.bench.profile_gpu_step import _model                         # noqa: E402

ST_SLOTS, ST_BLOCKS, ST_STAGES, ST_HEAD = 512, 8, 48, 10                 # kernels/mma_matmul.cu
ST_REC = ST_HEAD + 4 * ST_STAGES
TRACE = "MM_STAGE_TRACE"
# --all-blocks: every block of each traced launch (MM_BLOCKS_PER_SM a multiprocessor), its first
# stages only, in 1024 launch slots (where the tail comes from)
ALL_SLOTS, ALL_STAGES = 1024, 4


def _tables(cp, want: tuple[str, ...], with_defines: bool = False) -> list:
    """The trace table of every compiled mm_tc module whose defines include all of `want` (with
    with_defines: (defines, table) pairs)."""
    out = []
    with cb._MODULES._lock:
        mods = [(d, m) for (src, d), m in cb._MODULES._cache.items()
                if src == "mma_matmul.cu" and all(w in d for w in want)]
    for d, m in mods:
        ptr = m.get_global("mm_st_tab")
        t = cp.ndarray((ST_SLOTS * ST_BLOCKS, ST_REC), dtype=cp.uint32, memptr=ptr)
        out.append((d, t) if with_defines else t)
    return out


def _records(cp, tables) -> np.ndarray:
    """The records of blocks that recorded (stripe length > 0), each with its block index (the
    record's place in its launch's slot) appended as a last column."""
    rows = [cp.asnumpy(t) for t in tables]
    r = np.concatenate(rows) if rows else np.zeros((0, ST_REC), dtype=np.uint32)
    blk = (np.arange(len(r)) % ST_BLOCKS).astype(np.uint32)[:, None]
    r = np.concatenate([r, blk], axis=1)
    return r[r[:, 4] > 0]


def per_sm(title: str, recs: np.ndarray, rep: np.ndarray) -> None:
    """Where a launch's slow blocks sit (records of every block: --all-blocks): on the same
    multiprocessors launch after launch, or by their arrival on their multiprocessor."""
    r = recs.astype(np.int64)
    d = lambda a, b: (a - b) & 0xFFFFFFFF     # noqa: E731
    ghz = float(np.sum(d(r[:, 3], r[:, 1])) / max(1, np.sum(d(r[:, 7], r[:, 6]))))
    loop = d(r[:, 8], r[:, 2]) / ghz / 1e3
    launch = r[:, 0] + (rep.astype(np.int64) << 32)
    ids = np.unique(launch)
    sm, blk = r[:, 9], r[:, -1]
    n_sm = int(sm.max()) + 1
    rel = np.zeros(len(r))                      # a block's loop minus its launch's median
    end_rank = np.zeros(len(r))                 # 0 for the launch's first block to end, 1 for its last
    rank_entry = np.zeros(len(r), dtype=np.int64)
    rank_index = np.zeros(len(r), dtype=np.int64)
    spread_in, distinct_gen = [], []
    for gid in ids:
        m = np.nonzero(launch == gid)[0]
        rel[m] = loop[m] - np.median(loop[m])
        end_rank[m] = np.argsort(np.argsort(d(r[m, 7], np.min(r[m, 6])))) / max(1, len(m) - 1)
        for s_ in np.unique(sm[m]):             # the launch's blocks on one multiprocessor
            mm = m[sm[m] == s_]
            rank_entry[mm] = np.argsort(np.argsort(d(r[mm, 6], np.min(r[mm, 6])), kind="stable"), kind="stable")
            rank_index[mm] = np.argsort(np.argsort(blk[mm], kind="stable"), kind="stable")
            if len(mm) > 1:
                spread_in.append(np.ptp(loop[mm]))
            distinct_gen.append(len(np.unique(blk[mm] // n_sm)) == len(mm))
    # a multiprocessor's mean of rel over even and over odd launches: repeatable if they correlate
    par = np.searchsorted(ids, launch) % 2
    means = np.full((2, n_sm), np.nan)
    for h in range(2):
        for s_ in range(n_sm):
            m = (par == h) & (sm == s_)
            if m.any():
                means[h, s_] = rel[m].mean()
    ok = ~np.isnan(means).any(axis=0)
    corr = float(np.corrcoef(means[0, ok], means[1, ok])[0, 1]) if ok.sum() > 2 else float("nan")
    both = np.nanmean(means, axis=0)
    print(f"== {title}: {len(ids)} launches, {len(r)} block records, {ok.sum()} multiprocessors, clock {ghz:.2f} GHz")
    print(f"   stage loop p10/p50/p90/max {np.percentile(loop, 10):.2f} / {np.percentile(loop, 50):.2f} / "
          f"{np.percentile(loop, 90):.2f} / {np.max(loop):.2f} us; spread within a launch (p90 - p10 of loop - median) "
          f"{np.percentile(rel, 90) - np.percentile(rel, 10):.2f} us")
    print(f"   a multiprocessor's mean (loop - launch median): sd across multiprocessors {np.nanstd(both):.2f} us, "
          f"even-launch / odd-launch correlation {corr:.2f} (near 1: the same multiprocessors are slow every time)")
    order = np.argsort(both[ok])
    smids = np.arange(n_sm)[ok]
    print(f"   slowest multiprocessors (id: us) {', '.join(f'{smids[i]}: {both[ok][i]:+.2f}' for i in order[::-1][:12])}")
    print(f"   fastest multiprocessors (id: us) {', '.join(f'{smids[i]}: {both[ok][i]:+.2f}' for i in order[:12])}")
    print(f"   blocks of one launch on one multiprocessor: loop spread mean {np.mean(spread_in):.2f} us "
          f"(p90 {np.percentile(spread_in, 90):.2f}); blocks a multiprocessor a launch "
          f"{len(r) / len(ids) / max(1, ok.sum()):.2f}")
    c_blk = float(np.corrcoef(blk, rel)[0, 1])
    c_dep = float(np.corrcoef(d(r[:, 2], r[:, 1]), rel)[0, 1])
    print(f"   correlation of (loop - median) with the block index {c_blk:.2f}, with its dependency wait {c_dep:.2f}; "
          f"the last 5% to end: mean (loop - median) {rel[end_rank >= 0.95].mean():+.2f} us")
    gen = blk * 4 // (int(blk.max()) + 1)
    for name, col in (("quarter of the grid (block index * 4 // grid)", gen),
                      ("arrival rank on its multiprocessor", rank_entry),
                      ("index rank on its multiprocessor", rank_index)):
        g = [f"{v}: {rel[col == v].mean():+.2f} ({loop[col == v].mean():.2f})" for v in np.unique(col)]
        print(f"   (loop - median) and loop by {name}: {', '.join(g)} us")
    print(f"   a multiprocessor's blocks from distinct quarters of the grid in {np.mean(distinct_gen):.0%} of launches")


def summarise(title: str, recs: np.ndarray, rep: np.ndarray | None = None) -> None:
    """Prints the stage table of the records (rep: each record's replay, for grouping by launch)."""
    rep = np.zeros(len(recs), dtype=np.int64) if rep is None else rep
    if not len(recs):
        print(f"== {title}: no records")
        return
    r = recs.astype(np.int64)
    d = lambda a, b: (a - b) & 0xFFFFFFFF     # noqa: E731  (32-bit clock differences)
    cyc = d(r[:, 3], r[:, 1]).astype(float)
    ns = d(r[:, 7], r[:, 6]).astype(float)
    ok = ns > 0
    ghz = float(np.sum(cyc[ok]) / np.sum(ns[ok])) if ok.any() else 1.98
    us = lambda c: c / ghz / 1e3               # noqa: E731
    n_st = int(np.median(r[:, 4]))
    depth = int(np.median(r[:, 5]))
    ev = r[:, ST_HEAD:ST_REC].reshape(len(r), ST_STAGES, 4)       # issue, wait begin, passed, released
    print(f"== {title}: {len(r)} block records, stripes of {n_st} stages, {depth} in flight, clock {ghz:.2f} GHz")
    exch = us(d(r[:, 3], r[:, 8]).astype(float))
    print(f"   dep wait {us(np.mean(d(r[:, 2], r[:, 1]))):6.2f} us   run {us(np.mean(d(r[:, 3], r[:, 2]))):6.2f} us   "
          f"of which after the stage loop (cut row blocks) mean {np.mean(exch):.2f}, p90 {np.percentile(exch, 90):.2f}, "
          f"max {np.max(exch):.2f} us")
    loop = us(d(r[:, 8], r[:, 2]).astype(float))
    print(f"   stage loops p10/p50/p90/max {np.percentile(loop, 10):.2f} / {np.percentile(loop, 50):.2f} / "
          f"{np.percentile(loop, 90):.2f} / {np.max(loop):.2f} us")
    print(f"   {'stage':>5s} {'issue->pass':>11s} {'wait':>7s} {'hold':>7s} {'refill':>7s} {'between':>7s}   (us)")
    n = min(n_st, ST_STAGES)
    tot = np.zeros(5)
    for i in range(n):
        lat = us(np.mean(d(ev[:, i, 2], ev[:, i, 0])))
        wait = us(np.mean(d(ev[:, i, 2], ev[:, i, 1])))
        hold = us(np.mean(d(ev[:, i, 3], ev[:, i, 2])))
        refill = us(np.mean(d(ev[:, i + depth, 0], ev[:, i, 3]))) if i + depth < n else float("nan")
        between = us(np.mean(d(ev[:, i + 1, 1], ev[:, i, 3]))) if i + 1 < n else float("nan")
        tot += (lat, wait, hold, 0 if np.isnan(refill) else refill, 0 if np.isnan(between) else between)
        if i < 6 or i >= n - 3 or i % 4 == 0:
            print(f"   {i:5d} {lat:11.2f} {wait:7.2f} {hold:7.2f} {refill:7.2f} {between:7.2f}")
    print(f"   sums: wait {tot[1]:.2f} us, hold {tot[2]:.2f} us, between {tot[4]:.2f} us over {n} stages; "
          f"mean issue->pass {tot[0] / n:.2f} us, refill {tot[3] / max(n - depth, 1):.2f} us")
    # Across the traced blocks of one launch (%globaltimer, ns): how far apart they start and end,
    # and the spread of their runs (dependency wait passed to end, own clock).
    run_us = us(d(r[:, 3], r[:, 2]).astype(float))
    starts, ends, spans = [], [], []
    launch = r[:, 0] + (rep.astype(np.int64) << 32)     # a graph replays its launches with the same grid ids
    for gid in np.unique(launch):
        m = launch == gid
        if m.sum() < 2:
            continue
        t0, t1 = r[m, 6], r[m, 7]
        starts.append(float(np.max(d(t0, np.min(t0)))) / 1e3)
        ends.append(float(np.max(d(t1, np.min(t1)))) / 1e3)
        spans.append(float(np.max(d(t1, np.min(t0)))) / 1e3)
    if starts:
        print(f"   per launch ({len(starts)}): entry spread {np.mean(starts):.2f} us, end spread {np.mean(ends):.2f} us, "
              f"first entry to last end {np.mean(spans):.2f} us; block runs p10/p50/p90/max "
              f"{np.percentile(run_us, 10):.2f} / {np.percentile(run_us, 50):.2f} / {np.percentile(run_us, 90):.2f} / {np.max(run_us):.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--path", default=None)
    ap.add_argument("--variant", default="", help="defines for the gate|up launches, comma-separated")
    ap.add_argument("--all-blocks", action="store_true",
                    help="trace every block's first stages and print where the slow blocks sit")
    ap.add_argument("--launch", default=None,
                    help="trace the decode graph's launches whose label holds this text (one table per weight type)")
    ap.add_argument("--width", type=int, default=1,
                    help="the step's tokens: 1 = the decode step, more = the verify step of that many (1..32)")
    args = ap.parse_args()
    if not 1 <= args.width <= fused_gpu.MAX_T:
        ap.error(f"--width must be 1..{fused_gpu.MAX_T}")
    T = args.width
    nt = f"MM_NT={-(-T // 8)}"
    graph = "the decode graph" if T == 1 else f"the verify graph (W={T})"
    mode, logits = ("advance", "last") if T == 1 else ("verify", "all")
    extra = tuple(v for v in args.variant.split(",") if v)
    if args.all_blocks:
        global ST_SLOTS, ST_BLOCKS, ST_STAGES, ST_REC
        import cupy
        n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        ST_SLOTS, ST_BLOCKS, ST_STAGES = ALL_SLOTS, fused_gpu.MM_BLOCKS_PER_SM * n_sm, ALL_STAGES
        ST_REC = ST_HEAD + 4 * ST_STAGES
        extra += (f"ST_SLOTS={ST_SLOTS}", f"ST_BLOCKS={ST_BLOCKS}", f"ST_STAGES={ST_STAGES}")
    op_mm = fused_gpu.FusedGpu.op_mm

    def traced(self, label, segs, act, T, mode, ws, out_act=None, variant=()):
        if args.launch is None:
            variant = tuple(variant) + (TRACE,) + (extra if mode == fused_gpu.MODE_SWIGLU else ())
        elif args.launch in label:
            variant = tuple(variant) + (TRACE,) + extra
        return op_mm(self, label, segs, act, T, mode, ws, out_act=out_act, variant=variant)

    fused_gpu.FusedGpu.op_mm = traced
    model = _model("qwen35-27b-q4km", args.path, "cuda:0")
    b, step = model.backend, model.gpu_step
    cp = b.xp
    rng = np.random.default_rng(0)
    context = model.new_state(256 + 40)
    model.prefill(rng.integers(0, model.n_vocab, 256).tolist(), context, logits="last")
    step.ops_for(T, mode, logits, n_keys=context.n_past + T)               # builds the step's plan
    key = step.plan_key(T, mode, logits, context.n_past + T)
    state = context.copy()
    step._bind(state)
    for _ in range(2):
        state.copy_from(context)
        step._launch(key, None)
    _sync(b)
    if args.launch is not None:
        pairs = _tables(cp, (nt, TRACE), with_defines=True)
        recs = {d: [] for d, _ in pairs}
        for _ in range(args.reps):
            state.copy_from(context)
            for _, t in pairs:
                t.fill(0)
            _sync(b)
            step._launch(key, None)
            _sync(b)
            for d, t in pairs:
                recs[d].append(_records(cp, [t]))
        for d, rs in recs.items():
            rep = np.concatenate([np.full(len(x), i) for i, x in enumerate(rs)])
            kind = " ".join(x for x in d if x.startswith(("MM_QT", "MM_MODE")))
            summarise(f"'{args.launch}' T={T} in {graph} ({kind}) {' '.join(extra)}", np.concatenate(rs), rep)
        return
    want = ("MM_QT=12", nt, "MM_MODE=2", TRACE)
    tables = _tables(cp, want)
    recs = []
    for _ in range(args.reps):
        state.copy_from(context)
        for t in tables:
            t.fill(0)
        _sync(b)
        step._launch(key, None)
        _sync(b)
        recs.append(_records(cp, tables))
    rep = np.concatenate([np.full(len(x), i) for i, x in enumerate(recs)])
    if args.all_blocks:
        per_sm(f"gate|up T={T} in {graph}, every block", np.concatenate(recs), rep)
        return
    summarise(f"gate|up T={T} in {graph} {' '.join(extra)}", np.concatenate(recs), rep)

    # The same shape alone: 20 launches back to back (tests/bench/bench_mm_gpu.py's case).
    fg = fused_gpu.FusedGpu(b)
    n_out, n_in = 17408, 5120
    pool = ggml_quants.random_raw(12, 256, n_in, rng, scale_range=(2.0 ** -16, 2.0 ** -13))
    raw = np.tile(pool, (n_out // 256 + 1, 1))[:n_out]
    ws_ = [fg.repack("w", 12, n_out, n_in, raw), fg.repack("u", 12, n_out, n_in, raw)]
    act = fused_gpu.ActBuffer(cp, n_in)
    act.x16[...] = cp.asarray(rng.standard_normal(act.x16.shape).astype(np.float16).view(np.uint16))
    out_act = fused_gpu.ActBuffer(cp, n_out)
    need_f, need_c = fg.workspace_need(ws_, fused_gpu.MODE_SWIGLU)
    ws = fused_gpu.MmWorkspace(cp, need_f, need_c)
    op = fg.op_mm("gate|up", [(w, None, 0, n_out) for w in ws_], act, T, fused_gpu.MODE_SWIGLU, ws, out_act=out_act)
    for _ in range(3):
        op()
    _sync(b)
    tables = _tables(cp, want)
    for t in tables:
        t.fill(0)
    _sync(b)
    for _ in range(20):
        op()
    _sync(b)
    summarise(f"gate|up T={T} alone, 20 launches back to back {' '.join(extra)}", _records(cp, tables))


if __name__ == "__main__":
    main()
