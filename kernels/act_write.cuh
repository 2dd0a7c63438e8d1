// The writer of the activation format (tc_common.cuh act_index / xs_index) shared by fused.cu's preps
// and mma_matmul.cu's chain prep (MM_CHAIN), which must give the same bits. The includer includes
// tc_common.cuh first.
#pragma once

// One group of 8 columns of the activation format: v[0..8) (natural columns n .. n+7 of row t,
// n % 8 == 0) as f16 into out16, then the 32-column block's sum (the four groups of lanes 4k..4k+3,
// which must be the groups of one 32-column block) as f16 hi + lo into outxs. Every lane of the warp
// calls it (shuffles); lanes with valid false take part with nothing to write.
__device__ __forceinline__ void act_group(const float* v, bool valid, int n, int t, int T, u16* __restrict__ out16,
                                          u16* __restrict__ outxs) {
    float s = 0.0f;
    if (valid) {
        u32 packed[4];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const u16 h0 = f2h(v[e]), h1 = f2h(v[e + 1]);
            s += h2f(h0);
            s += h2f(h1);
            packed[e >> 1] = (u32)h0 | ((u32)h1 << 16);
        }
        *(uint4*)(out16 + act_index(t, n, T)) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
    s += shfl_xor(s, 1);
    s += shfl_xor(s, 2);
    if (valid && (threadIdx.x & 3) == 0 && outxs != nullptr) {
        const u16 hi = f2h(s);
        const u16 lo = f2h(s - h2f(hi));
        outxs[xs_index(t, n >> 5)] = hi;
        outxs[xs_index(t, n >> 5) + 2] = lo;
    }
}


// RMSNorm's scale from a row's sum of squares.
__device__ __forceinline__ float rms_inv(float ss, int K, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)K + (double)eps));
}
