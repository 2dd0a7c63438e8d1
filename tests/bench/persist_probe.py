"""What would a persistent decode step gain over today's chain of launches? A timing model, not dflashd.

The twenty-eighth session's decomposition (GPU_NOTES): the 27B decode graph is 6.43 ms against a 3.69 ms
bound, and ~0.95 ms of it is the boundaries of the 289 product launches alone (every product reduced to
its weight copies and every other launch left out: 4.64 ms), while one launch streams the same 15.8 GB in
3.43 ms (`stream_probe.py --mb 15800`). This probe streams the step's product weights, in the step's order
and sizes (the qwen35-27b Q4_K_M-like mix), through mm_tc's T = 1 copy pipeline (one issuer warp, a ring of
stages on full / empty mbarriers, four consumer warps) in ONE launch of 4 blocks a multiprocessor, and puts
the step's dependencies back as a grid-wide flag per product: a block's consumers start product j only once
every block has finished product j - 1, plus a fixed delay standing for the chain of small kernels between
them (RMSNorm prep, the DeltaNet conv / recurrence / gated norm, the attention chain). The issuer never
waits for a dependency (weights depend on nothing), so the ring streams the next products' weights while
the consumers wait: what a persistent step would do.

    python3 tests/bench/persist_probe.py [--stage 9216] [--stages 3 5] [--prep-us 2.5] [--dn-us 10] [--att-us 6]
        [--blocks-per-sm 4] [--groups 1] [--hold-cycles 0] [--launch-per-type] [--dynamic F ...]
        [--chain [--phases "prep=2.5;dn=3.3,2.8,2.3;att=1.4,6.9,2.1"] [--trig 12] [--phase-blocks 1 0]]
        [--act-bytes 12512]

Since the twenty-ninth session the step launches a projection of two weight types as one product
(mma_matmul.cu mm_tc_parts: 257 product launches); `--launch-per-type` models the twenty-eighth session's
step (a launch per type of a projection: 289), which its figures in GPU_NOTES were measured with.

`--dynamic F` (thirty-second session) runs the same step again with each product's first fraction F of chunks
as fixed stripes and the rest handed out from a cursor (`persist_dyn`): does handing the tail out shorten a
product's boundary? (It does not: GPU_NOTES.)

`--chain` (thirty-fourth session) puts the launch chain it replaces in the same run and the same terms: the
products as a captured graph of PDL launches of this pipeline (one a product, the ring asked for before the
dependency wait, dependents triggered `--trig` chunks before a stripe's end), each small launch of the chains as
a launch that spins its run time (`--phases`, us), against the persistent kernel with each phase run by one
block and ending in a flag. With `--hold-cycles` both forms hold every stage as long, so the difference is
what the persistent form saves with arithmetic in the stages. `--phase-blocks` (thirty-fifth session) spreads each
phase over that many blocks (0: one a multiprocessor), as the real small kernels are (gdn_recur 192 blocks, a
prep 7 a row): in the persistent form each then counts its arrival and the last raises the flag, the launch
chain's small launches get that grid; one block a phase (the default) is the persistent form's best case.

`--act-bytes` (thirty-fifth session) makes every stage also copy that many bytes of activation rows from a
buffer L2 holds, the shape of a verify step's stages (W = 23: 23 rows x 544 bytes beside a Q4_K stage's 9,216
of weights), so with `--trig -1` (wide launches trigger their dependents only at their end), the W = 23
timeline's phases and a longer hold the probe asks the same question of verify:

    python3 tests/bench/persist_probe.py --stages 2 --act-bytes 12512 --trig -1 --chain --hold-cycles 0 1650 \
        --phases "prep=3.6;dn=9.4,11.0,6.2;att=10.6,17.9,7.9" --phase-blocks 1 0

(the phases: what each small launch adds to the W = 23 step in the v24 timeline, less ~1 us, by which the T = 1
adds exceed the runs; the hold: 1,340 cycles scaled by a unit's instructions at NT = 3, ~308 against ~250. The wide
pipeline's own structure, warp 0 issuing and computing behind a block barrier a stage, is not modelled: both forms
get the decode pipeline's issuer warp, and a persistent verify kernel would have to fit NT = 3's products, 127
registers today, into the persistent block's budget.)

Prints ms a step for: the products as one stream (no dependencies), with the dependencies and no delays
(boundaries as flags), and with the delays, next to the figures of the launch chain it models.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SRC = r"""
#include "tc_common.cuh"
#define PROBE_ACT_SB 20           // --act-bytes: the superblocks of activation rows a stage cycles through (5120 columns)
typedef unsigned long long u64;
__device__ __forceinline__ u64 gtimer() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// off[0..n_prod]: the products' byte offsets in w; delay_ns[j]: the chain before product j; deps: 0 =
// one stream (no waits). count[j] / flag[j] / t_done[j]: zeroed by the host before each launch.
// A block is n_grp groups of 4 consumer warps and one issuer warp (the last); group g consumes the
// stages i with i % n_grp == g (mm_tc today: one group a block, four blocks a multiprocessor), each of
// its warps holding the stage `hold` SM cycles (standing for a unit's arithmetic) before releasing it.
__device__ __forceinline__ void consumers_sync(int n) { asm volatile("bar.sync 1, %0;" ::"r"(n) : "memory"); }
// The block's consumers (n threads) start product j only once product j - 1 is done everywhere and
// the chain of small kernels before j (delay_ns[j]) has passed since.
__device__ __forceinline__ void wait_product(int j, const unsigned* flag, const u64* t_done,
                                             const long long* delay_ns, int n) {
    if (threadIdx.x == 0) {
        while (ld_acquire(&flag[j - 1]) == 0) { }
        const u64 until = t_done[j - 1] + (u64)delay_ns[j];
        while (gtimer() < until) { }
    }
    consumers_sync(n);
}
// The block's part of product j is done: the last block to count it raises flag[j].
__device__ __forceinline__ void product_done(int j, unsigned* count, unsigned* flag, u64* t_done, int n) {
    consumers_sync(n);
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&count[j], 1u) == gridDim.x - 1) {
            t_done[j] = gtimer();
            st_release(&flag[j], 1u);
        }
    }
}
// A stage held `hold` SM clock cycles (standing for a unit's arithmetic; %globaltimer ticks too coarsely).
__device__ __forceinline__ void hold_stage(long long hold) {
    if (hold > 0) {
        const long long until = clock64() + hold;
        while (clock64() < until) { }
    }
}
// Ring stage q (the q-th chunk a block streams): its slot q % ns, refilled once the consumers have
// released the slot's previous fill; one lane of the issuer warp copies `sb` bytes from src into it.
// With ab > 0 (--act-bytes) the stage also holds ab bytes of activation rows, copied from act (a small
// buffer that stays in L2, as a launch's rows do) after the weights: a slot is then sb + ab bytes.
__device__ __forceinline__ void issue_stage(long long q, int ns, int sb, unsigned char* smem, const unsigned char* src,
                                            u64* full, u64* empty, int lane, int ab = 0,
                                            const unsigned char* act = nullptr) {
    const int k = (int)(q % ns), slot = sb + ab;
    const long long r = q / ns;
    if (r > 0) mbar_wait(&empty[k], (unsigned)(r - 1) & 1u);
    if (lane == 0) {
        mbar_expect(&full[k], (unsigned)slot);
        bulk_copy(smem + k * slot, src, (unsigned)sb, &full[k]);
        if (ab > 0) bulk_copy(smem + k * slot + sb, act + (q % PROBE_ACT_SB) * ab, (unsigned)ab, &full[k]);
    }
    __syncwarp();
}
// A consumer warp (gw of its group) waits for stage q, reads a word of it, holds it `hold` cycles and
// releases the slot; the word keeps the reads alive.
__device__ __forceinline__ unsigned consume_stage(long long q, int ns, int sb, const unsigned char* smem, int gw,
                                                  int lane, long long hold, u64* full, u64* empty, int ab = 0) {
    const int k = (int)(q % ns);
    mbar_wait(&full[k], (unsigned)(q / ns) & 1u);
    const unsigned v = *(const unsigned*)(smem + k * (sb + ab) + gw * 64 + lane * 4);
    hold_stage(hold);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_ref(&empty[k]));
    return v;
}
// --phases: the chain before product j as up to 4 phases of ph[4j + p] SM cycles, each run by thread 0 of nb
// blocks once the phase (or product) before it has raised its flag; the last of them to count itself in
// pcount[4j + p] raises pflag[4j + p], as a persistent step's small kernels spread over nb blocks would (an
// arrival and a flag round trip a phase; nb = 1: one block, no count); the consumers of j wait for the last.
// Phase p takes the blocks (p * nb + i) % G, so that consecutive phases are not run by the same blocks.
__device__ __forceinline__ void wait_phases(int j, const unsigned* flag, const long long* ph, unsigned* pflag,
                                            unsigned* pcount, int nb, int n) {
    if (threadIdx.x == 0) {
        const unsigned* prev = &flag[j - 1];
        for (int p = 0; p < 4 && ph[4 * j + p] > 0; ++p) {
            const unsigned i = (blockIdx.x + gridDim.x - (unsigned)(p * nb) % gridDim.x) % gridDim.x;
            if (i < (unsigned)nb) {
                while (ld_acquire(prev) == 0) { }
                hold_stage(ph[4 * j + p]);
                if (nb == 1) {
                    st_release(&pflag[4 * j + p], 1u);
                } else {
                    __threadfence();
                    if (atomicAdd(&pcount[4 * j + p], 1u) == (unsigned)nb - 1) st_release(&pflag[4 * j + p], 1u);
                }
            }
            prev = &pflag[4 * j + p];
        }
        while (ld_acquire(prev) == 0) { }
    }
    consumers_sync(n);
}
extern "C" __global__ void __launch_bounds__(544) persist(const unsigned char* __restrict__ w,
        const long long* __restrict__ off, int n_prod, const long long* __restrict__ delay_ns, int deps,
        int sb, int ns, int n_grp, long long hold, unsigned* count, unsigned* flag, u64* t_done, unsigned* sink,
        const long long* __restrict__ ph, unsigned* pflag, unsigned* pcount, int nb, int ab,
        const unsigned char* __restrict__ act) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 full[32], empty[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_cons = 128 * n_grp;
    const long long G = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0)
        for (int k = 0; k < ns; ++k) { mbar_init(&full[k], 1); mbar_init(&empty[k], 4); }
    __syncthreads();
    if (warp == 4 * n_grp) {                     // the issuer: every product's chunks, never waiting on a dependency
        long long i_all = 0;
        for (int j = 0; j < n_prod; ++j) {
            const long long c = (off[j + 1] - off[j]) / sb, c0 = c * b / G, c1 = c * (b + 1) / G;
            for (long long i = c0; i < c1; ++i, ++i_all)
                issue_stage(i_all, ns, sb, smem, w + off[j] + i * sb, full, empty, lane, ab, act);
        }
        return;
    }
    const int grp = warp / 4, gw = warp % 4;
    unsigned acc = 0;
    long long i_all = 0;
    for (int j = 0; j < n_prod; ++j) {
        if (deps == 1 && j > 0) wait_product(j, flag, t_done, delay_ns, n_cons);
        if (deps == 2 && j > 0) wait_phases(j, flag, ph, pflag, pcount, nb, n_cons);
        const long long c = (off[j + 1] - off[j]) / sb, c0 = c * b / G, c1 = c * (b + 1) / G;
        for (long long i = c0; i < c1; ++i, ++i_all) {
            if ((int)(i_all % n_grp) == grp)
                acc ^= consume_stage(i_all, ns, sb, smem, gw, lane, hold, full, empty, ab);
        }
        if (deps) product_done(j, count, flag, t_done, n_cons);
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;     // keeps the reads
}

// --chain: the launch chain the persistent kernel would replace, in the same terms. One launch a product
// (chain_prod: the persistent kernel's issuer and one consumer group on this product's stripe; the ring's
// weights asked for before the dependency wait, as mm_tc does, and dependents triggered once all but `trig`
// chunks of the stripe are issued, MM_TRIGGER_AHEAD), and one launch a phase of the chains (chain_small: a
// spin of the phase's cycles after its dependency wait). Both take enough dynamic shared memory that, as
// mm_tc's registers do, four product blocks fill a multiprocessor and nothing else starts there before one
// of them leaves.
extern "C" __global__ void __launch_bounds__(160) chain_prod(const unsigned char* __restrict__ w, long long c,
        int sb, int ns, long long hold, int trig, unsigned* sink, int ab, const unsigned char* __restrict__ act) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 full[32], empty[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long G = gridDim.x, b = blockIdx.x, c0 = c * b / G, c1 = c * (b + 1) / G;
    if (threadIdx.x == 0)
        for (int k = 0; k < ns; ++k) { mbar_init(&full[k], 1); mbar_init(&empty[k], 4); }
    __syncthreads();
    if (warp == 4) {
        for (long long i = c0; i < c1; ++i) {
            issue_stage(i - c0, ns, sb, smem, w + i * sb, full, empty, lane, ab, act);
            if (trig > 0 && i >= c1 - trig) trigger_dependents();
        }
        if (trig >= 0) trigger_dependents();    // trig < 0: at the block's end, as wide launches do
        return;
    }
    grid_dependency_wait();
    unsigned acc = 0;
    for (long long i = c0; i < c1; ++i)
        acc ^= consume_stage(i - c0, ns, sb, smem, warp, lane, hold, full, empty, ab);
    if (acc == 0x9e3779b9u) sink[b] = acc;
}
extern "C" __global__ void chain_small(long long cycles) {
    trigger_dependents();                        // as the step's small kernels do, at once
    grid_dependency_wait();
    if (threadIdx.x == 0) hold_stage(cycles);
    __syncthreads();
}

// The same step with part of each product's work handed out dynamically (one consumer group a block):
// the issuer streams its block's fixed stripe of the first sfrac / 1024 of product j's chunks, then takes
// each next chunk of the rest from product j's cursor (asked a stage ahead), and after product j puts an
// empty "end of j" stage in its ring, where the consumers count the block's part of j done. So a
// product ends within about a ring of chunks of its blocks, whichever of them run slow.
extern "C" __global__ void __launch_bounds__(160) persist_dyn(const unsigned char* __restrict__ w,
        const long long* __restrict__ off, int n_prod, const long long* __restrict__ delay_ns, int deps,
        int sb, int ns, long long hold, int sfrac, unsigned* count, unsigned* flag, u64* t_done, int* cursor,
        unsigned* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 full[32], empty[32];
    __shared__ long long tag[32];                // the chunk a stage holds, -1: the end of product ptag
    __shared__ int ptag[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long G = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0)
        for (int k = 0; k < ns; ++k) { mbar_init(&full[k], 1); mbar_init(&empty[k], 4); }
    __syncthreads();
    if (warp == 4) {                             // the issuer (lane 0 decides, asks the cursor a stage ahead)
        // Product j's chunks [0, S) go out as fixed stripes (S = c * sfrac / 1024), [S, c) from its cursor.
        int j = 0, pend = 0;
        long long c = 0, S = 0, s_next = 0, s_end = 0;
        auto ask = [&]() { pend = atomicAdd(&cursor[j * 32], 1); };   // a cache line a cursor
        auto start = [&]() {
            c = (off[j + 1] - off[j]) / sb;
            S = c * sfrac / 1024;
            s_next = S * b / G;
            s_end = S * (b + 1) / G;
            if (s_next == s_end) ask();
        };
        if (lane == 0) start();
        for (long long i_all = 0;; ++i_all) {
            const int k = (int)(i_all % ns);
            const long long rr = i_all / ns;
            if (rr > 0) mbar_wait(&empty[k], (unsigned)(rr - 1) & 1u);
            long long i = -1;
            int jj = j;
            if (lane == 0) {
                if (s_next < s_end) {
                    i = s_next++;
                    if (s_next == s_end) ask();  // the first dynamic chunk, asked ahead
                } else if (S + pend < c) {
                    i = S + pend;
                    ask();
                } else if (j + 1 < n_prod) {     // product j is used up: its end goes into this stage
                    ++j;
                    start();
                }
                tag[k] = i;
                ptag[k] = jj;
                if (i >= 0) {
                    mbar_expect(&full[k], (unsigned)sb);
                    bulk_copy(smem + k * sb, w + off[jj] + i * sb, (unsigned)sb, &full[k]);
                } else {
                    mbar_expect(&full[k], 0u);
                }
            }
            i = __shfl_sync(0xffffffffu, i, 0);
            jj = __shfl_sync(0xffffffffu, jj, 0);
            __syncwarp();
            if (i < 0 && jj == n_prod - 1) break;
        }
        return;
    }
    unsigned acc = 0;
    long long i_all = 0;
    int cur_j = -1;
    for (;;) {
        const int k = (int)(i_all % ns);
        const long long rr = i_all / ns;
        mbar_wait(&full[k], (unsigned)rr & 1u);
        const long long i = *(volatile long long*)&tag[k];
        const int j = *(volatile int*)&ptag[k];
        if (deps && j != cur_j && j > 0) wait_product(j, flag, t_done, delay_ns, 128);
        cur_j = j;
        if (i >= 0) {
            acc ^= *(const unsigned*)(smem + k * sb + warp * 64 + lane * 4);
            hold_stage(hold);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_ref(&empty[k]));
        ++i_all;
        if (i < 0) {
            if (deps) product_done(j, count, flag, t_done, 128);
            if (j == n_prod - 1) break;
        }
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}
"""


def step_products(prep_us: float, dn_us: float, att_us: float, launch_per_type: bool = False,
                  kinds: list | None = None):
    """(bytes, chain before it in us) of every product launch of a 27B decode step, in order: a
    projection's matrices as one launch (up to two weight types, as daemons/qwen35_gpu.py groups them),
    or as one launch per weight type (launch_per_type: the step before the twenty-ninth session).
    `kinds`, when given, receives each launch's chain: "prep", "dn", "att" or None."""
    from gguf import GGMLQuantizationType

    from daemons.bench import _matrix_type
    from daemons.synthetic import PRESETS, qwen35_tensor_shapes
    from kernels import ggml_quants
    shape = PRESETS["qwen35-27b"]
    shapes = qwen35_tensor_shapes(shape, 248320)

    def nbytes(name: str) -> tuple[int, str]:
        rows, n_in = shapes[name]
        qt = _matrix_type("q4_k_m", name, n_in, shape.n_layer)
        spec = ggml_quants.quant_spec(GGMLQuantizationType[qt])
        return rows * n_in // spec.block_size * spec.block_bytes, qt

    out = []
    chain_us = {"prep": prep_us, "dn": dn_us, "att": att_us, None: 0.0}

    def group(names, kind):
        by_type: dict[str, int] = {}
        for n in names:
            b, qt = nbytes(n)
            by_type[qt] = by_type.get(qt, 0) + b
        if not launch_per_type and len(by_type) <= 2:
            by_type = {"all": sum(by_type.values())}
        for i, b in enumerate(by_type.values()):
            out.append((b, chain_us[kind] if i == 0 else 0.0))
            if kinds is not None:
                kinds.append(kind if i == 0 else None)

    for i in range(shape.n_layer):
        p = f"blk.{i}."
        if (i + 1) % shape.full_attention_interval == 0:
            group([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], "prep")
            group([p + "attn_output.weight"], "att")
        else:
            group([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_alpha.weight", p + "ssm_beta.weight"],
                  "prep")
            group([p + "ssm_out.weight"], "dn")
        group([p + "ffn_gate.weight", p + "ffn_up.weight"], "prep")
        group([p + "ffn_down.weight"], None)
    group(["output.weight"], "prep")
    return out


def main() -> None:
    import cupy as cp
    import numpy as np
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", type=int, default=9216, help="bytes a stage (gate|up Q4_K at T = 1: 9216)")
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 5], help="ring depths to run (at most 32)")
    ap.add_argument("--prep-us", type=float, default=2.5)
    ap.add_argument("--dn-us", type=float, default=10.0)
    ap.add_argument("--att-us", type=float, default=6.0)
    ap.add_argument("--blocks-per-sm", type=int, default=4)
    ap.add_argument("--groups", type=int, default=1, help="groups of 4 consumer warps a block")
    ap.add_argument("--hold-cycles", type=int, nargs="+", default=[0],
                    help="SM cycles a stage is held by its group (T = 1 gate|up in the graph: ~1,340); "
                         "each value a run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dynamic", type=float, nargs="*", default=[],
                    help="also run each product's chunks with this fraction as fixed stripes and the rest handed "
                         "out from a cursor (0: all from the cursor; one consumer group)")
    ap.add_argument("--launch-per-type", action="store_true",
                    help="a launch per weight type of a projection (the step before the twenty-ninth session)")
    ap.add_argument("--chain", action="store_true",
                    help="also run the launch chain this kernel would replace (a captured graph with PDL: a launch "
                         "a product, a launch a phase of the chains) against the persistent kernel with each "
                         "phase ending in a flag, both with the --phases below")
    ap.add_argument("--phases", default="prep=2.5;dn=3.3,2.8,2.3;att=1.4,6.9,2.1",
                    help="us of each small launch of a chain (default: the v24 decode timeline's run times: the "
                         "preps; gdn_conv, gdn_recur, gdn_out_prep; attn_qk_rope_kv, attn_partial, attn_combine_prep)")
    ap.add_argument("--trig", type=int, default=12, help="--chain: chunks before a stripe's end that a product "
                                                          "launch triggers its dependents (MM_TRIGGER_AHEAD); "
                                                          "-1: at its blocks' end, as wide launches do")
    ap.add_argument("--phase-blocks", type=int, nargs="+", default=[1],
                    help="--chain: blocks that run each phase (each a run; 0: one a multiprocessor): a persistent "
                         "phase ends in an arrival of each and a flag, a launch of the chain has this grid")
    ap.add_argument("--act-bytes", type=int, default=0,
                    help="bytes of activation rows a stage also copies, from a buffer L2 holds (verify W = 23's "
                         "Q4_K stages: 23 x 544 = 12512)")
    args = ap.parse_args()
    # A ring slot must always go to the same group (stage i to group i % groups), or a group waits on
    # the parity of a phase another group's stage completed: --stages a multiple of --groups.
    if (not all(1 <= ns <= 32 and ns % args.groups == 0 for ns in args.stages) or not 1 <= args.groups <= 4
            or (args.dynamic and args.groups != 1)):
        sys.exit("--stages: 1 to 32 (the kernel's barrier arrays), each a multiple of --groups; --groups: 1 to 4 "
                 "(544 threads a block), 1 with --dynamic")
    if args.stage % 16 or args.act_bytes % 16 or args.act_bytes < 0 or (args.act_bytes and args.dynamic):
        sys.exit("--stage and --act-bytes: multiples of 16 (bulk copies); --act-bytes not with --dynamic")
    from kernels.cuda_backend import _inline_includes
    kinds: list = []
    prods = step_products(args.prep_us, args.dn_us, args.att_us, args.launch_per_type, kinds)
    phases_us = {kind: [float(x) for x in us.split(",")]
                 for kind, us in (item.split("=") for item in args.phases.split(";"))}
    if set(phases_us) != {"prep", "dn", "att"} or any(len(v) > 4 for v in phases_us.values()):
        sys.exit("--phases: prep=US,...;dn=US,...;att=US,... (at most 4 phases a chain)")
    sizes = [b // args.stage * args.stage for b, _ in prods]
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(off[-1])
    print(f"{len(prods)} product launches, {total / 1e9:.2f} GB a step; chains: prep {args.prep_us} us, "
          f"DeltaNet {args.dn_us} us, attention {args.att_us} us "
          f"({sum(d for _, d in prods) / 1e3:.2f} ms of chains in all)")
    dev = cp.cuda.Device()
    mod = cp.RawModule(code=_inline_includes(SRC), options=("-std=c++17",))
    k = mod.get_function("persist")
    w = cp.zeros(total, dtype=cp.uint8)
    off_d = cp.asarray(off)
    n = len(prods)
    count, flag = cp.zeros(n, dtype=cp.uint32), cp.zeros(n, dtype=cp.uint32)
    t_done = cp.zeros(n, dtype=cp.uint64)
    delays0 = cp.zeros(n, dtype=cp.int64)
    delays = cp.asarray(np.array([int(d * 1e3) for _, d in prods], dtype=np.int64))
    # --chain: each chain's phases in SM cycles (the device's rated clock), the same in both forms
    cyc_per_us = dev.attributes.get("ClockRate", 1_980_000) / 1e3
    ph_host = np.zeros((n, 4), dtype=np.int64)
    for j, kind in enumerate(kinds):
        for p, us in enumerate(phases_us.get(kind, []) if kind else []):
            ph_host[j, p] = int(us * cyc_per_us)
    ph = cp.asarray(ph_host.reshape(-1))
    pflag, pcount = cp.zeros(4 * n, dtype=cp.uint32), cp.zeros(4 * n, dtype=cp.uint32)
    n_sm = dev.attributes["MultiProcessorCount"]
    phase_blocks = [nb or n_sm for nb in args.phase_blocks]
    ab = args.act_bytes
    act = cp.zeros(max(ab, 16) * 20, dtype=cp.uint8)      # PROBE_ACT_SB superblocks of rows
    runs = (("one stream (no dependencies)", 0, delays0), ("dependencies, no chains", 1, delays0),
            ("dependencies and chains", 1, delays))

    def resident(kern, threads: int, smem: int) -> int:
        """Blocks of `kern` a multiprocessor holds at once (the occupancy calculator)."""
        n_fit = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n_fit), ctypes.c_void_p(kern.kernel.ptr), ctypes.c_int(threads), ctypes.c_size_t(smem)):
            sys.exit("the occupancy calculator failed")
        return n_fit.value

    def best_ms(launch, *zeroed, before=None) -> tuple[float, float]:
        """(min, median) ms of `reps` launches after one warm-up, `zeroed` arrays cleared before each
        and `before` queued before it, outside the timed span."""
        times = []
        for r in range(args.reps + 1):
            for a in (count, flag) + zeroed:
                a.fill(0)
            if before is not None:
                before()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            launch()
            e1.record()
            e1.synchronize()
            if r:
                times.append(cp.cuda.get_elapsed_time(e0, e1))
        return min(times), float(np.median(times))

    def fill_smem(kern, threads: int, need: int) -> int:
        """Dynamic shared memory (>= need) with which exactly --blocks-per-sm blocks of kern fit a
        multiprocessor, as mm_tc's registers make four fit and no more: a grid of that many a
        multiprocessor is then spread evenly, and nothing else starts beside them."""
        sm_smem = dev.attributes.get("MaxSharedMemoryPerMultiprocessor", 233472)
        dyn = sm_smem // args.blocks_per_sm - 2 * 32 * 8 - 1024    # the barriers; 1 KB a block is the driver's
        kern.max_dynamic_shared_size_bytes = dyn
        while dyn >= need and resident(kern, threads, dyn) < args.blocks_per_sm:
            dyn -= 1024
        if dyn < need or resident(kern, threads, dyn) != args.blocks_per_sm:
            raise ValueError(f"cannot hold exactly {args.blocks_per_sm} blocks of {need} bytes a multiprocessor")
        return dyn

    def chain_ms(ns: int, with_chains: bool, hold: int, nb: int) -> tuple[float, float]:
        """(min, median) ms of the step as a captured chain of launches with PDL (--chain)."""
        from kernels.cuda_backend import CudaBackend
        from kernels.fused_gpu import Op
        be = CudaBackend()
        kp, ks = mod.get_function("chain_prod"), mod.get_function("chain_small")
        dyn = fill_smem(kp, 160, slot * ns)
        small_smem = 8192                    # cannot start beside four product blocks
        grid = args.blocks_per_sm * n_sm
        sink = cp.zeros(grid, dtype=cp.uint32)
        ops = []
        for j in range(n):
            if with_chains:
                for cyc in ph_host[j]:
                    if cyc > 0:
                        ops.append(Op(f"phase{j}", ks, (nb,), (128,), (np.int64(cyc),), smem=small_smem))
            ops.append(Op(f"product{j}", kp, (grid,), (160,), (
                w[int(off[j]):], np.int64(sizes[j] // args.stage), np.int32(args.stage), np.int32(ns),
                np.int64(hold), np.int32(args.trig), sink, np.int32(ab), act), smem=dyn))
        g = be.capture_graph(ops)
        if not be.pdl_used:
            sys.exit(f"--chain: the graph was captured without PDL ({be.pdl_error})")
        # behind a busy-wait: the graph's ~700 launches are queued before it starts
        return best_ms(lambda: be.launch_graph(g), before=lambda: be.busy_wait(2e-3))

    slot = args.stage + ab
    for hold, ns in itertools.product(args.hold_cycles, args.stages):
        smem = slot * ns
        threads = 32 * (4 * args.groups + 1)
        if smem > 48 * 1024:
            k.max_dynamic_shared_size_bytes = smem
        # every block must be resident at once (they wait for each other): the grid is what fits
        per_sm = resident(k, threads, smem)
        grid = min(args.blocks_per_sm, per_sm) * dev.attributes["MultiProcessorCount"]
        sink = cp.zeros(grid, dtype=cp.uint32)
        print(f"stage {args.stage} B (+ {ab} B of rows) x {ns}, {args.groups} consumer group(s) a block, hold {hold} "
              f"cycles: {per_sm} blocks a multiprocessor resident, grid {grid}")
        for label, deps, dl in runs:
            lo, med = best_ms(lambda: k((grid,), (threads,), (
                w, off_d, np.int32(n), dl, np.int32(deps), np.int32(args.stage), np.int32(ns), np.int32(args.groups),
                np.int64(hold), count, flag, t_done, sink, ph, pflag, pcount, np.int32(1), np.int32(ab), act),
                shared_mem=smem))
            print(f"stage {args.stage} B x {ns}: {label:30s} {lo:6.3f} ms (median {med:.3f})")
        if args.chain and per_sm < args.blocks_per_sm:
            print(f"stage {args.stage} B x {ns}: no launch chain (fewer than {args.blocks_per_sm} blocks fit)")
        elif args.chain:
            lo, med = chain_ms(ns, False, hold, 1)
            print(f"stage {args.stage} B x {ns}: {'launch chain, products only':44s} {lo:6.3f} ms (median {med:.3f})")
            # the persistent kernel padded like the chain's product blocks: exactly --blocks-per-sm a
            # multiprocessor (with less shared memory more fit, and the grid may then land unevenly)
            try:
                smem_fill = fill_smem(k, threads, smem)
            except ValueError as e:
                print(f"stage {args.stage} B x {ns}: no persistent form with phases ({e})")
                phase_blocks_run = []
            else:
                phase_blocks_run = phase_blocks
            for nb in phase_blocks_run:
                lo, med = best_ms(lambda: k((grid,), (threads,), (
                    w, off_d, np.int32(n), delays0, np.int32(2), np.int32(args.stage), np.int32(ns),
                    np.int32(args.groups), np.int64(hold), count, flag, t_done, sink, ph, pflag, pcount,
                    np.int32(min(nb, grid)), np.int32(ab), act), shared_mem=smem_fill), pflag, pcount)
                label = f"dependencies, phases as flags ({nb} bl.)"
                print(f"stage {args.stage} B x {ns}: {label:44s} {lo:6.3f} ms (median {med:.3f})")
                lo, med = chain_ms(ns, True, hold, nb)
                label = f"launch chain, phases as launches ({nb} bl.)"
                print(f"stage {args.stage} B x {ns}: {label:44s} {lo:6.3f} ms (median {med:.3f})")
        kd = mod.get_function("persist_dyn")        # one consumer group a block (160 threads)
        if smem > 48 * 1024:
            kd.max_dynamic_shared_size_bytes = smem
        cursor = cp.zeros(n * 32, dtype=cp.int32)    # a cache line a product's cursor
        for frac in args.dynamic:
            for label, deps, dl in runs:
                lo, med = best_ms(lambda: kd((grid,), (160,), (
                    w, off_d, np.int32(n), dl, np.int32(deps), np.int32(args.stage), np.int32(ns),
                    np.int64(hold), np.int32(round(frac * 1024)), count, flag, t_done, cursor, sink),
                    shared_mem=smem), cursor)
                print(f"stage {args.stage} B x {ns}, {frac:.2f} fixed, rest from a cursor: {label:30s} "
                      f"{lo:6.3f} ms (median {med:.3f})")
    if not ab:
        print("the launch chain it models (twenty-eighth session, decode graph): products as copies, no other launch "
              "4.64 ms; products as copies with the step's other launches 5.21 ms")


if __name__ == "__main__":
    main()
