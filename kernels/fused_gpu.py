"""Launch builders for the GPU step: tensor-core weights (kernels/mma_matmul.cu) and the fused
kernels (kernels/fused.cu), as prepared launches ("ops") with fixed buffers and arguments.

A model's GPU step (daemons/qwen35_gpu.py) is a list of ops; running the list is one forward, and
capturing it once per (batch width, mode) as a CUDA graph makes later steps a single graph launch.
Everything that changes between steps lives in device memory the ops read: the params block
(positions, the rollback length, token ids) and the state table (pointers into the bound state).

`FusedGpu` needs from its device object only `xp` (array module), `_kernel(source, name,
defines)`, `ptr(array)` and `multiprocessors`: `kernels.cuda_backend.CudaBackend` on a GPU, and
`tests.emu.EmuDevice` (the same kernel sources built for the CPU) in the CPU test suite.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["FusedGpu", "TcWeight", "ActBuffer", "Op", "MmWorkspace", "TC_TYPES", "MAX_T", "UNIT_BYTES",
           "MODE_STORE", "MODE_ADD", "MODE_SWIGLU", "MM_BLOCKS_PER_SM", "mm_grid_blocks", "mm_smem_bytes",
           "TC_TYPE_NAMES"]

MAX_T = 32                          # activation rows one launch handles (4 MMA column tiles)
QT_F16, QT_Q8_0, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ4_XS = 1, 8, 12, 13, 14, 23
UNIT_BYTES = {QT_F16: 8192, QT_Q8_0: 4352, QT_Q4_K: 2304, QT_Q5_K: 2816, QT_Q6_K: 3360, QT_IQ4_XS: 2176}
TC_TYPES = tuple(UNIT_BYTES)
TC_TYPE_NAMES = {QT_F16: "F16", QT_Q8_0: "Q8_0", QT_Q4_K: "Q4_K", QT_Q5_K: "Q5_K", QT_Q6_K: "Q6_K",
                 QT_IQ4_XS: "IQ4_XS"}
_GGUF_BLOCK = {QT_F16: (1, 2), QT_Q8_0: (32, 34), QT_Q4_K: (256, 144), QT_Q5_K: (256, 176), QT_Q6_K: (256, 210),
               QT_IQ4_XS: (256, 136)}
QT_F32, QT_BF16 = 0, 30
# Float matrices of a quantised file join the tensor-core path as F16 units, converted on the host
# (`as_f16_rows`); a file whose matrices are all float keeps the plain layout (daemons/qwen35.py).
TC_FLOAT_TYPES = (QT_F32, QT_BF16)
MODE_STORE, MODE_ADD, MODE_SWIGLU = 0, 1, 2
MM_THREADS = 128
FUSED_THREADS = 256
SEG_DTYPE = np.dtype([("w", "<u8"), ("y", "<u8"), ("n_rows", "<i4"), ("n_tiles", "<i4"), ("ldy", "<i4"),
                      ("pad", "<i4")])
# mma_matmul.cu MmPhase: one product of an mm_chain launch (FusedGpu.op_mm_chain)
PHASE_DTYPE = np.dtype([("segs", "<u8"), ("x16", "<u8"), ("xs", "<u8"), ("ws", "<u8"), ("counters", "<u8"),
                        ("out16", "<u8"), ("outxs", "<u8"), ("kind", "<i4"), ("n_segs", "<i4"), ("n_sb", "<i4"),
                        ("T", "<i4"), ("gx", "<i4"), ("split", "<i4"), ("n_segs_a", "<i4"), ("n_rb_a", "<i4"),
                        ("x", "<u8"), ("w", "<u8"), ("acc", "<u8"), ("x_out", "<u8"), ("acc_zero", "<u8"),
                        ("eps", "<f4"), ("K", "<i4"), ("ld", "<i4"), ("d", "<i4"), ("tbl", "<u8"), ("out", "<u8"),
                        ("nk", "<i4"), ("nv", "<i4"), ("dk", "<i4"), ("dv", "<i4"), ("ab", "<u8"), ("dt_bias", "<u8"),
                        ("ssm_a", "<u8"), ("state_save", "<u8"), ("ab_clear", "<u8"), ("slot", "<i4"), ("pad_", "<i4")])
MM_CHAIN_PREP = 255                 # mma_matmul.cu: a phase that is a prep (RMSNorm of one row), not a product
MM_CHAIN_GNORM = 254                # ... DeltaNet's gated norm of one row (gdn_out_prep)
MM_CHAIN_RECUR = 253                # ... DeltaNet's recurrence for one token (gdn_recur)
MM_CHAIN_CONV = 252                 # ... DeltaNet's causal conv and gates for one token (gdn_conv)
MM_CHAIN_SCRATCH = 8192 - 1024      # mma_matmul.cu: a chain block's scratch for its small phases (bytes)
MM_CHAIN_HEADER = 8192              # mma_matmul.cu: the chain block's barriers and small state, after its ring
MM_CHAIN_MAX_KINDS = 12             # mma_matmul.cu MM_CHAIN_K0 .. K11
# A/B knobs of op_mm_chain (ab_bench.sh 'def:CHAIN_STEP=2+def:MM_CHAIN_SPREAD=8'): the counts of a phase's
# finished blocks spread over this many lines (block b counts in line b % spread: hundreds of arrivals on one
# address queue at its L2 slice), and a waiter's pause between two looks at them (ns; 0: none).
MM_CHAIN_SPREAD = 1
MM_CHAIN_POLL_NS = 0
# A failure hunt (tests/bench/chain_step_check_gpu.py --give-up): a chain's wait that runs out of patience
# records what it waited for and gives up instead of trapping (mma_matmul.cu mm_chain_stuck; results wrong,
# the device usable): FusedGpu.chain_stuck reads the record.
MM_CHAIN_GIVE_UP = False
MM_CHAIN_SEEN_MAX = 1024            # mma_matmul.cu: the blocks a give-up record's progress copy holds
# A/B knob (ab_bench.sh def:MM_CHAIN_PDL=False): a chain launched with programmatic dependent launch (its blocks
# placed while the launch before it drains) or plainly (on drained multiprocessors, which then take the shared-
# memory configuration the chain asks for).
MM_CHAIN_PDL = True
# A chain is launched as a cooperative grid (CUDA's guarantee that every block is resident at once, which a
# chain's phase counts assume), with programmatic dependent launch where MM_CHAIN_PDL (both launch attributes).
# Without it a chain placed beside its predecessor's blocks from PDL graphs could stay one block short of its
# grid for good (the give-up record: block 527 never started, one multiprocessor holding three chain blocks)
# and hang; with it the chained step ran bit-identical (GPU_NOTES, forty-first session). False: the failure hunt
# (chain_step_check_gpu.py --no-cooperative).
MM_CHAIN_COOPERATIVE = True
# A/B knob (ab_bench.sh def:MM_CHAIN_FLAG=True; bench_chain_gpu.py --spread flag): a phase's waiters look at a flag
# that its last arrival raises, not at the count (mma_matmul.cu MM_CHAIN_FLAG; the counts then on one line).
MM_CHAIN_FLAG = False
GDN_COLS = 32
GDN_PARTS = 8                       # fused.cu GDN_PARTS: lanes per value column
GDN_RPT = (1, 4, 8, 16, 32)         # gdn_recur_r* (decode) / _w* (wider): d_k <= GDN_PARTS * RPT
GDN_CHUNK = 32                      # fused.cu GDN_CHUNK: tokens staged at once (at most)
GDN_CONV_TOKENS = 4                 # gdn_conv: tokens a block computes in a verify step
# attn_partial's key splits (fused.cu, same names): a row of n keys takes clamp(ceil(n / ATT_SPLIT_KEYS),
# ATT_MIN_SPLITS, cap) splits, cap = ATT_SPLIT_CAP_FMA or ATT_SPLIT_CAP_TC by kernel family; the partials
# are laid out with a stride of ATT_MAX_SPLITS. The tensor-core kernels walk a split's tiles in series,
# so long rows need more of them. H200, 27B, 16K keys, graph ms (twelfth session): decode 10.14 with 16
# splits, 8.60 with 64, 8.97 with 128 (FMA kernel, 16 splits: 8.24); verify W=23 21.56 / 19.84 / 20.52
# (FMA 25.94). The FMA kernel runs 384 blocks at 16 already, and more split it no faster.
ATT_MIN_SPLITS = 16
ATT_MAX_SPLITS = 128
ATT_SPLIT_KEYS = 128
ATT_SPLIT_CAP_FMA = 16
ATT_SPLIT_CAP_TC = 64
ATT_HEADS = (1, 2, 3)               # query heads a block of attn_partial can take (fused.cu attn_partial_g<R>)
ATT_HEADS_DECODE = 1                # at most this many at T = 1, ATT_HEADS_WIDE at T > 1
ATT_HEADS_WIDE = 3
# attn_partial_tc / _tcd for every width (decode and verify must agree) where the head size allows.
# H200, 27B (tests/bench/GPU_NOTES.md, twelfth session; two runs): verify graph W=16-32 -0.3 to -0.7 ms
# and W=23 -0.03 to -0.5 ms at 512 keys, W=23 -0.6 ms at 4K and -6 ms at 16K (with the splits growing
# past 2K keys); decode +0.08 ms at 512 keys, +0.2 at 4K, +0.36 at 16K.
ATT_TENSOR_CORES = True
ATT_TC_S_LD = 24                    # fused.cu ATT_TC_S_LD: the score halves' row stride
# m-tiles of 16 (row, head) pairs a verify attention block (fused.cu attn_partial_tc<MT>: 1 or 2), whose
# warps share each staged K / V tile: 2 halves a verify step's K / V reads from L2 and its blocks, and holds
# 8 warps a multiprocessor (two blocks; registers) where 1 holds 6 (three; shared memory). The same bits
# either way. H100, 27B, against 1 (tests/bench/GPU_NOTES.md, forty-fourth session; three calls): verify
# graph W=23 -0.16 to -0.18 ms at 512 keys and -0.23 at 2048, W=32 -0.03 / -0.51, W=8 and W=16 +0.03 to
# +0.05 at 512 keys (their blocks fit one wave either way) but W=16 -0.30 at 2048; decode unchanged.
ATT_TC_MTILES = 2
ATT_TCD_CHUNK = 2                   # fused.cu ATT_TCD_CHUNK: tiles a stage of attn_partial_tcd holds
PREP_COLS = 256                     # columns per block of the act16-writing kernels (fused.cu)
PREP_SMEM_CLUSTER = (1024 + 8 * 4 + 4) * 4   # fused.cu PREP_SMEM_CLUSTER
ARGMAX_CHUNKS = 64                  # blocks per row of argmax_rows


MM_B_ROW = 256                      # halves per staged activation row (mma_matmul.cu)
TOPK_THREADS = 512                  # fused.cu TOPK_THREADS
TOPK_MAX = 4096                     # the most candidates a step hands to the host sampler
MM_SMEM_TARGET = 46 * 1024          # stages per thread block: four blocks per multiprocessor
MM_MAX_STAGES = 3                   # mma_matmul.cu MM_MAX_STAGES
# Launches of one row (decode's products) use mma_matmul.cu's MM_ONE_ROW build: T and the offsets it sets
# are constants (the second halves of the staged rows 256 bytes on), the same arithmetic. ab_bench.sh
# def:ONE_ROW_BUILD=False times the general build at T = 1.
ONE_ROW_BUILD = True
# Launches of more than 8 rows (verify widths) use a build for their exact row count (mma_matmul.cu
# MM_T_CONST): the same arithmetic with the stage's offsets constant, ~2% fewer instructions a stage.
# H100, against the general build (GPU_NOTES, forty-seventh session): verify W=23 graph -0.195 ms, W=16
# -0.09, decode unchanged. Each new width compiles its products once (~1 s an instantiation; CuPy keeps
# them on disk). ab_bench.sh def:WIDE_T_CONST=False times the general build. The CPU emulator (tests/emu)
# runs the general build unless WIDE_T_CONST_EMU: a build of its own for every width cost the CPU suite
# ~4 minutes of C++ compiles for no speed; tests/test_fused_kernels.py holds the two builds equal.
WIDE_T_CONST = True
WIDE_T_CONST_EMU = False


PREP_BLOCKS = 128                   # prep_rows: about this many blocks a launch (one wave on an H200)
PREP_MAX_COLS = 1024                # prep_rows: columns one block writes at most (fused.cu)


def attn_heads_per_block(group: int, T: int) -> int:
    """The query heads of one KV group an attn_partial block takes: each key's K and V rows then
    serve that many heads from registers (H200, 27B: verify W=23 up to 0.2 ms shorter with 3; 6 no
    better), where decode keeps one a block for more blocks in its short launches."""
    cap = ATT_HEADS_DECODE if T == 1 else ATT_HEADS_WIDE
    return max(r for r in ATT_HEADS if r <= cap and group % r == 0)


def att_row_splits(n_keys: int, tensor_cores: bool) -> int:
    """The splits of a row with n_keys keys (fused.cu att_split_range)."""
    cap = ATT_SPLIT_CAP_TC if tensor_cores else ATT_SPLIT_CAP_FMA
    return min(cap, max(ATT_MIN_SPLITS, -(-n_keys // ATT_SPLIT_KEYS)))


def att_launch_splits(n_keys: int, tensor_cores: bool) -> int:
    """An attn_partial grid's splits for rows of up to n_keys keys: the power of two from 16 that
    covers the longest row's (a captured step is replayed while the context grows; one graph per
    doubling)."""
    n = att_row_splits(max(1, n_keys), tensor_cores)
    return min(ATT_MAX_SPLITS, 1 << (n - 1).bit_length())


def prep_block_cols(K: int, n_rows: int, col_blocks: int | None = None) -> int:
    """Columns per block of a prep_rows launch over n_rows rows of K: 256 (PREP_COLS) while the
    launch has at most PREP_BLOCKS blocks, wider for more rows (up to PREP_MAX_COLS), since every
    block reads its whole row for the sum of squares; col_blocks asks for that many blocks a row."""
    chunks = -(-K // PREP_COLS)
    per = -(-chunks // col_blocks) if col_blocks else max(1, -(-(n_rows * chunks) // PREP_BLOCKS))
    return min(per, chunks, PREP_MAX_COLS // PREP_COLS) * PREP_COLS


PREP_CLUSTER_MAX = 8                # fused.cu prep_rows_cly<N>: column blocks a row's cluster holds at most


def prep_cluster_cols(K: int, n_rows: int, col_blocks: int | None = None) -> int | None:
    """Columns per block of the cluster prep (fused.cu prep_rows_cly<N>: the column blocks of a row
    share their chunk sums instead of each reading the whole row): prep_block_cols' split, widened
    until a row's blocks fit one cluster; None when a row is one block (nothing to share) or has
    more than 32 chunks."""
    chunks = -(-K // PREP_COLS)
    # (7 blocks of 768 columns at decode ran the 27B's graph 0.05-0.09 ms faster than 5 of 1024, H200)
    cpb = max(prep_block_cols(K, n_rows, col_blocks) // PREP_COLS, -(-chunks // PREP_CLUSTER_MAX))
    if chunks > 32 or cpb > PREP_MAX_COLS // PREP_COLS or -(-chunks // cpb) < 2:
        return None
    return cpb * PREP_COLS


def mm_smem_bytes(qtype: int, T: int, stages: int | None = None) -> int:
    """Dynamic shared memory of an mm_tc launch of T rows (mma_matmul.cu MmGeom: stages x stage)."""
    has_min = qtype in (12, 13)
    stage = 4 * UNIT_BYTES[qtype] + T * MM_B_ROW * 2 + (T * 32 if has_min else 0)
    stage = (stage + 127) // 128 * 128
    if stages is None:
        stages = max(2, min(MM_MAX_STAGES, MM_SMEM_TARGET // stage))
    return stages * stage


def as_f16_rows(raw: np.ndarray, qtype: int, n_out: int, n_in: int) -> np.ndarray | None:
    """F32 / BF16 GGUF rows (uint8 [n_out, row bytes]) as F16 rows (uint8 [n_out, 2 * n_in]), or
    None when a value is beyond f16's range (|w| > 65504, or not finite). BF16 converts exactly
    wherever f16 is normal (|w| >= 2^-14: its 8-bit mantissa fits f16's 10); F32 rounds once (2^-11
    relative), far below the quantisation error of the matrices around it in a quantised file; values
    under 2^-14 keep an absolute error <= 2^-25."""
    if qtype not in TC_FLOAT_TYPES:
        raise ValueError(f"type {qtype} is not a float type")
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1)
    out = np.empty((n_out, n_in), dtype=np.float16)
    step = max(1, (32 << 20) // (4 * n_in))        # rows per chunk: a 2.5 GB LM head needs no 5 GB copy
    for r0 in range(0, n_out, step):
        rows = b[r0:r0 + step]
        vals = (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if qtype == QT_BF16 else rows.view(np.float32)
        if not (np.abs(vals) <= 65504.0).all():    # NaN fails too
            return None
        out[r0:r0 + step] = vals
    return out.view(np.uint8)


# Thread blocks of an mm_tc launch per multiprocessor: 4 are resident at once. 8 (two waves, the
# hardware handing each later stripe to whichever slot frees first) ran the 27B decode graph 0.83 ms
# slower: every block pays its pipeline's fill (GPU_NOTES, twentieth session).
MM_BLOCKS_PER_SM = 4


def mm_workspace_size(gx: int, n_rb: int, T: int) -> tuple[int, int]:
    """(floats, counters) an mm_tc launch of gx blocks over n_rb row blocks needs for T rows: two
    partial row blocks per block, a counter per row block."""
    return 2 * gx * T * 64, n_rb


def mm_grid_blocks(n_rb: int, n_sb: int, n_sm: int, per_sm: int = MM_BLOCKS_PER_SM) -> int:
    """Thread blocks of an mm_tc launch: MM_BLOCKS_PER_SM per multiprocessor, at least 4
    superblocks of work each. A function of the matrix only, never of the batch width (rows stay
    batch-invariant)."""
    return max(1, min(per_sm * n_sm, (n_rb * n_sb) // 4))


def mm_parts(weights: Sequence[Any], mode: int, n_sm: int, per_sm: int = MM_BLOCKS_PER_SM) -> list[tuple[int, int]]:
    """(thread blocks, row blocks) of each part of an mm_tc launch: the weights of its first type,
    then those of its second (mma_matmul.cu MM_QT2). A launch of one type is mm_grid_blocks' grid;
    two types share that grid in proportion to their row blocks, so every block walks about as
    many (row block, superblock) stages as in a launch of one type, each part keeping at least one
    block and at most one per 4 of its stages. (In proportion to their bytes instead, a Q6_K
    stage being 1.46 times a Q4_K one, the 27B decode graph ran 0.03-0.07 ms slower: at decode a
    block's ring delivers a stage every ~1-1.3 us whatever its bytes, so a block's time follows its
    stages; GPU_NOTES, twenty-ninth session.) A function of the matrices only, never of the batch
    width (rows stay batch-invariant)."""
    types = list(dict.fromkeys(w.qtype for w in weights))
    n_sb = weights[0].n_sb
    if mode == MODE_SWIGLU:
        n_rbs = [-(-weights[0].n_tiles // 2)]
    else:
        n_rbs = [sum(-(-w.n_tiles // 4) for w in weights if w.qtype == t) for t in types]
    if len(n_rbs) == 1:
        return [(mm_grid_blocks(n_rbs[0], n_sb, n_sm, per_sm), n_rbs[0])]
    gx = mm_grid_blocks(sum(n_rbs), n_sb, n_sm, per_sm)
    cap = [max(1, n * n_sb // 4) for n in n_rbs]
    ga = min(cap[0], max(1, round(gx * n_rbs[0] / sum(n_rbs))))
    gb = min(cap[1], max(1, gx - ga))
    return [(ga, n_rbs[0]), (gb, n_rbs[1])]


def _variant_int(variant: Sequence[str], name: str, default):
    """The value of a benchmark define NAME=<int> in a variant's define set, else default."""
    return next((int(v.split("=", 1)[1]) for v in variant if v.startswith(name + "=")), default)


@dataclass(frozen=True, eq=False)
class TcWeight:
    """A matrix (n_out, n_in) in the tensor-core unit layout of kernels/mma_matmul.cu: the GGUF block
    bytes of each 16-row x 256-column unit, reordered (same size, nothing dequantised)."""

    name: str
    qtype: int
    n_out: int
    n_in: int
    n_sb: int
    n_tiles: int
    nbytes: int        # bytes of the GGUF matrix (what a step reads)
    data: Any          # uint8 device array: (n_tiles rounded up to a multiple of 4) * n_sb * UNIT_BYTES[qtype]

    @property
    def type_name(self) -> str:
        return TC_TYPE_NAMES[self.qtype]


class ActBuffer:
    """Activation rows in the tensor-core layout, superblock-major (tc_common.cuh act_index /
    xs_index): per superblock the block sums of its MAX_T rows (16 halves a row, rows in reverse
    order), then the T rows a step writes cut in halves: the T first halves (stored positions 0..127 of
    each row: k-step pairs 0..3), then the T second halves (odd rows with the two 64-byte halves of every
    128 bytes swapped), so a launch's rows and their sums are one contiguous run. `x16` [n_sb][MAX_T][256]
    (the rows' region; a row's halves are not where this shape puts them once T > 1) and `xs`
    [n_sb][MAX_T][16] are views of `buf`; kernels take `x16` and `buf` (the sums' base) as pointers.
    Allocated zeroed; columns past K are never written, so they stay zero (the weights there are zero
    too). `write_rows` / `read_rows` convert from / to the row-major
    form of kernels/fused_ref.act_layout (tests, host-side checks)."""

    def __init__(self, xp, K: int):
        if K % 8:
            raise ValueError(f"activation rows of {K} values: the tensor-core layout needs a multiple of 8")
        self.xp = xp
        self.K = int(K)
        self.n_sb = -(-self.K // 256)
        self.ld16 = self.n_sb * 256
        xs_rows = MAX_T * 16 // 256                       # the sums of a superblock fill 2 rows of 256
        self.buf = xp.zeros((self.n_sb, xs_rows + MAX_T, 256), dtype=xp.uint16)
        self.x16 = self.buf[:, xs_rows:]
        # each superblock's rows' region as one flat run (a 2-D slice of buf: a view)
        self._rows = self.buf.reshape(self.n_sb, (xs_rows + MAX_T) * 256)[:, xs_rows * 256:]
        # (splitting the contiguous last 512 halves of each superblock: a view, never a copy)
        self.xs = self.buf[:, :xs_rows].reshape(self.n_sb, MAX_T, 16)[:, ::-1]

    @staticmethod
    def positions(T: int) -> np.ndarray:
        """[T, 256]: where position p of row t of a T-row step sits in a superblock's rows' region
        (tc_common.cuh act_index): stored position q = p ^ 32 on odd rows, q's half first."""
        t = np.arange(T)[:, None]
        q = np.arange(256)[None, :] ^ (32 * (t & 1))
        return (q >> 7) * (T * 128) + t * 128 + (q & 127)

    def write_rows(self, x16: np.ndarray, xs: np.ndarray) -> None:
        """Rows 0..T-1 from row-major x16 [T, >= ld16] and xs [T, >= n_sb * 16] (uint16)."""
        x16 = np.asarray(x16, dtype=np.uint16)[:, :self.ld16]
        xs = np.asarray(xs, dtype=np.uint16)[:, :self.n_sb * 16]
        T = x16.shape[0]
        region = np.zeros((self.n_sb, T * 256), dtype=np.uint16)
        region[:, self.positions(T).ravel()] = x16.reshape(T, self.n_sb, 256).transpose(1, 0, 2).reshape(self.n_sb, -1)
        self._rows[:, :T * 256] = self.xp.asarray(region)
        self.xs[:, :T] = self.xp.asarray(xs.reshape(T, self.n_sb, 16).transpose(1, 0, 2))

    def read_rows(self, T: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows 0..T-1 of a T-row step as row-major host arrays (x16 [T, ld16], xs [T, n_sb * 16])."""
        get = (lambda a: a.get()) if hasattr(self.x16, "get") else np.asarray
        region, sums = get(self._rows[:, :T * 256]), get(self.xs[:, :T])
        x16 = region[:, self.positions(T).ravel()].reshape(self.n_sb, T, 256).transpose(1, 0, 2).reshape(T, -1)
        return np.ascontiguousarray(x16), np.ascontiguousarray(sums.transpose(1, 0, 2)).reshape(T, self.n_sb * 16)


class MmWorkspace:
    """Split-K partial sums and the per-row-block counters shared by every matmul of a step (the
    launches run one after another; the last block of each row block resets its counter)."""

    def __init__(self, xp, n_floats: int, n_counters: int):
        self.ws = xp.zeros(max(1, n_floats), dtype=xp.float32)
        self.counters = xp.zeros(max(1, n_counters), dtype=xp.int32)


@dataclass
class Op:
    """One prepared kernel launch."""

    label: str
    kernel: Any
    grid: tuple
    block: tuple
    args: tuple
    smem: int = 0
    weight_bytes: int = 0
    keep: tuple = field(default_factory=tuple)     # device arrays the arguments point into
    # The kernel calls grid_dependency_wait() before reading what earlier launches wrote, so it may
    # be launched with programmatic dependent launch (kernels/cuda_backend.py launch_pdl).
    pdl: bool = True
    # An mm_tc launch's (qtype, second qtype or 0, mode, variant defines), or the phase-table fields of a
    # one-row launch mma_matmul.cu's mm_chain can run as a phase (kind MM_CHAIN_PREP / GNORM / RECUR / CONV):
    # what op_mm_chain needs to run it in a chain.
    mm_kind: tuple = ()
    chain_phase: dict = field(default_factory=dict)
    # Launched as a cooperative grid (every block resident at once: mm_chain with MM_CHAIN_COOPERATIVE).
    cooperative: bool = False

    def __call__(self) -> None:
        if self.cooperative:
            # CuPy's RawKernel passes its own (constructor's) cooperative flag on to the compiled
            # Function, so a cooperative launch of a module's kernel goes to that Function directly
            fn = getattr(self.kernel, "kernel", self.kernel)
            fn(tuple(self.grid), tuple(self.block), self.args, shared_mem=self.smem, enable_cooperative_groups=True)
        else:
            self.kernel(self.grid, self.block, self.args, shared_mem=self.smem)


class FusedGpu:
    def __init__(self, dev: Any):
        self.dev = dev
        self.xp = dev.xp
        self.n_sm = int(getattr(dev, "multiprocessors", 132))
        # thread-block clusters (sm_90; the emulator runs them too): fused.cu's *_cly<N> kernels
        self.clusters = bool(getattr(dev, "supports_clusters", False))

    def _k(self, source: str, name: str, defines: tuple[str, ...] = ()):
        return self.dev._kernel(source, name, defines)

    def ptr(self, a) -> int:
        return int(self.dev.ptr(a))

    def _smem(self, kern, nbytes: int) -> None:
        """Allow `nbytes` of dynamic shared memory (beyond 48 KB minus the kernel's static shared
        memory, a launch needs the function attribute raised)."""
        if nbytes > 0 and hasattr(kern, "max_dynamic_shared_size_bytes"):
            if kern.max_dynamic_shared_size_bytes < nbytes:
                kern.max_dynamic_shared_size_bytes = nbytes

    # -- weights --------------------------------------------------------------------------------
    def repack_tensor(self, tensor: Any) -> TcWeight | None:
        """A GGUF matrix in the tensor-core layout, or None when it has none (its type, a row that is
        not a whole number of 8 columns, a float value beyond f16's range): the backend then keeps
        the plain layout for it. Both GPU backends load their matrices through this."""
        ne = tuple(int(n) for n in tensor.ne)
        qtype = int(tensor.qtype)
        if len(ne) != 2 or ne[0] % 8:
            return None
        n_in, n_out = ne
        raw = np.asarray(tensor.raw)
        if qtype in TC_FLOAT_TYPES:
            raw = as_f16_rows(raw, qtype, n_out, n_in)
            if raw is None:
                return None
            qtype = QT_F16
        if qtype not in UNIT_BYTES:
            return None
        return self.repack(str(tensor.name), qtype, n_out, n_in, raw)

    def repack(self, name: str, qtype: int, n_out: int, n_in: int, raw: np.ndarray) -> TcWeight:
        """GGUF rows raw uint8 [n_out, row_bytes] -> TcWeight (done on the device)."""
        xp = self.xp
        qtype = int(qtype)
        if qtype not in UNIT_BYTES:
            raise ValueError(f"weight '{name}': type {qtype} has no tensor-core layout")
        bw, bb = _GGUF_BLOCK[qtype]
        if n_in % bw:
            raise ValueError(f"weight '{name}': {n_in} columns is not a multiple of the block size {bw}")
        row_bytes = n_in // bw * bb
        raw = np.ascontiguousarray(raw)
        if raw.dtype != np.uint8 or raw.shape != (n_out, row_bytes):
            raise ValueError(f"weight '{name}': raw bytes {raw.dtype}{list(raw.shape)}, expected uint8[{n_out}, {row_bytes}]")
        n_sb = -(-n_in // 256)
        n_tiles = -(-n_out // 16)
        unit = UNIT_BYTES[qtype]
        n_words = -(-n_tiles // 4) * 4 * n_sb * unit // 4     # tiles in groups of four (mma_matmul.cu unit_index)
        out = xp.zeros(n_words * 4, dtype=xp.uint8)
        raw_dev = xp.asarray(raw)
        grid = (max(1, min(-(-n_words // 256), 1 << 16)),)
        base = (raw_dev, out, np.int32(n_out), np.int32(row_bytes), np.int32(n_sb))
        if qtype == QT_Q4_K:
            self._k("mma_matmul.cu", "repack_q4_k")(grid, (256,), base + (np.int64(n_words),))
        elif qtype == QT_Q5_K:
            self._k("mma_matmul.cu", "repack_q5_k")(grid, (256,), base + (np.int64(n_words),))
        elif qtype == QT_Q6_K:
            self._k("mma_matmul.cu", "repack_q6_k")(grid, (256,), base + (np.int64(n_words),))
        elif qtype == QT_IQ4_XS:
            self._k("mma_matmul.cu", "repack_iq4_xs")(grid, (256,), base + (np.int64(n_words),))
        elif qtype == QT_Q8_0:
            self._k("mma_matmul.cu", "repack_q8_0")(grid, (256,), base + (np.int32(n_in // 32), np.int64(n_words)))
        else:
            self._k("mma_matmul.cu", "repack_f16")(grid, (256,), base + (np.int32(n_in), np.int64(n_words)))
        del raw_dev
        return TcWeight(str(name), qtype, int(n_out), int(n_in), n_sb, n_tiles, n_out * row_bytes, out)

    # -- matmul ---------------------------------------------------------------------------------
    def units_to_f16(self, w: TcWeight, out, tile0: int = 0, n_tiles: int | None = None) -> None:
        """Rows 16 * tile0 .. 16 * (tile0 + n_tiles) of `w` dequantised into out, a C-contiguous
        uint16 (f16 bits) array [16 * n_tiles, n_sb * 256] (mma_matmul.cu units_f16_*: the weights
        the MMA path multiplies, each rounded to f16 once; rows past n_out and columns past n_in
        are zero). The wide-batch product (kernels/cuda_backend.py) multiplies such a slice with
        cuBLAS."""
        n_tiles = w.n_tiles - tile0 if n_tiles is None else int(n_tiles)
        if not (0 <= tile0 and 1 <= n_tiles and tile0 + n_tiles <= w.n_tiles):
            raise ValueError(f"{w.name}: tiles {tile0}..{tile0 + n_tiles} outside 0..{w.n_tiles}")
        ld = w.n_sb * 256
        if (tuple(out.shape) != (16 * n_tiles, ld) or out.dtype != self.xp.uint16
                or not out.flags.c_contiguous):
            raise ValueError(f"{w.name}: out must be C-contiguous uint16 [{16 * n_tiles}, {ld}], got "
                             f"{out.dtype}{list(out.shape)}")
        n_units = n_tiles * w.n_sb
        grid = (max(1, min(-(-n_units // 4), 16 * self.n_sm)),)
        self._k("mma_matmul.cu", f"units_f16_{TC_TYPE_NAMES[w.qtype].lower()}")(
            grid, (128,), (w.data, out, np.int32(w.n_sb), np.int32(tile0), np.int32(n_tiles), np.int32(ld)))

    def mm_grid(self, weights: Sequence[TcWeight], mode: int, per_sm: int = MM_BLOCKS_PER_SM) -> tuple[int, int]:
        """(thread blocks, row blocks) of a launch over `weights` (per_sm: benchmarks' MM_GRID)."""
        parts = mm_parts(weights, mode, self.n_sm, per_sm)
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def workspace_need(self, weights: Sequence[TcWeight], mode: int) -> tuple[int, int]:
        """(floats, counters) a launch needs at the widest batch: two partial row blocks per thread
        block, a counter per row block."""
        return mm_workspace_size(*self.mm_grid(weights, mode), MAX_T)

    def op_mm(self, label: str, segs: Sequence[tuple[TcWeight, Any, int, int]], act: ActBuffer, T: int, mode: int,
              ws: MmWorkspace, out_act: ActBuffer | None = None, variant: tuple[str, ...] = ()) -> Op:
        """y = act @ W.T for each segment (weight, y array, element offset into y, row stride of y);
        all weights share n_in and at most two types (STORE / ADD: the segments of each type form
        one part of the grid, mm_parts). MODE_ADD: y is an int64 fixed-point accumulator that the
        launch adds round(y * 2^32) into (op_prep_rows folds it into the residual). MODE_SWIGLU:
        segs = (gate, up) of one type, output into out_act."""
        xp = self.xp
        types = list(dict.fromkeys(s[0].qtype for s in segs))
        segs = [s for t in types for s in segs if s[0].qtype == t]        # the first type's part, then the second's
        weights = [s[0] for s in segs]
        qt, n_sb = weights[0].qtype, weights[0].n_sb
        if any(w.n_sb != n_sb for w in weights) or len(types) > 2 or (len(types) > 1 and mode == MODE_SWIGLU):
            raise ValueError(f"{label}: one launch needs one width and one type, or two types outside SwiGLU "
                             f"({[(w.name, TC_TYPE_NAMES.get(w.qtype, w.qtype)) for w in weights]})")
        if n_sb != act.n_sb:
            raise ValueError(f"{label}: activations of {act.K} columns for weights of {weights[0].n_in}")
        if not 1 <= T <= MAX_T:
            raise ValueError(f"{label}: T={T} outside 1..{MAX_T}")
        if mode == MODE_SWIGLU and (len(segs) != 2 or weights[0].n_out != weights[1].n_out or out_act is None):
            raise ValueError(f"{label}: SwiGLU needs gate and up of one shape and an output buffer")
        nt = -(-T // 8)
        per_sm = _variant_int(variant, "MM_GRID", MM_BLOCKS_PER_SM)
        parts = mm_parts(weights, mode, self.n_sm, per_sm)
        gx, n_rb = sum(p[0] for p in parts), sum(p[1] for p in parts)
        table = np.zeros(len(segs), dtype=SEG_DTYPE)
        keep = [act.buf]
        for i, (w, y, off, ldy) in enumerate(segs):
            want = "int64" if mode == MODE_ADD else "float32"       # ADD: a fixed-point accumulator
            if y is not None and str(y.dtype) != want:
                raise ValueError(f"{label}: output {y.dtype}, this mode writes {want}")
            table[i]["w"] = self.ptr(w.data)
            table[i]["y"] = (self.ptr(y) + y.itemsize * int(off)) if y is not None else 0
            table[i]["n_rows"] = w.n_out
            table[i]["n_tiles"] = w.n_tiles
            table[i]["ldy"] = int(ldy)
            keep += [w.data] + ([y] if y is not None else [])
        seg_dev = xp.asarray(table.view(np.uint8))
        keep.append(seg_dev)
        need_f, need_c = mm_workspace_size(gx, n_rb, T)
        if ws.ws.size < need_f or ws.counters.size < need_c:
            raise ValueError(f"{label}: workspace too small")
        if getattr(self.dev, "name", "") == "hip" and "MM_ISSUER_WARP=0" not in variant:
            variant = tuple(variant) + ("MM_ISSUER_WARP=0",)       # mma_matmul.cu: no issuer warp on HIP
        if ONE_ROW_BUILD and T == 1 and "MM_ONE_ROW=1" not in variant:
            variant = tuple(variant) + ("MM_ONE_ROW=1",)
        if (WIDE_T_CONST and T > 8 and (WIDE_T_CONST_EMU or getattr(self.dev, "name", "") != "emu")
                and not any(v.startswith("MM_T_CONST=") for v in variant)):
            variant = tuple(variant) + (f"MM_T_CONST={T}",)
        second = (f"MM_QT2={types[1]}",) if len(types) > 1 else ()
        kern = self._k("mma_matmul.cu", "mm_tc", (f"MM_QT={qt}",) + second + (f"MM_NT={nt}", f"MM_MODE={mode}")
                       + tuple(variant))
        stages = _variant_int(variant, "MM_STAGES", None)
        separate_issuer = nt == 1 and "MM_ISSUER_WARP=0" not in variant      # mma_matmul.cu MM_SEPARATE_ISSUER
        smem = max(mm_smem_bytes(t, T, stages) for t in types)
        # benchmarks: MM_SMEM_EXTRA=N pads the launch's shared memory (fewer blocks a multiprocessor)
        smem += _variant_int(variant, "MM_SMEM_EXTRA", 0)
        self._smem(kern, smem)
        out16 = out_act.x16 if out_act is not None else None
        outxs = out_act.buf if out_act is not None else None
        n_segs_a = sum(1 for w in weights if w.qtype == qt)
        args = (seg_dev, np.int32(len(segs)), act.x16, act.buf, np.int32(n_sb), np.int32(T), ws.ws, ws.counters, out16,
                outxs, np.int32(parts[0][0]), np.int32(n_segs_a), np.int32(parts[0][1]))
        return Op(label, kern, (gx,), (MM_THREADS + (32 if separate_issuer else 0),), args, smem,
                  sum(w.nbytes for w in weights), tuple(keep),
                  mm_kind=(qt, types[1] if len(types) > 1 else 0, mode, tuple(variant)))

    def op_mm_chain(self, label: str, ops: Sequence[Op]) -> Op:
        """The one-row launches `ops` (in order: op_mm products of T = 1, and the small launches whose
        Op.chain_phase says a chain can run them) as one persistent launch (mma_matmul.cu mm_chain): each
        block walks every product's stripe in turn, each product on its own launch's grid and stripes,
        and a small phase's blocks run it as its launch's blocks would, so every output is bit-identical to
        running the launches in order. An A/B candidate for the decode step (tests/bench/bench_chain_gpu.py,
        qwen35_gpu.CHAIN_STEP); nothing may run between two of its phases. Launched with programmatic
        dependent launch like the products (it waits for the launch before it, and lets the next one start
        at its last product's end); every block must be resident at once (at most four a multiprocessor:
        refused where the driver says fewer fit)."""
        xp = self.xp
        if not ops:
            raise ValueError(f"{label}: no products")
        kinds: list[tuple[int, int, int]] = []
        table = np.zeros(len(ops), dtype=PHASE_DTYPE)
        stage = 0
        keep: list[Any] = []
        for i, op in enumerate(ops):
            if op.chain_phase:
                row = table[i]
                for name, v in op.chain_phase.items():
                    row[name] = v
                keep += list(op.keep) + [a for a in op.args if getattr(a, "ndim", 0)]
                continue
            if not op.mm_kind:
                raise ValueError(f"{label}: {op.label} is neither a tensor-core product nor a chain phase")
            qt, qt2, mode, variant = op.mm_kind
            (segs, n_segs, x16, xs, n_sb, T, ws, counters, out16, outxs, split, n_segs_a, n_rb_a) = op.args
            if int(T) != 1 or "MM_ONE_ROW=1" not in variant or op.block[0] != MM_THREADS + 32:
                raise ValueError(f"{label}: {op.label}: a chain runs decode's one-row products (T = 1, the issuer warp)")
            if [v for v in variant if v != "MM_ONE_ROW=1"]:
                raise ValueError(f"{label}: {op.label}: benchmark variant {variant} in a chain")
            if (qt, qt2, mode) not in kinds:
                kinds.append((qt, qt2, mode))
            if len(kinds) > MM_CHAIN_MAX_KINDS:
                raise ValueError(f"{label}: more than {MM_CHAIN_MAX_KINDS} kinds of product")
            row = table[i]
            for name, a in (("segs", segs), ("x16", x16), ("xs", xs), ("ws", ws), ("counters", counters),
                            ("out16", out16), ("outxs", outxs)):
                row[name] = self.ptr(a) if a is not None else 0
            row["kind"] = kinds.index((qt, qt2, mode))
            for name, v in (("n_segs", n_segs), ("n_sb", n_sb), ("T", T), ("split", split), ("n_segs_a", n_segs_a),
                            ("n_rb_a", n_rb_a)):
                row[name] = int(v)
            row["gx"] = op.grid[0]
            stage = max([stage] + [mm_smem_bytes(q, 1, 1) for q in (qt, qt2) if q])    # one stage of each type
            keep += list(op.keep)
        if stage == 0:
            raise ValueError(f"{label}: no products")
        n_stages = max(2, min(MM_MAX_STAGES, MM_SMEM_TARGET // stage))
        grid = max(int(r["gx"]) for r in table)
        if grid > MM_BLOCKS_PER_SM * self.n_sm:
            raise ValueError(f"{label}: {grid} blocks cannot all be resident")
        defines = ("MM_CHAIN=1", "MM_ONE_ROW=1") + tuple(
            f"MM_CHAIN_K{i}={qt},{qt2},{mode}" for i, (qt, qt2, mode) in enumerate(kinds)) + (
            ("MM_CHAIN_GIVE_UP=1",) if MM_CHAIN_GIVE_UP else ()) + (("MM_CHAIN_FLAG=1",) if MM_CHAIN_FLAG else ())
        kern = self._k("mma_matmul.cu", "mm_chain", defines)
        smem = MM_CHAIN_HEADER + n_stages * stage
        self._smem(kern, smem)
        per_sm = getattr(self.dev, "resident_blocks", lambda *a: None)(kern, MM_THREADS + 32, smem)
        if per_sm is not None and grid > per_sm * self.n_sm:     # its blocks wait for each other: a hang
            raise ValueError(f"{label}: {grid} blocks of mm_chain, {per_sm} resident a multiprocessor "
                             f"({smem} bytes of shared memory each)")
        phases = xp.asarray(table.view(np.uint8))
        spread = 1 if MM_CHAIN_FLAG else max(1, min(int(MM_CHAIN_SPREAD), grid))
        # the phases' counts, the end count, then (MM_CHAIN_FLAG) the phases' flags, then (MM_CHAIN_GIVE_UP) a
        # word of progress for each block (mma_matmul.cu mm_chain)
        if MM_CHAIN_GIVE_UP and grid > MM_CHAIN_SEEN_MAX:
            raise ValueError(f"{label}: a give-up build's record holds {MM_CHAIN_SEEN_MAX} blocks, not {grid}")
        done = xp.zeros(32 * (spread * len(ops) + 1 + (len(ops) if MM_CHAIN_FLAG else 0))
                        + (grid if MM_CHAIN_GIVE_UP else 0), dtype=xp.int32)
        args = (phases, np.int32(len(ops)), done, np.int32(stage), np.int32(n_stages), np.int32(spread),
                np.int32(MM_CHAIN_POLL_NS))
        op = Op(label, kern, (grid,), (MM_THREADS + 32,), args, smem, sum(op.weight_bytes for op in ops),
                tuple(keep) + (phases, done), pdl=bool(MM_CHAIN_PDL), cooperative=bool(MM_CHAIN_COOPERATIVE))
        op.chain_defines = defines               # (chain_stuck: the module's record)
        return op

    def chain_stuck(self, op: Op, stream: Any = None) -> dict | None:
        """An MM_CHAIN_GIVE_UP chain's record of the first wait that gave up (None: none did, or it was another
        chain's: the record is one for every chain of the same build): the block and thread that waited, the
        phase (the one whose count of finished blocks it waited for), the counts it last saw against the grid;
        cleared after reading unless `stream` is given (a side stream on which to read it while the device
        still runs a launch that never ends). A CUDA device only (a module global)."""
        from kernels.cuda_backend import _MODULES
        if "MM_CHAIN_GIVE_UP=1" not in getattr(op, "chain_defines", ()):
            raise ValueError(f"{op.label}: not built with MM_CHAIN_GIVE_UP")
        xp = self.xp
        mod = _MODULES.get(xp, "mma_matmul.cu", op.chain_defines)
        rec_dev = xp.ndarray((16,), dtype=xp.int32, memptr=mod.get_global("mm_chain_stuck"))
        rec = [int(v) for v in rec_dev.get(stream=stream)]
        if stream is not None:
            stream.synchronize()
        done = op.args[2]
        dep = (rec[3] & 0xffffffff) | ((rec[4] & 0xffffffff) << 32)
        off = (dep - self.ptr(done)) // 4
        if rec[0] == 0 or not 0 <= off < done.size:
            return None
        if stream is None:
            rec_dev[...] = 0
        spread = rec[6]
        n_phases = int(op.args[1])
        flag = "MM_CHAIN_FLAG=1" in op.chain_defines       # dep: a flag (counts: the flag's value), after the counts
        phase = off // 32 - n_phases - 1 if flag else off // (32 * spread)
        # the blocks' progress when the wait gave up: (multiprocessor << 16) | 0x8000 (started) | phases past
        seen_dev = xp.ndarray((MM_CHAIN_SEEN_MAX,), dtype=xp.int32, memptr=mod.get_global("mm_chain_seen"))
        seen = [int(v) for v in seen_dev.get(stream=stream)[:rec[5]]]
        if stream is not None:
            stream.synchronize()
        started = [v for v in seen if v & 0x8000]
        per_sm = Counter(v >> 16 for v in started)       # {multiprocessor: chain blocks it held}
        hist = Counter(per_sm.values())                  # {chain blocks a multiprocessor held: multiprocessors}
        usual = max(hist, key=lambda n: (hist[n], n)) if hist else 0
        return {"gave_up": rec[0], "block": rec[1], "thread": rec[2], "grid": rec[5], "spread": spread,
                "phase_waited_for": phase, "counts": rec[7:7 + min(spread, 4)],
                "expected": [1] if flag else [(rec[5] - 1 - j) // spread + 1 for j in range(min(spread, 4))],
                # the blocks that had not started (not resident), those started but not past the phase waited
                # for (block, multiprocessor, phases past), how many multiprocessors held each number of chain
                # blocks, and those holding fewer than most did ({multiprocessor: blocks}); a block's word is
                # cleared by the last block of each run, so a word from an earlier run can show only if that run
                # did not end
                "not_started": [b for b, v in enumerate(seen) if not v & 0x8000][:16],
                "started_behind": [(b, v >> 16, v & 0x7fff) for b, v in enumerate(seen)
                                   if v & 0x8000 and (v & 0x7fff) <= phase][:16],
                "started": len(started), "sms": len(per_sm), "blocks_a_sm": dict(sorted(hist.items())),
                "sms_short": {sm: n for sm, n in sorted(per_sm.items()) if n < usual}}

    # -- fused kernels ----------------------------------------------------------------------------
    def op_prep_rows(self, label: str, x, ld_x: int, row0: int, w, eps: float, K: int, norm: bool, act: ActBuffer,
                     n_rows: int, acc=None, x_out=None, acc_zero=None, col_blocks: int | None = None,
                     cluster: bool | None = None) -> Op:
        """Rows row0.. of x (RMSNorm'd when norm) into act. acc: the residual's pending fixed-point
        sum (int64, x's layout; MODE_ADD launches add into it), folded into every value read; the
        folded rows then go to x_out and acc_zero's rows are cleared (either may be None).
        col_blocks: blocks per row (default: prep_block_cols' choice by the number of rows).
        cluster: a norm's column blocks as one thread-block cluster per row (prep_cluster_cols;
        default: where the device has clusters). Every split and either kernel give the same bits.
        The cluster kernel loads x before its dependency wait: x must not be written by the launch
        just before it (in the step only acc is; x is the fold's output from two or more launches
        back, and that launch triggers its dependents only after its own wait)."""
        for a, dt in ((acc, "int64"), (acc_zero, "int64"), (x_out, "float32")):
            if a is not None and str(a.dtype) != dt:
                raise ValueError(f"{label}: {dt} buffer expected, got {a.dtype}")
        args = (x, np.int32(ld_x), np.int32(row0), w, np.float32(eps), np.int32(K), np.int32(1 if norm else 0),
                act.x16, act.buf, acc, x_out, acc_zero)
        chain = {}                              # a one-row norm: also a phase op_mm_chain can run
        if norm and n_rows == 1 and K <= 32 * PREP_COLS:
            def row(a, itemsize):
                return self.ptr(a) + itemsize * row0 * ld_x if a is not None else 0
            chain = dict(kind=MM_CHAIN_PREP, gx=-(-K // PREP_COLS), T=1, x=row(x, 4),      # a block a 256-column chunk
                         w=self.ptr(w) if w is not None else 0, acc=row(acc, 8), x_out=row(x_out, 4),
                         acc_zero=row(acc_zero, 8), eps=float(eps), K=int(K), out16=self.ptr(act.x16),
                         outxs=self.ptr(act.buf))
        cl_cols = prep_cluster_cols(K, n_rows, col_blocks) if norm else None
        if cluster is None:
            cluster = cl_cols is not None and self.clusters
        if cluster:
            if cl_cols is None or not self.clusters:
                raise ValueError(f"{label}: no cluster prep for {K} columns{'' if self.clusters else ' on this device'}")
            n_cb = -(-K // cl_cols)
            return Op(label, self._k("fused.cu", f"prep_rows_cly{n_cb}"), (n_rows, n_cb), (FUSED_THREADS,),
                      args + (np.int32(cl_cols),), PREP_SMEM_CLUSTER, chain_phase=chain)
        cols = prep_block_cols(K, n_rows, col_blocks)
        kern = self._k("fused.cu", "prep_rows")
        smem = 4 * (-(-K // 4) * 4 if norm else cols)         # the folded row, or the block's columns
        self._smem(kern, smem)
        return Op(label, kern, (n_rows, -(-K // cols)), (FUSED_THREADS,), args + (np.int32(cols),), smem,
                  chain_phase=chain)

    def op_embed(self, label: str, weight: Any, ids_dev, out, T: int) -> Op:
        """out[0:T] = rows ids_dev[0:T] of the raw GGUF embedding (kernels.cuda_backend.GpuWeight)."""
        from kernels import cuda_backend as cb
        qt = weight.qtype
        kern = self._k("quant_matvec.cu", cb._DEQUANT_NAMES[qt])
        total = T * weight.n_in
        per_thread = 16 if qt in cb._GENERIC_MATVEC_TYPES else 1
        grid = (max(1, min((total // per_thread + 255) // 256, 65535)),)
        args = (weight.data, ids_dev, np.int32(0), out, np.int32(T), np.int32(weight.n_in), np.int32(weight.row_bytes))
        return Op(label, kern, grid, (256,), args, pdl=False)

    def op_gdn_conv(self, label: str, qkv, ldq: int, tbl, slot: int, conv_w, ab, dt_bias, ssm_a, rec, T: int,
                    nk: int, nv: int, dk: int, dv: int, kc: int, eps: float, write_state: bool, state_save=None,
                    qkv_save=None, clear=None, tokens_per_block: int | None = None) -> Op:
        """qkv and ab: the projections' int64 fixed-point sums (MODE_ADD launches). clear: the
        (qkv, ab) sums to zero over the same rows for the next matmul that adds (default: qkv and ab
        themselves, after they are read; the step passes the other layer parity's, fused.cu).
        tokens_per_block: tokens a block computes (default all T: one block per head, as decode
        wants; fewer for wide verify blocks: more blocks, the same bits), all T when write_state
        or when clearing what it reads. Verify: state_save / qkv_save receive the conv state and the
        block's inputs (as floats) for gdn_commit_conv."""
        if kc > 8:
            raise ValueError(f"conv kernel of {kc} taps (gdn_conv handles up to 8)")
        qkv_clear, ab_clear = clear if clear is not None else (qkv, ab)
        for a in (qkv, ab, qkv_clear, ab_clear):
            if str(a.dtype) != "int64":
                raise ValueError(f"{label}: qkv and ab are int64 fixed-point sums (got {a.dtype})")
        tpb = max(1, min(T, tokens_per_block or T))
        if tpb < T and (write_state or clear is None):
            raise ValueError(f"{label}: token blocks need write_state off and other buffers to clear")
        kern = self._k("fused.cu", "gdn_conv")
        width = max(dk, dv)
        smem = 4 * (2 * tpb + 2 * kc - 1) * width        # outputs, inputs, old state, taps (fused.cu)
        self._smem(kern, smem)
        args = (qkv, np.int32(ldq), tbl, np.int32(slot), conv_w, ab, dt_bias, ssm_a, rec, np.int32(T), np.int32(nk),
                np.int32(nv), np.int32(dk), np.int32(dv), np.int32(kc), np.float32(eps), np.int32(1 if write_state else 0),
                state_save, qkv_save, qkv_clear, ab_clear, np.int32(tpb))
        chain = {}                              # one token that advances the state: also a phase op_mm_chain can run
        if T == 1 and write_state and qkv_save is None and 4 * width * (2 * kc + 1) <= MM_CHAIN_SCRATCH:
            chain = dict(kind=MM_CHAIN_CONV, gx=2 * nk + nv + 1, T=1, x=self.ptr(conv_w), acc=self.ptr(qkv), ld=int(ldq),
                         d=int(kc), tbl=self.ptr(tbl), slot=int(slot), out=self.ptr(rec), eps=float(eps), nk=nk, nv=nv,
                         dk=dk, dv=dv, ab=self.ptr(ab), dt_bias=self.ptr(dt_bias), ssm_a=self.ptr(ssm_a),
                         state_save=self.ptr(state_save) if state_save is not None else 0,
                         ab_clear=self.ptr(ab_clear), acc_zero=self.ptr(qkv_clear))
        return Op(label, kern, (2 * nk + nv + 1, -(-T // tpb)), (FUSED_THREADS,), args, smem, chain_phase=chain)

    def op_gdn_recur(self, label: str, tbl, n_slots: int, T: int, n_dev, out, nk: int, nv: int, dk: int,
                     dv: int) -> Op:
        """T tokens (or *n_dev of them, up to MAX_T, when n_dev is given: commit)."""
        rpt = next((r for r in GDN_RPT if GDN_PARTS * r >= dk), None)
        if rpt is None:
            raise ValueError(f"d_k = {dk} exceeds the kernel's {GDN_PARTS * GDN_RPT[-1]}")
        kern = self._k("fused.cu", f"gdn_recur_{'r' if T == 1 and n_dev is None else 'w'}{rpt}")
        chunk = GDN_CHUNK if n_dev is not None else max(1, min(T, GDN_CHUNK))
        # Staged q, k, v, decay, beta (fused.cu), at every width at least what the state's write-back
        # through shared memory took before the state was stored transposed: with only their ~1 KB
        # the decode blocks left room for more of the next launches' blocks early, and the 27B decode
        # graph ran 0.03-0.05 ms slower (H200, two A/Bs; 32 or 64 KB: 0.03 slower).
        smem = 4 * max(chunk * (2 * GDN_PARTS * rpt + GDN_COLS + 2), GDN_PARTS * rpt * (GDN_COLS + 1))
        self._smem(kern, smem)
        args = (tbl, np.int32(T), n_dev, out, np.int32(nk), np.int32(nv), np.int32(dk), np.int32(dv),
                np.float32(1.0 / math.sqrt(dk)), np.int32(chunk))
        chain = {}                              # one token of one slot: also a phase op_mm_chain can run
        if T == 1 and n_dev is None and n_slots == 1 and rpt in (4, 8, 16):
            chain = dict(kind=MM_CHAIN_RECUR, gx=nv * -(-dv // (MM_THREADS // GDN_PARTS)), T=1, d=rpt, tbl=self.ptr(tbl),
                         out=self.ptr(out) if out is not None else 0, nk=nk, nv=nv, dk=dk, dv=dv,
                         eps=float(np.float32(1.0 / math.sqrt(dk))))
        return Op(label, kern, (-(-dv // GDN_COLS), nv, n_slots), (GDN_COLS * GDN_PARTS,), args, smem, chain_phase=chain)

    def op_gdn_commit_conv(self, label: str, tbl, n_slots: int, params, C: int, kc: int) -> Op:
        kern = self._k("fused.cu", "gdn_commit_conv")
        args = (tbl, params, np.int32(C), np.int32(kc))
        return Op(label, kern, (max(1, min(-(-C // FUSED_THREADS), 1024)), n_slots), (FUSED_THREADS,), args, pdl=False)

    def op_gdn_out_prep(self, label: str, o, z, ldz: int, w, eps: float, nv: int, dv: int, act: ActBuffer, T: int) -> Op:
        """z: the gate projection's int64 fixed-point sum (a MODE_ADD launch), cleared as it is read."""
        if str(z.dtype) != "int64":
            raise ValueError(f"{label}: z is an int64 fixed-point sum (got {z.dtype})")
        kern = self._k("fused.cu", "gdn_out_prep")
        args = (o, z, np.int32(ldz), w, np.float32(eps), np.int32(nv), np.int32(dv), act.x16, act.buf)
        n_cb = -(-(nv * dv) // PREP_COLS)
        chain = {}                              # one row: also a phase op_mm_chain can run
        if T == 1 and dv % 8 == 0:
            chain = dict(kind=MM_CHAIN_GNORM, gx=n_cb, T=1, x=self.ptr(o), acc_zero=self.ptr(z), w=self.ptr(w),
                         eps=float(eps), K=nv * dv, ld=int(ldz), d=int(dv), out16=self.ptr(act.x16),
                         outxs=self.ptr(act.buf))
        return Op(label, kern, (T, n_cb), (FUSED_THREADS,), args, chain_phase=chain)

    def op_attn_qk_rope_kv(self, label: str, qg, k, v, q_norm, k_norm, eps: float, params, tbl, slot: int, qout,
                           H: int, Hkv: int, D: int, n_rot: int, theta: float, T: int) -> Op:
        if D > 256:
            raise ValueError(f"head dim {D} (the fused attention kernels handle up to 256)")
        kern = self._k("fused.cu", "attn_qk_rope_kv")
        args = (qg, k, v, q_norm, k_norm, np.float32(eps), params, tbl, np.int32(slot), qout, np.int32(H),
                np.int32(Hkv), np.int32(D), np.int32(n_rot), np.float64(theta))
        return Op(label, kern, (H + 2 * Hkv, T), (max(32, -(-D // 32) * 32),), args)

    @staticmethod
    def att_tensor_cores(D: int) -> bool:
        """Whether attn_partial runs on tensor cores by default for head size D."""
        return ATT_TENSOR_CORES and D % 16 == 0

    def op_attn_partial(self, label: str, q, params, tbl, slot: int, part_o, part_ml, H: int, Hkv: int, D: int,
                        scale: float, T: int, heads: int | None = None, tensor_cores: bool | None = None,
                        decode_kernel: bool | None = None, splits: int | None = None) -> Op:
        """Split-K attention of T rows over the cache into part_o [T, H, ATT_MAX_SPLITS, D] and
        part_ml [T, H, ATT_MAX_SPLITS, 2]; a block takes `heads` query heads of one KV group (default
        attn_heads_per_block: the result's bits do not depend on it). tensor_cores (default
        att_tensor_cores(D)): m-tiles of 16 (row, head) pairs of one KV group with the scores and
        outputs on tensor cores and the keys staged in shared memory (other bits than
        attn_partial_g<R>, so decode and verify must both take it, as they do through this default):
        attn_partial_tc (ATT_TC_MTILES m-tiles a block on the same staged keys), or for rows that fit
        one m-tile (T * H / Hkv <= 16: decode; decode_kernel forces either) attn_partial_tcd, the same
        rows' bits with eight warps. splits: the grid's
        splits, at least att_row_splits of the longest row (att_launch_splits; default the family's
        cap, right for any context); attn_combine_prep must scan as many."""
        if D % 8 or D > 256:
            raise ValueError(f"{label}: attention head size {D} (attn_partial takes multiples of 8 up to 256)")
        if tensor_cores is None:
            tensor_cores = self.att_tensor_cores(D)
        cap = ATT_SPLIT_CAP_TC if tensor_cores else ATT_SPLIT_CAP_FMA
        splits = cap if splits is None else splits
        if not ATT_MIN_SPLITS <= splits <= cap:
            raise ValueError(f"{label}: {splits} splits (this kernel family takes {ATT_MIN_SPLITS}..{cap})")
        if tensor_cores:
            if D % 16 or H % Hkv:
                raise ValueError(f"{label}: attn_partial_tc takes head sizes that are multiples of 16 and whole KV "
                                 f"groups, got D={D}, H={H}, Hkv={Hkv}")
            M = T * (H // Hkv)
            tcd = M <= 16 if decode_kernel is None else decode_kernel
            if tcd and M > 16:
                raise ValueError(f"{label}: attn_partial_tcd takes up to 16 (row, head) pairs a KV group, got {M}")
            args = (q, params, tbl, np.int32(slot), part_o, part_ml, np.int32(H), np.int32(Hkv), np.int32(D),
                    np.int32(cap), np.float32(scale), np.int32(T))
            if tcd:
                kern = self._k("fused.cu", "attn_partial_tcd")
                smem = 4 * 16 * ATT_TCD_CHUNK * (2 * (D + 16) + 2 * (D + 4) + 2 * ATT_TC_S_LD)   # fused.cu
                self._smem(kern, smem)
                return Op(label, kern, (splits, Hkv, 1), (256,), args, smem)
            mt = ATT_TC_MTILES
            if mt not in (1, 2):
                raise ValueError(f"{label}: attn_partial_tc takes 1 or 2 m-tiles a block, not {mt}")
            kern = self._k("fused.cu", "attn_partial_tc" if mt == 1 else f"attn_partial_tc{mt}")
            smem = 4 * 16 * (2 * (D + 16) + 2 * (D + 4) + 2 * mt * ATT_TC_S_LD)   # fused.cu: K, V stages, score halves
            self._smem(kern, smem)
            return Op(label, kern, (splits, Hkv, -(-M // (16 * mt))), (64 * mt,), args, smem)
        R = heads if heads is not None else attn_heads_per_block(H // Hkv, T)
        if R not in ATT_HEADS or H % Hkv or (H // Hkv) % R:
            raise ValueError(f"{label}: {R} heads a block for a group of {H}/{Hkv} heads")
        kern = self._k("fused.cu", f"attn_partial_g{R}")
        args = (q, params, tbl, np.int32(slot), part_o, part_ml, np.int32(H), np.int32(Hkv), np.int32(D),
                np.int32(cap), np.float32(scale))
        return Op(label, kern, (splits, H // R, T), (128,), args)

    def op_attn_combine_prep(self, label: str, part_o, part_ml, qg, H: int, D: int, act: ActBuffer, T: int,
                             splits: int) -> Op:
        """Merge the `splits` partials of each (row, head) (the attn_partial launch's grid), gate,
        act16."""
        if not 1 <= splits <= ATT_MAX_SPLITS:
            raise ValueError(f"{label}: {splits} splits (1..{ATT_MAX_SPLITS})")
        kern = self._k("fused.cu", "attn_combine_prep")
        args = (part_o, part_ml, qg, np.int32(H), np.int32(D), np.int32(splits), act.x16, act.buf)
        return Op(label, kern, (T, -(-(H * D) // PREP_COLS)), (FUSED_THREADS,), args)

    def op_topk(self, label: str, logits, V: int, ld: int, k: int, out_ids, out_vals, meta, n_rows: int) -> Op:
        """The k largest logits of each row (fused.cu topk_row): ids / vals [n_rows][k], meta[n_rows]
        = NaN / +inf count."""
        if not 1 <= k <= V:
            raise ValueError(f"{label}: top-k of {k} over {V} values")
        kern = self._k("fused.cu", "topk_row")
        args = (logits, np.int32(V), np.int32(ld), np.int32(k), out_ids, out_vals, meta)
        return Op(label, kern, (n_rows,), (TOPK_THREADS,), args, pdl=False)

    def op_argmax(self, label: str, logits, V: int, ld: int, out_ids, n_rows: int) -> Op:
        xp = self.xp
        kern = self._k("fused.cu", "argmax_rows")
        n_chunks = max(1, min(ARGMAX_CHUNKS, -(-V // 1024)))
        part_v = xp.zeros((n_rows, n_chunks), dtype=xp.float32)
        part_i = xp.zeros((n_rows, n_chunks), dtype=xp.int32)
        counters = xp.zeros(n_rows, dtype=xp.int32)
        args = (logits, np.int32(V), np.int32(ld), out_ids, part_v, part_i, counters)
        return Op(label, kern, (n_chunks, n_rows), (FUSED_THREADS,), args, keep=(part_v, part_i, counters))

    def op_step_chain(self, label: str, params, ids) -> Op:
        """params[0] += 1, params[2] = ids[0]: the next decode step's position and token, on the
        device (the step's last launch when the host queues the next step before reading ids)."""
        return Op(label, self._k("fused.cu", "step_chain"), (1,), (32,), (params, ids))
