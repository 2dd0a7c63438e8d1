// Softmax attention over the f32 KV cache, for decode (T = 1), verify (T tokens with an explicit
// mask) and prefill (T tokens, causal): one kernel for all three.
//
//   out[t, h] = sum_j p_j v[kvh, j],  p = softmax_j(scale * q[t, h] . k[kvh, j]) over the allowed j,
//   kvh = h / (H_q / H_kv) (GQA), j allowed iff j < kv_len, j <= pos[t] and (no mask or mask[t, j]).
//   A row with no allowed key gives zeros (the CPU backend's convention).
//
// Layouts: q, out [T, H_q, D] contiguous; k_cache, v_cache [H_kv, ctx, D]; pos int32 [T];
// mask uint8 [T, kv_len] or null. D <= ATT_MAXE * 32.
//
// Work split: the keys are cut into fixed spans of ATT_SPAN positions; block (s, h, t) handles
// span s for query row t, head h. Inside a block, each group of 32 threads (a warp, or half a
// 64-lane wave) takes every ATT_GROUPS-th key of the span: the lanes hold D/32 elements of q and of
// the output accumulator, the score is a xor-shuffle sum inside the group, and the softmax is kept
// online (running max m, normaliser l) in f32. The groups are merged in shared memory; with one
// span the block writes the output, otherwise (m, l, unnormalised o) per span go to a workspace
// and `attention_combine` merges them.
//
// The spans depend on positions only (never on T or kv_len), and spans past a row's position
// contribute exact zeros, so a row's result is the same whether it is computed alone (decode)
// or inside a verify batch: speculative decoding relies on that.

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_XOR32(v, m) __shfl_xor((v), (m), 32)
#else
#define SHFL_XOR32(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), 32)
#endif

#define ATT_THREADS 128
#define ATT_GROUPS (ATT_THREADS / 32)
#define ATT_SPAN 256
#define ATT_MAXE 8

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float group32_allsum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += SHFL_XOR32(v, m);
    return v;
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_f32(
    const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,
    const int* __restrict__ pos, const unsigned char* __restrict__ mask,
    float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ out,
    int H_q, int H_kv, int D, int ctx, int kv_len, int n_span, float scale) {
    __shared__ float s_m[ATT_GROUPS], s_l[ATT_GROUPS];
    __shared__ float s_acc[ATT_GROUPS][ATT_MAXE * 32];
    const int span = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int grp = threadIdx.x >> 5;
    const int kvh = h / (H_q / H_kv);
    const float* qr = q + ((size_t)t * H_q + h) * D;
    const float* kb = k_cache + (size_t)kvh * ctx * D;
    const float* vb = v_cache + (size_t)kvh * ctx * D;

    float qv[ATT_MAXE], acc[ATT_MAXE];
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < D ? qr[d] : 0.0f;
        acc[e] = 0.0f;
    }
    float m = neg_inf(), l = 0.0f;
    const int j_begin = span * ATT_SPAN;
    const int j_end = min(min(kv_len, j_begin + ATT_SPAN), pos[t] + 1);
    const unsigned char* mrow = mask ? mask + (size_t)t * kv_len : 0;
    for (int j = j_begin + grp; j < j_end; j += ATT_GROUPS) {
        if (mrow && !mrow[j]) continue;                       // the same j for the whole group
        const float* kr = kb + (size_t)j * D;
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < ATT_MAXE; ++e) {
            const int d = lane + 32 * e;
            if (d < D) part += qv[e] * kr[d];
        }
        const float score = group32_allsum(part) * scale;
        const float m_new = fmaxf(m, score);
        const float corr = expf(m - m_new);                   // 0 while m is -inf
        const float p = expf(score - m_new);
        l = l * corr + p;
        const float* vr = vb + (size_t)j * D;
#pragma unroll
        for (int e = 0; e < ATT_MAXE; ++e) {
            const int d = lane + 32 * e;
            if (d < D) acc[e] = acc[e] * corr + p * vr[d];
        }
        m = m_new;
    }

    if (lane == 0) { s_m[grp] = m; s_l[grp] = l; }
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) s_acc[grp][lane + 32 * e] = acc[e];
    __syncthreads();

    float M = neg_inf();
    for (int g = 0; g < ATT_GROUPS; ++g) M = fmaxf(M, s_m[g]);
    float wgt[ATT_GROUPS];
    float L = 0.0f;
    for (int g = 0; g < ATT_GROUPS; ++g) {
        wgt[g] = s_m[g] == neg_inf() ? 0.0f : expf(s_m[g] - M);
        L += s_l[g] * wgt[g];
    }
    const size_t row = (size_t)t * H_q + h;
    for (int d = threadIdx.x; d < D; d += ATT_THREADS) {
        float o = 0.0f;
        for (int g = 0; g < ATT_GROUPS; ++g) o += s_acc[g][d] * wgt[g];
        if (n_span == 1) {
            out[row * D + d] = L > 0.0f ? o / L : 0.0f;
        } else {
            part_o[(row * n_span + span) * D + d] = o;
        }
    }
    if (n_span > 1 && threadIdx.x == 0) {
        part_ml[(row * n_span + span) * 2] = M;
        part_ml[(row * n_span + span) * 2 + 1] = L;
    }
}

// Merge the spans of attention_f32: one block per (h, t).
extern "C" __global__ void attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             float* __restrict__ out, int H_q, int D, int n_span) {
    const int h = blockIdx.x, t = blockIdx.y;
    const size_t row = (size_t)t * H_q + h;
    const float* ml = part_ml + row * n_span * 2;
    float M = neg_inf();
    for (int s = 0; s < n_span; ++s) M = fmaxf(M, ml[2 * s]);
    float L = 0.0f;
    for (int s = 0; s < n_span; ++s) {
        const float w = ml[2 * s] == neg_inf() ? 0.0f : expf(ml[2 * s] - M);
        L += ml[2 * s + 1] * w;
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < n_span; ++s) {
            const float w = ml[2 * s] == neg_inf() ? 0.0f : expf(ml[2 * s] - M);
            o += part_o[(row * n_span + s) * D + d] * w;
        }
        out[row * D + d] = L > 0.0f ? o / L : 0.0f;
    }
}
