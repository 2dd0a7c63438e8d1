// The small per-token operations of the qwen35 model on f32 activations: RMSNorm, L2 norm, gated
// RMSNorm, SwiGLU, sigmoid gating, partial NeoX RoPE, the depthwise causal conv + silu, and row
// argmax. Each mirrors the CPU backend (kernels/cpu_backend.py) operation for operation; where the
// CPU rounds a product before adding, so do these (__fmul_rn / __fadd_rn keep the compiler from
// contracting them into an FMA), so that most results agree with the CPU to the last bit or two.
//
// Sources compile under NVRTC and hiprtc: no headers, no inline PTX; reductions loop over
// `warpSize` and finish in shared memory, so they work for 32- and 64-lane warps.
//
// Row addressing for the norms: a row r of D contiguous floats starts at
//     (r / n_inner) * s_outer + (r % n_inner) * s_inner        (in floats)
// which covers contiguous arrays and the strided views the model passes (q = qg[:, :, :D] of a
// packed q|gate projection; q/k heads sliced out of the conv output). Outputs are contiguous.

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_XOR(v, m) __shfl_xor((v), (m))
#else
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

#define OPS_MAX_THREADS 256
#define OPS_MAX_WARPS (OPS_MAX_THREADS / 32)   // enough slots for any warp size >= 32

__device__ __forceinline__ float warp_allsum(float v) {
    for (int m = warpSize >> 1; m > 0; m >>= 1) v += SHFL_XOR(v, m);
    return v;
}

// Sum of v over the block, returned to every thread. Every thread of the block must call it.
__device__ float block_allsum(float v) {
    __shared__ float part[OPS_MAX_WARPS];
    __shared__ float total;
    const int lane = threadIdx.x % warpSize;
    const int warp = threadIdx.x / warpSize;
    const int n_warps = (blockDim.x + warpSize - 1) / warpSize;
    v = warp_allsum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < n_warps; ++w) s += part[w];
        total = s;
    }
    __syncthreads();
    const float r = total;
    __syncthreads();   // `part` and `total` may be reused by the next call
    return r;
}

__device__ __forceinline__ size_t row_offset(int r, int n_inner, long long s_outer, long long s_inner) {
    return (size_t)((long long)(r / n_inner) * s_outer + (long long)(r % n_inner) * s_inner);
}

__device__ __forceinline__ float silu_f(float z) {
    return z / (1.0f + expf(-z));
}

#define NORM_RMS 0     // x / sqrt(mean(x^2) + eps) * w
#define NORM_L2 1      // x / sqrt(sum(x^2) + eps)
#define NORM_GATED 2   // silu(z) * (x / sqrt(mean(x^2) + eps) * w)

// One block per row. w (length D) may be null (no weight). z (gated mode) is contiguous [n_rows, D].
// The inverse norm is formed in double from the f32 sum of squares, as the CPU backend forms it
// from a double sum: the two differ by the f32 rounding of the sum only (~1e-7 relative).
extern "C" __global__ void norm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                     const float* __restrict__ z, float* __restrict__ y,
                                     int n_rows, int D, int n_inner, long long s_outer, long long s_inner,
                                     float eps, int mode) {
    const int r = blockIdx.x;
    const float* xr = x + row_offset(r, n_inner, s_outer, s_inner);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = block_allsum(ss);
    const double denom = mode == NORM_L2 ? (double)ss : (double)ss / (double)D;
    const float inv = (float)(1.0 / sqrt(denom + (double)eps));
    float* yr = y + (size_t)r * D;
    const float* zr = z + (size_t)r * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = __fmul_rn(xr[i], inv);
        if (w != 0) v = __fmul_rn(v, w[i]);
        if (mode == NORM_GATED) v = __fmul_rn(silu_f(zr[i]), v);
        yr[i] = v;
    }
}

// out = silu(a) * b  (SwiGLU: a = gate, b = up)
extern "C" __global__ void silu_mul_f32(const float* __restrict__ a, const float* __restrict__ b,
                                        float* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = __fmul_rn(silu_f(a[i]), b[i]);
}

// out = a * sigmoid(b) = a / (1 + exp(-b))  (attention output gate)
extern "C" __global__ void sigmoid_mul_f32(const float* __restrict__ a, const float* __restrict__ b,
                                           float* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = a[i] / (1.0f + expf(-b[i]));
}

// Partial NeoX RoPE on contiguous x[T, H, D] -> y: pair (i, i + n_rot/2), i < n_rot/2, rotated by
// pos[t] * theta^(-2i/n_rot). The angle is formed and reduced mod 2*pi in double, then cos/sin are
// taken in f32 (the CPU backend's order). One block per (t, h) row.
#define TWO_PI 6.283185307179586
extern "C" __global__ void rope_neox_f32(const float* __restrict__ x, float* __restrict__ y,
                                         const int* __restrict__ pos, int H, int D, int n_rot, double theta) {
    const int row = blockIdx.x;
    const int t = row / H;
    const int half = n_rot >> 1;
    const float* xr = x + (size_t)row * D;
    float* yr = y + (size_t)row * D;
    const double p = (double)pos[t];
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        if (i < n_rot) {
            const int j = i < half ? i : i - half;
            const double inv_freq = pow(theta, (-2.0 * (double)j) / (double)n_rot);
            const float angle = (float)fmod(p * inv_freq, TWO_PI);
            const float c = cosf(angle), s = sinf(angle);
            const float x1 = xr[j], x2 = xr[j + half];
            yr[i] = i < half ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
                             : __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c));
        } else {
            yr[i] = xr[i];
        }
    }
}

// Depthwise causal conv over time, then silu. x[T, C] (contiguous), state[K-1, C] (row 0 oldest),
// w[C, K] (tap K-1 on the newest input). X = [state; x]: y[t, c] = silu(sum_j X[t + j, c] w[c, j]),
// summed j = 0..K-1 with each product rounded (the CPU's order); new_state = X[T .. T+K-2].
// One thread per (channel, span of CONV_TOKENS tokens): the outputs are independent, so a long
// prompt spreads over T / CONV_TOKENS times more blocks (one block row per span; the spans of
// blockIdx.y 0 also write new_state). Each output is summed in the same order whatever the split.
#define CONV_TOKENS 16
extern "C" __global__ void causal_conv1d_silu_f32(const float* __restrict__ x, const float* __restrict__ state,
                                                  const float* __restrict__ w, float* __restrict__ y,
                                                  float* __restrict__ new_state, int T, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int K1 = K - 1;
    const int t0 = blockIdx.y * CONV_TOKENS, t1 = min(T, t0 + CONV_TOKENS);
    for (int t = t0; t < t1; ++t) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int i = t + j;
            const float xv = i < K1 ? state[(size_t)i * C + c] : x[(size_t)(i - K1) * C + c];
            const float prod = __fmul_rn(xv, w[(size_t)c * K + j]);
            acc = j == 0 ? prod : __fadd_rn(acc, prod);
        }
        y[(size_t)t * C + c] = acc / (1.0f + expf(-acc));
    }
    if (blockIdx.y != 0) return;
    for (int r = 0; r < K1; ++r) {
        const int i = T + r;
        new_state[(size_t)r * C + c] = i < K1 ? state[(size_t)i * C + c] : x[(size_t)(i - K1) * C + c];
    }
}

// Row argmax with numpy's rules: the first NaN if there is one, else the lowest index of the maximum.
__device__ __forceinline__ bool argmax_better(float a, int ia, float b, int ib) {
    if (ib < 0) return ia >= 0;
    if (ia < 0) return false;
    const bool na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

extern "C" __global__ void argmax_rows_f32(const float* __restrict__ x, long long* __restrict__ out, int V) {
    __shared__ float sv[OPS_MAX_WARPS];
    __shared__ int si[OPS_MAX_WARPS];
    const int row = blockIdx.x;
    const float* xr = x + (size_t)row * V;
    float bv = 0.0f;
    int bi = -1;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = xr[i];
        if (argmax_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    for (int m = warpSize >> 1; m > 0; m >>= 1) {
        const float ov = SHFL_XOR(bv, m);
        const int oi = SHFL_XOR(bi, m);
        if (argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x % warpSize;
    const int warp = threadIdx.x / warpSize;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n_warps = (blockDim.x + warpSize - 1) / warpSize;
        for (int w = 1; w < n_warps; ++w)
            if (argmax_better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
        out[row] = bi;
    }
}

// Busy-wait for about `cycles` ticks of clock64() on one multiprocessor. Benchmarks queue it before
// the work they time, so the device is still busy while the host issues that work and the events
// around it measure the kernels back to back, without the host's gaps.
extern "C" __global__ void spin_wait(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
