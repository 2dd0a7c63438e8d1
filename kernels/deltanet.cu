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
// adjacent threads, each holding RPT rows of that column in registers for the whole call, so the
// state is read and written once per call (plus checkpoints). The two dot products per token are
// finished with xor-shuffles inside groups of DN_PARTS adjacent lanes, which lie in one warp for
// any warp size >= 4 (CUDA 32, HIP 64).

#ifdef __HIP_PLATFORM_AMD__
#define SHFL_XOR(v, m) __shfl_xor((v), (m))
#else
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

#define DN_COLS 32
#define DN_PARTS 4
#define DN_BLOCK (DN_COLS * DN_PARTS)

template <int RPT>
__device__ __forceinline__ void deltanet_recurrent_impl(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
    float* __restrict__ checkpoints, float* __restrict__ out,
    int T, int H_k, int H_v, int d_k, int d_v, float scale) {
    const int h = blockIdx.y;
    const int kh = h % H_k;
    const int col = blockIdx.x * DN_COLS + (threadIdx.x / DN_PARTS);
    const int part = threadIdx.x % DN_PARTS;
    const bool col_ok = col < d_v;
    const int i0 = part * RPT;
    float* S = state + (size_t)h * d_k * d_v;

    float s[RPT];
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) {
        const int i = i0 + ii;
        s[ii] = (col_ok && i < d_k) ? S[(size_t)i * d_v + col] : 0.0f;
    }

    for (int t = 0; t < T; ++t) {
        const float decay = expf(g[(size_t)t * H_v + h]);
        const float bt = beta[(size_t)t * H_v + h];
        const float* kt = k + ((size_t)t * H_k + kh) * d_k;
        const float* qt = q + ((size_t)t * H_k + kh) * d_k;

        float kr[RPT];
        float kv = 0.0f;
#pragma unroll
        for (int ii = 0; ii < RPT; ++ii) {
            const int i = i0 + ii;
            kr[ii] = (i < d_k) ? kt[i] : 0.0f;
            s[ii] *= decay;
            kv += s[ii] * kr[ii];
        }
        kv += SHFL_XOR(kv, 1);
        kv += SHFL_XOR(kv, 2);
        const float vt = col_ok ? v[((size_t)t * H_v + h) * d_v + col] : 0.0f;
        const float delta = bt * (vt - kv);

        float o = 0.0f;
#pragma unroll
        for (int ii = 0; ii < RPT; ++ii) {
            const int i = i0 + ii;
            s[ii] += kr[ii] * delta;
            o += s[ii] * ((i < d_k) ? qt[i] : 0.0f);
        }
        o += SHFL_XOR(o, 1);
        o += SHFL_XOR(o, 2);
        if (col_ok && part == 0) out[((size_t)t * H_v + h) * d_v + col] = o * scale;

        if (checkpoints != nullptr && col_ok) {
            float* C = checkpoints + ((size_t)t * H_v + h) * d_k * d_v;
#pragma unroll
            for (int ii = 0; ii < RPT; ++ii) {
                const int i = i0 + ii;
                if (i < d_k) C[(size_t)i * d_v + col] = s[ii];
            }
        }
    }

    if (col_ok) {
#pragma unroll
        for (int ii = 0; ii < RPT; ++ii) {
            const int i = i0 + ii;
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
