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

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_DOWN(v, off) __shfl_down((v), (off))
#else
#define SHFL_DOWN(v, off) __shfl_down_sync(0xffffffffu, (v), (off))
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
// F16 / BF16 rows. Unit: 4 columns (one 8-byte load per row); needs n_in % 4 == 0 (the host
// sends other widths through dequantisation + GEMM).
template <int T, int R, bool BF16>
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
            const uint2 u = *(const uint2*)(w + row_off[r] + 2 * (size_t)c);
            const unsigned int h[4] = {u.x & 0xffffu, u.x >> 16, u.y & 0xffffu, u.y >> 16};
#pragma unroll
            for (int i = 0; i < 4; ++i) wv[r][i] = BF16 ? bf16_bits_to_float(h[i]) : half_bits_to_float(h[i]);
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

#ifdef MV_T
#ifndef MV_U
#define MV_U 1
#endif
#define MV_ARGS const unsigned char* __restrict__ w, const float* __restrict__ x, \
                float* __restrict__ y, int n_out, int n_in, int row_bytes
extern "C" __global__ void __launch_bounds__(MV_BLOCK) q8_0_matvec(MV_ARGS) {
    q8_0_matvec_impl<MV_T, MV_R, MV_U>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) q4_k_matvec(MV_ARGS) {
    q4_k_matvec_impl<MV_T, MV_R, MV_U>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) f16_matvec(MV_ARGS) {
    f16_matvec_impl<MV_T, MV_R, false>(w, x, y, n_out, n_in, row_bytes);
}
extern "C" __global__ void __launch_bounds__(MV_BLOCK) bf16_matvec(MV_ARGS) {
    f16_matvec_impl<MV_T, MV_R, true>(w, x, y, n_out, n_in, row_bytes);
}
#endif

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

extern "C" __global__ void dequant_q8_0(DQ_ARGS) {
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        const unsigned char* blk = w + dq_row_offset(row_ids, row_start, r, row_bytes) + (size_t)(c >> 5) * Q8_0_BYTES;
        const float d = half_bits_to_float(*(const unsigned short*)blk);
        out[i] = __fmul_rn(d, (float)(signed char)blk[2 + (c & 31)]);
    }
}

extern "C" __global__ void dequant_q4_k(DQ_ARGS) {
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

extern "C" __global__ void dequant_f16(DQ_ARGS) {
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        out[i] = half_bits_to_float(*(const unsigned short*)(w + dq_row_offset(row_ids, row_start, r, row_bytes) + 2 * (size_t)c));
    }
}

extern "C" __global__ void dequant_bf16(DQ_ARGS) {
    const size_t total = (size_t)n_rows * n_in;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_in;
        const int c = (int)(i - r * n_in);
        out[i] = bf16_bits_to_float(*(const unsigned short*)(w + dq_row_offset(row_ids, row_start, r, row_bytes) + 2 * (size_t)c));
    }
}
