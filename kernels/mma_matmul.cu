// Quantised matrix products for 1..32 activation rows on tensor cores (m16n8k16, f16 in, f32
// accumulate), reading every weight byte once per launch whatever the number of rows:
//
//     y[t, o] = sum_i W[o, i] * x16[t, i]        t < T <= 32
//
// This is the decode / verify / short-prompt product of the qwen35 GPU step (daemons/qwen35_gpu.py);
// from kernels/cuda_backend.py WIDE_MIN_T rows on, the units are dequantised to f16 (units_f16_* below)
// and multiplied by cuBLAS instead.
//
// Weights. At load time each GGUF matrix is rearranged on the device (the `repack_*` kernels below)
// into "units": 16 rows (one MMA tile) x 256 columns (one K-quant superblock), each cut in two pieces
// (k-steps 8..15's quants, and the rest), unit (tile, sb)'s pieces at unit_piece(tile, sb, n_sb, h)
// (tiles in pairs within groups of four, below). The bytes are exactly the GGUF block bytes of those
// 16 rows x 256 columns, reordered so that each lane of a warp reads its MMA fragments with 16-byte
// loads that coalesce across the warp; nothing is dequantised or widened (a Q4_K unit is 16 x 144
// bytes). Rows past n_out and columns past n_in (rows that are not a whole number of superblocks) are
// zero.
//
// Element map (all types). Lane L = 4g + c, k-step s (0..15) of a superblock, A register r (0..3),
// half hf: row 16*tile + g + 8*(r & 1), column 256*sb + 64c + 8*(s >> 1) + 4*(s & 1) + 2*(r >> 1)
// + hf. This is a permutation of k: the MMA sums over all 16 k of a step, so any bijection that A
// and B share gives the same product. Its point: lane c only ever touches columns 64c..64c+63 of a
// superblock, i.e. two 32-wide (four 16-wide) scale groups per row, so it decodes 2 (4) scales per
// row instead of 8 (16).
//
// Activations ("act16"): f16 rows of n_sb*256 halves in the same permuted order (natural column
// n = [c:2][p:3][e:3] within a 256-block stored at [p:3][c:2][e:3]: kernels/tc_common.cuh act_pos),
// so the four lanes of a token read 64 contiguous bytes per pair of k-steps, stored superblock-major
// (a superblock's rows cut in halves, odd rows swizzled: tc_common.cuh act_index). For Q4_K /
// Q5_K the block sums of each 32-column block (as f16 hi + lo) ride along (xs_pos, xs_index). Both
// are written by the kernels that produce a matmul's input (fused.cu `prep_*`, the SwiGLU epilogue).
//
// How each type turns bytes into A fragments (exact unless said):
//   Q4_K / Q5_K  A = sc_j * q (integers <= 63*31 < 2048, exact in f16) built with one LOP3 + one
//                HFMA2 per register (the 0x6400 exponent trick); per superblock acc += d * (A.x)
//                - dmin * (m . xs) in f32, the min term as one more MMA of the 6-bit mins against
//                the block sums (hi and lo halves in the two k halves, so the sums stay ~f32).
//   Q6_K         A = f16(sc * (q - 32)) (exact up to |2048|, else rounded to an even integer:
//                <= 2^-12 relative), acc += d * (A.x).
//   IQ4_XS       A = f16(kv[q] * (ls - 32)), kv the IQ4_NL codebook (int8), ls the 6-bit scale of
//                the 32-wide block (|A| <= 127 * 32: exact up to 2048, else rounded to an even
//                integer, an error of at most 1 = 2^-11 relative), acc += d * (A.x).
//   Q8_0         A = f16(d * q) (rounded once, <= 2^-12 relative), acc += A.x.
//   F16          A = w, acc += A.x.
// Activations are rounded to f16 once (2^-11 relative); everything else is f32.
//
// Work split. A thread block of 4 computing warps works on row blocks of 4 tiles (one per warp; for
// SwiGLU 2 gate + 2 up tiles of the same rows) superblock by superblock, its units and activation
// rows streamed into shared memory by a pipeline of bulk copies (TMA) 2-3 stages deep, issued by
// a fifth warp at decode widths (T <= 8) and by warp 0 otherwise. The flat space (row block,
// superblock) is cut into one contiguous stripe per thread block (grid = a fixed number per
// matrix, four blocks per multiprocessor, all resident), so every block streams the same number of
// bytes whatever the matrix shape (a launch over matrices of two types splits its grid between them,
// each part striped the same way: mm_tc_parts below). A row block wholly inside a stripe is written
// straight from the MMA fragments; one cut between stripes (only a stripe's first and last can be) is finished by
// the last of its stripes to arrive, which adds the partial sums in stripe order (deterministic; a
// counter per row block, reset by that block so a CUDA graph can replay the launch). ADD needs no
// such exchange: every part adds its sums into a 64-bit fixed-point accumulator (exact, so in any
// order; tc_common.cuh red_add_fixed), which the next RMSNorm prep folds into the residual.
// Batch invariance: a row's result depends only on its own activation row (MMA columns are
// independent, the stripes depend on the matrix and the grid, never on T), so decoding 1 token or
// verifying 23 gives bit-identical rows; speculative decoding relies on it.
//
// Epilogues: STORE y[t, o] = acc; ADD acc64[t, o] += fixed(acc) (y is int64: the residual's
// pending sum, fused.cu prep_rows folds it); SWIGLU (two segments:
// gate and up, paired tile for tile) writes silu(gate) * up as the next product's act16 row and
// block sums directly.
#include "tc_common.cuh"

#define MM_THREADS 128                   // the four warps that compute (one tile each)
// Decode widths (one 8-column MMA tile, T <= 8) add a fifth warp that only issues the copies, so no
// computing warp starts its stage late and holds the others at the stage barrier (warp 0 did both:
// ncu put a third of the stall cycles on that barrier). Wider batches keep warp 0 as the issuer:
// their registers do not fit five warps in four blocks per multiprocessor. Both do the same
// arithmetic in the same order, so rows stay batch-invariant.
#ifndef MM_ISSUER_WARP
#if defined(__HIP_PLATFORM_AMD__)
#define MM_ISSUER_WARP 0                 // HIP has no named barriers for the computing warps alone
#else
#define MM_ISSUER_WARP 1
#endif
#endif
#define MM_SEPARATE_ISSUER(NT) (MM_ISSUER_WARP && (NT) == 1)
#define MM_BLOCK_THREADS(NT) (MM_SEPARATE_ISSUER(NT) ? 160 : 128)
#define MM_ISSUER(NT) (MM_SEPARATE_ISSUER(NT) ? 4 : 0)
// The computing warps' own barrier (the issuer warp, when separate, never joins it).
template <int NT> __device__ __forceinline__ void mm_sync() {
    if (MM_SEPARATE_ISSUER(NT)) compute_warps_sync(MM_THREADS);
    else __syncthreads();
}

struct MmSeg {                 // one matrix of a launch; all share the type, n_in and the epilogue
    unsigned long long w;      // tiled weight
    unsigned long long y;      // f32 output [T][ldy] (STORE / ADD)
    int n_rows;
    int n_tiles;
    int ldy;
    int pad;
};

#define QT_F16 1
#define QT_Q8_0 8
#define QT_Q4_K 12
#define QT_Q5_K 13
#define QT_Q6_K 14
#define QT_IQ4_XS 23

#define MODE_STORE 0
#define MODE_ADD 1
#define MODE_SWIGLU 2

template <int QT> struct UnitBytes;
template <> struct UnitBytes<QT_F16> { static constexpr int v = 8192; };
template <> struct UnitBytes<QT_Q8_0> { static constexpr int v = 4352; };
template <> struct UnitBytes<QT_Q4_K> { static constexpr int v = 2304; };
template <> struct UnitBytes<QT_Q5_K> { static constexpr int v = 2816; };
template <> struct UnitBytes<QT_Q6_K> { static constexpr int v = 3360; };
template <> struct UnitBytes<QT_IQ4_XS> { static constexpr int v = 2176; };

// The UNIT-byte slot of unit (tile, sb) in a matrix's tiled weight: tiles in groups of four, each
// group's units superblock-major with its four tiles side by side, so a row block's units for one
// superblock (the four tiles of a STORE / ADD row block; a SwiGLU row block's two gate or two up
// tiles, half a group) are one contiguous run of bytes, one bulk copy a stage instead of four. Inside
// a pair of slots the two units lie in pieces (unit_piece, below); an even tile's slot is where its
// pair starts. A matrix's tile count is padded to a multiple of four (the padding is zeros).
__device__ __forceinline__ long long unit_index(int tile, int sb, int n_sb) {
    return ((long long)(tile >> 2) * n_sb + sb) * 4 + (tile & 3);
}

// Word i (0..3, the same in all lanes of a quad) of v as selects, not branches.
__device__ __forceinline__ u32 sel4(const uint4& v, int i) {
    const u32 lo = (i & 1) ? v.y : v.x, hi = (i & 1) ? v.w : v.z;
    return (i & 2) ? hi : lo;
}
template <int I> __device__ __forceinline__ u32 comp(const uint4& v) {
    return I == 0 ? v.x : (I == 1 ? v.y : (I == 2 ? v.z : v.w));
}
// A byte permute (__byte_perm's operands) for selectors whose nibbles may have bit 3 set only for
// output bytes the caller discards. __byte_perm reads 3 bits per selector nibble, the prmt it
// compiles to reads bit 3 as "replicate the byte's sign", so nvcc masks a variable selector with
// 0x7777 first (one more instruction); the bytes the caller keeps are the same either way, so CUDA
// issues the bare prmt.
__device__ __forceinline__ u32 prmt_keep(u32 x, u32 y, u32 s) {
#if !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(y), "r"(s));
    return d;
#else
    return __byte_perm(x, y, s);
#endif
}
// Plain loads: the units are read from the shared-memory stage the pipeline filled.
__device__ __forceinline__ uint4 ld128(const unsigned char* p) { return *(const uint4*)p; }
__device__ __forceinline__ u32 ld32(const unsigned char* p) { return *(const u32*)p; }
__device__ __forceinline__ u16 ld16(const unsigned char* p) { return *(const u16*)p; }

// ---------------------------------------------------------------------------------------------
// A lane's byte offsets inside a unit (g = lane / 4, c = lane % 4): q = 16 lane (its 16 bytes of
// each 512-byte quant plane), r = 16 g (row g's 16-byte record; row g + 8's is 128 further),
// r4 = 16 g + 4 c, g2 = 2 g. The matmul builds them once with keep_reg, so that ptxas does not
// recompute them from the lane index for every stage (8-22 instructions a unit of the loop).
struct LaneOffs {
    int q, r, r4, g2, c;
    __device__ __forceinline__ static LaneOffs of(int lane) {
        const int g = lane >> 2, c = lane & 3;
        return LaneOffs{16 * lane, 16 * g, 16 * g + 4 * c, 2 * g, c};
    }
    __device__ __forceinline__ static LaneOffs kept(int lane) {
        const LaneOffs o = of(lane);
        return LaneOffs{keep_reg(o.q), keep_reg(o.r), keep_reg(o.r4), keep_reg(o.g2), keep_reg(o.c)};
    }
};

// Per-type lane state for one unit (read from its shared-memory copy). Interface:
//   load_h<H>(piece, offs)      loads what the superblock needs from the unit's piece H (unit_piece: a
//                               unit lies in two pieces, H = 0 with k-steps 0..7's quants and the
//                               scales, H = 1 with k-steps 8..15's quants; K-quants: everything)
//   H1                          bytes of the second piece: the unit's bytes [H1, 2 H1) as repacked
//                               (always the quants of k-steps 8..15); the first piece is the rest, in order
//   pair(piece, offs, p)        loads what k-steps 2p, 2p+1 need from their piece (Q8_0 / F16 quants;
//                               p mod 4)
//   frag<S>(a)                  the A fragment of k-step S
//   HAS_MIN / row scale d[2] (rows g, g+8) / dmin[2], amin (A of the min MMA)
// The scale state of a Q4_K / Q5_K unit for one lane: its two 32-wide groups 2c, 2c+1 of rows g
// (registers 0 and 2, nibbles at x1) and g+8 (registers 1 and 3, nibbles at x16), the mins as the A
// operand of the min MMA, and the super-block scales d / dmin of both rows.
struct KQuantScales {
    u32 c1[2], b1[2], c16[2], b16[2];
    u32 amin[2];
    float d[2], dmin[2];
    // Scale record of a row: word c = sc[2c] | sc[2c+1] << 6 | m[2c] << 12 | m[2c+1] << 18 |
    // (byte c of d | dmin << 16) << 24.
    __device__ __forceinline__ void decode(const uint4& r, int c, int row8) {
        const u32 w = sel4(r, c);
        const u32 t1 = __byte_perm(r.x, r.y, 0x0073), t2 = __byte_perm(r.z, r.w, 0x0073);
        const u32 dd = __byte_perm(t1, t2, 0x5410);
        d[row8] = h2f((u16)(dd & 0xffffu));
        dmin[row8] = h2f((u16)(dd >> 16));
        const u32 ma = (w >> 12) & 63u, mb = (w >> 18) & 63u;
        // 1024 + sc in both halves (one replicate, one LOP3 each), then the values the frags use,
        // each exact: sc, -1024 sc (x1 nibbles); sc / 16 = (1024 + sc) / 16 - 64, -64 sc (x16).
        const u32 xa = lop_and_or<0x003F003Fu>(__byte_perm(w, 0u, 0x1010), H2_1024);
        const u32 xb = lop_and_or<0x003F003Fu>(__byte_perm(w >> 6, 0u, 0x1010), H2_1024);
        if (row8 == 0) {
            c1[0] = h2sub(xa, H2_1024); b1[0] = h2mul(c1[0], H2_M1024);
            c1[1] = h2sub(xb, H2_1024); b1[1] = h2mul(c1[1], H2_M1024);
        } else {
            c16[0] = h2fma(xa, H2_1_16, H2_M64); b16[0] = h2mul(c16[0], H2_M1024);
            c16[1] = h2fma(xb, H2_1_16, H2_M64); b16[1] = h2mul(c16[1], H2_M1024);
        }
        amin[row8] = h2_int_pair(ma, mb);
    }
    __device__ __forceinline__ void load_records(const unsigned char* rec, const LaneOffs& o) {
        decode(ld128(rec + o.r), o.c, 0);
        decode(ld128(rec + o.r + 128), o.c, 1);
    }
};

struct UnitQ4K : KQuantScales {
    static constexpr bool HAS_MIN = true, SCALED = true;
    static constexpr int H1 = 1024;
    uint4 q[4];
    template <int H> __device__ __forceinline__ void load_h(const unsigned char* u, const LaneOffs& o) {
        q[2 * H] = ld128(u + o.q);
        q[2 * H + 1] = ld128(u + 512 + o.q);
        if (H == 0) load_records(u + 1024, o);
    }
    __device__ __forceinline__ void pair(const unsigned char*, const LaneOffs&, int) {}
    template <int S> __device__ __forceinline__ void frag(u32 (&a)[4]) const {
        const u32 w = comp<S & 3>(q[S >> 2]);
        constexpr int j = S >> 3;                       // scale group 2c + j
        const u32 w8 = w >> 8;
#if defined(MM_DQ_PROBE)    // timing only (wrong results): 1 = no HFMA2 (the nibbles under 1024 as they are), 2 = raw words
        if (MM_DQ_PROBE == 2 || MM_DQ_PROBE == 4) { a[0] = w; a[1] = w8; a[2] = w ^ 0x5555u; a[3] = w8 ^ 0x5555u; return; }
        if (MM_DQ_PROBE == 1) {
            a[0] = lop_and_or<0x000F000Fu>(w, H2_1024); a[1] = lop_and_or<0x00F000F0u>(w, H2_1024);
            a[2] = lop_and_or<0x000F000Fu>(w8, H2_1024); a[3] = lop_and_or<0x00F000F0u>(w8, H2_1024);
            return;
        }
#endif
        a[0] = h2fma(lop_and_or<0x000F000Fu>(w, H2_1024), c1[j], b1[j]);
        a[1] = h2fma(lop_and_or<0x00F000F0u>(w, H2_1024), c16[j], b16[j]);
        a[2] = h2fma(lop_and_or<0x000F000Fu>(w8, H2_1024), c1[j], b1[j]);
        a[3] = h2fma(lop_and_or<0x00F000F0u>(w8, H2_1024), c16[j], b16[j]);
    }
};

struct UnitQ5K : KQuantScales {
    static constexpr bool HAS_MIN = true, SCALED = true;
    uint4 q[4];
    uint4 qh;
    static constexpr int H1 = 1024;
    template <int H> __device__ __forceinline__ void load_h(const unsigned char* u, const LaneOffs& o) {
        q[2 * H] = ld128(u + o.q);
        q[2 * H + 1] = ld128(u + 512 + o.q);
        if (H == 0) {
            qh = ld128(u + 1024 + o.q);
            load_records(u + 1536, o);
        }
    }
    __device__ __forceinline__ void pair(const unsigned char*, const LaneOffs&, int) {}
    // High bits: word S>>2 of qh; for k-step v = S & 3 the bit of (register r, half hf) sits at
    // bit (4, 8, 0, 12)[r] + v + 16*hf.
    template <int S> __device__ __forceinline__ void frag(u32 (&a)[4]) const {
        const u32 w = comp<S & 3>(q[S >> 2]);
        const u32 t = comp<(S >> 2)>(qh) >> (S & 3);
        constexpr int j = S >> 3;
        const u32 w8 = w >> 8;
        a[0] = h2fma(lop_and_or<0x000F000Fu>(w, lop_and_or<0x00100010u>(t, H2_1024)), c1[j], b1[j]);
        a[1] = h2fma(lop_and_or<0x00F000F0u>(w, lop_and_or<0x01000100u>(t, H2_1024)), c16[j], b16[j]);
        a[2] = h2fma(lop_and_or<0x000F000Fu>(w8, lop_and_or<0x00100010u>(t << 4, H2_1024)), c1[j], b1[j]);
        a[3] = h2fma(lop_and_or<0x00F000F0u>(w8, lop_and_or<0x01000100u>(t >> 4, H2_1024)), c16[j], b16[j]);
    }
};

// Q6_K unit: 3072 bytes of 6-bit codes, then 16 x 16 scale bytes (row-major), then 16 f16 d.
// Codes: a lane's pair p of k-steps (8 registers R = 4 (S & 1) + r, two halves each) is 3 words
// W0..W2, word 3p + i of the lane's 24 (word j at byte 512 (j >> 2) + 16 lane + 4 (j & 3)). Each
// half (bits 16 hf..) of word i holds code R = i at bits 4-9 and code R = 3 + i at bits 10-15; the
// last two registers' codes are spread over the bits 0-3: R6 = W0[0:4] | W1[0:2] << 4, R7 =
// W2[0:4] | W1[2:4] << 4. Every code then becomes A at x16 (1024 + 16 q6, bits 4-9 under 1024's
// exponent) with one LOP3 (R0-R2), a shift + LOP3 (R3-R5) or two of each (R6, R7): 17 integer
// instructions a pair where nibble + high-bit planes took ~30. Not x1 like Q4_K: sc is a signed
// 8-bit scale and 1024 * sc overflows f16 beyond |sc| = 63.
struct UnitQ6K {
    static constexpr bool HAS_MIN = false, SCALED = true;
    uint4 q[6];
    u32 cs[4][2], bs[4][2];      // [16-wide group 4c + k][row g / g+8]
    float d[2], dmin[2];
    u32 amin[2];
    static constexpr int H1 = 1536;
    template <int H> __device__ __forceinline__ void load_h(const unsigned char* u, const LaneOffs& o) {
#pragma unroll
        for (int i = 0; i < 3; ++i) q[3 * H + i] = ld128(u + i * 512 + o.q);
        if (H == 0) load_scales<1536>(u, o);
    }
    // The 16 x 16 scale bytes and the 16 d at byte OFF of the first piece.
    template <int OFF> __device__ __forceinline__ void load_scales(const unsigned char* u, const LaneOffs& o) {
        const u32 s0 = ld32(u + OFF + o.r4), s1 = ld32(u + OFF + 128 + o.r4);
        d[0] = h2f(ld16(u + (OFF + 256) + o.g2));
        d[1] = h2f(ld16(u + (OFF + 256) + 16 + o.g2));
        // Byte k of s ^ 0x80808080 under 0x64 in both halves is 1024 + 128 + sc (one PRMT); then
        // sc / 16 = (1152 + sc) / 16 - 72 and -96 sc = -1536 (sc / 16), each exact.
        const u32 x0 = s0 ^ 0x80808080u, x1 = s1 ^ 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 sel = 0x4040u | (0x0101u * k);
            const u32 h0 = __byte_perm(x0, 0x64646464u, sel), h1 = __byte_perm(x1, 0x64646464u, sel);
            cs[k][0] = h2fma(h0, H2_1_16, H2_M72); bs[k][0] = h2mul(cs[k][0], H2_M1536);
            cs[k][1] = h2fma(h1, H2_1_16, H2_M72); bs[k][1] = h2mul(cs[k][1], H2_M1536);
        }
    }
    __device__ __forceinline__ void pair(const unsigned char*, const LaneOffs&, int) {}
    template <int J> __device__ __forceinline__ u32 word() const { return comp<J & 3>(q[J >> 2]); }
    // Register R of pair P as 1024 + 16 q6 (f16x2).
    template <int P, int R> __device__ __forceinline__ u32 code16() const {
        constexpr u32 M = 0x03F003F0u;
        if constexpr (R < 3) {
            return lop_and_or<M>(word<3 * P + R>(), H2_1024);
        } else if constexpr (R < 6) {
            return lop_and_or<M>(word<3 * P + R - 3>() >> 6, H2_1024);
        } else {
            const u32 hi = lop_and_or<0x03000300u>(word<3 * P + 1>() << (R == 6 ? 8 : 6), H2_1024);
            return lop_and_or<0x00F000F0u>(word<3 * P + (R == 6 ? 0 : 2)>() << 4, hi);
        }
    }
    // (1024 + 16 q6) * sc/16 - 96 sc = (q6 - 32) * sc; registers r = 0, 2 are row g, 1, 3 row g + 8.
    template <int S> __device__ __forceinline__ void frag(u32 (&a)[4]) const {
        constexpr int P = S >> 1, R0 = 4 * (S & 1), k = S >> 2;     // 16-wide group 4c + k
#if defined(MM_DQ_PROBE)    // timing only (wrong results), as UnitQ4K::frag
        if (MM_DQ_PROBE == 2 || MM_DQ_PROBE == 4) { a[0] = word<3 * P>(); a[1] = word<3 * P + 1>(); a[2] = word<3 * P + 2>(); a[3] = word<3 * P + 2>() >> 4; return; }
        if (MM_DQ_PROBE == 1) {
            a[0] = code16<P, R0 + 0>(); a[1] = code16<P, R0 + 1>(); a[2] = code16<P, R0 + 2>(); a[3] = code16<P, R0 + 3>();
            return;
        }
#endif
        a[0] = h2fma(code16<P, R0 + 0>(), cs[k][0], bs[k][0]);
        a[1] = h2fma(code16<P, R0 + 1>(), cs[k][1], bs[k][1]);
        a[2] = h2fma(code16<P, R0 + 2>(), cs[k][0], bs[k][0]);
        a[3] = h2fma(code16<P, R0 + 3>(), cs[k][1], bs[k][1]);
    }
};

// IQ4_XS unit: 2048 bytes of nibble words in lane order (like Q4_K, but the nibble of (register r,
// half hf) at bit 4 * ((r & 1) + 2 hf + 4 (r >> 1)): registers 0, 1 in the low 16 bits, 2, 3 in the
// high, because a prmt takes its 4 selector nibbles from the low 16 bits: one lookup per half word,
// whose bytes 0, 2 (1, 3) are then register 0's (1's) two halves), then 8 records of 16 bytes,
// record g = the first 8 bytes of the GGUF block of row g {f16 d; u16 scales_h; u8 scales_l[4]},
// then those of row g + 8 (one load gives a lane both its rows). The 6-bit scale of 32-wide block
// 2c + j is nibble j of scales_l[c] | (bits 4c + 2j, 4c + 2j + 1 of scales_h) << 4: lane c reads
// byte c of one word and a nibble of the other.
#define IQ4_KV0 0x3F2D1801u      // the IQ4_NL codebook kv[0..15] + 128, four bytes a word
#define IQ4_KV1 0x766A5D4Fu
#define IQ4_KV2 0xA6998D81u
#define IQ4_KV3 0xF1D9C5B5u
struct UnitIQ4XS {
    static constexpr bool HAS_MIN = false, SCALED = true;
    uint4 q[4];
    u32 cs[2][2], bs[2][2];      // [32-wide block 2c + j][row g / g+8]
    float d[2], dmin[2];
    u32 amin[2];
    __device__ __forceinline__ void decode(u32 w0, u32 w1, int c, int row8) {
        d[row8] = h2f((u16)(w0 & 0xffffu));
        const u32 sh = w0 >> (16 + 4 * c), sl = w1 >> (8 * c);
        const u32 ls0 = (sl & 15u) | ((sh & 3u) << 4), ls1 = ((sl >> 4) & 15u) | ((sh & 12u) << 2);
        cs[0][row8] = h2sub(ls0 | (ls0 << 16) | H2_1024, H2_1056); bs[0][row8] = h2mul(cs[0][row8], H2_M1152);
        cs[1][row8] = h2sub(ls1 | (ls1 << 16) | H2_1024, H2_1056); bs[1][row8] = h2mul(cs[1][row8], H2_M1152);
    }
    static constexpr int H1 = 1024;
    template <int H> __device__ __forceinline__ void load_h(const unsigned char* u, const LaneOffs& o) {
        q[2 * H] = ld128(u + o.q);
        q[2 * H + 1] = ld128(u + 512 + o.q);
        if (H == 0) {
            const uint4 r = ld128(u + 1024 + o.r);
            decode(r.x, r.y, o.c, 0);
            decode(r.z, r.w, o.c, 1);
        }
    }
    __device__ __forceinline__ void pair(const unsigned char*, const LaneOffs&, int) {}
    // Codebook: a prmt looks up 4 nibbles in 8 bytes, so each half word is looked up in kv[0..7]
    // with its nibbles as they are and in kv[8..15] with bit 3 flipped (clear for the nibbles 8..15;
    // the bytes of nibbles from the other half come out wrong and are dropped), then one prmt keeps
    // per byte the lookup its bit 3 names (selector nibble i = i | 4 * bit 3). The table bytes are
    // kv + 128 (kv is int8): 0x64 above one makes f16 1152 + kv, and (1152 + kv) * s - 1152 s = kv * s
    // in one HFMA2, s = ls - 32, rounded once (1152 s = 9 s * 128 is exact). 10 prmt, 4 HFMA2 and
    // 6 integer ops per k-step.
    template <int S> __device__ __forceinline__ void frag(u32 (&a)[4]) const {
        const u32 w = comp<S & 3>(q[S >> 2]);
        constexpr int j = S >> 3;                       // 32-wide block 2c + j
        const u32 wx = w ^ 0x88888888u;
        const u32 sel = ((w >> 1) & 0x44444444u) | 0x32103210u;
        const u32 m01 = prmt_keep(prmt_keep(IQ4_KV0, IQ4_KV1, w), prmt_keep(IQ4_KV2, IQ4_KV3, wx), sel);
        const u32 m23 = prmt_keep(prmt_keep(IQ4_KV0, IQ4_KV1, w >> 16), prmt_keep(IQ4_KV2, IQ4_KV3, wx >> 16), sel >> 16);
        a[0] = h2fma(__byte_perm(m01, 0x64646464u, 0x4240), cs[j][0], bs[j][0]);
        a[1] = h2fma(__byte_perm(m01, 0x64646464u, 0x4341), cs[j][1], bs[j][1]);
        a[2] = h2fma(__byte_perm(m23, 0x64646464u, 0x4240), cs[j][0], bs[j][0]);
        a[3] = h2fma(__byte_perm(m23, 0x64646464u, 0x4341), cs[j][1], bs[j][1]);
    }
};

struct UnitQ8_0 {
    static constexpr bool HAS_MIN = false, SCALED = false;
    uint4 qp;                    // the current pair's quants
    u32 dg[2][2];                // [block 2c + j][row g / g+8] as (d, d)
    float d[2], dmin[2];
    u32 amin[2];
    static constexpr int H1 = 2048;
    template <int H> __device__ __forceinline__ void load_h(const unsigned char* u, const LaneOffs& o) {
        if (H == 0) load_d<2048>(u, o);
    }
    template <int OFF> __device__ __forceinline__ void load_d(const unsigned char* u, const LaneOffs& o) {
        // the f16 d of rows g, g + 8 for blocks 2c, 2c + 1: bytes 2 (8 g + 2 c) = 16 g + 4 c
        const u32 w0 = ld32(u + OFF + o.r4), w1 = ld32(u + OFF + 128 + o.r4);
        dg[0][0] = __byte_perm(w0, 0u, 0x1010); dg[1][0] = __byte_perm(w0, 0u, 0x3232);
        dg[0][1] = __byte_perm(w1, 0u, 0x1010); dg[1][1] = __byte_perm(w1, 0u, 0x3232);
    }
    __device__ __forceinline__ void pair(const unsigned char* u, const LaneOffs& o, int p) { qp = ld128(u + p * 512 + o.q); }
    template <int S> __device__ __forceinline__ void frag(u32 (&a)[4]) const {
        constexpr int j = S >> 3;
        const u32 X = ((S & 1) ? qp.z : qp.x) ^ 0x80808080u, Y = ((S & 1) ? qp.w : qp.y) ^ 0x80808080u;
        a[0] = h2mul(h2sub(__byte_perm(X, 0x64646464u, 0x4140), H2_1152), dg[j][0]);
        a[1] = h2mul(h2sub(__byte_perm(X, 0x64646464u, 0x4342), H2_1152), dg[j][1]);
        a[2] = h2mul(h2sub(__byte_perm(Y, 0x64646464u, 0x4140), H2_1152), dg[j][0]);
        a[3] = h2mul(h2sub(__byte_perm(Y, 0x64646464u, 0x4342), H2_1152), dg[j][1]);
    }
};

struct UnitF16 {
    static constexpr bool HAS_MIN = false, SCALED = false;
    static constexpr int H1 = 4096;
    uint4 qs[2];
    float d[2], dmin[2];
    u32 amin[2];
    template <int H> __device__ __forceinline__ void load_h(const unsigned char*, const LaneOffs&) {}
    __device__ __forceinline__ void pair(const unsigned char* u, const LaneOffs& o, int p) {
        qs[0] = ld128(u + (2 * p) * 512 + o.q);
        qs[1] = ld128(u + (2 * p + 1) * 512 + o.q);
    }
    template <int S> __device__ __forceinline__ void frag(u32 (&a)[4]) const {
        const uint4& v = qs[S & 1];
        a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
    }
};

template <int QT> struct UnitOf;
template <> struct UnitOf<QT_Q4_K> { typedef UnitQ4K T; };
template <> struct UnitOf<QT_Q5_K> { typedef UnitQ5K T; };
template <> struct UnitOf<QT_Q6_K> { typedef UnitQ6K T; };
template <> struct UnitOf<QT_IQ4_XS> { typedef UnitIQ4XS T; };
template <> struct UnitOf<QT_Q8_0> { typedef UnitQ8_0 T; };
template <> struct UnitOf<QT_F16> { typedef UnitF16 T; };

// Where piece h of unit (tile, sb) sits in a matrix's tiled weight (bytes). A unit is cut in two pieces
// (U::H1 above: the second piece is k-steps 8..15's quants, the first everything else in order), and
// each pair of tiles 2i, 2i+1 of a superblock is [first piece of 2i, of 2i+1][second piece of 2i, of
// 2i+1], the pairs laid out as unit_index lays out tiles: so a pair of tiles is 2 UNIT contiguous
// bytes (a SwiGLU row block's gate or up pair: one bulk copy a stage), a group of four tiles 4 UNIT
// (a STORE / ADD row block). (The cut was made for half-superblock stages, which the H200 measured
// slower and which are gone: GPU_NOTES, thirty-seventh session.)
template <int QT> __device__ __forceinline__ long long unit_piece(int tile, int sb, int n_sb, int h) {
    constexpr int UNIT = UnitBytes<QT>::v, H1 = UnitOf<QT>::T::H1, H0 = UNIT - H1;
    const long long pair = (((long long)(tile >> 2) * n_sb + sb) * 4 + (tile & 2)) * UNIT;
    return pair + (h ? 2 * H0 + (tile & 1) * H1 : (tile & 1) * H0);
}

__device__ __forceinline__ float silu_f(float z) { return z / (1.0f + expf(-z)); }

// Pipeline geometry (the host computes the same numbers: kernels/fused_gpu.py mm_smem_bytes). A
// stage holds the row block's 4 units, then the T activation rows actually used (one superblock of
// the activation buffer: T x 256 halves, odd rows swizzled, tc_common.cuh act_index), then their
// block sums (K-quants with mins); it is sized by T, so a decode step (T = 1) stages no activation
// rows it does not use.
#define MM_B_ROW 256                       // halves per staged activation row
#define MM_SMEM_TARGET (46 * 1024)         // stages per block: four blocks (with their static smem) per SM
#define MM_MAX_STAGES 3                    // H200, bench_mm_gpu.py: 3 stages beat 4 and 5 (by 2-7%) at T = 1
template <int QT> struct MmGeom {
    static constexpr int UNIT = UnitBytes<QT>::v;
    static constexpr int A_BYTES = 4 * UNIT;
    static constexpr int H1 = UnitOf<QT>::T::H1, H0 = UNIT - H1;     // a unit's two pieces (unit_piece)
    static constexpr bool HAS_MIN = UnitOf<QT>::T::HAS_MIN;
    // A stage: the 4 units, the rows' block sums (K-quants with mins; rows in reverse order), the rows
    // (tc_common.cuh ACT_SB: sums and rows are one run in the activation buffer, one bulk copy).
    __device__ static int x_off(int n_rows) { return A_BYTES + (HAS_MIN ? n_rows * 32 : 0); }
    __device__ static int stage(int n_rows) { return (x_off(n_rows) + n_rows * MM_B_ROW * 2 + 127) & ~127; }
    __device__ static int stages(int n_rows) {
#ifdef MM_STAGES       // benchmarks (tests/bench/bench_mm_gpu.py --variants) try other depths
        return MM_STAGES;
#else
        const int n = MM_SMEM_TARGET / stage(n_rows);
        return n < 2 ? 2 : (n > MM_MAX_STAGES ? MM_MAX_STAGES : n);
#endif
    }
};

// Per-stage trace, for benchmarks only (tests/bench/stage_trace_gpu.py builds with -DMM_STAGE_TRACE;
// every other build compiles the marks to nothing). Why: inside the step's graph a T = 1 product
// runs at ~2.5 TB/s where its copies alone would run near the copy rate, and neither its arithmetic
// nor a stage's hold time explains the gap (GPU_NOTES, nineteenth session); at T = 23 the products
// cost ~2.7 ms of the verify step over their copies alone (twenty-eighth) with one stage in flight
// behind the one computed. This records, for a few blocks of every launch, when each stage's copy was
// issued, when computing warp 0 began waiting for it, when it passed the wait and when it released
// the stage (%clock of the block's multiprocessor), so the same launch can be compared in the
// graph and alone, and a wide launch's waits read against its holds.
#if defined(MM_STAGE_TRACE) && !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
#ifndef ST_SLOTS                     // (stage_trace_gpu.py --all-blocks sets all three)
#define ST_SLOTS 512                 // launches, by grid id
#endif
#ifndef ST_BLOCKS
#define ST_BLOCKS 8                  // traced blocks of a launch (spread over the grid)
#endif
#ifndef ST_STAGES
#define ST_STAGES 48                 // stages traced per block
#endif
#define ST_HEAD 10                   // grid id, entry, dependency wait passed, end, stages, n_stages, timer at entry, at end,
                                     // the stage loop's end (before the cut row blocks' exchange), multiprocessor
#define ST_REC (ST_HEAD + 4 * ST_STAGES)
extern "C" {
__device__ unsigned int mm_st_tab[ST_SLOTS * ST_BLOCKS * ST_REC];
}
__device__ __forceinline__ unsigned st_clock() {
    unsigned t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t));
    return t;
}
__device__ __forceinline__ unsigned st_timer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (unsigned)t;
}
__device__ __forceinline__ unsigned* st_record() {    // this block's record, or null when not traced
    const int every = max(1, (int)gridDim.x / ST_BLOCKS);
    if ((int)blockIdx.x % every != 0 || (int)blockIdx.x / every >= ST_BLOCKS) return nullptr;
    unsigned long long g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    unsigned* r = mm_st_tab + ((size_t)(g % ST_SLOTS) * ST_BLOCKS + blockIdx.x / every) * ST_REC;
    return r;
}
#define ST_ON 1
#else
#define ST_ON 0
#endif

// One pair of k-steps (2p, 2p+1) of the warp's tile; activations from the stage.
// boff[nt][P & 1]: byte offset of this lane's 16 bytes of pair P (minus 64 P) in the staged row
// behind MMA column g of tile nt (columns past T repeat the last row): odd rows hold pair P at
// (P ^ 1) * 64 bytes (act_index), so even and odd P get their own offset, fixed per launch.
// A staged row is [first half][second half] (act_index: pairs 0..3, then 4..7, sb_x pointing at the
// half) and ub is the unit's first or second piece (unit_piece), so pair P sits at (P & 3) * 64 in its
// half and its quants are the piece's planes of pair P & 3.
template <typename U, int NT, int P>
__device__ __forceinline__ void mm_pair(U& un, const unsigned char* ub, const unsigned char* sb_x, const int (&boff)[NT][2],
                                        const LaneOffs& lo, float (&tm)[NT][4]) {
    uint4 bq[NT];
    constexpr int PA = P & 3;                    // the pair's place in its half of the stage
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#ifdef MM_B_ONE_LOAD      // timing only (wrong results): every column tile reuses tile 0's activations, so a
        // warp reads 1/NT of the B bytes from shared memory (does the wide product wait on them?)
        bq[nt] = nt == 0 ? *(const uint4*)(sb_x + boff[0][P & 1] + PA * 64) : bq[0];
#else
#if defined(MM_DQ_PROBE) && MM_DQ_PROBE == 5       // timing only: every pair reads pair 0's activations
        bq[nt] = *(const uint4*)(sb_x + boff[nt][0]);
#else
        bq[nt] = *(const uint4*)(sb_x + boff[nt][P & 1] + PA * 64);
#endif
#endif
    }
    un.pair(ub, lo, PA);
    u32 a[4];
    un.template frag<2 * P>(a);
#if defined(MM_DQ_PROBE) && (MM_DQ_PROBE == 3 || MM_DQ_PROBE == 4)   // timing only: an XOR chain for the MMAs
#define MM_PAIR_MMA(t, a, b0, b1) (t[0] = __uint_as_float(__float_as_uint(t[0]) ^ a[0] ^ a[1] ^ a[2] ^ a[3] ^ (b0) ^ (b1)))
#else
#define MM_PAIR_MMA(t, a, b0, b1) mma16816(t, a, b0, b1)
#endif
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) MM_PAIR_MMA(tm[nt], a, bq[nt].x, bq[nt].y);
    un.template frag<2 * P + 1>(a);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) MM_PAIR_MMA(tm[nt], a, bq[nt].z, bq[nt].w);
#undef MM_PAIR_MMA
}

// The row block rb (flat over the segments) -> its segment and its index in it. A row block is
// 4 tiles of one segment (STORE / ADD), or 2 gate tiles + the 2 up tiles of the same rows (SWIGLU).
template <int MODE>
__device__ __forceinline__ void rb_locate(const MmSeg* __restrict__ segs, int n_segs, int rb, int& seg, int& lrb) {
    seg = 0;
    lrb = rb;
    if (MODE == MODE_SWIGLU) return;
    for (int s = 0; s < n_segs; ++s) {
        const int n_rb = (segs[s].n_tiles + 3) >> 2;
        if (lrb < n_rb) { seg = s; return; }
        lrb -= n_rb;
    }
}

// Tile slot q (0..3, one per warp) of row block lrb of segment seg -> (segment, tile); tile may be
// past the segment's end (then the slot is idle).
template <int MODE>
__device__ __forceinline__ void slot_tile(int seg, int lrb, int q, int& s, int& tile) {
    if (MODE == MODE_SWIGLU) {
        s = q < 2 ? 0 : 1;
        tile = lrb * 2 + (q & 1);
    } else {
        s = seg;
        tile = lrb * 4 + q;
    }
}

// The block that owns flat superblock f of W, when G blocks split [0, W) into contiguous stripes
// [i*W/G, (i+1)*W/G).
__device__ __forceinline__ int stripe_owner(long long f, long long W, int G) { return (int)(((f + 1) * G - 1) / W); }

// SwiGLU epilogue of one row block from its sums in shared memory (rows 0..31 gate, 32..63 up of
// features lrb*32 .. +31): the next product's act16 and its 32-column block sums.
#define MM_SROW 68                               // padded smem row of a row block's result
// Not inlined: one copy of this cold code for its three callers.
__device__ __noinline__ void mm_swiglu_epilogue(const float* sres, int lrb, int T, int n_ff, int tid,
                                                u16* __restrict__ out16, u16* __restrict__ outxs) {
    constexpr int F = 32, GROUPS = F / 8;
    const int items = T * GROUPS;
    if (tid >= MM_THREADS) return;               // the issuer warp (the loop below has warp shuffles only)
    for (int base = 0; base < items; base += MM_THREADS) {
        const int item = base + tid;
        const bool valid = item < items;
        const int tok = valid ? item / GROUPS : 0, grp = item % GROUPS;
        const int f0f = lrb * F + grp * 8;
        float sum = 0.0f;
        if (valid && f0f < n_ff) {
            u32 packed[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const float g0 = sres[tok * MM_SROW + grp * 8 + e], g1 = sres[tok * MM_SROW + grp * 8 + e + 1];
                const float u0 = sres[tok * MM_SROW + F + grp * 8 + e], u1 = sres[tok * MM_SROW + F + grp * 8 + e + 1];
                const u16 h0 = f2h(silu_f(g0) * u0), h1 = f2h(silu_f(g1) * u1);
                sum += h2f(h0);
                sum += h2f(h1);
                packed[e >> 1] = (u32)h0 | ((u32)h1 << 16);
            }
            *(uint4*)(out16 + act_index(tok, f0f, T)) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        }
        sum += shfl_xor(sum, 1);
        sum += shfl_xor(sum, 2);
        if (valid && (grp & 3) == 0 && f0f < n_ff && outxs != nullptr) {
            const u16 hi = f2h(sum);
            const u16 lo = f2h(sum - h2f(hi));
            outxs[xs_index(tok, f0f >> 5)] = hi;
            outxs[xs_index(tok, f0f >> 5) + 2] = lo;
        }
    }
}

// A row block wholly inside this stripe: STORE / ADD straight from the MMA fragments (no barrier);
// SwiGLU through shared memory (gate and up rows sit in different warps). IN_STAGE: sres is the
// pipeline stage the row block's last superblock was read from, which other warps may still be
// reading: a barrier first.
template <int NT, int MODE, bool IN_STAGE>
__device__ __forceinline__ void mm_epilogue_regs(const float (&acc)[NT][4], const MmSeg* s_segs, int seg, int lrb, int warp,
                                                 int lane, int T, float* sres, u16* __restrict__ out16,
                                                 u16* __restrict__ outxs) {
    const int g = lane >> 2, c = lane & 3;
    if (MODE != MODE_SWIGLU) {
        if (warp >= 4) return;                   // the issuer warp holds no tile
        const MmSeg& sg = s_segs[seg];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int tok = nt * 8 + 2 * c + (i & 1);
                const int row = lrb * 64 + warp * 16 + g + 8 * (i >> 1);
                if (tok < T && row < sg.n_rows) {
                    if (MODE == MODE_ADD) red_add_fixed((long long*)sg.y + (size_t)tok * sg.ldy + row, acc[nt][i]);
                    else ((float*)sg.y)[(size_t)tok * sg.ldy + row] = acc[nt][i];
                }
            }
    } else {
        if (IN_STAGE) mm_sync<NT>();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int tok = nt * 8 + 2 * c + (i & 1);
                if (tok < T && warp < 4) sres[tok * MM_SROW + warp * 16 + g + 8 * (i >> 1)] = acc[nt][i];
            }
        mm_sync<NT>();
        mm_swiglu_epilogue(sres, lrb, T, s_segs[0].n_rows, threadIdx.x, out16, outxs);
        mm_sync<NT>();
    }
}

// MM_ONE_ROW: a build for launches of one activation row (decode's products; kernels/fused_gpu.py picks it
// at T = 1): T is a constant, so the second halves' offset (x_half) folds into the loads' immediates and
// the epilogues' token loops go. The same arithmetic as the build for 1..8 rows, so the same bits.
#ifndef MM_ONE_ROW
#define MM_ONE_ROW 0
#endif
// MM_T_CONST = N: a build for launches of exactly N rows (fused_gpu.WIDE_T_CONST: each verify width of
// more than 8 rows gets its own), as MM_ONE_ROW is for one: the stage's size and depth, the rows' offsets
// and the second halves' offset (x_half) are constants, folded into the loads' immediates instead of
// added each stage: ~2% fewer instructions a stage, verify W=23 -0.195 ms on an H100 (GPU_NOTES,
// forty-seventh session; the stage slot made a constant as well, 5% fewer, gained nothing: forty-eighth).
// The same arithmetic, so the same bits as the general build.
#ifndef MM_T_CONST
#define MM_T_CONST 0
#endif
// A block of mm_chain (below: the products of a chain as phases of one persistent launch) carries its
// pipeline from one product to the next: the stage ring (barriers and both cursors) and the small state
// a launch keeps in static shared memory, here in the chain's dynamic shared memory (the emulator runs
// a chain's blocks side by side, where a `__shared__` object is one for all of them). The issuer warp and
// the computing warps each keep their own copy of a product's segments: the issuer starts the next
// product while the computing warps finish this one.
struct MmChainBlock {                            // (the ring: n_stages slots of `stage` bytes from dynamic smem's start)
    unsigned long long* full;                    // [n_stages] a slot's copies have landed
    unsigned long long* empty;                   // [n_stages] the four computing warps have read it
    MmSeg* segs_i;                               // [4] the issuer warp's copy
    MmSeg* segs_c;                               // [4] the computing warps' copy
    float* sres;                                 // a SwiGLU row block's result rows (one row: SROW floats)
    int* last;                                   // [2] finish_cuts' verdicts
    int stage, n_stages;
    const int* dep;                              // the previous phase's counts of finished blocks (null: none) ...
    int spread;                                  // ... block b's in dep[32 * (b % spread)]
    int poll_ns;                                 // a waiter's pause between two looks at them
    int i_k, i_round;                            // the issuer's cursor: next slot, times round the ring
    int k;                                       // the computing warps' cursor: next slot, its parity
    unsigned phase;
    bool trigger;                                // the chain's last product: lets the next launch start
};

// A chain product's issuer (lane 0) waits for the previous phase's blocks (all the grid's) to have
// finished before it issues a copy of the rows they wrote (they may be this product's input): relaxed
// looks at the counts (spread over lines so that the arrivals of hundreds of blocks do not queue on one
// address; the looks all in flight), then an acquire fence, then the proxy fence (the copies read in the
// async proxy). The first product's wait is for the launch before the chain (programmatic dependent launch).
#if defined(DFLASH_EMU)
inline int ld_relaxed(const int* p) { return std::atomic_ref<int>(*(int*)p).load(std::memory_order_relaxed); }
inline void chain_nap(int) {}
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ int ld_relaxed(const int* p) {
    return __hip_atomic_load((int*)p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ void chain_nap(int ns) { if (ns) __builtin_amdgcn_s_sleep(1); }
#else
__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void chain_nap(int ns) { if (ns) __nanosleep((unsigned)ns); }
#endif
// MM_CHAIN_FLAG=1 (fused_gpu.MM_CHAIN_FLAG, an A/B candidate): a phase's waiters look at one flag that the
// block whose arrival completes the count raises (a release add after its acquire-release count), not at the
// count itself, so the looks of hundreds of issuers do not queue with the arrivals at the count's line (the
// boundary persist_probe.py modelled, thirty-fourth to thirty-eighth sessions). The counts on one line.
#ifndef MM_CHAIN_FLAG
#define MM_CHAIN_FLAG 0
#endif
// MM_CHAIN_GIVE_UP=1 (fused_gpu.MM_CHAIN_GIVE_UP; tests/bench/chain_step_check_gpu.py, a failure hunt): a wait
// that runs out of patience records what it waited for in mm_chain_stuck and gives up instead of trapping,
// and every later wait gives up at once, so the launch ends (its results wrong) with the device usable and
// the host reads the record (fused_gpu.FusedGpu.chain_stuck): [0] waits given up, then the first one's
// block, thread, dep's address (low, high word), grid, spread, and the counts it last saw (lines 0..3).
// Each block also keeps its progress in the words after the chain's counts (mm_chain_progress: started,
// its multiprocessor, the phases it has arrived past), which the first wait to give up copies into
// mm_chain_seen, so the host sees whether the blocks a count lacks never started (not resident) or
// started and stopped inside a phase, and how many chain blocks each multiprocessor held.
#if defined(MM_CHAIN) && defined(MM_CHAIN_GIVE_UP) && !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
#define MM_CHAIN_SEEN_MAX 1024                   // (fused_gpu: a give-up build's grid at most this)
extern "C" {
__device__ int mm_chain_stuck[16];               // (C linkage: the host finds them by these names)
__device__ int mm_chain_seen[MM_CHAIN_SEEN_MAX];
}
__shared__ int* mm_chain_progress_of_block;      // this block's chain's progress words (set by mm_chain)
__device__ __forceinline__ void mm_chain_progress(int phases_past) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    mm_chain_progress_of_block[blockIdx.x] = (int)(smid << 16) | 0x8000 | phases_past;
}
__device__ __noinline__ void mm_chain_gave_up(const int* dep, int spread) {
    if (atomicAdd(&mm_chain_stuck[0], 1) == 0) {
        const unsigned long long a = (unsigned long long)dep;
        const int rec[6] = {(int)blockIdx.x, (int)threadIdx.x, (int)(a & 0xffffffffu), (int)(a >> 32),
                            (int)gridDim.x, spread};
        for (int i = 0; i < 6; ++i) mm_chain_stuck[1 + i] = rec[i];
        for (int j = 0; j < 4 && j < spread; ++j) mm_chain_stuck[7 + j] = ld_relaxed(dep + 32 * j);
        for (int b = 0; b < (int)gridDim.x && b < MM_CHAIN_SEEN_MAX; ++b)
            mm_chain_seen[b] = ld_relaxed(mm_chain_progress_of_block + b);
    }
}
#define MM_CHAIN_STUCK 1
#endif
__device__ __forceinline__ void mm_chain_wait(const int* dep, int spread, int poll_ns) {
    if (dep == nullptr) {
        grid_dependency_wait();
        return;
    }
    const int G = (int)gridDim.x;
    for (long long spins = 0;; ++spins) {
#if defined(MM_CHAIN) && MM_CHAIN_FLAG
        (void)G;
        if (ld_relaxed(dep) != 0) break;         // dep: the phase's flag, raised by its last arrival
#else
        int short_of = 0;
        for (int j = 0; j < spread; ++j)         // counter j: the blocks b = j (mod spread)
            short_of += ld_relaxed(dep + 32 * j) < (G - 1 - j) / spread + 1;
        if (short_of == 0) break;
#endif
        chain_nap(poll_ns);
#if defined(DFLASH_EMU)
        if (spins > 20000000LL) emu_fail("mm_chain: a phase's blocks never finished (deadlock)");
        emu_spin();
#elif defined(MM_CHAIN_STUCK)
        if (spins > (1LL << 25)) {
            mm_chain_gave_up(dep, spread);
            break;
        }
        if ((spins & 255) == 255 && ld_relaxed(&mm_chain_stuck[0]) != 0) break;     // another wait gave up
#elif !defined(__HIP_PLATFORM_AMD__)
        if (spins > (1LL << 25)) __trap();       // (seconds: a launch error, not a device that hangs)
#endif
    }
    fence_acq_rel();
    fence_proxy_async_global();
}

// The static shared array st of a launch, or the same array in a chain's dynamic shared memory. (A
// reference to the array either way: a pointer chosen between the two changed the code of the launches
// of two types, whose two instantiations both keep such arrays.)
template <bool C, typename T> __device__ __forceinline__ T& mm_chain_or(T& st, void* in_chain) {
    if constexpr (C) return *reinterpret_cast<T*>(in_chain);
    else return st;
}

template <int QT, int NT, int MODE, bool CHAIN = false>
__device__ __forceinline__ void mm_tc_impl(const MmSeg* __restrict__ segs, int n_segs, const u16* __restrict__ x16,
                                           const u16* __restrict__ xs, int n_sb, int T_launch,
                                           float* __restrict__ ws, int* __restrict__ counters,
                                           u16* __restrict__ out16, u16* __restrict__ outxs,
                                           const int bid, const int Gn,   // this block in the part's own grid of Gn
                                           MmChainBlock* ch = nullptr) {  // CHAIN: the block's state (mm_chain)
    typedef typename UnitOf<QT>::T U;
    typedef MmGeom<QT> G;
    constexpr int UNIT = G::UNIT;
    constexpr int ROWS = 64;                     // rows (4 tiles) per row block
    constexpr int SROW = MM_SROW;
    static_assert(!CHAIN || (MM_SEPARATE_ISSUER(NT) && MM_ONE_ROW), "a chain runs decode's one-row products");
    DYN_SMEM(unsigned char, smem);               // n_stages pipeline stages (a chain: its ring)
    // A SwiGLU row block's result rows (T x SROW floats). At NT = 4 (T = 25..32) they live in the
    // stage the row block's last superblock was read from (T rows of 512 bytes a stage hold T rows
    // of SROW floats), which the block-barrier pipeline refills only after the next stage's
    // barrier: without these 8.7 KB of static shared memory a T = 32 gate|up launch fits four
    // blocks a multiprocessor, not three (its fixed grid in two waves). Narrower launches keep
    // static rows: they fit four blocks either way (registers allow no fifth), and the separate
    // issuer (T <= 8) refills a stage as soon as its warps release it.
    constexpr bool SRES_IN_STAGE = MODE == MODE_SWIGLU && NT >= 4 && !MM_SEPARATE_ISSUER(NT);
    // MM_TAIL_PREFETCH (0 off; 3 since the forty-second session's A/B: decode -0.29 ms, verify W=23 -0.68 ms on
    // the H100, GPU_NOTES): a wide SwiGLU launch's stripe ending on a row block that the next
    // stripe finishes (two parts; the next stripe's part is its head, done early and counted with release)
    // polls that count this many superblocks before its end, and once the part has arrived, copies it into
    // sres_static, which the loop leaves idle. At its end the block then adds it to its own sums (the same
    // order as `finish`: 0 + its part + the next) and runs the epilogue: no partial stored, no arrival
    // counted, no partial loaded after the loop. When the part has not arrived, the exchange below.
    // Decode's one-row build (the separate issuer; a partial is one row, 64 floats) does the same with
    // computing warp 0's lanes loading the partial into two registers each (TAIL_PREF_ROW).
#ifndef MM_TAIL_PREFETCH
#define MM_TAIL_PREFETCH 3
#endif
    constexpr bool TAIL_PREF_ROW = MM_TAIL_PREFETCH > 0 && MODE == MODE_SWIGLU && MM_ONE_ROW && MM_SEPARATE_ISSUER(NT)
                                   && !CHAIN;
    constexpr bool TAIL_PREF_WIDE = MM_TAIL_PREFETCH > 0 && MODE == MODE_SWIGLU && NT > 1 && !SRES_IN_STAGE
                                    && !MM_SEPARATE_ISSUER(NT);
    constexpr bool TAIL_PREF = TAIL_PREF_WIDE || TAIL_PREF_ROW;
    // (TAIL_PREF_WIDE's bulk copy lands in sres_static: the copy's shared address must be 16-byte aligned;
    // other builds keep a float's alignment, their shared-memory layout unchanged)
    constexpr int SRES_ALIGN = TAIL_PREF_WIDE ? 16 : 4;
    // (A chain keeps these in its dynamic shared memory: mm_chain_or.)
    __shared__ __align__(SRES_ALIGN) float sres_static_[MODE == MODE_SWIGLU && !SRES_IN_STAGE ? (CHAIN ? SROW : 32 * SROW) : 1];
    __shared__ int s_last_[2];
    auto& sres_static = mm_chain_or<CHAIN>(sres_static_, CHAIN ? ch->sres : nullptr);
    auto& s_last = mm_chain_or<CHAIN>(s_last_, CHAIN ? ch->last : nullptr);
    __shared__ __align__(8) unsigned long long s_pref_bar[1];
    __shared__ int s_pref[1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    static_assert(!MM_ONE_ROW || NT == 1, "a one-row build is a build of one column tile");
    const int T = MM_ONE_ROW ? 1 : (MM_T_CONST > 0 ? MM_T_CONST : T_launch);
    const int n_rows_b = min(T, NT * 8);         // activation rows staged (only the real ones)
    const int STAGE = CHAIN ? ch->stage : (MM_T_CONST > 0 ? G::stage(n_rows_b) : keep_reg(G::stage(n_rows_b)));
    const int n_stages = CHAIN ? ch->n_stages : G::stages(n_rows_b);
    const int X_OFF = MM_T_CONST > 0 ? G::x_off(n_rows_b) : keep_reg(G::x_off(n_rows_b));
    int brow[NT];                                // MMA columns past T read the last real row
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) brow[nt] = min(nt * 8 + g, n_rows_b - 1);
    int boff[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int base = brow[nt] * MM_B_ROW + c * 16, swz = 64 * (brow[nt] & 1);    // (half rows: 256 bytes)
        boff[nt][0] = keep_reg(base + swz);
        boff[nt][1] = keep_reg(base - swz);
    }

    // This block's stripe of the flat (row block, superblock) space: the split depends on the
    // matrix and the grid only (never on T), so every row is summed in the same order whatever T.
    // Flat indices stay 32-bit and advance incrementally: 64-bit divisions in the loop cost more
    // issue slots than the copies they address.
    int n_rb = 0;
    if (MODE == MODE_SWIGLU) n_rb = (segs[0].n_tiles + 1) >> 1;
    else
        for (int s = 0; s < n_segs; ++s) n_rb += (segs[s].n_tiles + 3) >> 2;
    const int W = n_rb * n_sb;
    const int f0 = (int)((long long)bid * W / Gn), f1 = (int)((long long)(bid + 1) * W / Gn);
#if ST_ON
    // Thread 0 (computing warp 0's lane 0) records the waits and releases, the issuer warp's lane 0 the
    // issues; at T > 8 warp 0 is both, and one pointer serves (a second one spilled at NT = 3).
    unsigned* st_rec = tid == 0 ? st_record() : nullptr;
    unsigned* st_iss = !MM_SEPARATE_ISSUER(NT) ? st_rec : ((warp == MM_ISSUER(NT) && lane == 0) ? st_record() : nullptr);
    if (st_rec) {
        unsigned long long g;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
        st_rec[0] = (unsigned)g; st_rec[1] = st_clock(); st_rec[4] = (unsigned)(f1 - f0); st_rec[6] = st_timer();
    }
#define ST_MARK(ptr, i, field) do { if ((ptr) && (i) < ST_STAGES) (ptr)[ST_HEAD + 4 * (i) + (field)] = st_clock(); } while (0)
#else
#define ST_MARK(ptr, i, field) do { } while (0)
#endif

    // Stage k holds flat superblock f: the row block's 4 units, the T activation rows, their block
    // sums. The issuer warp (MM_ISSUER) issues each stage as bulk copies completing on the stage's
    // "full" mbarrier (TMA on sm_90: lane 0 issues the units and the activation rows; without TMA
    // the warp copies them itself, tc_common.cuh stage_copy). Each computing
    // warp releases a stage on its "empty" mbarrier as soon as it has read it; the issuer refills a
    // stage once all four have, so up to n_stages superblocks are in flight and no block-wide
    // barrier holds a warp behind the slowest one (a __syncthreads per stage was the largest stall
    // reason in ncu).
    //
    // Programmatic dependent launch: the issuer warp of T <= 8 lets the next kernel launch once it
    // has issued all but the last MM_TRIGGER_AHEAD superblocks of its stripe (its blocks then start
    // beside this grid's last ones and request their weights while this grid's last stages compute
    // and exchange; they wait for this grid's end before reading what it writes). 27B decode graph,
    // same session: 7.50 ms triggering at the end, 7.27 at the last issue, 7.24 four superblocks
    // before it, 7.14-7.16 from 8 to 16 and at the loop's start (an older build that triggered at
    // the kernel's start ran 0.5 ms slower). Wider batches: MM_WIDE_TRIGGER_AHEAD below.
#ifndef MM_TRIGGER_AHEAD
#define MM_TRIGGER_AHEAD 12
#endif
// Wider batches (warp 0 issues and computes) trigger once warp 0 has issued the last superblock of
// its stripe (0; -1: at the block's end; n: n superblocks before the last issue). H200, 38th session,
// ab_bench.sh, verify graph against the block's end: W = 16 / 23 / 32 -0.37 / -0.40 / -0.25 ms at 0,
// -0.19 / -0.10 / -0.16 at 1, mixed at 2 and 8; decode's launches are not these. (In the tenth session,
// before v23 made a wide stage two bulk copies, warp 0's issue tail was long and 0 cost 0.1-0.6 ms.)
#ifndef MM_WIDE_TRIGGER_AHEAD
#define MM_WIDE_TRIGGER_AHEAD 0
#endif
    constexpr int ISSUER = MM_ISSUER(NT);
    constexpr bool SEPARATE = MM_SEPARATE_ISSUER(NT);
    // Wider batches (warp 0 issues and computes): a block barrier per stage, the refill of the
    // stage just left issued after it. H200, bench_mm_gpu.py: the empty-barrier pipeline is 2-7%
    // slower on every T = 23 shape there (gate|up 61.3 against 59.6 us; 15-20% while warp 0 still
    // issued one copy per activation row) while it gained 9% at T = 1 with the separate issuer.
#ifndef MM_BARRIER_PIPE
#define MM_BARRIER_PIPE 1
#endif
    constexpr bool BARRIER_PIPE = !SEPARATE && MM_BARRIER_PIPE;
    static_assert(!SRES_IN_STAGE || BARRIER_PIPE, "result rows in a stage need the block-barrier pipeline");
    __shared__ MmSeg s_segs_[4];
    __shared__ __align__(8) unsigned long long s_full_[8];
    __shared__ __align__(8) unsigned long long s_empty_[8];
    auto& s_segs = mm_chain_or<CHAIN>(s_segs_, CHAIN ? (warp == ISSUER ? ch->segs_i : ch->segs_c) : nullptr);
    auto& s_full = mm_chain_or<CHAIN>(s_full_, CHAIN ? ch->full : nullptr);
    auto& s_empty = mm_chain_or<CHAIN>(s_empty_, CHAIN ? ch->empty : nullptr);
    if constexpr (CHAIN) {                       // (the ring's barriers are set up once, by mm_chain)
        if (warp == ISSUER) {
            if (lane < n_segs && lane < 4) s_segs[lane] = segs[lane];
            warp_sync();
        } else {
            if (tid < n_segs && tid < 4) s_segs[tid] = segs[tid];
            mm_sync<NT>();
        }
    } else {
        if (tid < n_segs && tid < 4) s_segs[tid] = segs[tid];
        if (tid == 0)
            for (int k = 0; k < n_stages; ++k) {
                mbar_init(&s_full[k], 1);
                mbar_init(&s_empty[k], 4);       // the four computing warps
            }
        if (TAIL_PREF && tid == 0) {
            mbar_init(&s_pref_bar[0], 1);
            s_pref[0] = 0;
        }
        __syncthreads();
    }
#ifdef MM_ACT_ROWS_CAP    // timing only (wrong results): each stage copies only this many activation rows, the
    // rest of the stage keeps stale bytes (what do the wide product's activation copies cost?)
    const int n_rows_copy = min(n_rows_b, MM_ACT_ROWS_CAP);
#else
    const int n_rows_copy = n_rows_b;
#endif
    const unsigned b_bytes = (unsigned)n_rows_copy * 512u + (U::HAS_MIN ? (unsigned)n_rows_b * 32u : 0u);
    int i_f = f0, i_rb = f0 / max(n_sb, 1), i_sb = f0 - i_rb * n_sb, i_k = CHAIN ? ch->i_k : 0, i_seg = 0, i_lrb = 0;
    int i_round = CHAIN ? ch->i_round : 0;       // times the issuer's cursor has gone round the stages
    rb_locate<MODE>(s_segs, n_segs, i_rb, i_seg, i_lrb);
    // The row block's units of one superblock as runs of consecutive tiles (unit_index): one run of
    // four tiles (STORE / ADD), or the gate pair and the up pair (SwiGLU); a run is cut short where
    // its matrix ends (the slots past it stay idle).
    constexpr int RUNS = MODE == MODE_SWIGLU ? 2 : 1, RUN_TILES = 4 / RUNS;
    auto issue_w = [&]() {                       // the issuer warp: lane 0 arms the barrier, the units
        const unsigned char* src[RUNS];
        unsigned nb[RUNS];
        unsigned bytes = b_bytes;
#pragma unroll
        for (int r = 0; r < RUNS; ++r) {         // whole pairs of tiles (a matrix's last one padded)
            int s, tile;
            slot_tile<MODE>(i_seg, i_lrb, r * RUN_TILES, s, tile);
            const int n = min(RUN_TILES, s_segs[s].n_tiles - tile);
            nb[r] = n > 0 ? (unsigned)((n + 1) & ~1) * UNIT : 0u;
            bytes += nb[r];
            src[r] = (const unsigned char*)s_segs[s].w + unit_index(tile, i_sb, n_sb) * UNIT;
        }
        unsigned char* st = smem + i_k * STAGE;
        ST_MARK(st_iss, i_f - f0, 0);
        if (lane == 0) mbar_expect(&s_full[i_k], bytes);
        warp_sync();                             // announced before any lane's bytes count off
#pragma unroll
        for (int r = 0; r < RUNS; ++r)
            if (nb[r]) stage_copy(st + r * RUN_TILES * UNIT, src[r], nb[r], &s_full[i_k], lane);
    };
    auto issue_x = [&](int k, int sb) {          // the issuer warp: superblock sb of the T rows (and their sums)
        unsigned char* st = smem + k * STAGE;
        if (U::HAS_MIN)
            stage_copy(st + G::A_BYTES, xs + (size_t)sb * ACT_SB + (ACT_ROWS - n_rows_b) * 16, b_bytes, &s_full[k], lane);
        else
            stage_copy(st + G::A_BYTES, x16 + (size_t)sb * ACT_SB, b_bytes, &s_full[k], lane);
    };
    auto advance = [&]() {
        ++i_f;
        if (++i_k == n_stages) {
            i_k = 0;
            ++i_round;
        }
        if (++i_sb == n_sb) {
            i_sb = 0;
            ++i_rb;
            rb_locate<MODE>(s_segs, n_segs, i_rb, i_seg, i_lrb);
        }
    };
    // The issuer warp's next stage (all its lanes): once the stage's previous superblock has been
    // released by the computing warps (completion i_round - 1 of its empty barrier).
    auto issue_next = [&]() {
        if (!BARRIER_PIPE && i_round > 0) mbar_wait(&s_empty[i_k], (unsigned)(i_round - 1) & 1u);
        issue_w();
        issue_x(i_k, i_sb);
        advance();
    };

    // Weights do not depend on the previous kernel: the first stages' are requested before
    // waiting for it (programmatic dependent launch), the activations after.
    const int n_pro = min(BARRIER_PIPE ? n_stages - 1 : n_stages, f1 - f0);
    const int k_pro = i_k;                       // the issuer's slot of the stripe's first superblock
    if (warp == ISSUER) {
        for (int k = 0; k < n_pro; ++k) {
            // (a chain's ring is not empty at a product's start: its slots free as the previous product's
            // last superblocks are read)
            if (CHAIN && i_round > 0) mbar_wait(&s_empty[i_k], (unsigned)(i_round - 1) & 1u);
            issue_w();
            advance();
        }
    }
    if constexpr (CHAIN) {
        if (warp == ISSUER) {
            if (lane == 0) mm_chain_wait(ch->dep, ch->spread, ch->poll_ns);
            warp_sync();
        }
    } else {
        grid_dependency_wait();
    }
#if ST_ON
    if (st_rec) { st_rec[2] = st_clock(); st_rec[5] = (unsigned)n_stages; }
#endif
    if (warp == ISSUER) {
        int sbk = f0 - (f0 / max(n_sb, 1)) * n_sb;
        for (int k = 0; k < n_pro; ++k) {
            issue_x(CHAIN ? (k_pro + k) % n_stages : k, sbk);
            if (++sbk == n_sb) sbk = 0;
        }
    }
    if (SEPARATE && warp == ISSUER) {            // the issuer warp's whole job; it joins no barrier
        while (i_f < f1) {
            issue_next();
            if ((!CHAIN || ch->trigger) && i_f >= f1 - MM_TRIGGER_AHEAD) trigger_dependents();   // (once: repeats are no-ops)
        }
        if constexpr (CHAIN) {                   // the next product starts from here
            ch->i_k = i_k;
            ch->i_round = i_round;
            if (ch->trigger) trigger_dependents();
        } else {
            trigger_dependents();                // a stripe the prologue issued whole
        }
        return;
    }

    float acc[NT][4];
    // acc += superblock's sums tm: d * tm, less dmin times the min MMA of the mins against the block sums
    // bm (K-quants); the order every build keeps (a row's bits do not depend on the launch's width).
    auto add_superblock = [&](const U& un, const float (&tm)[NT][4], const uint2 (&bm)[NT]) {
        if (U::HAS_MIN) {
            const u32 am[4] = {un.amin[0], un.amin[1], un.amin[0], un.amin[1]};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float mn[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma16816(mn, am, bm[nt].x, bm[nt].y);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float a1 = fmaf(un.d[i >> 1], tm[nt][i], acc[nt][i]);
                    acc[nt][i] = fmaf(-un.dmin[i >> 1], mn[i], a1);
                }
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    acc[nt][i] = U::SCALED ? fmaf(un.d[i >> 1], tm[nt][i], acc[nt][i]) : acc[nt][i] + tm[nt][i];
        }
    };
    const BarRef full0 = keep_bar(bar_ref(&s_full[0])), empty0 = keep_bar(bar_ref(&s_empty[0]));
    const LaneOffs lo = LaneOffs::kept(lane);    // lane offsets kept in registers for the loop
    int xs_lane[NT];                             // byte offset of this lane's block sums of tile nt
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xs_lane[nt] = keep_reg(G::A_BYTES + (n_rows_b - 1 - brow[nt]) * 32 + c * 8);
    // This warp's unit in a stage: the stage holds its row block's pairs of tiles as copied (unit_piece:
    // [first pieces][second pieces] a pair); w_off / w_off1: the unit's first and second piece.
    // x_half: where the staged rows' second halves start (after the T first halves).
    const int w_off = keep_reg((warp >> 1) * 2 * UNIT + (warp & 1) * G::H0);
    const int w_off1 = keep_reg((warp >> 1) * 2 * UNIT + 2 * G::H0 + (warp & 1) * G::H1);
    const int x_half = MM_ONE_ROW ? MM_B_ROW
                                  : (MM_T_CONST > 0 ? n_rows_b * MM_B_ROW : keep_reg(n_rows_b * MM_B_ROW));
    int seg = 0, lrb = 0, s_w = 0, tile_w = 0;
    bool ok = false;
    int tail_rb = -1;                            // the stripe's last row block, when a later stripe ends it
    int k = CHAIN ? ch->k : 0, rb = f0 / max(n_sb, 1);
    unsigned phase = CHAIN ? ch->phase : 0u;
    // The result rows of a SwiGLU row block whose last superblock here was read from stage k_last
    // (at the stripe's end no copy is in flight: any stage will do).
    auto res_rows = [&](int k_last) -> float* { return SRES_IN_STAGE ? (float*)(smem + k_last * STAGE) : sres_static; };
    // A cut row block's partial sums, in this block's workspace slot (1 when it is the row block's
    // first part, else 0; a stripe cuts at most two row blocks, its first and its last).
    auto put_partial = [&](int rbx, const float (&a)[NT][4]) {
        const int first = stripe_owner((long long)rbx * n_sb, W, Gn);
        const int slot = bid == first ? 1 : 0;
        float* part = ws + ((size_t)bid * 2 + slot) * (size_t)(T * ROWS);
        if (warp >= 4) return;                   // the issuer warp holds no tile
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int tok = nt * 8 + 2 * c + (i & 1);
                if (tok < T) part[tok * ROWS + warp * 16 + g + 8 * (i >> 1)] = a[nt][i];
            }
    };
    // A cut row block: each of its stripes stores its partial and counts its arrival; the last to
    // arrive adds all of them in stripe order (deterministic, whatever T) and runs the epilogue.
    auto parts_of = [&](int rbx, int& first, int& n_part) {
        const long long fa = (long long)rbx * n_sb;
        first = stripe_owner(fa, W, Gn);
        n_part = stripe_owner(fa + n_sb - 1, W, Gn) - first + 1;
    };
    // The last part of a cut row block to arrive sums all parts' partials from the workspace (its
    // own included) and runs the epilogue; every computing thread calls it, after an acquire.
    auto finish = [&](int rbx) {
        const int n_el = T * ROWS;
        int first, n_part;
        parts_of(rbx, first, n_part);
        int sgx, lrx;
        rb_locate<MODE>(s_segs, n_segs, rbx, sgx, lrx);
        // Each computing thread sums elements tid + MM_THREADS * e of all partials, walking the
        // partials in stripe order R at a time with every load of a round in flight (one round for
        // the <= 8 parts of a decode launch; element by element, a 23-row launch waited on ~24
        // rounds of L2 latency here). Every element is still 0 + p_first + p_first+1 + ... in that
        // order, whatever T. (ADD never gets here: its parts add in fixed point.)
        constexpr int EPT = NT * 8 * ROWS / MM_THREADS;
        constexpr int R = NT == 1 ? 8 : (NT == 2 ? 4 : 2);
        const MmSeg& sg = s_segs[sgx];
        float* y = (float*)sg.y;
        float v[EPT];
#pragma unroll
        for (int e = 0; e < EPT; ++e) v[e] = 0.0f;
        if (tid < MM_THREADS) {
            const int end = first + n_part;
            for (int p0 = first; p0 < end; p0 += R) {
                float l[R][EPT];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int p = p0 + r;
                    const float* b = ws + ((size_t)p * 2 + (p == first ? 1 : 0)) * (size_t)n_el;
#pragma unroll
                    for (int e = 0; e < EPT; ++e) {
                        const int i = tid + MM_THREADS * e;
                        l[r][e] = (p < end && i < n_el) ? ldcg_f32(b + i) : 0.0f;
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int e = 0; e < EPT; ++e)
                        if (p0 + r < end) v[e] += l[r][e];
            }
        }
        if (MODE == MODE_SWIGLU) {
            if (tid < MM_THREADS) {
#pragma unroll
                for (int e = 0; e < EPT; ++e) {
                    const int i = tid + MM_THREADS * e;
                    if (i < n_el) res_rows(0)[(i / ROWS) * SROW + (i % ROWS)] = v[e];
                }
            }
            mm_sync<NT>();
            // Benchmarks: MM_EXCH_FINISH_PROBE 1 sums the partials but runs no epilogue (wrong results),
            // 2 runs the epilogue twice, the second time from a warm instruction cache (same results).
#if !defined(MM_EXCH_FINISH_PROBE) || MM_EXCH_FINISH_PROBE != 1
            mm_swiglu_epilogue(res_rows(0), lrx, T, s_segs[0].n_rows, tid, out16, outxs);
#endif
#if defined(MM_EXCH_FINISH_PROBE) && MM_EXCH_FINISH_PROBE == 2
            mm_sync<NT>();
            mm_swiglu_epilogue(res_rows(0), lrx, T, s_segs[0].n_rows, tid, out16, outxs);
#endif
        } else if (tid < MM_THREADS) {
#pragma unroll
            for (int e = 0; e < EPT; ++e) {
                const int i = tid + MM_THREADS * e, row = lrx * ROWS + i % ROWS;
                if (i < n_el && row < sg.n_rows) y[(size_t)(i / ROWS) * sg.ldy + row] = v[e];
            }
        }
        if (tid == 0) counters[rbx] = 0;
        mm_sync<NT>();                           // the result rows are reused
    };
    // The stripe's first row block, cut by the previous stripe, is done early in the loop: its
    // partial is stored and its arrival counted with release semantics only, so no warp waits for
    // the count here (an acquire-release arrival and a barrier after it stalled the whole block
    // for an L2 round trip mid-stripe). The previous stripe reaches that row block at its end, so
    // it is nearly always the last part and sums; when the head is last after all, the block
    // finds out at its own end (head_old) and sums then.
    int head_rb = -1, head_old = 0;
    auto arrive_head = [&](int rbx, const float (&a)[NT][4]) {
        put_partial(rbx, a);
#ifdef MM_EXCH_NO_HEAD_ARRIVAL  // benchmarks: the head's barrier and release arrival left out
        return;
#endif
        mm_sync<NT>();                           // every thread's partial before thread 0's release
        if (tid == 0) head_old = atomic_add_release(&counters[rbx], 1);
        head_rb = rbx;
    };
    // The superblock after which warp 0 polls for row block rbx: the stripe's last, when it starts in this
    // stripe and the next stripe holds its only other part; else -1.
    auto poll_point = [&](int rbx) {
        return (rbx + 1) * n_sb > f1 && rbx * n_sb >= f0
               && stripe_owner((long long)rbx * n_sb + n_sb - 1, W, Gn) == bid + 1
               ? max(f1 - 1 - MM_TAIL_PREFETCH, rbx * n_sb) : -1;
    };
    // MM_TAIL_PREFETCH: warp 0, at poll_point(rbx): has the next stripe's part arrived? Then fetch its
    // partial: a bulk copy into sres_static (wide), two floats a lane of warp 0 (one row).
    float pv[2] = {0.0f, 0.0f};                  // TAIL_PREF_ROW: warp 0's lanes' share of the partial
    auto poll_tail = [&](int rbx) {
        if (warp != (TAIL_PREF_ROW ? 0 : ISSUER)) return;
        int arrived = 0;
        if (lane == 0) arrived = ld_acquire(&counters[rbx]) == 1;
        arrived = (int)shfl((u32)arrived, 0);
        if (TAIL_PREF_ROW && arrived) {
            warp_sync();                         // lane 0's acquire, then every lane's loads
            const float* part = ws + (size_t)(bid + 1) * 2 * (size_t)ROWS;
            pv[0] = ldcg_f32(part + 2 * lane);
            pv[1] = ldcg_f32(part + 2 * lane + 1);
            if (lane == 0) s_pref[0] = 1;
        } else if (arrived) {
            const unsigned bytes = (unsigned)(T * ROWS) * 4u;
            fence_proxy_async_global();          // the acquired partial, then the copy that reads it
            if (lane == 0) mbar_expect(&s_pref_bar[0], bytes);
            warp_sync();
            stage_copy(sres_static, ws + (size_t)(bid + 1) * 2 * (size_t)(T * ROWS), bytes, &s_pref_bar[0], lane);
            if (lane == 0) s_pref[0] = 1;
        }
    };
    // ... and at the stripe's end: its sums plus that partial, in `finish`'s order, then the epilogue.
    auto finish_prefetched = [&](int rbx, const float (&a)[NT][4]) {
        if (TAIL_PREF_ROW) {
            if (warp == 0) {
                sres_static[2 * lane] = pv[0];
                sres_static[2 * lane + 1] = pv[1];
            }
            mm_sync<NT>();
        } else {
            mbar_wait(&s_pref_bar[0], 0u);
        }
        float v[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int tok = nt * 8 + 2 * c + (i & 1);
                v[nt][i] = tok < T ? (0.0f + a[nt][i]) + sres_static[tok * ROWS + warp * 16 + g + 8 * (i >> 1)] : 0.0f;
            }
        // (IN_STAGE: a barrier before the rows overwrite the partial other threads are reading)
        mm_epilogue_regs<NT, MODE, true>(v, s_segs, 0, rbx, warp, lane, T, sres_static, out16, outxs);
        if (tid == 0) counters[rbx] = 0;
    };
    // At the stripe's end: the tail row block's arrival (acquire-release), then whichever of the
    // two this block was last for.
    auto finish_cuts = [&](int tail, const float (&a)[NT][4]) {
        if (TAIL_PREF && tail >= 0) {
            mm_sync<NT>();                       // warp 0's s_pref, for every thread
            if (s_pref[0]) {
                finish_prefetched(tail, a);
                tail = -1;                       // no partial stored, no arrival counted
            }
        }
        if (tail >= 0) put_partial(tail, a);
        mm_sync<NT>();
        if (tid == 0) {
            int first, n_part;
            bool head_last = false, tail_last = false;
            if (head_rb >= 0) {
                parts_of(head_rb, first, n_part);
                head_last = head_old == n_part - 1;
            }
            if (tail >= 0) {
                parts_of(tail, first, n_part);
                tail_last = atomic_add_acq_rel(&counters[tail], 1) == n_part - 1;
            }
            if (head_last) fence_acq_rel();
            s_last[0] = head_last;
            s_last[1] = tail_last;
        }
        mm_sync<NT>();
#ifdef MM_EXCH_NO_FINISH        // benchmarks: arrivals only, no part sums its row block
        return;
#endif
        // One call site: this code runs once per launch, from a cold instruction cache (two
        // inlined copies were 800 more instructions and ~0.5 us more per gate|up launch).
#pragma unroll 1
        for (int w = 0; w < 2; ++w)
            if (s_last[w]) finish(w == 0 ? head_rb : tail);
    };
    auto new_row_block = [&]() {
        rb_locate<MODE>(s_segs, n_segs, rb, seg, lrb);
        slot_tile<MODE>(seg, lrb, warp, s_w, tile_w);
        ok = warp < 4 && tile_w < s_segs[s_w].n_tiles;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
    };
    // Superblock f in stage k: wait for it, add its products to acc, release the stage.
    auto run_stage = [&](int f) {
        // Warp 0 as the issuer refills the stage of superblock f - 1 (never f's own: it would wait
        // on itself) once every warp has released it.
        if (BARRIER_PIPE) {
            __syncthreads();                     // everyone is done with the stage refilled below
            if (warp == ISSUER && i_f < f1) issue_next();
        } else if (!SEPARATE && warp == ISSUER && f > f0 && i_f < f1) {
            issue_next();
        }
        if (MM_WIDE_TRIGGER_AHEAD >= 0 && !SEPARATE && warp == ISSUER && i_f >= f1 - MM_WIDE_TRIGGER_AHEAD)
            trigger_dependents();
        ST_MARK(st_rec, f - f0, 1);
        mbar_wait(bar_at(full0, k), phase);      // this superblock has landed
        ST_MARK(st_rec, f - f0, 2);
        const unsigned char* st = smem + k * STAGE;
#ifdef MM_NO_COMPUTE      // benchmarks: the pipeline's loads alone
        if (st[tid] == 0xff && st[tid + 1] == 0x17) acc[0][0] += 1.0f;
#else
        if (ok) {
            const unsigned char* us = st + w_off;            // the unit's two pieces (unit_piece)
            const unsigned char* us1 = st + w_off1;
            U un;
            un.template load_h<0>(us, lo);
            un.template load_h<1>(us1, lo);
            const unsigned char* sb_x = st + X_OFF;          // the rows' first halves, then their second
            const unsigned char* sb_x1 = sb_x + x_half;
            float tm[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) tm[nt][i] = 0.0f;
            mm_pair<U, NT, 0>(un, us, sb_x, boff, lo, tm);
            mm_pair<U, NT, 1>(un, us, sb_x, boff, lo, tm);
            mm_pair<U, NT, 2>(un, us, sb_x, boff, lo, tm);
            mm_pair<U, NT, 3>(un, us, sb_x, boff, lo, tm);
            mm_pair<U, NT, 4>(un, us1, sb_x1, boff, lo, tm);
            mm_pair<U, NT, 5>(un, us1, sb_x1, boff, lo, tm);
            mm_pair<U, NT, 6>(un, us1, sb_x1, boff, lo, tm);
            mm_pair<U, NT, 7>(un, us1, sb_x1, boff, lo, tm);
            uint2 bm[NT];                        // the min term's block sums: the stage's last bytes read
            if (U::HAS_MIN)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) bm[nt] = *(const uint2*)(st + xs_lane[nt]);
            // Released before the superblock's last MMAs, its min term and its scaling (they only
            // use registers), so the issuer refills it while this warp finishes: 27B decode graph
            // -0.03 / -0.05 ms (H200, two A/Bs of two rounds; verify W=23 -0.11 in one, unchanged
            // in the other).
            warp_sync();                         // every lane's reads of the stage are done
            if (lane == 0) mbar_arrive(bar_at(empty0, k));
            ST_MARK(st_rec, f - f0, 3);
            add_superblock(un, tm, bm);
        } else {                                 // an idle slot (a tile past its matrix's end)
            warp_sync();
            if (lane == 0) mbar_arrive(bar_at(empty0, k));
        }
#endif
#ifdef MM_NO_COMPUTE
        warp_sync();
        if (lane == 0) mbar_arrive(bar_at(empty0, k));
        ST_MARK(st_rec, f - f0, 3);
#endif
    };
    // The row block's part in this stripe is done: a row block wholly in this stripe is written at
    // once; one cut between stripes (only the stripe's first and last can be) is exchanged.
    auto end_row_block = [&](int k_last) {      // (k_last: the stage of the row block's last superblock here)
#ifdef MM_NO_EXCHANGE     // benchmarks: no epilogue (every tile's result kept alive, or the
        {                     // compiler drops the MMAs of the tiles whose sums reach no memory)
            float keep = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) keep += acc[nt][i];
            if (keep == 1234.5f) ws[tid] = keep;
        }
        return;
#endif
        const bool is_head = rb * n_sb < f0, is_tail = (rb + 1) * n_sb > f1;
        if (MODE == MODE_ADD) {                  // every part adds its own sums (fixed point): no exchange
            mm_epilogue_regs<NT, MODE, SRES_IN_STAGE>(acc, s_segs, seg, lrb, warp, lane, T, res_rows(k_last), out16, outxs);
        } else if (is_tail) {
            tail_rb = rb;                        // the stripe's last superblock: exchanged after the loop
        } else if (is_head) {
#ifndef MM_NO_EXCHANGE
            arrive_head(rb, acc);
#endif
        } else {
            mm_epilogue_regs<NT, MODE, SRES_IN_STAGE>(acc, s_segs, seg, lrb, warp, lane, T, res_rows(k_last), out16, outxs);
        }
        // Ordinary stores into a stage that a bulk copy refills next (tc_common.cuh); with TAIL_PREF into
        // sres_static, where poll_tail may copy a partial later in the stripe.
        if ((SRES_IN_STAGE || TAIL_PREF) && !is_head && !is_tail) fence_proxy_async_smem();
    };
    if (NT == 1) {
        // T <= 8: one flat loop over the stripe's superblocks. (The nested loop below is ~20
        // instructions a stage shorter and as fast alone, but the 27B decode graph ran 0.085 ms
        // slower with it: 6.85 against 6.77 ms, same session; why is open.)
        int sb = f0 - rb * n_sb;
        auto next_sb = [&]() {
            if (++k == n_stages) { k = 0; phase ^= 1u; }
            if (++sb == n_sb) { sb = 0; ++rb; }
        };
        const int rb_last = (f1 - 1) / max(n_sb, 1);
        const int f_poll = TAIL_PREF_ROW ? poll_point(rb_last) : -1;
        for (int f = f0; f < f1; ++f, next_sb()) {
            if (f == f0 || sb == 0) new_row_block();
            run_stage(f);
            if (TAIL_PREF_ROW && f == f_poll) poll_tail(rb_last);
            if (sb != n_sb - 1 && f != f1 - 1) continue;
            end_row_block(k);
        }
    } else {
        // Wider batches: row blocks outside, their superblocks inside, so the inner loop carries
        // only the stage ring and f (verify graph W=32 16.5 -> 16.0 ms, W=23 -0.1 ms).
        int f = f0;
        while (f < f1) {
            new_row_block();
            const int f_end = keep_reg(min(f1, (rb + 1) * n_sb));    // the row block's last superblock here, + 1
            const int f_poll = TAIL_PREF_WIDE ? poll_point(rb) : -1;
            for (; f < f_end; ++f) {
                run_stage(f);
                if (++k == n_stages) { k = 0; phase ^= 1u; }
                if (TAIL_PREF_WIDE && f == f_poll) poll_tail(rb);
            }
            end_row_block(k == 0 ? n_stages - 1 : k - 1);
            ++rb;
        }
    }

#if ST_ON
    if (st_rec) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        st_rec[8] = st_clock(); st_rec[9] = smid;
    }
#endif
#ifndef MM_NO_EXCHANGE
    if (tail_rb >= 0 || head_rb >= 0) finish_cuts(tail_rb, acc);
#endif
#if ST_ON
    if (st_rec) { st_rec[3] = st_clock(); st_rec[7] = st_timer(); }
#endif
#undef ST_MARK
    if constexpr (CHAIN) {
        ch->k = k;
        ch->phase = phase;
    } else {
        trigger_dependents();                    // if no earlier trigger did (MM_TRIGGER_AHEAD above)
    }
}

// One launch over the matrices of two types (QT2 != 0: a projection that a llama.cpp mix types
// unevenly; Q4_K_M gives half the layers a Q6_K attn_qkv beside Q4_K z, alpha and beta, and a Q6_K
// attn_v beside Q4_K q and k): segments [0, n_segs_a) are QT, the rest QT2. Blocks [0, split) run
// the first part as a grid of their own and the others the second, each part with its own stripes
// (fixed by its matrices and its share of the grid, never by T: fused_gpu.mm_parts), workspace
// slots and row-block counters, so every row is summed as by a launch of that part alone on that
// many blocks. The parts stream side by side and the projection pays one launch boundary, not two
// (27B decode graph -0.12 ms against a launch per type: GPU_NOTES, v24).
template <int QT, int QT2, int NT, int MODE>
__device__ __forceinline__ void mm_tc_parts(const MmSeg* __restrict__ segs, int n_segs, const u16* __restrict__ x16,
                                            const u16* __restrict__ xs, int n_sb, int T, float* __restrict__ ws,
                                            int* __restrict__ counters, u16* __restrict__ out16,
                                            u16* __restrict__ outxs, int split, int n_segs_a, int n_rb_a) {
    if constexpr (QT2 == 0) {
        mm_tc_impl<QT, NT, MODE>(segs, n_segs, x16, xs, n_sb, T, ws, counters, out16, outxs, (int)blockIdx.x,
                                 (int)gridDim.x);
    } else {
        if ((int)blockIdx.x < split)
            mm_tc_impl<QT, NT, MODE>(segs, n_segs_a, x16, xs, n_sb, T, ws, counters, out16, outxs, (int)blockIdx.x,
                                     split);
        else
            mm_tc_impl<QT2, NT, MODE>(segs + n_segs_a, n_segs - n_segs_a, x16, xs, n_sb, T,
                                      ws + (size_t)2 * split * T * 64, counters + n_rb_a, out16, outxs,
                                      (int)blockIdx.x - split, (int)gridDim.x - split);
    }
}

#if defined(MM_QT)
// One instantiation per module: -DMM_QT=<ggml type> -DMM_NT=<1..4> -DMM_MODE=<0..2>, and -DMM_QT2=<ggml
// type> for a launch of two types (mm_tc_parts; a single-type build ignores the last three arguments).
#ifndef MM_QT2
#define MM_QT2 0
#endif
#if defined(MM_MAXNREG)         // a register cap instead of the occupancy bound (benchmarks)
#define MM_BOUNDS __maxnreg__(MM_MAXNREG)
#else
#define MM_BOUNDS __launch_bounds__(MM_BLOCK_THREADS(MM_NT), 4)
#endif
extern "C" __global__ void MM_BOUNDS
mm_tc(const MmSeg* __restrict__ segs, int n_segs, const u16* __restrict__ x16, const u16* __restrict__ xs,
      int n_sb, int T, float* __restrict__ ws, int* __restrict__ counters,
      u16* __restrict__ out16, u16* __restrict__ outxs, int split, int n_segs_a, int n_rb_a) { TL_SCOPE;
    mm_tc_parts<MM_QT, MM_QT2, MM_NT, MM_MODE>(segs, n_segs, x16, xs, n_sb, T, ws, counters, out16, outxs, split,
                                               n_segs_a, n_rb_a);
}
#elif defined(MM_CHAIN)
// ---------------------------------------------------------------------------------------------
// mm_chain: decode's products (T = 1, the one-row build: -DMM_ONE_ROW=1) as phases of one persistent
// launch, each block walking every product's stripe in turn (an A/B candidate: how much of the step's
// launch chain a persistent step would save, measured on its heaviest part; tests/bench/bench_chain_gpu.py).
// Why: in the launch chain a product's blocks start only as the previous grid's blocks retire, and wait
// for that grid's end before their first activation copy; here a block that has finished its stripe
// of product p at once requests product p+1's first weights into the slots its own last stages free,
// then waits for p's count of finished blocks (every block of the chain: a product may read any row
// the previous one wrote), then copies the activations. The ring, its barriers and cursors carry over
// from product to product (MmChainBlock); the issuer warp may be one product ahead of the computing
// warps. Every product runs mm_tc_impl on its own stripes (its launch's grid gx, its split for two
// types), so its bits are those of its own launch (tests/test_fused_kernels.py). Between products a chain
// may hold small phases, one-row launches of fused.cu rebuilt for a chain block's computing warps with the
// same arithmetic (below: RMSNorm prep, DeltaNet's conv, recurrence and gated norm), which the issuer skips.
//
// Products: kinds -DMM_CHAIN_K<i>=<qtype>,<qtype2 or 0>,<mode> (i < 12), a phase's `kind` indexes them;
// a small phase's kind is one of MM_CHAIN_CONV .. MM_CHAIN_PREP.
// Every block of the grid must be resident at once (the host launches at most four a multiprocessor, the
// products' own bound); done[32 * (spread * p + j)] counts the blocks b = j (mod spread) past phase p, and
// done[32 * spread * n_phases] all blocks past the last one, the last of which clears every count, so a
// graph replays the launch as it is (fused_gpu.MM_CHAIN_SPREAD, MM_CHAIN_POLL_NS: A/B knobs).
struct MmPhase {                                 // one phase: a launch's arguments (fused_gpu.op_mm_chain)
    const MmSeg* segs;
    const u16* x16;
    const u16* xs;
    float* ws;
    int* counters;
    u16* out16;                                  // (a prep's output too)
    u16* outxs;
    int kind, n_segs, n_sb, T, gx, split, n_segs_a, n_rb_a;
    // kind MM_CHAIN_PREP: fused.cu prep_rows' arguments for one row with its norm (mm_chain_prep);
    // kind MM_CHAIN_GNORM: gdn_out_prep's for one row (x = o, acc = acc_zero = z, ld = ldz, d = dv)
    const float* x;
    const float* w;
    const long long* acc;
    float* x_out;
    long long* acc_zero;
    float eps;
    int K;
    int ld, d;
    // kind MM_CHAIN_RECUR: gdn_recur's for one token and one layer slot (d = its RPT, eps = its scale)
    const unsigned long long* tbl;
    float* out;
    int nk, nv, dk, dv;
    // kind MM_CHAIN_CONV: gdn_conv's for one token, writing the state (x = conv_w, acc = qkv, ld = ldq,
    // d = Kc, tbl + slot: the state, out = rec; eps its eps; acc_zero = qkv_clear)
    const long long* ab;
    const float* dt_bias;
    const float* ssm_a;
    float* state_save;
    long long* ab_clear;
    int slot, pad_;
};
#define MM_CHAIN_PREP 255                        // a phase's kind: a prep, not a product
#define MM_CHAIN_GNORM 254                       // ... DeltaNet's gated norm of one row
#define MM_CHAIN_RECUR 253                       // ... DeltaNet's recurrence for one token
#define MM_CHAIN_CONV 252                        // ... DeltaNet's causal conv and gates for one token
#define MM_CHAIN_HEADER 8192                     // after the ring: barriers, segments, verdicts, result row, scratch
#define MM_CHAIN_MAX_STAGES 8
#include "act_write.cuh"
#include "gdn_conv.cuh"

// A prep phase (kind MM_CHAIN_PREP: the RMSNorm that fused.cu prep_rows does for one row, folding the
// residual's pending fixed-point sum) on the computing warps of blocks [0, gx), gx = the row's 256-column
// chunks: each block sums the whole row's squares itself in prep_rows' order (chunk c = columns 256c..;
// its sum the xor-tree sums of its 8 runs of 32 columns in order; the row's the chunks' in order), here
// run r of the row computed by warp r % 4, then writes its own chunk (warp 0, 8 columns a lane): x + acc
// to x_out, 0 to acc_zero, the normalised values as act16 and block sums (act_group). The same bits as
// prep_rows (tests/test_fused_kernels.py). What the chain's earlier phases wrote (x, acc) is read past L1.
__device__ __noinline__ void mm_chain_prep(const MmPhase* __restrict__ php, float* red /* [8 * 32] */) {
    const MmPhase& ph = *php;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int K = ph.K, n_runs = (K + 31) >> 5, n_chunks = (K + 255) >> 8;
    const float* x = ph.x;
    const long long* acc = ph.acc;
    for (int r0 = warp; r0 < 8 * n_chunks; r0 += 4 * 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {            // eight runs a warp, all loads in flight
            const int r = r0 + 4 * u, col = 32 * r + lane;
            const bool in = r < n_runs && col < K;
            const float xv = in ? ldcg_f32(x + col) : 0.0f;
            const long long av = (in && acc != nullptr) ? ldcg_s64(acc + col) : 0;
            v[u] = in ? (acc != nullptr ? xv + fixed_to_float(av) : xv) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            float q = v[u] * v[u];
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) q += shfl_xor(q, m);
            if (lane == 0 && r0 + 4 * u < 8 * n_chunks) red[r0 + 4 * u] = q;
        }
    }
    mm_sync<1>();
    float cs = 0.0f;                             // lane c: chunk c's sum
    if (lane < n_chunks)
#pragma unroll
        for (int w = 0; w < 8; ++w) cs += red[8 * lane + w];
    float ss = 0.0f;
    for (int c = 0; c < n_chunks; ++c) ss += __uint_as_float(shfl(__float_as_uint(cs), c));
    const float inv = rms_inv(ss, K, ph.eps);
    if (warp == 0) {
        const int n = 256 * (int)blockIdx.x + 8 * lane;          // this lane's 8 columns
        const bool valid = n < K;
        float vals[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int col = n + e;
            const bool in = valid && col < K;
            const float xv = in ? ldcg_f32(x + col) : 0.0f;
            const float v = (in && acc != nullptr) ? xv + fixed_to_float(ldcg_s64(acc + col)) : xv;
            if (in && ph.x_out != nullptr) ph.x_out[col] = v;
            if (in && ph.acc_zero != nullptr) ph.acc_zero[col] = 0;
            vals[e] = v * inv * ((in && ph.w != nullptr) ? ph.w[col] : 1.0f);
        }
        act_group(vals, valid, n, 0, 1, ph.out16, ph.outxs);
    }
    mm_sync<1>();                                // red is reused by the next prep
}

// A gated-norm phase (kind MM_CHAIN_GNORM: fused.cu gdn_out_prep for one row, y = RMSNorm(o; w) * silu(z)
// per head of d_v, then act16) on the computing warps of blocks [0, gx), 256 columns a block as
// gdn_out_prep's blocks: each head's sum of squares in its order (lane l: columns l, l + 32, ... of the
// head, then the warp's xor tree), z read and cleared, the act16 rows and block sums through act_group.
// The same bits as gdn_out_prep (tests/test_fused_kernels.py).
__device__ __noinline__ void mm_chain_gnorm(const MmPhase* __restrict__ php, float* scratch /* [2 * 256 + 1] */) {
    const MmPhase& ph = *php;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int K = ph.K, dv = ph.d, n0 = 256 * (int)blockIdx.x, count = min(256, K - n0);
    const int h0 = n0 / dv, h1 = (n0 + count - 1) / dv;
    float* vals = scratch;                       // [256]
    float* inv_h = scratch + 256;                // [257]
    const float* o = ph.x;
    long long* z = ph.acc_zero;
    for (int h = h0 + warp; h <= h1; h += MM_THREADS / 32) {
        float ss = 0.0f;
#pragma unroll 4
        for (int i = lane; i < dv; i += 32) {
            const float v = ldcg_f32(o + h * dv + i);
            ss += v * v;
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) ss += shfl_xor(ss, m);
        if (lane == 0) inv_h[h - h0] = (float)(1.0 / sqrt((double)ss / (double)dv + (double)ph.eps));
    }
    mm_sync<1>();
    for (int c = tid; c < count; c += MM_THREADS) {
        const int n = n0 + c;
        const float zv = fixed_to_float(ldcg_s64(z + n));
        z[n] = 0;                                // read: cleared for the next layer's matmul
        const float ov = ldcg_f32(o + n);
        vals[c] = silu_f(zv) * (ov * inv_h[n / dv - h0] * ph.w[n % dv]);
    }
    mm_sync<1>();
    if (warp == 0) {                             // 8 columns a lane (act_group: 4 lanes a 32-column block)
        const int n_groups = count >> 3;
        act_group(vals + 8 * min(lane, n_groups - 1), lane < n_groups, n0 + 8 * lane, 0, 1, ph.out16, ph.outxs);
    }
    mm_sync<1>();                                // the scratch is reused by the next phase
}

// A conv phase (kind MM_CHAIN_CONV: fused.cu gdn_conv for one token that advances the conv state, the decode
// step's) on the computing warps of blocks [0, 2 nk + nv + 1): a block per q / k / v head's channels and one
// for the gates, as gdn_conv's blocks, the same items in the same arithmetic (each (token, channel) output
// summed over its taps in order, silu, the q / k heads' L2 norm by one warp in gdn_conv's order; the gates'
// softplus and sigmoid), so the same bits; the old state and the taps loaded before the wait, the sums
// after it past L1, then cleared (the other parity's, as the step passes them).
__device__ __noinline__ void mm_chain_conv(const MmPhase* __restrict__ php, float* scratch /* 9 * width */,
                                           const int* dep, int spread, int poll_ns) {
    const MmPhase& ph = *php;
    const int tid = threadIdx.x, b = (int)blockIdx.x;
    const int nk = ph.nk, nv = ph.nv, dk = ph.dk, dv = ph.dv, Kc = ph.d;
    const int C = 2 * nk * dk + nv * dv, K1 = Kc - 1;
    const long long* qkv = ph.acc;
    float* rec = ph.out;
    if (b == 2 * nk + nv) {                      // the gates
        if (tid == 0) mm_chain_wait(dep, spread, poll_ns);
        mm_sync<1>();
        for (int h = tid; h < nv; h += MM_THREADS)
            gdn_gates<true>(ph.ab + h, nv, ph.dt_bias, ph.ssm_a, h, rec + C + h, rec + C + nv + h);
        mm_sync<1>();                            // every read of ab is done (ab_clear may be ab itself)
        for (int h = tid; h < nv; h += MM_THREADS) {
            ph.ab_clear[h] = 0;
            ph.ab_clear[nv + h] = 0;
        }
        mm_sync<1>();
        return;
    }
    int ch0, width;
    bool normed;
    gdn_conv_channels(b, nk, dk, dv, ch0, width, normed);
    float* state = (float*)ph.tbl[ph.slot];
    float* sm = scratch;                         // the outputs [width]
    float* sx = sm + width;                      // the newest inputs [width]
    float* s_old = sx + width;                   // the old state [K1][width]
    float* s_w = s_old + K1 * width;             // the taps [width][Kc]
    for (int e = tid; e < K1 * width; e += MM_THREADS) {
        const int j = e / width, i = e - j * width;
        const float v = state[(size_t)j * C + ch0 + i];
        s_old[e] = v;
        if (ph.state_save != nullptr) ph.state_save[(size_t)j * C + ch0 + i] = v;
    }
    for (int e = tid; e < width * Kc; e += MM_THREADS) s_w[e] = ph.x[(size_t)ch0 * Kc + e];
    if (tid == 0) mm_chain_wait(dep, spread, poll_ns);
    mm_sync<1>();
    for (int i = tid; i < width; i += MM_THREADS) {    // token 0's item of channel ch0 + i
        const int ch = ch0 + i;
        float y = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (j < Kc) {
                const float xv = j < K1 ? s_old[j * width + i] : fixed_to_float(ldcg_s64(qkv + ch));
                const float wv = s_w[i * Kc + j];
                y = j == 0 ? xv * wv : fmaf(xv, wv, y);
                if (j == K1) sx[i] = xv;
            }
        }
        sm[i] = y / (1.0f + expf(-y));
    }
    mm_sync<1>();                                // every read of the old state and of qkv is done
    for (int i = tid; i < width; i += MM_THREADS) ph.acc_zero[ch0 + i] = 0;
    for (int i = tid; i < width; i += MM_THREADS) {    // the state after this token (gdn_conv's write_state)
        const int ch = ch0 + i;
#pragma unroll
        for (int j = 0; j < 7; ++j) {
            if (j < K1) {
                const int r = 1 + j;             // X[T + j], T = 1: the old rows shift by one, the input last
                state[(size_t)j * C + ch] = r >= K1 ? sx[i] : s_old[r * width + i];
            }
        }
    }
    if (tid < 32) {                              // q / k heads: the L2 norm (one warp, gdn_conv's order)
        const int lane = tid;
        float inv = 1.0f;
        if (normed) {
            float ss = 0.0f;
            for (int i = lane; i < width; i += 32) ss += sm[i] * sm[i];
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) ss += shfl_xor(ss, m);
            inv = (float)(1.0 / sqrt((double)ss + (double)ph.eps));
        }
        for (int i = lane; i < width; i += 32) rec[ch0 + i] = normed ? sm[i] * inv : sm[i];
    }
    mm_sync<1>();                                // the scratch is reused by the next phase
}

// A recurrence phase (kind MM_CHAIN_RECUR: fused.cu gdn_recur for one token, advance or verify by its table)
// on the computing warps of blocks [0, nv * ceil(d_v / 16)): a block owns 16 value columns of one head, each
// column's d_k state rows over 8 adjacent lanes as gdn_recur's (deltanet_step.cuh dn_token<RPT, 8>: the same
// token arithmetic, so the same bits). The state is loaded (and backed up) before the wait for the phase
// before, as gdn_recur loads it before its dependency wait; q, k, v and the gates are read past L1.
#define DN_SHFL_XOR(v, m) shfl_xor(v, m)
#include "deltanet_step.cuh"
template <int RPT>
__device__ __noinline__ void mm_chain_recur(const MmPhase* __restrict__ php, float* scratch, const int* dep, int spread,
                                            int poll_ns) {
    constexpr int PARTS = 8, COLS = MM_THREADS / PARTS, DKP = PARTS * RPT;
    const MmPhase& ph = *php;
    const int tid = threadIdx.x;
    const int nk = ph.nk, nv = ph.nv, dk = ph.dk, dv = ph.dv, n_cg = (dv + COLS - 1) / COLS;
    const int h = (int)blockIdx.x / n_cg, cg = (int)blockIdx.x % n_cg, kh = h % nk;
    const unsigned long long* tbl = ph.tbl;
    const float* rec = (const float*)tbl[0];
    const float* S_in = (const float*)tbl[1] + (size_t)h * dk * dv;
    float* S_out = tbl[2] ? (float*)tbl[2] + (size_t)h * dk * dv : nullptr;
    float* S_bak = tbl[3] ? (float*)tbl[3] + (size_t)h * dk * dv : nullptr;
    const int C = 2 * nk * dk + nv * dv;
    const int lcol = tid / PARTS, col = cg * COLS + lcol, part = tid % PARTS;
    const bool col_ok = col < dv;
    const size_t cbase = (size_t)(col_ok ? col : 0) * dk;
    float s[RPT];
    dn_col_load<RPT, PARTS>(s, S_in + cbase, part, dk, col_ok);
    if (S_bak != nullptr && col_ok) dn_col_store<RPT, PARTS>(S_bak + cbase, s, part, dk);
    if (tid == 0) mm_chain_wait(dep, spread, poll_ns);
    mm_sync<1>();                                // (thread 0's acquire, then every thread's loads)
    float* sq = scratch;                         // [DKP] q, [DKP] k, [COLS] v, decay, beta
    float* sk = sq + DKP;
    float* sv = sk + DKP;
    float* sg = sv + COLS;
    for (int i = tid; i < DKP; i += MM_THREADS) {
        sq[i] = i < dk ? ldcg_f32(rec + kh * dk + i) : 0.0f;
        sk[i] = i < dk ? ldcg_f32(rec + nk * dk + kh * dk + i) : 0.0f;
    }
    if (tid < COLS) {
        const int cc = cg * COLS + tid;
        sv[tid] = cc < dv ? ldcg_f32(rec + 2 * nk * dk + h * dv + cc) : 0.0f;
    }
    if (tid == 0) {
        sg[0] = expf(ldcg_f32(rec + C + h));
        sg[1] = ldcg_f32(rec + C + nv + h);
    }
    mm_sync<1>();
    const float o = dn_token<RPT, PARTS>(s, sk, sq, sv[lcol], sg[0], sg[1], part);
    if (ph.out != nullptr && col_ok && part == 0) ph.out[(size_t)h * dv + col] = o * ph.eps;
    if (S_out != nullptr && col_ok) dn_col_store<RPT, PARTS>(S_out + cbase, s, part, dk);
    mm_sync<1>();                                // the scratch is reused by the next phase
}

template <int QT, int QT2, int MODE>
__device__ __forceinline__ void mm_chain_product(const MmPhase& ph, MmChainBlock* ch) {
    const int b = (int)blockIdx.x;
    if constexpr (QT2 == 0) {
        mm_tc_impl<QT, 1, MODE, true>(ph.segs, ph.n_segs, ph.x16, ph.xs, ph.n_sb, ph.T, ph.ws, ph.counters, ph.out16,
                                      ph.outxs, b, ph.gx, ch);
    } else if (b < ph.split) {                   // as mm_tc_parts
        mm_tc_impl<QT, 1, MODE, true>(ph.segs, ph.n_segs_a, ph.x16, ph.xs, ph.n_sb, ph.T, ph.ws, ph.counters,
                                      ph.out16, ph.outxs, b, ph.split, ch);
    } else {
        mm_tc_impl<QT2, 1, MODE, true>(ph.segs + ph.n_segs_a, ph.n_segs - ph.n_segs_a, ph.x16, ph.xs, ph.n_sb, ph.T,
                                       ph.ws + (size_t)2 * ph.split * ph.T * 64, ph.counters + ph.n_rb_a, ph.out16,
                                       ph.outxs, b - ph.split, ph.gx - ph.split, ch);
    }
}

extern "C" __global__ void __launch_bounds__(MM_BLOCK_THREADS(1), 4)
mm_chain(const MmPhase* __restrict__ phases, int n_phases, int* __restrict__ done, int stage, int n_stages, int spread,
         int poll_ns) { TL_SCOPE;
    static_assert(MM_SEPARATE_ISSUER(1) && MM_ONE_ROW, "mm_chain: build with the issuer warp and -DMM_ONE_ROW=1");
    DYN_SMEM(unsigned char, dsm);
    const int tid = threadIdx.x;
    unsigned long long* full = (unsigned long long*)(dsm + (size_t)n_stages * stage);    // (stage: a multiple of 128)
    unsigned long long* empty = full + MM_CHAIN_MAX_STAGES;
    MmSeg* segs_i = (MmSeg*)(empty + MM_CHAIN_MAX_STAGES);
    MmSeg* segs_c = segs_i + 4;
    int* last = (int*)(segs_c + 4);
    float* sres = (float*)(last + 4);
    float* red = (float*)((unsigned char*)full + 1024);      // scratch: a prep's sums, a gated norm's rows
    static_assert(16 * 8 + 8 * sizeof(MmSeg) + 16 + MM_SROW * 4 <= 1024 && 1024 + (2 * 256 + 1) * 4 <= MM_CHAIN_HEADER,
                  "mm_chain header");   // (the scratch from 1024: a conv's 9 * 128 floats at most, fused_gpu)
    if (tid == 0)
        for (int k = 0; k < n_stages; ++k) {
            mbar_init(&full[k], 1);
            mbar_init(&empty[k], 4);             // the four computing warps
        }
    __syncthreads();
    MmChainBlock ch{full, empty, segs_i, segs_c, sres, last, stage, n_stages, nullptr, spread, poll_ns,
                    0, 0, 0, 0u, false};
    const int n_counts = 32 * spread * n_phases;
    int* flags = done + n_counts + 32;           // MM_CHAIN_FLAG: phase p's flag at flags[32 p]
#ifdef MM_CHAIN_STUCK
    // the blocks' progress words after the counts, the end count and the flags (fused_gpu.op_mm_chain)
    if (tid == 0) {
        mm_chain_progress_of_block = flags + (MM_CHAIN_FLAG ? 32 * n_phases : 0);
        mm_chain_progress(0);
    }
    __syncthreads();
#endif
    const bool issuer = (tid >> 5) == MM_ISSUER(1);
    // Programmatic dependent launch: the issuer waits for the launch before the chain after requesting the
    // first product's weights (mm_chain_wait); the computing warps, which have nothing to do before their
    // first stage lands, wait at once (their adds then follow whatever that launch wrote or cleared).
    if (!issuer) grid_dependency_wait();
    for (int p = 0; p < n_phases; ++p) {
        const MmPhase ph = phases[p];
        ch.dep = p == 0 ? nullptr : MM_CHAIN_FLAG ? flags + 32 * (p - 1) : done + 32 * spread * (p - 1);
        ch.trigger = p == n_phases - 1;          // the next launch starts beside the last product's end
        if (ph.kind >= MM_CHAIN_CONV) {           // a small phase: its blocks' computing warps; the issuer goes on
            if (!issuer && (int)blockIdx.x < ph.gx) {
                if (ph.kind == MM_CHAIN_CONV) {                  // (waits itself, after its state loads)
                    mm_chain_conv(phases + p, red, ch.dep, spread, poll_ns);
                } else if (ph.kind == MM_CHAIN_RECUR) {          // (the same)
                    if (ph.d == 4) mm_chain_recur<4>(phases + p, red, ch.dep, spread, poll_ns);
                    else if (ph.d == 8) mm_chain_recur<8>(phases + p, red, ch.dep, spread, poll_ns);
                    else mm_chain_recur<16>(phases + p, red, ch.dep, spread, poll_ns);
                } else {
                    if (tid == 0) mm_chain_wait(ch.dep, spread, poll_ns);    // (p = 0: the launch before)
                    mm_sync<1>();                // (thread 0's acquire, then every thread's loads)
                    if (ph.kind == MM_CHAIN_PREP) mm_chain_prep(phases + p, red);
                    else mm_chain_gnorm(phases + p, red);
                }
            }
        } else if ((int)blockIdx.x < ph.gx) {
            switch (ph.kind) {
#define MM_CHAIN_CASE(i, ...) case i: mm_chain_product<__VA_ARGS__>(ph, &ch); break;
#ifdef MM_CHAIN_K0
                MM_CHAIN_CASE(0, MM_CHAIN_K0)
#endif
#ifdef MM_CHAIN_K1
                MM_CHAIN_CASE(1, MM_CHAIN_K1)
#endif
#ifdef MM_CHAIN_K2
                MM_CHAIN_CASE(2, MM_CHAIN_K2)
#endif
#ifdef MM_CHAIN_K3
                MM_CHAIN_CASE(3, MM_CHAIN_K3)
#endif
#ifdef MM_CHAIN_K4
                MM_CHAIN_CASE(4, MM_CHAIN_K4)
#endif
#ifdef MM_CHAIN_K5
                MM_CHAIN_CASE(5, MM_CHAIN_K5)
#endif
#ifdef MM_CHAIN_K6
                MM_CHAIN_CASE(6, MM_CHAIN_K6)
#endif
#ifdef MM_CHAIN_K7
                MM_CHAIN_CASE(7, MM_CHAIN_K7)
#endif
#ifdef MM_CHAIN_K8
                MM_CHAIN_CASE(8, MM_CHAIN_K8)
#endif
#ifdef MM_CHAIN_K9
                MM_CHAIN_CASE(9, MM_CHAIN_K9)
#endif
#ifdef MM_CHAIN_K10
                MM_CHAIN_CASE(10, MM_CHAIN_K10)
#endif
#ifdef MM_CHAIN_K11
                MM_CHAIN_CASE(11, MM_CHAIN_K11)
#endif
#undef MM_CHAIN_CASE
                default: break;
            }
        }
        if (!issuer) {
            // Every computing thread's stores and adds of phase p, then thread 0's release: a block that
            // acquires the full count sees them (release is cumulative over the barrier), and its issuer's
            // bulk copies too: the readers fence the proxies after their acquire (mm_chain_wait), the
            // writers here before the barrier.
            fence_proxy_async_global();
            mm_sync<1>();
            if (tid == 0) {
#ifdef MM_CHAIN_STUCK
                mm_chain_progress(p + 1);
#endif
                if (p < n_phases - 1) {
#if MM_CHAIN_FLAG
                    // the arrival that completes the count (acquiring every other) raises the flag (releasing them)
                    if (atomic_add_acq_rel(&done[32 * p], 1) == (int)gridDim.x - 1) atomic_add_release(&flags[32 * p], 1);
#else
                    atomic_add_release(&done[32 * (spread * p + (int)blockIdx.x % spread)], 1);
#endif
                } else if (atomic_add_acq_rel(&done[n_counts], 1) == (int)gridDim.x - 1) {
                    // the last block past the last phase: every issuer has passed every wait
                    for (int q = 0; q <= n_counts + (MM_CHAIN_FLAG ? 32 * n_phases : 0); q += 32) done[q] = 0;
#ifdef MM_CHAIN_STUCK
                    for (int b = 0; b < (int)gridDim.x; ++b) mm_chain_progress_of_block[b] = 0;
#endif
                }
            }
        }
    }
    trigger_dependents();                        // (a block outside the last product's grid)
}
#else
// ---------------------------------------------------------------------------------------------
// Repacking: raw GGUF rows (n_rows x row_bytes) -> units. One thread per output 32-bit word;
// words of rows >= n_rows or columns >= n_in are zero.

__device__ __forceinline__ u32 raw_byte(const unsigned char* raw, int row_bytes, int n_rows, int row, int off) {
    return row < n_rows ? (u32)raw[(size_t)row * row_bytes + off] : 0u;
}

// The lane/k-step/register/half -> (row in tile, column in superblock) element map.
__device__ __forceinline__ void elem_of(int lane, int s, int r, int hf, int& row16, int& col) {
    const int g = lane >> 2, c = lane & 3;
    row16 = g + 8 * (r & 1);
    col = 64 * c + 8 * (s >> 1) + 4 * (s & 1) + 2 * (r >> 1) + hf;
}

// ggml get_scale_min_k4
__device__ __forceinline__ void k4_scale_min(const unsigned char* sc, int j, u32& s, u32& m) {
    if (j < 4) {
        s = sc[j] & 63u;
        m = sc[j + 4] & 63u;
    } else {
        s = (sc[j + 4] & 0x0fu) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// Q4_K / Q5_K nibble of element (row, col) of superblock sb: qs at byte offset qs_off of the block.
__device__ __forceinline__ u32 k_nibble(const unsigned char* raw, int row_bytes, int n_rows, int n_sb_raw,
                                        int block_bytes, int qs_off, int row, int sb, int col) {
    if (row >= n_rows || sb >= n_sb_raw) return 0u;
    const int j = col >> 5, i = col & 31;
    const u32 b = raw[(size_t)row * row_bytes + (size_t)sb * block_bytes + qs_off + 32 * (j >> 1) + i];
    return (j & 1) ? (b >> 4) : (b & 15u);
}

// Scale record of a Q4_K / Q5_K row (see UnitQ4K::decode).
__device__ __forceinline__ u32 k_scale_word(const unsigned char* raw, int row_bytes, int n_rows, int n_sb_raw,
                                            int block_bytes, int row, int sb, int c) {
    if (row >= n_rows || sb >= n_sb_raw) return 0u;
    const unsigned char* blk = raw + (size_t)row * row_bytes + (size_t)sb * block_bytes;
    u32 sa, ma, sb2, mb;
    k4_scale_min(blk + 4, 2 * c, sa, ma);
    k4_scale_min(blk + 4, 2 * c + 1, sb2, mb);
    return sa | (sb2 << 6) | (ma << 12) | (mb << 18) | ((u32)blk[c] << 24);
}

// n_sb: superblocks of the tiled matrix (n_in rounded up to 256); n_sb_raw = n_in / 256 for K-quants.
// Word o (< 2048, byte offset) of a unit's nibble region: the 8 four-bit values of one lane's
// k-step, (register r, half hf) at bit 4r + 16hf (UnitQ4K::frag). nib(row, col) gives a value.
template <typename Nib>
__device__ __forceinline__ u32 nibble_word(int o, const Nib& nib) {
    const int i = o / 512, lane = (o % 512) / 16, w = (o % 16) / 4, s = 4 * i + w;
    u32 v = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            int row16, col;
            elem_of(lane, s, r, hf, row16, col);
            v |= (nib(row16, col) & 15u) << (4 * r + 16 * hf);
        }
    return v;
}

// The grid-stride walk every repack kernel shares: output word wi -> (tile, superblock, byte offset
// o inside the UNIT-byte unit); out[wi] = word(tile, sb, o). The output is unit_piece's layout: per
// group of four tiles and superblock, two pairs of tiles, each [first pieces][second pieces].
template <int QT, typename Word>
__device__ __forceinline__ void repack_units(u32* __restrict__ out, int n_sb, long long n_words, const Word& word) {
    constexpr int UNIT = UnitBytes<QT>::v, H1 = UnitOf<QT>::T::H1, H0 = UNIT - H1;
    for (long long wi = blockIdx.x * (long long)blockDim.x + threadIdx.x; wi < n_words;
         wi += (long long)gridDim.x * blockDim.x) {
        const long long blk = wi / UNIT;          // (4 UNIT bytes = UNIT words a group and superblock)
        const int ob = (int)(wi % UNIT) * 4, pair = ob / (2 * UNIT), op = ob % (2 * UNIT);
        int t, o;
        if (op < 2 * H0) {                        // a first piece: the unit's bytes [0, H1) and [2 H1, UNIT)
            t = op / H0;
            const int q = op % H0;
            o = q < H1 ? q : q + H1;
        } else {                                  // a second piece: its bytes [H1, 2 H1)
            t = (op - 2 * H0) / H1;
            o = H1 + (op - 2 * H0) % H1;
        }
        out[wi] = word((int)(blk / n_sb) * 4 + 2 * pair + t, (int)(blk % n_sb), o);
    }
}

extern "C" __global__ void repack_q4_k(const unsigned char* __restrict__ raw, u32* __restrict__ out, int n_rows,
                                       int row_bytes, int n_sb, long long n_words) { TL_SCOPE;
    repack_units<QT_Q4_K>(out, n_sb, n_words, [&](int tile, int sb, int o) {
        u32 v;
        if (o < 2048) {
            v = nibble_word(o, [&](int row16, int col) {
                return k_nibble(raw, row_bytes, n_rows, n_sb, 144, 16, tile * 16 + row16, sb, col);
            });
        } else {
            const int rr = (o - 2048) / 16, c = ((o - 2048) % 16) / 4;
            v = k_scale_word(raw, row_bytes, n_rows, n_sb, 144, tile * 16 + rr, sb, c);
        }
        return v;
    });
}

extern "C" __global__ void repack_q5_k(const unsigned char* __restrict__ raw, u32* __restrict__ out, int n_rows,
                                       int row_bytes, int n_sb, long long n_words) { TL_SCOPE;
    repack_units<QT_Q5_K>(out, n_sb, n_words, [&](int tile, int sb, int o) {
        u32 v = 0;
        if (o < 2048) {
            v = nibble_word(o, [&](int row16, int col) {
                return k_nibble(raw, row_bytes, n_rows, n_sb, 176, 48, tile * 16 + row16, sb, col);
            });
        } else if (o < 2560) {
            const int lane = (o - 2048) / 16, u = ((o - 2048) % 16) / 4;
            const int base_bit[4] = {4, 8, 0, 12};
#pragma unroll
            for (int vv = 0; vv < 4; ++vv) {
                const int s = 4 * u + vv;
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        int row16, col;
                        elem_of(lane, s, r, hf, row16, col);
                        const int row = tile * 16 + row16;
                        u32 hb = 0;
                        if (row < n_rows) {
                            const u32 qhb = raw[(size_t)row * row_bytes + (size_t)sb * 176 + 16 + (col & 31)];
                            hb = (qhb >> (col >> 5)) & 1u;
                        }
                        v |= hb << (base_bit[r] + vv + 16 * hf);
                    }
            }
        } else {
            const int rr = (o - 2560) / 16, c = ((o - 2560) % 16) / 4;
            v = k_scale_word(raw, row_bytes, n_rows, n_sb, 176, tile * 16 + rr, sb, c);
        }
        return v;
    });
}

// Q6_K element (row, col) of superblock sb as its 6-bit code q (w = d * sc[col/16] * (q - 32)).
__device__ __forceinline__ u32 q6_code(const unsigned char* raw, int row_bytes, int n_rows, int row, int sb, int col) {
    if (row >= n_rows) return 0u;
    const unsigned char* blk = raw + (size_t)row * row_bytes + (size_t)sb * 210;
    const int half = col >> 7, rr = col & 127, quarter = rr >> 5, l = rr & 31;
    const u32 qlb = blk[64 * half + l + 32 * (quarter & 1)];
    const u32 lo = quarter >= 2 ? (qlb >> 4) : (qlb & 15u);
    const u32 hi = (blk[128 + 32 * half + l] >> (2 * quarter)) & 3u;
    return lo | (hi << 4);
}

extern "C" __global__ void repack_q6_k(const unsigned char* __restrict__ raw, u32* __restrict__ out, int n_rows,
                                       int row_bytes, int n_sb, long long n_words) { TL_SCOPE;
    repack_units<QT_Q6_K>(out, n_sb, n_words, [&](int tile, int sb, int o) {
        u32 v = 0;
        if (o < 3072) {
            // word j = 3p + i of lane `lane` (UnitQ6K): codes of pair p's registers R = i, 3 + i, and
            // the split codes of R6 / R7
            const int j = 4 * (o / 512) + (o % 16) / 4, lane = (o % 512) / 16, p = j / 3, i = j % 3;
            auto code = [&](int R, int hf) {
                int row16, col;
                elem_of(lane, 2 * p + (R >> 2), R & 3, hf, row16, col);
                return q6_code(raw, row_bytes, n_rows, tile * 16 + row16, sb, col);
            };
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const u32 c6 = code(6, hf), c7 = code(7, hf);
                const u32 low = i == 0 ? (c6 & 15u) : (i == 2 ? (c7 & 15u) : ((c6 >> 4) | ((c7 >> 4) << 2)));
                v |= (low | (code(i, hf) << 4) | (code(3 + i, hf) << 10)) << (16 * hf);
            }
        } else if (o < 3328) {
            const int rr = (o - 3072) / 16, b4 = (o - 3072) % 16;
            const int row = tile * 16 + rr;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                v |= raw_byte(raw, row_bytes, n_rows, row, sb * 210 + 192 + b4 + k) << (8 * k);
        } else {
            const int rr = (o - 3328) / 2;      // two rows per word
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int row = tile * 16 + rr + k;
                const u32 dv = raw_byte(raw, row_bytes, n_rows, row, sb * 210 + 208) |
                               (raw_byte(raw, row_bytes, n_rows, row, sb * 210 + 209) << 8);
                v |= dv << (16 * k);
            }
        }
        return v;
    });
}

// IQ4_XS element (row, col) of superblock sb as its 4-bit codebook index (w = d * (ls - 32) * kv[q]).
__device__ __forceinline__ u32 iq4_code(const unsigned char* raw, int row_bytes, int n_rows, int row, int sb, int col) {
    if (row >= n_rows) return 0u;
    const int ib = col >> 5, i = col & 31;
    const u32 b = raw[(size_t)row * row_bytes + (size_t)sb * 136 + 8 + 16 * ib + (i & 15)];
    return i < 16 ? (b & 15u) : (b >> 4);
}

// n_in is a whole number of superblocks (FusedGpu.repack checks), so every superblock is real.
extern "C" __global__ void repack_iq4_xs(const unsigned char* __restrict__ raw, u32* __restrict__ out, int n_rows,
                                         int row_bytes, int n_sb, long long n_words) { TL_SCOPE;
    repack_units<QT_IQ4_XS>(out, n_sb, n_words, [&](int tile, int sb, int o) {
        u32 v = 0;
        if (o < 2048) {
            const int i = o / 512, lane = (o % 512) / 16, s = 4 * i + (o % 16) / 4;
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    int row16, col;
                    elem_of(lane, s, r, hf, row16, col);
                    const u32 q = iq4_code(raw, row_bytes, n_rows, tile * 16 + row16, sb, col);
                    v |= q << (4 * ((r & 1) + 2 * hf + 4 * (r >> 1)));
                }
        } else {
            const int g = (o - 2048) / 16, k = ((o - 2048) % 16) / 4;   // word k: row g + 8 (k >> 1), bytes 4 (k & 1) ..
            const int row = tile * 16 + g + 8 * (k >> 1);
#pragma unroll
            for (int b = 0; b < 4; ++b) v |= raw_byte(raw, row_bytes, n_rows, row, sb * 136 + 4 * (k & 1) + b) << (8 * b);
        }
        return v;
    });
}

// Q8_0: a unit is 8 consecutive blocks of 32; n_blk = n_in / 32 real blocks per row.
extern "C" __global__ void repack_q8_0(const unsigned char* __restrict__ raw, u32* __restrict__ out, int n_rows,
                                       int row_bytes, int n_sb, int n_blk, long long n_words) { TL_SCOPE;
    repack_units<QT_Q8_0>(out, n_sb, n_words, [&](int tile, int sb, int o) {
        u32 v = 0;
        if (o < 4096) {
            const int p = o / 512, lane = (o % 512) / 16, h = (o % 16) / 8, half_word = (o % 8) / 4;
            const int s = 2 * p + h;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int bb = 4 * half_word + k;           // byte of the k-step's 8: register bb/2, half bb&1
                int row16, col;
                elem_of(lane, s, bb >> 1, bb & 1, row16, col);
                const int row = tile * 16 + row16, blk = sb * 8 + (col >> 5);
                const u32 q = blk < n_blk ? raw_byte(raw, row_bytes, n_rows, row, blk * 34 + 2 + (col & 31)) : 0u;
                v |= q << (8 * k);
            }
        } else {
            const int idx = (o - 4096) / 2;                 // (row * 8 + block) halves, two per word
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int rr = (idx + k) >> 3, j = (idx + k) & 7;
                const int row = tile * 16 + rr, blk = sb * 8 + j;
                u32 dv = 0;
                if (blk < n_blk)
                    dv = raw_byte(raw, row_bytes, n_rows, row, blk * 34) | (raw_byte(raw, row_bytes, n_rows, row, blk * 34 + 1) << 8);
                v |= dv << (16 * k);
            }
        }
        return v;
    });
}

// F16: n_in real columns.
extern "C" __global__ void repack_f16(const unsigned char* __restrict__ raw, u32* __restrict__ out, int n_rows,
                                      int row_bytes, int n_sb, int n_in, long long n_words) { TL_SCOPE;
    repack_units<QT_F16>(out, n_sb, n_words, [&](int tile, int sb, int o) {
        const int s = o / 512, lane = (o % 512) / 16, r = (o % 16) / 4;
        u32 v = 0;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            int row16, col;
            elem_of(lane, s, r, hf, row16, col);
            const int row = tile * 16 + row16, n = sb * 256 + col;
            u32 h = 0;
            if (n < n_in)
                h = raw_byte(raw, row_bytes, n_rows, row, 2 * n) | (raw_byte(raw, row_bytes, n_rows, row, 2 * n + 1) << 8);
            v |= h << (16 * hf);
        }
        return v;
    });
}

// ---------------------------------------------------------------------------------------------
// Units -> f16 rows, for the wide-batch product (prefill chunks of kernels/cuda_backend.py
// WIDE_MIN_T tokens or more): a slice of a matrix's row tiles is dequantised here and multiplied by
// cuBLAS, whose f16 GEMM is compute-bound at hundreds of rows where mm_tc re-reads the weights every
// 32. Each element is the weight the MMA path multiplies: the A fragment of frag<S> times the row
// scale d (minus dmin * m for Q4_K / Q5_K), rounded to f16 once; Q8_0 and F16 fragments are f16
// already and are copied.
// out[16 * t + r, col] for tile tile0 + t (t < n_tiles), r < 16, col < n_sb * 256; row stride ld
// halves (a multiple of 8). One warp per unit: its fragments into a shared 16 x 256 tile, then 16
// row stores of 512 contiguous bytes.
#define UF_WARPS 4
#define UF_LD 132                  // u32 per staged row (128 + 4: 16-byte aligned, rows on other banks)

template <typename U>
__device__ __forceinline__ u32 uf_value(const U& un, u32 a, int row8, int j) {
    if (!U::SCALED) return a;
    const float d = un.d[row8];
    float lo = h2f((u16)(a & 0xffffu)) * d, hi = h2f((u16)(a >> 16)) * d;
    if (U::HAS_MIN) {
        const u32 mm = un.amin[row8];
        const float m = un.dmin[row8] * h2f((u16)(j ? (mm >> 16) : (mm & 0xffffu)));
        lo -= m;
        hi -= m;
    }
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
}
// k-step S: register r, halves hf = 0, 1 -> row g + 8 (r & 1), columns 64c + 8 (S >> 1) + 4 (S & 1)
// + 2 (r >> 1) + hf (elem_of), i.e. one 32-bit word of the staged row.
template <typename U, int S>
__device__ __forceinline__ void uf_step(const U& un, u32* st, int lane) {
    const int g = lane >> 2, c = lane & 3;
    u32 a[4];
    un.template frag<S>(a);
#pragma unroll
    for (int r = 0; r < 4; ++r)
        st[(g + 8 * (r & 1)) * UF_LD + 32 * c + 4 * (S >> 1) + 2 * (S & 1) + (r >> 1)] = uf_value(un, a[r], r & 1, S >> 3);
}
template <typename U, int P>
__device__ __forceinline__ void uf_pair(U& un, const unsigned char* u, u32* st, int lane) {   // u: P's piece
    un.pair(u, LaneOffs::of(lane), P & 3);
    uf_step<U, 2 * P>(un, st, lane);
    uf_step<U, 2 * P + 1>(un, st, lane);
}
template <int QT>
__device__ __forceinline__ void units_f16_impl(const unsigned char* __restrict__ units, u16* __restrict__ out, int n_sb,
                                               int tile0, int n_tiles, int ld) {
    typedef typename UnitOf<QT>::T U;
    __shared__ __align__(16) u32 stage[UF_WARPS][16 * UF_LD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32* st = stage[warp];
    const long long n_units = (long long)n_tiles * n_sb;
    for (long long i = (long long)blockIdx.x * UF_WARPS + warp; i < n_units; i += (long long)gridDim.x * UF_WARPS) {
        const int t = (int)(i / n_sb), sb = (int)(i % n_sb);
        const unsigned char* u0 = units + unit_piece<QT>(tile0 + t, sb, n_sb, 0);
        const unsigned char* u1 = units + unit_piece<QT>(tile0 + t, sb, n_sb, 1);
        U un;
        un.template load_h<0>(u0, LaneOffs::of(lane));
        un.template load_h<1>(u1, LaneOffs::of(lane));
        uf_pair<U, 0>(un, u0, st, lane);
        uf_pair<U, 1>(un, u0, st, lane);
        uf_pair<U, 2>(un, u0, st, lane);
        uf_pair<U, 3>(un, u0, st, lane);
        uf_pair<U, 4>(un, u1, st, lane);
        uf_pair<U, 5>(un, u1, st, lane);
        uf_pair<U, 6>(un, u1, st, lane);
        uf_pair<U, 7>(un, u1, st, lane);
        warp_sync();
        u16* o = out + (size_t)t * 16 * ld + (size_t)sb * 256 + lane * 8;
#pragma unroll 4
        for (int r = 0; r < 16; ++r) *(uint4*)(o + (size_t)r * ld) = *(const uint4*)(st + r * UF_LD + lane * 4);
        warp_sync();
    }
}
#define UNITS_F16(NAME, QT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(UF_WARPS * 32) NAME(                                              \
        const unsigned char* __restrict__ units, u16* __restrict__ out, int n_sb, int tile0, int n_tiles, int ld) { TL_SCOPE; \
        units_f16_impl<QT>(units, out, n_sb, tile0, n_tiles, ld);                                                  \
    }
UNITS_F16(units_f16_q4_k, QT_Q4_K)
UNITS_F16(units_f16_q5_k, QT_Q5_K)
UNITS_F16(units_f16_q6_k, QT_Q6_K)
UNITS_F16(units_f16_iq4_xs, QT_IQ4_XS)
UNITS_F16(units_f16_q8_0, QT_Q8_0)
UNITS_F16(units_f16_f16, QT_F16)
#endif
