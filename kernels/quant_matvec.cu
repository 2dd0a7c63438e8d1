// Quantised matrix-vector products and dequantisation on GGUF weights kept in ggml's exact block
// layouts (the bytes of the file, uploaded once).
//
//   y[t, o] = sum_i W[o, i] * x[t, i]      x: f32 [T, n_in], y: f32 [T, n_out], W: n_out rows of
//                                           `row_bytes` bytes each (ggml ne = [n_in, n_out]).
//
// Layouts (ggml):
//   Q8_0  block of 32 weights, 34 bytes: f16 d, int8 qs[32];               w = d * q
//   Q4_K  super-block of 256 weights, 144 bytes: f16 d, f16 dmin, u8 scales[12] (8 packed 6-bit
//         scale/min pairs), u8 qs[128]; sub-block j (32 weights) = nibbles of qs[32*(j/2) .. +31]
//         (low nibble for even j, high for odd j);                          w = d*sc_j*q - dmin*m_j
//   F16 / BF16  plain 16-bit rows.
//
// The sources compile under NVRTC (CUDA) and hiprtc (ROCm): no inline PTX, no CUDA-only intrinsics
// outside the __HIP_PLATFORM_AMD__ switch below, and nothing depends on the warp being 32 lanes
// (lane groups that must share a warp are at most 4 wide; reductions loop over `warpSize`).
//
// Matvec kernels are templates over T (activation rows, 1..8), R (weight rows per thread block)
// and U (passes over the columns per iteration: more weight bytes in flight per thread, fewer
// barriers); the host compiles one (T, R, U) per module with -DMV_T=.. -DMV_R=.. -DMV_U=.. (see
// kernels/cuda_backend.py).
// Each block of MV_BLOCK threads handles R consecutive output rows; each thread walks the columns in
// 4-column units, so consecutive threads read consecutive weight words and consecutive x floats
// (coalesced), and every x float loaded into a register is used for all R rows.

// the benchmarks' step timeline (TL_SCOPE: nothing in other builds)
#include "timeline.cuh"

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_DOWN(v, off) __shfl_down((v), (off))
#define SHFL_XOR32(v, m) __shfl_xor((v), (m), 32)
#else
#define SHFL_DOWN(v, off) __shfl_down_sync(0xffffffffu, (v), (off))
#define SHFL_XOR32(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), 32)
#endif

#define MV_BLOCK 128
#define MV_MAX_WARPS (MV_BLOCK / 32)  // enough slots for any warp size >= 32 (HIP: 64)
#define Q8_0_BYTES 34
#define Q4_K_BYTES 144
// 2^23 as float: OR-ing an integer 0 <= n < 2^23 into its mantissa gives 2^23 + n exactly, so
// (bits | n) - 2^23 converts small integers with one logic op and one add instead of the slow
// integer-to-float conversion unit.
#define MAGIC_2_23 8388608.0f

__device__ __forceinline__ float half_bits_to_float(unsigned int h) {
    // Exact IEEE binary16 -> binary32 without relying on f32 subnormal arithmetic (whose flushing
    // differs between compilers and devices).
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int em = h & 0x7fffu;
    float f;
    if (em < 0x0400u) {
        f = (float)em * 5.9604644775390625e-08f;                    // subnormal: em * 2^-24
    } else if (em >= 0x7c00u) {
        f = __uint_as_float(0x7f800000u | ((em & 0x03ffu) << 13));  // inf / nan
    } else {
        f = __uint_as_float((em << 13) + 0x38000000u);              // rebias exponent 15 -> 127
    }
    return __uint_as_float(__float_as_uint(f) | sign);
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned int h) {
    return __uint_as_float(h << 16);
}

// Float bits 2^23 + (byte I of w): w's byte I under exponent byte 0x4B. On CUDA one PRMT.
template <int I>
__device__ __forceinline__ unsigned int byte_under_2_23(unsigned int w) {
#ifdef __HIP_PLATFORM_AMD__
    return ((w >> (8 * I)) & 0xffu) | 0x4B000000u;
#else
    return __byte_perm(w, 0x4B000000u, 0x7440u + I);
#endif
}

// The 4 bytes of w (each < 256) as floats, minus `bias`.
__device__ __forceinline__ void bytes_to_floats(unsigned int w, float bias, float (&out)[4]) {
    out[0] = __uint_as_float(byte_under_2_23<0>(w)) - bias;
    out[1] = __uint_as_float(byte_under_2_23<1>(w)) - bias;
    out[2] = __uint_as_float(byte_under_2_23<2>(w)) - bias;
    out[3] = __uint_as_float(byte_under_2_23<3>(w)) - bias;
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
// held in h.y (bytes 0..3), h.z (4..7), h.w (8..11).
__device__ __forceinline__ void q4_k_scale_min(int j, uint4 h, unsigned int& sc, unsigned int& m) {
    if (j < 4) {
        sc = (h.y >> (8 * j)) & 63u;
        m = (h.z >> (8 * j)) & 63u;
    } else {
        const int s = 8 * (j - 4);
        const unsigned int lowbits = (h.w >> s) & 0xffu;
        sc = (lowbits & 0x0fu) | (((h.y >> s) >> 6 & 3u) << 4);
        m = (lowbits >> 4) | (((h.z >> s) >> 6 & 3u) << 4);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = warpSize >> 1; off > 0; off >>= 1) v += SHFL_DOWN(v, off);
    return v;
}

// Sum acc over the block and store y[t, row0 + r] for rows < n_out.
template <int T, int R>
__device__ __forceinline__ void block_reduce_store(float (&acc)[R][T], float* __restrict__ y,
                                                   int row0, int n_out) {
    __shared__ float partial[R * T][MV_MAX_WARPS];
    const int lane = threadIdx.x % warpSize;
    const int warp = threadIdx.x / warpSize;
    const int n_warps = (blockDim.x + warpSize - 1) / warpSize;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0) partial[r * T + t][warp] = v;
        }
    }
    __syncthreads();
    if ((int)threadIdx.x < R * T) {
        const int k = threadIdx.x;
        float s = 0.0f;
        for (int w = 0; w < n_warps; ++w) s += partial[k][w];
        const int r = k / T, t = k % T;
        const int row = row0 + r;
        if (row < n_out) y[(size_t)t * n_out + row] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// Q8_0. Unit: 4 quants of one block; 8 threads per block, so one pass of the thread block covers
// 16 blocks (512 columns), and an iteration covers U passes (SPAN = 16*U blocks). Blocks are 34
// bytes, so quant words are only 2-byte aligned: each thread reads the two aligned 32-bit words
// around its 4 bytes and shifts. The block scales are decoded once per (row, block) by helper
// threads into shared memory (double-buffered: one barrier per iteration). The next iteration's
// loads are issued before this iteration's arithmetic, so each thread keeps 2*U*R weight words in
// flight.
template <int R>
__device__ __forceinline__ void q8_0_load(const unsigned char* __restrict__ w, const size_t (&row_off)[R],
                                          int b, int word, unsigned int (&qv)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const size_t off = row_off[r] + (size_t)b * Q8_0_BYTES + 2 + 4 * word;
        const unsigned int* p = (const unsigned int*)(w + (off & ~(size_t)3));
        const unsigned int lo = p[0], hi = p[1];
        qv[r] = (off & 2) ? ((lo >> 16) | (hi << 16)) : lo;
    }
}

template <int T, int R, int U>
__device__ __forceinline__ void q8_0_matvec_impl(const unsigned char* __restrict__ w,
                                                 const float* __restrict__ x, float* __restrict__ y,
                                                 int n_out, int n_in, int row_bytes) {
    constexpr int SPAN = 16 * U;                                  // blocks per iteration
    constexpr int JOBS = R * SPAN;                                // scales decoded per iteration
    constexpr int JPT = (JOBS + MV_BLOCK - 1) / MV_BLOCK;        // decode jobs per thread
    __shared__ float scale[2][R][SPAN];
    const int tid = threadIdx.x;
    const int word = tid & 7;
    const int bslot = tid >> 3;
    const int row0 = blockIdx.x * R;
    const int n_blocks = n_in >> 5;

    size_t row_off[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_off[r] = (size_t)min(row0 + r, n_out - 1) * (size_t)row_bytes;
    bool dec_ok[JPT];
    int dec_r[JPT], dec_s[JPT];
    size_t dec_off[JPT];
#pragma unroll
    for (int m = 0; m < JPT; ++m) {
        const int j = tid + m * MV_BLOCK;
        dec_ok[m] = j < JOBS;
        dec_r[m] = dec_ok[m] ? j / SPAN : 0;
        dec_s[m] = j % SPAN;
        dec_off[m] = (size_t)min(row0 + dec_r[m], n_out - 1) * (size_t)row_bytes;
    }

    float acc[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;

    const int n_iter = (n_blocks + SPAN - 1) / SPAN;
    unsigned int qv[U][R];
    unsigned int dbits[JPT];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (bslot + 16 * u < n_blocks) q8_0_load<R>(w, row_off, bslot + 16 * u, word, qv[u]);
#pragma unroll
    for (int m = 0; m < JPT; ++m) {
        dbits[m] = 0u;
        if (dec_ok[m] && dec_s[m] < n_blocks)
            dbits[m] = *(const unsigned short*)(w + dec_off[m] + (size_t)dec_s[m] * Q8_0_BYTES);
    }

    for (int it = 0; it < n_iter; ++it) {
        const int buf = it & 1;
        const int base = it * SPAN;
#pragma unroll
        for (int m = 0; m < JPT; ++m)
            if (dec_ok[m]) scale[buf][dec_r[m]][dec_s[m]] = (base + dec_s[m] < n_blocks) ? half_bits_to_float(dbits[m]) : 0.0f;
        __syncthreads();
        // Prefetch the next iteration.
        unsigned int qn[U][R] = {};
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int bn = base + SPAN + bslot + 16 * u;
            if (bn < n_blocks) q8_0_load<R>(w, row_off, bn, word, qn[u]);
        }
#pragma unroll
        for (int m = 0; m < JPT; ++m) {
            const int dbn = base + SPAN + dec_s[m];
            if (dec_ok[m] && dbn < n_blocks) dbits[m] = *(const unsigned short*)(w + dec_off[m] + (size_t)dbn * Q8_0_BYTES);
        }

#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = base + bslot + 16 * u;
            if (b < n_blocks) {
                float q[R][4];
#pragma unroll
                for (int r = 0; r < R; ++r) bytes_to_floats(qv[u][r] ^ 0x80808080u, MAGIC_2_23 + 128.0f, q[r]);  // int8 -> biased byte
                float d[R];
#pragma unroll
                for (int r = 0; r < R; ++r) d[r] = scale[buf][r][bslot + 16 * u];
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    const float4 xv = *(const float4*)(x + (size_t)t * n_in + (b << 5) + (word << 2));
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        acc[r][t] += d[r] * (q[r][0] * xv.x + q[r][1] * xv.y + q[r][2] * xv.z + q[r][3] * xv.w);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) qv[u][r] = qn[u][r];
    }
    block_reduce_store<T, R>(acc, y, row0, n_out);
}

// ---------------------------------------------------------------------------------------------
// Q4_K. Unit: one 32-bit word of qs = 4 columns of sub-block 2g (low nibbles) and the same 4
// columns of sub-block 2g+1 (high nibbles); 32 threads per super-block, so one pass of the thread
// block covers 4 super-blocks and an iteration U passes (SPAN = 4*U super-blocks).
// sum_i (d*sc*q_i - dmin*m) x_i = d*sc * sum q_i x_i - dmin*m * sum x_i, so the per-weight work is
// one conversion and one FMA per activation row. The (d*sc, dmin*m) pairs are decoded once per
// (row, super-block, pair) by helper threads into shared memory; loads are prefetched one
// iteration ahead as for Q8_0.
template <int T, int R, int U>
__device__ __forceinline__ void q4_k_matvec_impl(const unsigned char* __restrict__ w,
                                                 const float* __restrict__ x, float* __restrict__ y,
                                                 int n_out, int n_in, int row_bytes) {
    constexpr int SPAN = 4 * U;                                   // super-blocks per iteration
    constexpr int JOBS = R * SPAN * 4;                            // (row, super-block, pair) per iteration
    constexpr int JPT = (JOBS + MV_BLOCK - 1) / MV_BLOCK;
    __shared__ float4 scale[2][R][SPAN][4];  // [buf][row][super-block slot][pair g]
    const int tid = threadIdx.x;
    const int word = tid & 31;
    const int g = word >> 3;
    const int l = (word & 7) << 2;
    const int slot = tid >> 5;
    const int row0 = blockIdx.x * R;
    const int n_sb = n_in >> 8;

    size_t row_off[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_off[r] = (size_t)min(row0 + r, n_out - 1) * (size_t)row_bytes;
    bool dec_ok[JPT];
    int dec_r[JPT], dec_s[JPT], dec_g[JPT];
    size_t dec_off[JPT];
#pragma unroll
    for (int m = 0; m < JPT; ++m) {
        const int j = tid + m * MV_BLOCK;
        dec_ok[m] = j < JOBS;
        dec_r[m] = dec_ok[m] ? j / (SPAN * 4) : 0;
        dec_s[m] = (j >> 2) % SPAN;
        dec_g[m] = j & 3;
        dec_off[m] = (size_t)min(row0 + dec_r[m], n_out - 1) * (size_t)row_bytes;
    }

    float acc[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;

    const int n_iter = (n_sb + SPAN - 1) / SPAN;
    unsigned int qv[U][R];
    uint4 hdr[JPT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int sb = slot + 4 * u;
        if (sb < n_sb) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                qv[u][r] = *(const unsigned int*)(w + row_off[r] + (size_t)sb * Q4_K_BYTES + 16 + 4 * word);
        }
    }
#pragma unroll
    for (int m = 0; m < JPT; ++m) {
        hdr[m] = make_uint4(0u, 0u, 0u, 0u);
        if (dec_ok[m] && dec_s[m] < n_sb) hdr[m] = *(const uint4*)(w + dec_off[m] + (size_t)dec_s[m] * Q4_K_BYTES);
    }

    for (int it = 0; it < n_iter; ++it) {
        const int buf = it & 1;
        const int base = it * SPAN;
#pragma unroll
        for (int m = 0; m < JPT; ++m) {
            if (dec_ok[m]) {
                float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (base + dec_s[m] < n_sb) {
                    const uint4 h = hdr[m];
                    const float dd = half_bits_to_float(h.x & 0xffffu);
                    const float dmin = half_bits_to_float(h.x >> 16);
                    unsigned int sc0, m0, sc1, m1;
                    q4_k_scale_min(2 * dec_g[m], h, sc0, m0);
                    q4_k_scale_min(2 * dec_g[m] + 1, h, sc1, m1);
                    s = make_float4(dd * (float)sc0, dmin * (float)m0, dd * (float)sc1, dmin * (float)m1);
                }
                scale[buf][dec_r[m]][dec_s[m]][dec_g[m]] = s;
            }
        }
        __syncthreads();
        // Prefetch the next iteration.
        unsigned int qn[U][R] = {};
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int sbn = base + SPAN + slot + 4 * u;
            if (sbn < n_sb) {
#pragma unroll
                for (int r = 0; r < R; ++r)
                    qn[u][r] = *(const unsigned int*)(w + row_off[r] + (size_t)sbn * Q4_K_BYTES + 16 + 4 * word);
            }
        }
#pragma unroll
        for (int m = 0; m < JPT; ++m) {
            const int dsbn = base + SPAN + dec_s[m];
            if (dec_ok[m] && dsbn < n_sb) hdr[m] = *(const uint4*)(w + dec_off[m] + (size_t)dsbn * Q4_K_BYTES);
        }

#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int sb = base + slot + 4 * u;
            if (sb < n_sb) {
                float lo[R][4], hi[R][4];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    bytes_to_floats(qv[u][r] & 0x0f0f0f0fu, MAGIC_2_23, lo[r]);
                    bytes_to_floats((qv[u][r] >> 4) & 0x0f0f0f0fu, MAGIC_2_23, hi[r]);
                }
                float4 sc[R];
#pragma unroll
                for (int r = 0; r < R; ++r) sc[r] = scale[buf][r][slot + 4 * u][g];
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    const float* xb = x + (size_t)t * n_in + (sb << 8) + (g << 6) + l;
                    const float4 xl = *(const float4*)xb;
                    const float4 xh = *(const float4*)(xb + 32);
                    const float sl = (xl.x + xl.y) + (xl.z + xl.w);
                    const float sh = (xh.x + xh.y) + (xh.z + xh.w);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const float dl = lo[r][0] * xl.x + lo[r][1] * xl.y + lo[r][2] * xl.z + lo[r][3] * xl.w;
                        const float dh = hi[r][0] * xh.x + hi[r][1] * xh.y + hi[r][2] * xh.z + hi[r][3] * xh.w;
                        acc[r][t] += (sc[r].x * dl - sc[r].y * sl) + (sc[r].z * dh - sc[r].w * sh);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) qv[u][r] = qn[u][r];
    }
    block_reduce_store<T, R>(acc, y, row0, n_out);
}

// ---------------------------------------------------------------------------------------------
// F16 / BF16 / F32 rows. Unit: 4 columns (one 8-byte load per row, 16 bytes for F32); needs
// n_in % 4 == 0 (the host sends other widths through dequantisation + GEMM).
#define ROW_F16 0
#define ROW_BF16 1
#define ROW_F32 2
template <int T, int R, int KIND>
__device__ __forceinline__ void f16_matvec_impl(const unsigned char* __restrict__ w,
                                                const float* __restrict__ x, float* __restrict__ y,
                                                int n_out, int n_in, int row_bytes) {
    const int tid = threadIdx.x;
    const int row0 = blockIdx.x * R;
    size_t row_off[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_off[r] = (size_t)min(row0 + r, n_out - 1) * (size_t)row_bytes;
    float acc[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;

    for (int c = tid << 2; c < n_in; c += MV_BLOCK << 2) {
        float wv[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (KIND == ROW_F32) {
                const float4 f = *(const float4*)(w + row_off[r] + 4 * (size_t)c);
                wv[r][0] = f.x; wv[r][1] = f.y; wv[r][2] = f.z; wv[r][3] = f.w;
            } else {
                const uint2 u = *(const uint2*)(w + row_off[r] + 2 * (size_t)c);
                const unsigned int h[4] = {u.x & 0xffffu, u.x >> 16, u.y & 0xffffu, u.y >> 16};
#pragma unroll
                for (int i = 0; i < 4; ++i) wv[r][i] = KIND == ROW_BF16 ? bf16_bits_to_float(h[i]) : half_bits_to_float(h[i]);
            }
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float4 xv = *(const float4*)(x + (size_t)t * n_in + c);
#pragma unroll
            for (int r = 0; r < R; ++r)
                acc[r][t] += wv[r][0] * xv.x + wv[r][1] * xv.y + wv[r][2] * xv.z + wv[r][3] * xv.w;
        }
    }
    block_reduce_store<T, R>(acc, y, row0, n_out);
}

#define MV_ARGS const unsigned char* __restrict__ w, const float* __restrict__ x, \
                float* __restrict__ y, int n_out, int n_in, int row_bytes
#ifndef MV_U
#define MV_U 1
#endif

#if defined(MV_T) && !defined(MV_QTYPE)
extern "C" __global__ void __launch_bounds__(MV_BLOCK) q8_0_matvec(MV_ARGS) { TL_SCOPE;
    q8_0_matvec_impl<MV_T, MV_R, MV_U>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) q4_k_matvec(MV_ARGS) { TL_SCOPE;
    q4_k_matvec_impl<MV_T, MV_R, MV_U>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) f16_matvec(MV_ARGS) { TL_SCOPE;
    f16_matvec_impl<MV_T, MV_R, ROW_F16>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) bf16_matvec(MV_ARGS) { TL_SCOPE;
    f16_matvec_impl<MV_T, MV_R, ROW_BF16>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) f32_matvec(MV_ARGS) { TL_SCOPE;
    f16_matvec_impl<MV_T, MV_R, ROW_F32>(w, x, y, n_out, n_in, row_bytes);
}
#endif

// ---------------------------------------------------------------------------------------------
// Every block type, one generic path: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS.
//
// A row is a run of 32-weight units (a Q*_0/Q*_1 block, or one of the 8 sub-blocks of a 256-weight
// super-block). `load_half<QT>(row, unit, hh, q, a, b)` decodes the 16 weights 16*hh .. 16*hh+15 of
// a unit as small integers q[i] (exact in f32) with w[i] = a*q[i] + b, so that
//     sum_i w[i] x[i] = a * sum_i q[i] x[i] + b * sum_i x[i]
// (b = 0 for the types without a min). Type codes are ggml's (enum ggml_type).
#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q5_0 6
#define QT_Q5_1 7
#define QT_Q8_0 8
#define QT_Q4_K 12
#define QT_Q5_K 13
#define QT_Q6_K 14
#define QT_IQ4_XS 23

// The 32-bit little-endian word at a 2-byte-aligned address, from the two aligned words around it
// (may read 2 bytes past the word: weights carry WEIGHT_PAD_BYTES of padding).
__device__ __forceinline__ unsigned int load_u32_a2(const unsigned char* p) {
    const size_t addr = (size_t)p;
    const unsigned int* a = (const unsigned int*)(addr & ~(size_t)3);
    const unsigned int lo = a[0];
    if ((addr & 2) == 0) return lo;
    return (lo >> 16) | (a[1] << 16);
}

__device__ __forceinline__ unsigned int load_u16(const unsigned char* p) {
    return *(const unsigned short*)p;
}

// The 16 bytes at a 2-byte-aligned address as 4 words.
__device__ __forceinline__ void load16_a2(const unsigned char* p, unsigned int (&u)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) u[i] = load_u32_a2(p + 4 * i);
}

__device__ __forceinline__ void load16_a16(const unsigned char* p, unsigned int (&u)[4]) {
    const uint4 v = *(const uint4*)p;
    u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
}

__device__ __forceinline__ unsigned int byte_of(const unsigned int (&u)[4], int i) {
    return (u[i >> 2] >> (8 * (i & 3))) & 0xffu;
}

__device__ __constant__ float IQ4NL_VALUES[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                                  1.f, 13.f, 25.f, 38.f, 53.f, 69.f, 89.f, 113.f};

template <int QT> struct BlockType;
// (weights per block, bytes per block, has a min term)
template <> struct BlockType<QT_Q4_0>  { enum { QK = 32,  BYTES = 18,  MIN = 0 }; };
template <> struct BlockType<QT_Q4_1>  { enum { QK = 32,  BYTES = 20,  MIN = 1 }; };
template <> struct BlockType<QT_Q5_0>  { enum { QK = 32,  BYTES = 22,  MIN = 0 }; };
template <> struct BlockType<QT_Q5_1>  { enum { QK = 32,  BYTES = 24,  MIN = 1 }; };
template <> struct BlockType<QT_Q8_0>  { enum { QK = 32,  BYTES = 34,  MIN = 0 }; };
template <> struct BlockType<QT_Q4_K>  { enum { QK = 256, BYTES = 144, MIN = 1 }; };
template <> struct BlockType<QT_Q5_K>  { enum { QK = 256, BYTES = 176, MIN = 1 }; };
template <> struct BlockType<QT_Q6_K>  { enum { QK = 256, BYTES = 210, MIN = 0 }; };
template <> struct BlockType<QT_IQ4_XS> { enum { QK = 256, BYTES = 136, MIN = 0 }; };

template <int QT>
__device__ __forceinline__ void load_half(const unsigned char* __restrict__ row, int unit, int hh,
                                          float (&q)[16], float& a, float& b) {
    constexpr int UPB = BlockType<QT>::QK / 32;                  // units per block
    const unsigned char* blk = row + (size_t)(unit / UPB) * BlockType<QT>::BYTES;
    const int j = unit % UPB;                                   // sub-block inside a super-block
    unsigned int u[4];
    b = 0.0f;
    if (QT == QT_Q4_0 || QT == QT_Q4_1) {
        const int qoff = QT == QT_Q4_0 ? 2 : 4;
        a = half_bits_to_float(load_u16(blk));
        if (QT == QT_Q4_1) b = half_bits_to_float(load_u16(blk + 2));
        load16_a2(blk + qoff, u);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int n = (int)((byte_of(u, i) >> (4 * hh)) & 0xfu);
            q[i] = (float)(QT == QT_Q4_0 ? n - 8 : n);
        }
    } else if (QT == QT_Q5_0 || QT == QT_Q5_1) {
        const int hoff = QT == QT_Q5_0 ? 2 : 4;
        a = half_bits_to_float(load_u16(blk));
        if (QT == QT_Q5_1) b = half_bits_to_float(load_u16(blk + 2));
        const unsigned int qh = load_u32_a2(blk + hoff);
        load16_a2(blk + hoff + 4, u);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int n = (int)(((byte_of(u, i) >> (4 * hh)) & 0xfu) | (((qh >> (i + 16 * hh)) & 1u) << 4));
            q[i] = (float)(QT == QT_Q5_0 ? n - 16 : n);
        }
    } else if (QT == QT_Q8_0) {
        a = half_bits_to_float(load_u16(blk));
        load16_a2(blk + 2 + 16 * hh, u);
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = (float)(int)(signed char)byte_of(u, i);
    } else if (QT == QT_Q4_K || QT == QT_Q5_K) {
        const uint4 h = *(const uint4*)blk;
        unsigned int sc, m;
        q4_k_scale_min(j, h, sc, m);
        a = half_bits_to_float(h.x & 0xffffu) * (float)sc;
        b = -(half_bits_to_float(h.x >> 16) * (float)m);
        const int qs = QT == QT_Q4_K ? 16 : 48;
        load16_a16(blk + qs + 32 * (j >> 1) + 16 * hh, u);
        if (QT == QT_Q4_K) {
#pragma unroll
            for (int i = 0; i < 16; ++i) q[i] = (float)((byte_of(u, i) >> (4 * (j & 1))) & 0xfu);
        } else {
            unsigned int hb[4];
            load16_a16(blk + 16 + 16 * hh, hb);
#pragma unroll
            for (int i = 0; i < 16; ++i)
                q[i] = (float)(((byte_of(u, i) >> (4 * (j & 1))) & 0xfu) | (((byte_of(hb, i) >> j) & 1u) << 4));
        }
    } else if (QT == QT_Q6_K) {
        const int n = j >> 2, grp = j & 3;
        const float d = half_bits_to_float(load_u16(blk + 208));
        a = d * (float)(int)(signed char)blk[192 + 8 * n + 2 * grp + hh];
        unsigned int hb[4];
        load16_a2(blk + 64 * n + 32 * (grp & 1) + 16 * hh, u);
        load16_a2(blk + 128 + 32 * n + 16 * hh, hb);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int lo = (int)((byte_of(u, i) >> (4 * (grp >> 1))) & 0xfu);
            const int hi = (int)((byte_of(hb, i) >> (2 * grp)) & 3u);
            q[i] = (float)((lo | (hi << 4)) - 32);
        }
    } else if (QT == QT_IQ4_XS) {
        const float d = half_bits_to_float(load_u16(blk));
        const unsigned int scales_h = load_u16(blk + 2);
        const int ls = (int)(((blk[4 + (j >> 1)] >> (4 * (j & 1))) & 0xfu) | (((scales_h >> (2 * j)) & 3u) << 4));
        a = d * (float)(ls - 32);
        const uint2 lo2 = *(const uint2*)(blk + 8 + 16 * j);
        const uint2 hi2 = *(const uint2*)(blk + 16 + 16 * j);
        u[0] = lo2.x; u[1] = lo2.y; u[2] = hi2.x; u[3] = hi2.y;
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = IQ4NL_VALUES[(byte_of(u, i) >> (4 * hh)) & 0xfu];
    }
}

// y[t, o] for MV_T activation rows: each group of 32 consecutive threads (inside one warp for any
// warp size >= 32) owns R output rows; lane l takes units l, l+32, ... of those rows, and the lanes
// are summed with xor-shuffles inside the group. A row's result depends only on its weights and its
// activation row (not on T, R or the other rows), so the product is batch-invariant.
#define GROUPS_PER_BLOCK (MV_BLOCK / 32)

__device__ __forceinline__ float group32_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += SHFL_XOR32(v, m);
    return v;
}

template <int T, int R, int QT>
__device__ __forceinline__ void block_matvec_impl(const unsigned char* __restrict__ w,
                                                  const float* __restrict__ x, float* __restrict__ y,
                                                  int n_out, int n_in, int row_bytes) {
    const int lane = threadIdx.x & 31;
    const int grp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GROUPS_PER_BLOCK + grp) * R;
    const int n_units = n_in >> 5;
    float acc[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;

    for (int unit = lane; unit < n_units; unit += 32) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float dots[T], sums[T];
            const int col = unit * 32 + hh * 16;
#pragma unroll
            for (int t = 0; t < T; ++t) { dots[t] = 0.0f; sums[t] = 0.0f; }
            float q[R][16], a[R], b[R];
#pragma unroll
            for (int r = 0; r < R; ++r)
                load_half<QT>(w + (size_t)min(row0 + r, n_out - 1) * (size_t)row_bytes, unit, hh, q[r], a[r], b[r]);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float4* xp = (const float4*)(x + (size_t)t * n_in + col);
                float xv[16];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float4 v = xp[k];
                    xv[4 * k] = v.x; xv[4 * k + 1] = v.y; xv[4 * k + 2] = v.z; xv[4 * k + 3] = v.w;
                }
                float sx = 0.0f;
                if (BlockType<QT>::MIN) {
#pragma unroll
                    for (int i = 0; i < 16; ++i) sx += xv[i];
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float d = 0.0f;
#pragma unroll
                    for (int i = 0; i < 16; ++i) d += q[r][i] * xv[i];
                    // Explicit FMAs: with two products the compiler's contraction order could
                    // differ between instantiations (R, T), breaking batch invariance.
                    acc[r][t] = BlockType<QT>::MIN ? fmaf(a[r], d, fmaf(b[r], sx, acc[r][t])) : fmaf(a[r], d, acc[r][t]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float v = group32_sum(acc[r][t]);
            if (lane == 0 && row0 + r < n_out) y[(size_t)t * n_out + row0 + r] = v;
        }
    }
}

#if defined(MV_T) && defined(MV_QTYPE)
extern "C" __global__ void __launch_bounds__(MV_BLOCK) block_matvec(MV_ARGS) { TL_SCOPE;
    block_matvec_impl<MV_T, MV_R, MV_QTYPE>(w, x, y, n_out, n_in, row_bytes);
}
#endif

#ifndef MV_T   // dequantisers live in the module compiled without matvec defines
// ---------------------------------------------------------------------------------------------
// Dequantisation of rows [row_start, row_start + n_rows) (or of the rows listed in row_ids, for
// embedding look-ups) to f32 out[n_rows, n_in]. Products are rounded separately (__fmul_rn) so the
// result equals ggml's dequantize_row_* bit for bit: d1 = d*sc; m1 = dmin*m; y = d1*q - m1.
#define DQ_ARGS const unsigned char* __restrict__ w, const int* __restrict__ row_ids, int row_start, \
                float* __restrict__ out, int n_rows, int n_in, int row_bytes

__device__ __forceinline__ size_t dq_row_offset(const int* row_ids, int row_start, size_t r, int row_bytes) {
    const size_t src = row_ids ? (size_t)row_ids[r] : (size_t)row_start + r;
    return src * (size_t)row_bytes;
}

extern "C" __global__ void dequant_q8_0(DQ_ARGS) { TL_SCOPE;
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        const unsigned char* blk = w + dq_row_offset(row_ids, row_start, r, row_bytes) + (size_t)(c >> 5) * Q8_0_BYTES;
        const float d = half_bits_to_float(*(const unsigned short*)blk);
        out[i] = __fmul_rn(d, (float)(signed char)blk[2 + (c & 31)]);
    }
}

extern "C" __global__ void dequant_q4_k(DQ_ARGS) { TL_SCOPE;
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        const unsigned char* sbp = w + dq_row_offset(row_ids, row_start, r, row_bytes) + (size_t)(c >> 8) * Q4_K_BYTES;
        const uint4 h = *(const uint4*)sbp;
        const int within = c & 255;
        const int g = within >> 6, upper = (within >> 5) & 1, l = within & 31;
        const unsigned int byte = sbp[16 + 32 * g + l];
        const unsigned int q = upper ? (byte >> 4) : (byte & 0x0fu);
        unsigned int sc, m;
        q4_k_scale_min(2 * g + upper, h, sc, m);
        const float d1 = __fmul_rn(half_bits_to_float(h.x & 0xffffu), (float)sc);
        const float m1 = __fmul_rn(half_bits_to_float(h.x >> 16), (float)m);
        out[i] = __fmul_rn(d1, (float)q) - m1;
    }
}

extern "C" __global__ void dequant_f16(DQ_ARGS) { TL_SCOPE;
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        out[i] = half_bits_to_float(*(const unsigned short*)(w + dq_row_offset(row_ids, row_start, r, row_bytes) + 2 * (size_t)c));
    }
}

extern "C" __global__ void dequant_bf16(DQ_ARGS) { TL_SCOPE;
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        out[i] = bf16_bits_to_float(*(const unsigned short*)(w + dq_row_offset(row_ids, row_start, r, row_bytes) + 2 * (size_t)c));
    }
}

// Every block type (see load_half): one thread per 16 weights. Equal bit for bit to the CPU's
// dequantisers (kernels/ggml_quants.py, ggml's dequantize_row_*): w = a*q + b with the product and
// the sum rounded separately, a and b formed as there (d*sc, -(dmin*m), d*(ls-32), ...).
template <int QT>
__device__ __forceinline__ void dequant_block_impl(const unsigned char* __restrict__ w, const int* __restrict__ row_ids,
                                                   int row_start, float* __restrict__ out, int n_rows, int n_in,
                                                   int row_bytes) {
    const int halves = n_in >> 4;
    const size_t total = (size_t)n_rows * halves;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / halves;
        const int hidx = (int)(i - r * halves);
        const unsigned char* row = w + dq_row_offset(row_ids, row_start, r, row_bytes);
        float q[16], a, b;
        load_half<QT>(row, hidx >> 1, hidx & 1, q, a, b);
        float* o = out + r * (size_t)n_in + (size_t)hidx * 16;
#pragma unroll
        for (int k = 0; k < 16; ++k) o[k] = BlockType<QT>::MIN ? __fadd_rn(__fmul_rn(a, q[k]), b) : __fmul_rn(a, q[k]);
    }
}

#define DQB(name, QT) \
    extern "C" __global__ void name(DQ_ARGS) { TL_SCOPE; dequant_block_impl<QT>(w, row_ids, row_start, out, n_rows, n_in, row_bytes); }
DQB(dequant_block_q4_0, QT_Q4_0)
DQB(dequant_block_q4_1, QT_Q4_1)
DQB(dequant_block_q5_0, QT_Q5_0)
DQB(dequant_block_q5_1, QT_Q5_1)
DQB(dequant_block_q8_0, QT_Q8_0)
DQB(dequant_block_q4_k, QT_Q4_K)
DQB(dequant_block_q5_k, QT_Q5_K)
DQB(dequant_block_q6_k, QT_Q6_K)
DQB(dequant_block_iq4_xs, QT_IQ4_XS)

extern "C" __global__ void dequant_f32(DQ_ARGS) { TL_SCOPE;
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        out[i] = *(const float*)(w + dq_row_offset(row_ids, row_start, r, row_bytes) + 4 * (size_t)c);
    }
}
#endif  // MV_T
