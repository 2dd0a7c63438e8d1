// One token of the gated delta rule for one value column of one head (qwen35 math §3.6), shared by
// the backend's recurrence (deltanet.cu) and the GPU step's (fused.cu gdn_recur):
//     S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
// The column's d_k state rows are split over PARTS adjacent lanes (a power of two, DN_PARTS = 4 by
// default), each holding RPT of them in registers: row dn_row<RPT, PARTS>(part, ii). With RPT a
// multiple of 4 a lane holds groups of 4 consecutive rows, the groups of the PARTS lanes
// interleaved, so k and q come from shared memory as one 16-byte load per group and the lanes of a
// column read 16 * PARTS contiguous bytes (conflict-free); each dot product keeps 4 partial sums (a chain of RPT/4 FMAs, not RPT), added
// pairwise, then across the lanes with xor-shuffles. The result depends only on the token's inputs
// and the state, never on how many tokens a launch walks (verify rows equal decode steps).
//
// The includer defines DN_SHFL_XOR(v, m) (a float xor-shuffle inside the warp) and stages k, q
// rows of PARTS * RPT floats (zero past d_k) in shared memory, 16-byte aligned.
#pragma once

#define DN_PARTS 4

template <int RPT> struct DnRows {
    static constexpr int W = (RPT % 4 == 0) ? 4 : 1;      // consecutive rows per group
};
template <int RPT, int PARTS = DN_PARTS>
__device__ __forceinline__ int dn_row(int part, int ii) {
    constexpr int W = DnRows<RPT>::W;
    return (ii / W) * (PARTS * W) + part * W + (ii % W);
}

// Advances s (this lane's rows) by one token and returns the column's output S^T q (unscaled).
template <int RPT, int PARTS = DN_PARTS>
__device__ __forceinline__ float dn_token(float (&s)[RPT], const float* sk, const float* sq, float vt, float decay,
                                          float bt, int part) {
    constexpr int W = DnRows<RPT>::W;
    float kr[RPT], qr[RPT];
#pragma unroll
    for (int m = 0; m < RPT / W; ++m) {
        const int i = m * PARTS * W + part * W;
        if (W == 4) {
            const float4 k4 = *(const float4*)(sk + i), q4 = *(const float4*)(sq + i);
            kr[4 * m] = k4.x; kr[4 * m + 1] = k4.y; kr[4 * m + 2] = k4.z; kr[4 * m + 3] = k4.w;
            qr[4 * m] = q4.x; qr[4 * m + 1] = q4.y; qr[4 * m + 2] = q4.z; qr[4 * m + 3] = q4.w;
        } else {
            kr[m] = sk[i];
            qr[m] = sq[i];
        }
    }
    float a[W];
#pragma unroll
    for (int w = 0; w < W; ++w) a[w] = 0.0f;
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) {
        s[ii] *= decay;
        a[ii % W] = fmaf(s[ii], kr[ii], a[ii % W]);
    }
    float kv = W == 4 ? (a[0] + a[W > 1 ? 1 : 0]) + (a[W > 2 ? 2 : 0] + a[W > 3 ? 3 : 0]) : a[0];
#pragma unroll
    for (int m = 1; m < PARTS; m <<= 1) kv += DN_SHFL_XOR(kv, m);
    const float delta = bt * (vt - kv);
#pragma unroll
    for (int w = 0; w < W; ++w) a[w] = 0.0f;
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) {
        s[ii] = fmaf(kr[ii], delta, s[ii]);
        a[ii % W] = fmaf(s[ii], qr[ii], a[ii % W]);
    }
    float o = W == 4 ? (a[0] + a[W > 1 ? 1 : 0]) + (a[W > 2 ? 2 : 0] + a[W > 3 ? 3 : 0]) : a[0];
#pragma unroll
    for (int m = 1; m < PARTS; m <<= 1) o += DN_SHFL_XOR(o, m);
    return o;
}
