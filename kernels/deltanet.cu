// Gated DeltaNet recurrent step (qwen35 math §3.6), token by token, state updated in place.
//
// Per token t and v-head h (k-head kh = h % H_k, GGUF tiled order), with S = state[h] (d_k x d_v):
//     S     <- exp(g[t,h]) * S                       (decay)
//     delta  = beta[t,h] * (v[t,h] - S^T k[t,kh])    (read)
//     S     <- S + k[t,kh] delta^T                   (write)
//     o[t,h] = S^T q[t,kh] * scale                   (output; reads the updated S; scale = 1/sqrt(d_k))
//
// Layouts (row-major, f32): q, k [T, H_k, d_k]; v, o [T, H_v, d_v]; g, beta [T, H_v];
// state [H_v, d_k, d_v]; optional checkpoints [T, H_v, d_k, d_v] (the state after each token).
//
// Mapping: a block owns DN_COLS value columns of one head; each column is split over DN_PARTS
// adjacent threads, thread `part` holding rows part, part + DN_PARTS, ... of that column in
// registers for the whole call (interleaved, so the DN_PARTS threads of a column read adjacent
// shared-memory words), so the state is read and written once per call (plus checkpoints). The
// two dot products per token are finished with xor-shuffles inside groups of DN_PARTS adjacent
// lanes, which lie in one warp for any warp size >= 4 (CUDA 32, HIP 64). The inputs of
// DN_CHUNK tokens (q and k rows of the k-head, the block's v columns, the gates) are staged in
// shared memory together, so the token loop waits on one round of loads per chunk instead of one
// per token (a 512-token prefill of the 27B shape, 48 heads of 128 x 128: 0.68 -> 0.43 ms a layer).

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_XOR(v, m) __shfl_xor((v), (m))
#else
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

#define DN_COLS 32
#define DN_PARTS 4
#define DN_BLOCK (DN_COLS * DN_PARTS)
#define DN_CHUNK 8
#define DN_MAX_DK (DN_PARTS * 64)

template <int RPT>
__device__ __forceinline__ void deltanet_recurrent_impl(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
    float* __restrict__ checkpoints, float* __restrict__ out,
    int T, int H_k, int H_v, int d_k, int d_v, float scale) {
    __shared__ float sq[DN_CHUNK][DN_MAX_DK], sk[DN_CHUNK][DN_MAX_DK];
    __shared__ float sv[DN_CHUNK][DN_COLS], sdecay[DN_CHUNK], sbeta[DN_CHUNK];
    const int h = blockIdx.y;
    const int kh = h % H_k;
    const int lcol = threadIdx.x / DN_PARTS;
    const int col = blockIdx.x * DN_COLS + lcol;
    const int part = threadIdx.x % DN_PARTS;
    const bool col_ok = col < d_v;
    float* S = state + (size_t)h * d_k * d_v;

    float s[RPT];
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) {
        const int i = part + DN_PARTS * ii;
        s[ii] = (col_ok && i < d_k) ? S[(size_t)i * d_v + col] : 0.0f;
    }

    for (int c0 = 0; c0 < T; c0 += DN_CHUNK) {
        const int n = min(DN_CHUNK, T - c0);
        __syncthreads();                 // the previous chunk's reads are done
        for (int e = threadIdx.x; e < n * d_k; e += DN_BLOCK) {
            const int tt = e / d_k, i = e - tt * d_k;
            const size_t off = ((size_t)(c0 + tt) * H_k + kh) * d_k + i;
            sq[tt][i] = q[off];
            sk[tt][i] = k[off];
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
            const float decay = sdecay[tt];
            float kr[RPT];
            float kv = 0.0f;
#pragma unroll
            for (int ii = 0; ii < RPT; ++ii) {
                const int i = part + DN_PARTS * ii;
                kr[ii] = (i < d_k) ? sk[tt][i] : 0.0f;
                s[ii] *= decay;
                kv += s[ii] * kr[ii];
            }
            kv += SHFL_XOR(kv, 1);
            kv += SHFL_XOR(kv, 2);
            const float delta = sbeta[tt] * (sv[tt][lcol] - kv);

            float o = 0.0f;
#pragma unroll
            for (int ii = 0; ii < RPT; ++ii) {
                const int i = part + DN_PARTS * ii;
                s[ii] += kr[ii] * delta;
                o += s[ii] * ((i < d_k) ? sq[tt][i] : 0.0f);
            }
            o += SHFL_XOR(o, 1);
            o += SHFL_XOR(o, 2);
            if (col_ok && part == 0) out[((size_t)t * H_v + h) * d_v + col] = o * scale;

            if (checkpoints != nullptr && col_ok) {
                float* C = checkpoints + ((size_t)t * H_v + h) * d_k * d_v;
#pragma unroll
                for (int ii = 0; ii < RPT; ++ii) {
                    const int i = part + DN_PARTS * ii;
                    if (i < d_k) C[(size_t)i * d_v + col] = s[ii];
                }
            }
        }
    }

    if (col_ok) {
#pragma unroll
        for (int ii = 0; ii < RPT; ++ii) {
            const int i = part + DN_PARTS * ii;
            if (i < d_k) S[(size_t)i * d_v + col] = s[ii];
        }
    }
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
