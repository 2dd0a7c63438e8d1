// Gated DeltaNet recurrent step (qwen35 math §3.6), token by token, state updated in place.
//
// Per token t and v-head h (k-head kh = h % H_k, GGUF tiled order), with S (d_k x d_v) = state[h]^T:
//     S     <- exp(g[t,h]) * S                       (decay)
//     delta  = beta[t,h] * (v[t,h] - S^T k[t,kh])    (read)
//     S     <- S + k[t,kh] delta^T                   (write)
//     o[t,h] = S^T q[t,kh] * scale                   (output; reads the updated S; scale = 1/sqrt(d_k))
//
// Layouts (row-major, f32): q, k [T, H_k, d_k]; v, o [T, H_v, d_v]; g, beta [T, H_v];
// state [H_v, d_v, d_k] (S^T per head: a column's rows contiguous, kernels/deltanet.py); optional
// checkpoints [T, H_v, d_v, d_k] (the state after each token).
//
// Mapping: a block owns DN_COLS value columns of one head; each column is split over DN_PARTS
// adjacent threads holding its state rows in registers for the whole call (kernels/
// deltanet_step.cuh: the row map and the token step), so the state is read and written once per
// call (plus checkpoints). The inputs of DN_CHUNK tokens (q and k rows of the k-head, the block's
// v columns, the gates) are staged in shared memory together, so the token loop waits on one
// round of loads per chunk instead of one per token.

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_XOR(v, m) __shfl_xor((v), (m))
#else
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif
#define DN_SHFL_XOR(v, m) SHFL_XOR(v, m)
#include "deltanet_step.cuh"

#define DN_COLS 32
#define DN_BLOCK (DN_COLS * DN_PARTS)
#define DN_CHUNK 8
#define DN_MAX_DK (DN_PARTS * 64)

template <int RPT>
__device__ __forceinline__ void deltanet_recurrent_impl(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
    float* __restrict__ checkpoints, float* __restrict__ out,
    int T, int H_k, int H_v, int d_k, int d_v, float scale) {
    __shared__ __align__(16) float sq[DN_CHUNK][DN_MAX_DK];
    __shared__ __align__(16) float sk[DN_CHUNK][DN_MAX_DK];
    __shared__ float sv[DN_CHUNK][DN_COLS], sdecay[DN_CHUNK], sbeta[DN_CHUNK];
    constexpr int DKP = DN_PARTS * RPT;          // staged row length (zero past d_k)
    const int h = blockIdx.y;
    const int kh = h % H_k;
    const int lcol = threadIdx.x / DN_PARTS;
    const int col = blockIdx.x * DN_COLS + lcol;
    const int part = threadIdx.x % DN_PARTS;
    const bool col_ok = col < d_v;
    float* Sc = state + ((size_t)h * d_v + (col_ok ? col : 0)) * d_k;    // this lane's column

    float s[RPT];
    dn_col_load<RPT>(s, Sc, part, d_k, col_ok);

    for (int c0 = 0; c0 < T; c0 += DN_CHUNK) {
        const int n = min(DN_CHUNK, T - c0);
        __syncthreads();                 // the previous chunk's reads are done
        for (int e = threadIdx.x; e < n * DKP; e += DN_BLOCK) {
            const int tt = e / DKP, i = e - tt * DKP;
            const size_t off = ((size_t)(c0 + tt) * H_k + kh) * d_k + i;
            sq[tt][i] = i < d_k ? q[off] : 0.0f;
            sk[tt][i] = i < d_k ? k[off] : 0.0f;
        }
        for (int e = threadIdx.x; e < n * DN_COLS; e += DN_BLOCK) {
            const int tt = e / DN_COLS, lc = e - tt * DN_COLS, cc = blockIdx.x * DN_COLS + lc;
            sv[tt][lc] = cc < d_v ? v[((size_t)(c0 + tt) * H_v + h) * d_v + cc] : 0.0f;
        }
        if (threadIdx.x < n) {
            sdecay[threadIdx.x] = expf(g[(size_t)(c0 + threadIdx.x) * H_v + h]);
            sbeta[threadIdx.x] = beta[(size_t)(c0 + threadIdx.x) * H_v + h];
        }
        __syncthreads();
        for (int tt = 0; tt < n; ++tt) {
            const int t = c0 + tt;
            const float o = dn_token<RPT>(s, sk[tt], sq[tt], sv[tt][lcol], sdecay[tt], sbeta[tt], part);
            if (col_ok && part == 0) out[((size_t)t * H_v + h) * d_v + col] = o * scale;
            if (checkpoints != nullptr && col_ok)
                dn_col_store<RPT>(checkpoints + (((size_t)t * H_v + h) * d_v + col) * d_k, s, part, d_k);
        }
    }

    if (col_ok) dn_col_store<RPT>(Sc, s, part, d_k);
}

#define DN_ARGS const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, \
                const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,   \
                float* __restrict__ checkpoints, float* __restrict__ out,                                  \
                int T, int H_k, int H_v, int d_k, int d_v, float scale
#define DN_CALL q, k, v, g, beta, state, checkpoints, out, T, H_k, H_v, d_k, d_v, scale

// d_k <= DN_PARTS * RPT: the host picks the smallest that fits.
extern "C" __global__ void __launch_bounds__(DN_BLOCK) deltanet_recurrent_r8(DN_ARGS) { deltanet_recurrent_impl<8>(DN_CALL); }
extern "C" __global__ void __launch_bounds__(DN_BLOCK) deltanet_recurrent_r16(DN_ARGS) { deltanet_recurrent_impl<16>(DN_CALL); }
extern "C" __global__ void __launch_bounds__(DN_BLOCK) deltanet_recurrent_r32(DN_ARGS) { deltanet_recurrent_impl<32>(DN_CALL); }
extern "C" __global__ void __launch_bounds__(DN_BLOCK) deltanet_recurrent_r64(DN_ARGS) { deltanet_recurrent_impl<64>(DN_CALL); }
