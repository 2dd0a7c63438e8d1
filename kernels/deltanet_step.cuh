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

// The state is stored transposed ([head][column][row], kernels/deltanet.py), so a column's d_k
// rows are contiguous at sc and a lane's groups of 4 rows are 16-byte pieces: the PARTS lanes of a
// column cover 16 * PARTS contiguous bytes, whole sectors. ok = 0: zeros (a column past d_v).
template <int RPT, int PARTS = DN_PARTS>
__device__ __forceinline__ void dn_col_load(float (&s)[RPT], const float* sc, int part, int dk, bool ok) {
    if (DnRows<RPT>::W == 4 && ((dk & 3) | ((unsigned long long)sc & 15)) == 0) {
#pragma unroll
        for (int m = 0; m < RPT / 4; ++m) {
            const int i = dn_row<RPT, PARTS>(part, 4 * m);
            const float4 v = (ok && i < dk) ? *(const float4*)(sc + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            s[4 * m] = v.x; s[4 * m + 1] = v.y; s[4 * m + 2] = v.z; s[4 * m + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int ii = 0; ii < RPT; ++ii) {
            const int i = dn_row<RPT, PARTS>(part, ii);
            s[ii] = (ok && i < dk) ? sc[i] : 0.0f;
        }
    }
}
template <int RPT, int PARTS = DN_PARTS>
__device__ __forceinline__ void dn_col_store(float* sc, const float (&s)[RPT], int part, int dk) {
    if (DnRows<RPT>::W == 4 && ((dk & 3) | ((unsigned long long)sc & 15)) == 0) {
#pragma unroll
        for (int m = 0; m < RPT / 4; ++m) {
            const int i = dn_row<RPT, PARTS>(part, 4 * m);
            if (i < dk) *(float4*)(sc + i) = make_float4(s[4 * m], s[4 * m + 1], s[4 * m + 2], s[4 * m + 3]);
        }
    } else {
#pragma unroll
        for (int ii = 0; ii < RPT; ++ii) {
            const int i = dn_row<RPT, PARTS>(part, ii);
            if (i < dk) sc[i] = s[ii];
        }
    }
}
