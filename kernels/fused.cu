// The non-matmul kernels of the qwen35 GPU step (daemons/qwen35_gpu.py): each is one launch that
// does what several backend operations do on the CPU, with fixed buffers and with everything that
// changes from step to step (positions, the state's buffers) read from device memory, so that the
// whole step can be captured once as a CUDA graph and replayed.
//
//   prep_rows          RMSNorm (or nothing) of activation rows -> f16 act16 rows + block sums, the
//                      input format of mma_matmul.cu (prep_rows_cly<N>: a row's column blocks as
//                      one thread-block cluster, sm_90)
//   gdn_conv           DeltaNet: causal conv + silu over the q|k|v channels, L2 norm of q and k,
//                      the gates g = a * softplus(alpha + dt_bias) and beta = sigmoid(b)
//   gdn_recur          DeltaNet: the gated delta rule, token by token (math §3.6), in three modes:
//                      advance (state in place), verify (state untouched, a backup written) and
//                      commit (replay n tokens from the backup into the state: exact rollback)
//   gdn_out_prep       DeltaNet: gated RMSNorm of the output -> act16
//   attn_qk_rope_kv    attention: q/k RMSNorm, partial NeoX RoPE, K/V written into the cache
//   attn_partial       attention: softmax over a split of the keys (flash-decoding style)
//   attn_combine_prep  attention: merge the splits, sigmoid gate -> act16
//   argmax_rows        greedy ids on the device (first NaN, else the lowest index of the max)
//   topk_row           the k largest logits of a row (sampled decoding: only they cross to the host)
//   step_chain         the next decode step's params from this one's argmax (greedy decoding with
//                      the host a step behind the device)
//
// CPU counterparts: kernels/cpu_backend.py (`fused_*` methods), held equal by tests/test_fused.py.
// Determinism: every reduction has a fixed order that depends on a row's own length only, never
// on T, so a row gives the same bits decoded alone or inside a verify batch.
//
// Device params block (int32, daemons/qwen35_gpu.py): [0] n_past (position of row 0), [1] n_keep.
// State table (u64): per layer slot, pointers into the bound state (see daemons/qwen35_gpu.py).
#include "tc_common.cuh"

#define FUSED_THREADS 256
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float silu_f(float z) { return z / (1.0f + expf(-z)); }

// Sum over the block in a fixed order (lanes by xor tree, warps in index order), to every thread.
// Every thread must call it; blockDim.x a multiple of 32, at most 1024.
__device__ float block_sum(float v, float* red /* >= 33 floats of smem */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += shfl_xor(v, m);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < n_warps; ++w) s += red[w];
        red[32] = s;
    }
    __syncthreads();
    const float r = red[32];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += shfl_xor(v, m);
    return v;
}

#include "act_write.cuh"

// vals[0..count) (smem) = natural columns n0 .. n0+count-1 of row t -> that row of an activation
// buffer of T rows (f16, permuted: tc_common.cuh act_index) and the block sums of those columns.
// n0 % 32 == 0 and count % 8 == 0; a 32-column block must lie inside the range (count % 32 == 0, or
// the range ends the row). Every thread of the block must call it (shuffles). The act16 writers run
// one block row per token (grid.x = T), so they pass gridDim.x as T.
__device__ void prep_cols(const float* vals, int n0, int count, int t, u16* __restrict__ out16, u16* __restrict__ outxs) {
    const int T = (int)gridDim.x;
    const int n_groups = count >> 3;
    const int n_pad = (n_groups + blockDim.x - 1) / blockDim.x * blockDim.x;
    for (int base = 0; base < n_pad; base += blockDim.x) {
        const int u = base + threadIdx.x;
        act_group(vals + 8 * min(u, n_groups - 1), u < n_groups, n0 + 8 * u, t, T, out16, outxs);
    }
}

#define PREP_COLS 256       // columns one block of the prep-writing kernels turns into act16

// ---------------------------------------------------------------------------------------------
// prep_rows: row t of the output comes from x[(row0 + t) * ld_x]. norm = 1: RMSNorm with weight w
// (w may be null), 0: values as they are, into row t of the activation buffer out16 / outxs.
// grid (rows, ceil(K / cols)), 256 threads: each block writes `cols` columns (a multiple of 256,
// at most PREP_MAX_COLS; kernels/fused_gpu.py prep_block_cols).
// acc (may be null): the residual's pending fixed-point sum (mm_tc MODE_ADD), same layout as x:
// every value read is x + fixed_to_float(acc). The block then writes its columns of that sum to
// x_out (the residual's other buffer: other blocks of this launch may still read x and acc) and
// zeroes its columns of acc_zero (the accumulator the next ADD adds into), either may be null.
//
// The row's sum of squares has one order whatever the split (so a row's bits never depend on the
// width it is decoded at): the row is cut into 256-column chunks; chunk c's sum is block_sum's
// order over columns 256c + j (thread j: warp xor-trees, then the 8 warps in order; 0 past K), and
// the row's is the chunks' in order. Two kernels compute it:
//   prep_rows          every block stages its whole row (and accumulator) in shared memory and sums
//                      all the chunks (any device; 60 KB read per block at the 27B's 5120 columns);
//   prep_rows_cly<N>   the N column blocks of a row form a thread-block cluster (sm_90): each sums
//                      only its own chunks and reads the others' chunk sums from their shared
//                      memory, so no block reads more than its own columns (H200, 27B decode graph
//                      0.05-0.09 ms shorter: most of a prep's few microseconds is its chain of
//                      dependent steps, not those reads).
#define PREP_MAX_COLS 1024
#define PREP_CPB (PREP_MAX_COLS / PREP_COLS)      // chunks a block holds at most
__device__ __forceinline__ float fold_fixed(float x, const long long* a, int i) {
    return a != nullptr ? x + fixed_to_float(a[i]) : x;
}

// Per chunk held (v[u]: this thread's value of chunk u, 0 past K): the warps' partial sums of
// squares into red[8 u + warp] (lane 0), then, after a barrier, chunk u's sum in block_sum's order.
// Every thread of the 256 must call both (a block barrier between them).
template <int NU>
__device__ __forceinline__ void chunk_warp_sums(const float (&v)[NU], int n_u, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int u = 0; u < NU; ++u) {
        float s = v[u] * v[u];
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) s += shfl_xor(s, m);
        if (lane == 0 && u < n_u) red[8 * u + warp] = s;
    }
}
__device__ __forceinline__ float chunk_sum(const float* red, int u) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < FUSED_THREADS / 32; ++w) s += red[8 * u + w];
    return s;
}

// The folded row (x + acc, 0 past K) into rowsm[0 .. K), all loads in flight (16-byte ones where
// the row allows; 8 of each per thread a round: a 5120-wide row in one round trip), then the row's
// sum of squares in the chunked order from there, to every thread. red: 8 * PREP_ROUND floats.
#define PREP_ROUND 8                             // chunks summed between two barriers
__device__ __forceinline__ float row_sum_squares(const float* xr, const long long* ar, int K, float* rowsm,
                                                 float* red) {
    if ((K & 3) == 0 && (((size_t)xr) & 15) == 0 && (((size_t)ar) & 15) == 0) {
        const float4* x4 = (const float4*)xr;
        const longlong2* a2 = (const longlong2*)ar;
        const int n4 = K >> 2;
        for (int base = 0; base < n4; base += 8 * FUSED_THREADS) {
            float4 q[8];
            longlong2 a[8][2];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = base + u * FUSED_THREADS + (int)threadIdx.x;
                q[u] = i < n4 ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                a[u][0] = (ar != nullptr && i < n4) ? a2[2 * i] : make_longlong2(0, 0);
                a[u][1] = (ar != nullptr && i < n4) ? a2[2 * i + 1] : make_longlong2(0, 0);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = base + u * FUSED_THREADS + (int)threadIdx.x;
                if (ar != nullptr) {
                    q[u].x += fixed_to_float(a[u][0].x);
                    q[u].y += fixed_to_float(a[u][0].y);
                    q[u].z += fixed_to_float(a[u][1].x);
                    q[u].w += fixed_to_float(a[u][1].y);
                }
                if (i < n4) *(float4*)(rowsm + 4 * i) = q[u];
            }
        }
    } else {
#pragma unroll 8
        for (int i = threadIdx.x; i < K; i += FUSED_THREADS) rowsm[i] = fold_fixed(xr[i], ar, i);
    }
    __syncthreads();
    const int n_chunks = (K + PREP_COLS - 1) / PREP_COLS;
    float ss = 0.0f;
    for (int cb = 0; cb < n_chunks; cb += PREP_ROUND) {
        float v[PREP_ROUND];
#pragma unroll
        for (int u = 0; u < PREP_ROUND; ++u) {
            const int i = (cb + u) * PREP_COLS + (int)threadIdx.x;
            v[u] = i < K ? rowsm[i] : 0.0f;
        }
        const int n_u = min(PREP_ROUND, n_chunks - cb);
        chunk_warp_sums<PREP_ROUND>(v, n_u, red);
        __syncthreads();
        for (int u = 0; u < n_u; ++u) ss += chunk_sum(red, u);
        __syncthreads();                                      // red is refilled next round
    }
    return ss;
}

// Normalise the block's own[] columns, write x_out / acc_zero, and turn them into act16.
__device__ __forceinline__ void prep_finish(float* own, int n_own, int c0, int t, size_t r0, int norm, float inv,
                                            const float (&wv)[PREP_CPB], float* __restrict__ x_out,
                                            long long* __restrict__ acc_zero, u16* __restrict__ out16,
                                            u16* __restrict__ outxs) {
#pragma unroll
    for (int k = 0; k < PREP_CPB; ++k) {
        const int j = k * FUSED_THREADS + (int)threadIdx.x;
        if (j < n_own) {                         // a thread reads and rewrites only its own columns
            const float v = own[j];
            own[j] = norm ? v * inv * wv[k] : v;
            if (x_out != nullptr) x_out[r0 + c0 + j] = v;
            if (acc_zero != nullptr) acc_zero[r0 + c0 + j] = 0;
        }
    }
    __syncthreads();
    prep_cols(own, c0, n_own, t, out16, outxs);
}

#define PREP_ARGS const float* __restrict__ x, int ld_x, int row0, const float* __restrict__ w, float eps, int K, \
    int norm, u16* __restrict__ out16, u16* __restrict__ outxs, const long long* __restrict__ acc,               \
    float* __restrict__ x_out, long long* __restrict__ acc_zero, int cols

// Dynamic shared memory: 4 * K bytes with norm (the whole folded row), else 4 * cols (fused_gpu.py).
extern "C" __global__ void __launch_bounds__(FUSED_THREADS) prep_rows(PREP_ARGS) { TL_SCOPE;
    DYN_SMEM(float, rowsm);                      // the folded row (norm) or this block's columns
    __shared__ float red[8 * PREP_ROUND];
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int t = blockIdx.x, c0 = blockIdx.y * cols, n_own = min(cols, K - c0);
    const size_t r0 = (size_t)(row0 + t) * ld_x;
    const float* xr = x + r0;
    const long long* ar = acc != nullptr ? acc + r0 : nullptr;
    float wv[PREP_CPB];                          // the weights of this thread's columns: before the wait
#pragma unroll
    for (int k = 0; k < PREP_CPB; ++k) {
        const int j = k * FUSED_THREADS + (int)threadIdx.x;
        wv[k] = (norm && w != nullptr && j < n_own) ? w[c0 + j] : 1.0f;
    }
    grid_dependency_wait();
    float inv = 1.0f;
    float* own = rowsm;                          // this block's columns, then its outputs
    if (norm) {
        inv = rms_inv(row_sum_squares(xr, ar, K, rowsm, red), K, eps);
        own = rowsm + c0;
    } else {
        for (int j = threadIdx.x; j < n_own; j += FUSED_THREADS) own[j] = fold_fixed(xr[c0 + j], ar, c0 + j);
        __syncthreads();
    }
    prep_finish(own, n_own, c0, t, r0, norm, inv, wv, x_out, acc_zero, out16, outxs);
}

#if defined(TC_HAVE_CLUSTERS)
// prep_rows with norm as a cluster of the column blocks of a row (grid (rows, N), cluster (1, N, 1),
// cols * N >= K, ceil(K / 256) <= 32 chunks). Dynamic shared memory: PREP_SMEM_CLUSTER bytes.
// Barrier phases: 1 publishes every block's chunk sums; 2 says a block has read the others' (its
// shared memory must outlive those reads, so it waits for phase 2 before it returns).
#define PREP_SMEM_CLUSTER ((PREP_MAX_COLS + 8 * PREP_CPB + PREP_CPB) * 4)
__device__ __forceinline__ void prep_rows_cluster(PREP_ARGS) {
    DYN_SMEM(float, psm);
    float* own = psm;                            // [PREP_MAX_COLS]
    float* red = own + PREP_MAX_COLS;            // [8 * PREP_CPB]
    float* csum = red + 8 * PREP_CPB;            // [PREP_CPB] this block's chunk sums, read by the cluster
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int t = blockIdx.x, rank = (int)cluster_rank(), c0 = rank * cols, n_own = max(0, min(cols, K - c0));
    const int cpb = cols / PREP_COLS, lane = threadIdx.x & 31;
    const size_t r0 = (size_t)(row0 + t) * ld_x;
    const float* xr = x + r0;
    const long long* ar = acc != nullptr ? acc + r0 : nullptr;
    float wv[PREP_CPB];
#pragma unroll
    for (int k = 0; k < PREP_CPB; ++k) {
        const int j = k * FUSED_THREADS + (int)threadIdx.x;
        wv[k] = (w != nullptr && j < n_own) ? w[c0 + j] : 1.0f;
    }
    // x itself before the wait: only the accumulator is the previous launch's output. x was written
    // by the fold before it (or the embedding), at least two launches back, and the launch just
    // before passed its own wait before letting this one start, so that fold has finished. Loaded
    // from L2 (.cg): no line an earlier launch left in this multiprocessor's L1 can be read. The
    // x loads after the wait missed L2 (a layer's weights stream through it in between): loading
    // them here took the 27B decode graph from 6.589 to 6.479 ms (H200, twentieth session).
    float v[PREP_CPB];
#pragma unroll
    for (int k = 0; k < PREP_CPB; ++k) {         // this block's columns only, all loads in flight
        const int j = k * FUSED_THREADS + (int)threadIdx.x;
        v[k] = j < n_own ? ldcg_f32(xr + c0 + j) : 0.0f;
    }
    grid_dependency_wait();
#pragma unroll
    for (int k = 0; k < PREP_CPB; ++k) {
        const int j = k * FUSED_THREADS + (int)threadIdx.x;
        if (ar != nullptr && j < n_own) v[k] += fixed_to_float(ar[c0 + j]);     // fold_fixed's sum
        if (j < n_own) own[j] = v[k];
    }
    const int n_chunks = (K + PREP_COLS - 1) / PREP_COLS;
    chunk_warp_sums<PREP_CPB>(v, cpb, red);
    __syncthreads();
    if ((int)threadIdx.x < cpb) csum[threadIdx.x] = chunk_sum(red, threadIdx.x);
    cluster_arrive();                            // phase 1 (release): csum
    cluster_wait();
    // Every warp gathers the row's chunk sums (lane c: chunk c, from the block that holds it) and
    // adds them in chunk order by broadcasts: one remote load a lane, no block barrier after.
    const u32 mine = lane < n_chunks ? __float_as_uint(cluster_ld_f32(csum + lane % cpb, (unsigned)(lane / cpb))) : 0u;
    cluster_arrive();                            // phase 2: this thread's remote reads are done
    float ss = 0.0f;
    for (int c = 0; c < n_chunks; ++c) ss += __uint_as_float(shfl(mine, c));
    prep_finish(own, n_own, c0, t, r0, 1, rms_inv(ss, K, eps), wv, x_out, acc_zero, out16, outxs);
    cluster_wait();
}
#define PREP_CLUSTER_KERNEL(N)                                                                                   \
    extern "C" __global__ void __cluster_dims__(1, N, 1) __launch_bounds__(FUSED_THREADS) prep_rows_cly##N(PREP_ARGS) { \
        TL_SCOPE;                                                                                                \
        prep_rows_cluster(x, ld_x, row0, w, eps, K, norm, out16, outxs, acc, x_out, acc_zero, cols);            \
    }
PREP_CLUSTER_KERNEL(2)
PREP_CLUSTER_KERNEL(3)
PREP_CLUSTER_KERNEL(4)
PREP_CLUSTER_KERNEL(5)
PREP_CLUSTER_KERNEL(6)
PREP_CLUSTER_KERNEL(7)
PREP_CLUSTER_KERNEL(8)
#endif
// ---------------------------------------------------------------------------------------------
// gdn_conv. qkv[T][C] (row stride ldq) = the raw projection (q heads | k heads | v heads) as the
// int64 fixed-point sums its matmul added (mm_tc MODE_ADD: no exchange between the blocks that
// share a row block); the conv state [Kc-1][C] (row 0 oldest) is at tbl[slot]; conv_w[C][Kc],
// tap Kc-1 on the newest input. ab[T][2*nv] = alpha (no bias yet) | beta logits, fixed point too.
// Writes rec[T][R], R = 2*nk*dk + nv*dv + 2*nv: q (L2-normalised) | k (L2-normalised) | v | g |
// beta. write_state: advance the conv state in place (decode / prefill); 0 for verify. Verify also
// passes state_save and qkv_save: the conv state ([Kc-1][C]) and the block's inputs ([T][C], as
// floats) are copied into the layer's verify record [Kc-1+T][C], so that gdn_commit_conv can
// rebuild the state after any prefix from the record alone.
// Clearing for the next matmul that adds: each block zeroes its channels' rows of qkv_clear (and
// the gates block those of ab_clear) after its reads. The step passes the other layer parity's
// sums (kernels/fused_gpu.py op_gdn_conv): this launch's own rows are read by two token blocks
// (a token's item reads the Kc-1 rows before it), so no block may clear them, and the other
// parity's last reader, the previous DeltaNet layer's gdn_conv, has finished.
// grid (2*nk + nv + 1, ceil(T / tpb)): q heads, k heads, v heads and one block for the gates, by
// blocks of tpb tokens (one block of all T when write_state: the new state needs the old one,
// which the first token block reads). Dynamic smem (2*tpb + 2*Kc - 1) * width floats.
#include "gdn_conv.cuh"
extern "C" __global__ void __launch_bounds__(FUSED_THREADS) gdn_conv(
    const long long* __restrict__ qkv, int ldq, const unsigned long long* __restrict__ tbl, int slot,
    const float* __restrict__ conv_w, const long long* __restrict__ ab, const float* __restrict__ dt_bias,
    const float* __restrict__ ssm_a, float* __restrict__ rec, int T, int nk, int nv, int dk, int dv, int Kc,
    float eps, int write_state, float* __restrict__ state_save, float* __restrict__ qkv_save,
    long long* __restrict__ qkv_clear, long long* __restrict__ ab_clear, int tpb) { TL_SCOPE;
    DYN_SMEM(float, sm);
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int b = blockIdx.x;
    const int C = 2 * nk * dk + nv * dv;
    const int R = C + 2 * nv;
    const int t0 = blockIdx.y * tpb, n = min(tpb, T - t0);    // this block's tokens t0 .. t0 + n
    if (b == 2 * nk + nv) {              // gates
        grid_dependency_wait();
        for (int i = threadIdx.x; i < n * nv; i += blockDim.x) {
            const int t = t0 + i / nv, h = i % nv;
            const long long* pa = ab + (size_t)t * 2 * nv + h;
            gdn_gates<false>(pa, nv, dt_bias, ssm_a, h, rec + (size_t)t * R + C + h, rec + (size_t)t * R + C + nv + h);
        }
        __syncthreads();                 // every read of ab is done (ab_clear may be ab itself)
        for (int i = threadIdx.x; i < n * nv; i += blockDim.x) {
            long long* pc = ab_clear + (size_t)(t0 + i / nv) * 2 * nv + i % nv;
            pc[0] = 0;
            pc[nv] = 0;
        }
        return;
    }
    int ch0, width;
    bool normed;
    gdn_conv_channels(b, nk, dk, dv, ch0, width, normed);
    float* state = (float*)tbl[slot];
    float* sx = sm + tpb * width;        // the block's inputs X[K1 + t] = qkv[t], as floats
    const int K1 = Kc - 1;
    float* s_old = sx + tpb * width;     // the conv state of the block's channels [K1][width]
    float* s_w = s_old + K1 * width;     // their taps [width][Kc]
    // Before the wait: the conv state is written by no earlier launch of the step (only by this
    // one, below, or by a graph that ran before), the taps by none, so their loads overlap the
    // end of the projections' matmul. Verify keeps the old state in its record from here.
    if (t0 < K1)
        for (int e = threadIdx.x; e < K1 * width; e += blockDim.x) {
            const int j = e / width, i = e - j * width;
            const float v = state[(size_t)j * C + ch0 + i];
            s_old[e] = v;
            if (state_save != nullptr && t0 == 0) state_save[(size_t)j * C + ch0 + i] = v;
        }
    for (int e = threadIdx.x; e < width * Kc; e += blockDim.x) s_w[e] = conv_w[(size_t)ch0 * Kc + e];
    __syncthreads();
    grid_dependency_wait();
    // One (token, channel) output per item, summed over its Kc inputs X[t .. t + Kc-1] of
    // X = [state; qkv] in tap order: the items are independent, so all their loads are in flight
    // at once (a token loop per channel waited on one load per token), and each is computed the
    // same way whatever T and however the tokens are split into blocks. An item keeps its newest
    // input (qkv row t) for the state and the record.
    for (int it = threadIdx.x; it < n * width; it += blockDim.x) {
        const int tl = it / width, t = t0 + tl, i = it - tl * width, ch = ch0 + i;
        float y = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (j < Kc) {
                const int r = t + j;
                const float xv = r < K1 ? s_old[r * width + i] : fixed_to_float(qkv[(size_t)(r - K1) * ldq + ch]);
                const float wv = s_w[i * Kc + j];
                y = j == 0 ? xv * wv : fmaf(xv, wv, y);
                if (j == K1) {
                    sx[tl * width + i] = xv;
                    if (qkv_save != nullptr) qkv_save[(size_t)t * C + ch] = xv;
                }
            }
        }
        sm[tl * width + i] = y / (1.0f + expf(-y));
    }
    __syncthreads();                     // every read of the old state and of qkv is done
    for (int it = threadIdx.x; it < n * width; it += blockDim.x) {
        const int tl = it / width, i = it - tl * width;
        qkv_clear[(size_t)(t0 + tl) * ldq + ch0 + i] = 0;
    }
    if (write_state)                     // (one token block: t0 = 0, n = T)
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            const int ch = ch0 + i;
            float old[7];
#pragma unroll
            for (int j = 0; j < 7; ++j) old[j] = j < K1 ? s_old[j * width + i] : 0.0f;
            float nw[7];                 // X[T .. T + Kc-2]: the last Kc-1 inputs
#pragma unroll
            for (int j = 0; j < 7; ++j) {
                const int r = T + j;
                float v = 0.0f;
                if (j < K1 && r >= K1) v = sx[(r - K1) * width + i];
#pragma unroll
                for (int m = 0; m < 7; ++m)
                    if (j < K1 && r < K1 && m == r) v = old[m];   // T < Kc-1: part of the old state stays
                nw[j] = v;
            }
#pragma unroll
            for (int j = 0; j < 7; ++j)
                if (j < K1) state[(size_t)j * C + ch] = nw[j];
        }
    // q / k heads: L2 norm per token, one warp per token (no block barrier per token).
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    for (int tl = warp; tl < n; tl += n_warps) {
        float inv = 1.0f;
        if (normed) {
            float ss = 0.0f;
            for (int i = lane; i < width; i += 32) ss += sm[tl * width + i] * sm[tl * width + i];
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) ss += shfl_xor(ss, m);
            inv = (float)(1.0 / sqrt((double)ss + (double)eps));
        }
        for (int i = lane; i < width; i += 32)
            rec[(size_t)(t0 + tl) * R + ch0 + i] = normed ? sm[tl * width + i] * inv : sm[tl * width + i];
    }
}

// ---------------------------------------------------------------------------------------------
// gdn_recur. Per layer slot z (grid.z): tbl[4z + 0] rec[T][R] (gdn_conv's output), [1] the state
// read ([nv][d_v][d_k]: S^T per head, kernels/deltanet.py), [2] the state written (0: none), [3] a
// copy of the state read (0: none).
// T = *n_dev when n_dev is not null (commit: n_keep from the params block). out [T][nv*dv] may be
// null (commit). Mapping and token step as kernels/deltanet.cu (kernels/deltanet_step.cuh), with
// GDN_PARTS = 8 lanes a column instead of 4: a block owns 32 value columns of one head (256
// threads), each column's rows split over 8 adjacent threads, so that a token's dependent chain of
// FMAs per thread is half as long (the recurrence of a verify block is that chain, token after
// token, with ~2 warps a scheduler). The inputs of up to GDN_CHUNK tokens are staged in shared
// memory at once (dynamic, sized by T: fused_gpu.py op_gdn_recur); the wide kernels (below) stage
// them as float4 pieces where the rows allow, so a thread's loads for a 23-token block go out
// together (W=23 graph -0.13 ms against scalar loads in three rounds), bounded to two blocks a
// multiprocessor (w16: 118 registers; unbounded it took 137, one block a multiprocessor and two
// waves for the 27B's 192 blocks). The arithmetic of a token does not depend on T, so verify rows
// equal decode steps.
#define DN_SHFL_XOR(v, m) shfl_xor(v, m)
#include "deltanet_step.cuh"
#define GDN_COLS 32
#define GDN_PARTS 8
#define GDN_CHUNK 32
#define GDN_THREADS (GDN_COLS * GDN_PARTS)

template <int RPT, bool WIDE>
__device__ __forceinline__ void gdn_recur_impl(const unsigned long long* __restrict__ tbl, int T,
                                               const int* __restrict__ n_dev, float* __restrict__ out,
                                               int nk, int nv, int dk, int dv, float scale, int chunk) {
    constexpr int DKP = GDN_PARTS * RPT;         // staged row length (zero past dk)
    DYN_SMEM(float, rsm);                        // [chunk][DKP] q, [chunk][DKP] k, [chunk][32] v, decay, beta
    float* sq = rsm;
    float* sk = sq + chunk * DKP;
    float* sv = sk + chunk * DKP;
    float* sdecay = sv + chunk * GDN_COLS;
    float* sbeta = sdecay + chunk;
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int z = blockIdx.z, h = blockIdx.y, kh = h % nk;
    const float* rec = (const float*)tbl[4 * z + 0];
    const float* S_in = (const float*)tbl[4 * z + 1] + (size_t)h * dk * dv;
    float* S_out = tbl[4 * z + 2] ? (float*)tbl[4 * z + 2] + (size_t)h * dk * dv : nullptr;
    float* S_bak = tbl[4 * z + 3] ? (float*)tbl[4 * z + 3] + (size_t)h * dk * dv : nullptr;
    const int C = 2 * nk * dk + nv * dv, R = C + 2 * nv;
    const int lcol = threadIdx.x / GDN_PARTS;
    const int col = blockIdx.x * GDN_COLS + lcol;
    const int part = threadIdx.x % GDN_PARTS;
    const bool col_ok = col < dv;
    // Rows staged as float4 when every piece starts on 16 bytes (the 27B: d_k = d_v = 128).
    const bool vec = WIDE && ((R | dk | dv) & 3) == 0 && ((unsigned long long)rec & 15) == 0;

    // The state is stored transposed, [head][column][row] (kernels/deltanet.py: S^T per head), so a
    // lane's rows of its column are 16-byte pieces and a warp's loads and stores cover whole lines
    // (deltanet_step.cuh dn_col_load; in the [row][column] layout a warp's access was 8 rows x 16
    // bytes: 8 half-used sectors, which cost the decode step ~0.1 ms even written through shared
    // memory, and verify's backup its read and write).
    const size_t cbase = (size_t)(col_ok ? col : 0) * dk;
    float s[RPT];
    dn_col_load<RPT, GDN_PARTS>(s, S_in + cbase, part, dk, col_ok);
    if (S_bak != nullptr && col_ok) dn_col_store<RPT, GDN_PARTS>(S_bak + cbase, s, part, dk);
    // Only now the wait: the state (and its backup) is written by no earlier launch of the step,
    // only by this one (advance) or by a graph that ran before (commit reads verify's backup), so
    // its loads from DRAM overlap the end of gdn_conv instead of following it.
    grid_dependency_wait();
    if (n_dev != nullptr) T = n_dev[0];
    // The column's output pointer, advanced a token at a time: its 64-bit index arithmetic per
    // token was a seventh of the token loop's instructions, issued by every warp (each holds a
    // column's part 0).
    const bool writes_out = out != nullptr && col_ok && part == 0;
    float* outp = out + (writes_out ? (size_t)h * dv + col : 0);
    const size_t out_stride = writes_out ? (size_t)nv * dv : 0;
    for (int c0 = 0; c0 < T; c0 += chunk) {
        const int n = min(chunk, T - c0);
        __syncthreads();                                // the previous chunk's reads are done
        if (vec) {
            // One float4 a thread and row piece, unrolled: a thread's loads for the whole chunk go out
            // in one round of L2 latency (the scalar loop took three at T = 23).
            constexpr int DQ = DKP / 4;
            const int dkq = dk >> 2;
            const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
            for (int e = threadIdx.x; e < n * DQ; e += GDN_THREADS) {
                const int tt = e / DQ, i = e - tt * DQ;
                const float4* rt = (const float4*)(rec + (size_t)(c0 + tt) * R);
                ((float4*)sq)[tt * DQ + i] = i < dkq ? rt[(kh * dk >> 2) + i] : zero;
                ((float4*)sk)[tt * DQ + i] = i < dkq ? rt[((nk + kh) * dk >> 2) + i] : zero;
            }
            constexpr int CQ = GDN_COLS / 4;
            for (int e = threadIdx.x; e < n * CQ; e += GDN_THREADS) {
                const int tt = e / CQ, lq = e - tt * CQ, cc = blockIdx.x * GDN_COLS + 4 * lq;
                ((float4*)sv)[tt * CQ + lq] = cc < dv
                    ? *(const float4*)(rec + (size_t)(c0 + tt) * R + 2 * nk * dk + h * dv + cc) : zero;
            }
        } else {
#pragma unroll 4
            for (int e = threadIdx.x; e < n * DKP; e += GDN_THREADS) {
                const int tt = e / DKP, i = e - tt * DKP;
                const float* rt = rec + (size_t)(c0 + tt) * R;
                sq[tt * DKP + i] = i < dk ? rt[kh * dk + i] : 0.0f;
                sk[tt * DKP + i] = i < dk ? rt[nk * dk + kh * dk + i] : 0.0f;
            }
            for (int e = threadIdx.x; e < n * GDN_COLS; e += GDN_THREADS) {
                const int tt = e / GDN_COLS, lc = e - tt * GDN_COLS, cc = blockIdx.x * GDN_COLS + lc;
                sv[tt * GDN_COLS + lc] = cc < dv ? rec[(size_t)(c0 + tt) * R + 2 * nk * dk + h * dv + cc] : 0.0f;
            }
        }
        if ((int)threadIdx.x < n) {
            const float* rt = rec + (size_t)(c0 + threadIdx.x) * R;
            sdecay[threadIdx.x] = expf(rt[C + h]);
            sbeta[threadIdx.x] = rt[C + nv + h];
        }
        __syncthreads();
        // Unrolled: a token's output reduction (shuffles) and store then overlap the next token's
        // loads and decayed dot product, which the loop's back edge kept apart (W=23 graph -0.15 ms)
#pragma unroll 4
        for (int tt = 0; tt < n; ++tt) {
            const float o = dn_token<RPT, GDN_PARTS>(s, sk + tt * DKP, sq + tt * DKP, sv[tt * GDN_COLS + lcol],
                                                     sdecay[tt], sbeta[tt], part);
            if (writes_out) *outp = o * scale;
            outp += out_stride;
        }
    }
    if (S_out != nullptr && col_ok) dn_col_store<RPT, GDN_PARTS>(S_out + cbase, s, part, dk);
}

#define GDN_ARGS const unsigned long long* __restrict__ tbl, int T, const int* __restrict__ n_dev, \
                 float* __restrict__ out, int nk, int nv, int dk, int dv, float scale, int chunk
#define GDN_CALL tbl, T, n_dev, out, nk, nv, dk, dv, scale, chunk
// gdn_recur_r<RPT>: one token (decode), scalar staging, one block's registers unbounded (r16: 96,
// two blocks a multiprocessor anyway); gdn_recur_w<RPT>: wider steps and commit, float4 staging
// and two blocks a multiprocessor. The same token arithmetic (dn_token), so verify rows still
// equal decode steps; decode on the wide kernel was 0.02-0.03 ms slower a step (H200 A/B).
#define GDN_KERNELS(R) \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS, 1) gdn_recur_r##R(GDN_ARGS) { \
        TL_SCOPE; gdn_recur_impl<R, false>(GDN_CALL); } \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS, 2) gdn_recur_w##R(GDN_ARGS) { \
        TL_SCOPE; gdn_recur_impl<R, true>(GDN_CALL); }
GDN_KERNELS(1)
GDN_KERNELS(4)
GDN_KERNELS(8)
GDN_KERNELS(16)
GDN_KERNELS(32)

// ---------------------------------------------------------------------------------------------
// gdn_commit_conv: the conv state after n = params[1] tokens of a verified block is rows n..n+Kc-2
// of the layer's verify record [Kc-1+T][C] (the state before the block, then the block's inputs).
// Per layer slot z (grid.y): tbl[2z] the record, tbl[2z+1] the conv state [Kc-1][C].
extern "C" __global__ void __launch_bounds__(FUSED_THREADS) gdn_commit_conv(
    const unsigned long long* __restrict__ tbl, const int* __restrict__ params, int C, int Kc) { TL_SCOPE;
    const int z = blockIdx.y;
    const float* rec = (const float*)tbl[2 * z];
    float* state = (float*)tbl[2 * z + 1];
    const int n = params[1];
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < C; ch += gridDim.x * blockDim.x)
        for (int j = 0; j < Kc - 1; ++j) state[(size_t)j * C + ch] = rec[(size_t)(n + j) * C + ch];
}

// ---------------------------------------------------------------------------------------------
// gdn_out_prep: y[t, h] = RMSNorm(o[t, h]; w) * silu(z[t, h]) over d_v, then act16. grid (T,
// ceil(nv*dv / 256)): a block writes 256 columns, normalising the heads they belong to. z is the
// gate projection's int64 fixed-point sum (mm_tc MODE_ADD), cleared as it is read.
extern "C" __global__ void __launch_bounds__(FUSED_THREADS) gdn_out_prep(
    const float* __restrict__ o, long long* __restrict__ zb, int ldz, const float* __restrict__ w, float eps,
    int nv, int dv, u16* __restrict__ out16, u16* __restrict__ outxs) { TL_SCOPE;
    __shared__ float vals[PREP_COLS];
    __shared__ float inv_h[PREP_COLS + 1];
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int t = blockIdx.x, n0 = blockIdx.y * PREP_COLS;
    const int K = nv * dv, count = min(PREP_COLS, K - n0);
    const int h0 = n0 / dv, h1 = (n0 + count - 1) / dv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const float* ot = o + (size_t)t * K;
    const float wv = (int)threadIdx.x < count ? w[(n0 + threadIdx.x) % dv] : 0.0f;   // a weight: before the wait
    grid_dependency_wait();
    float zv = 0.0f, ov = 0.0f;                  // this thread's column, requested before the norms
    if ((int)threadIdx.x < count) {
        const int n = n0 + threadIdx.x;
        zv = fixed_to_float(zb[(size_t)t * ldz + n]);
        zb[(size_t)t * ldz + n] = 0;             // read: cleared for the next layer's matmul
        ov = ot[n];
    }
    for (int h = h0 + warp; h <= h1; h += n_warps) {
        float ss = 0.0f;
#pragma unroll 4
        for (int i = lane; i < dv; i += 32) ss += ot[h * dv + i] * ot[h * dv + i];
        ss = warp_sum(ss);
        if (lane == 0) inv_h[h - h0] = (float)(1.0 / sqrt((double)ss / (double)dv + (double)eps));
    }
    __syncthreads();
    if ((int)threadIdx.x < count) {
        const int h = (n0 + threadIdx.x) / dv;
        vals[threadIdx.x] = silu_f(zv) * (ov * inv_h[h - h0] * wv);
    }
    __syncthreads();
    prep_cols(vals, n0, count, t, out16, outxs);
}

// ---------------------------------------------------------------------------------------------
// attn_qk_rope_kv. qg[T][2*H*D] (per head: D q values, then D gate values), k/v[T][Hkv*D].
// Writes q (normed, rotated) to qout[T][H][D] and k (normed, rotated) / v into the cache of the
// bound state: tbl[slot] k_cache [Hkv][ctx][D], tbl[slot+1] v_cache, tbl[slot+2] = ctx.
// Position of row t: params[0] + t. grid (H + 2*Hkv, T), block >= D threads (D <= 256).
__device__ __forceinline__ void rope_angle(int i, int n_rot, double pos, double theta, float* cs, float* sn) {
    const int half = n_rot >> 1;
    const int j = i < half ? i : i - half;
    const double inv_freq = pow(theta, (-2.0 * (double)j) / (double)n_rot);
    const float angle = (float)fmod(pos * inv_freq, 6.283185307179586);
    *cs = cosf(angle);
    *sn = sinf(angle);
}
// Element i (< D) of the rotated row xs; cs / sn: rope_angle of i (unused past n_rot).
__device__ __forceinline__ float rope_one(const float* xs, int i, int n_rot, float cs, float sn) {
    const int half = n_rot >> 1;
    if (i >= n_rot) return xs[i];
    const int j = i < half ? i : i - half;
    const float x1 = xs[j], x2 = xs[j + half];
    return i < half ? x1 * cs - x2 * sn : x1 * sn + x2 * cs;
}

extern "C" __global__ void __launch_bounds__(FUSED_THREADS) attn_qk_rope_kv(
    const float* __restrict__ qg, const float* __restrict__ kb, const float* __restrict__ vb,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps, const int* __restrict__ params,
    const unsigned long long* __restrict__ tbl, int slot, float* __restrict__ qout, int H, int Hkv, int D,
    int n_rot, double theta) { TL_SCOPE;
    __shared__ float xsm[256];
    __shared__ float red[33];
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int hh = blockIdx.x, t = blockIdx.y, i = threadIdx.x;
    // The position (the params block: written by the host before the graph), the table, the norm
    // weight and the rotation are known before the wait; the rotation's pow / fmod / sincos then
    // overlap the end of the q|k|v matmul.
    const int pos = params[0] + t;
    const int ctx = (int)tbl[slot + 2];
    const float* src;
    const float* nw;
    if (hh < H) { src = qg + (size_t)t * 2 * H * D + (size_t)hh * 2 * D; nw = q_norm; }
    else if (hh < H + Hkv) { src = kb + (size_t)t * Hkv * D + (size_t)(hh - H) * D; nw = k_norm; }
    else {
        const int kvh = hh - H - Hkv;
        float* vc = (float*)tbl[slot + 1];
        grid_dependency_wait();
        if (i < D) vc[((size_t)kvh * ctx + pos) * D + i] = vb[(size_t)t * Hkv * D + (size_t)kvh * D + i];
        return;
    }
    const float wn = i < D ? nw[i] : 0.0f;
    float cs = 1.0f, sn = 0.0f;
    if (i < n_rot) rope_angle(i, n_rot, (double)pos, theta, &cs, &sn);
    grid_dependency_wait();
    const float v = i < D ? src[i] : 0.0f;
    const float ss = block_sum(v * v, red);
    const float inv = (float)(1.0 / sqrt((double)ss / (double)D + (double)eps));
    if (i < D) xsm[i] = (v * inv) * wn;
    __syncthreads();
    if (i < D) {
        const float r = rope_one(xsm, i, n_rot, cs, sn);
        if (hh < H) qout[((size_t)t * H + hh) * D + i] = r;
        else {
            float* kc = (float*)tbl[slot];
            kc[((size_t)(hh - H) * ctx + pos) * D + i] = r;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attn_partial. Row t (position p = params[0] + t) attends to cache rows 0..p. Its n_split =
// clamp(ceil((p+1) / ATT_SPLIT_KEYS), ATT_MIN_SPLITS, split_cap) splits (split_cap, a kernel
// argument: fused_gpu.py ATT_SPLIT_CAP_FMA = 16 for these kernels, ATT_SPLIT_CAP_TC = 64 for the
// tensor-core ones, whose blocks walk a split in series) cover rows [s*chunk, min((s+1)*chunk,
// p+1)), chunk = ceil((p+1)/n_split) rounded up to 16: a function of p (and the kernel family)
// only, so a launch's grid may hold more splits than its rows use (a split past a row's n_split is
// empty: l = 0). Partials live at [t][h][s] with a stride of ATT_MAX_SPLITS, whatever the grid.
// Inside a split, warp w takes rows 4w.., 4 at a time (independent dot
// products in flight), then 16 further; online softmax per warp, the warps merged in order. Writes
// (m, l) and the unnormalised o of the split. 128 threads, D <= 256, D % 8 == 0.
//
// A block takes R query heads of one KV group (attn_partial_g<R>, grid (splits, H / R, T); R
// divides H / Hkv): each key's K and V rows, loaded once into registers, serve all R heads (one
// head a block re-read every key once per head of the group). Each head's arithmetic is the same
// whatever R (the same operations in the same order), so R may differ between launches (decode
// and verify) and the rows stay bit-identical.
#define ATT_WARPS 4
#define ATT_KEYS 4
#define ATT_MIN_SPLITS 16                        // fused_gpu.py: the same names
#define ATT_MAX_SPLITS 128
#define ATT_SPLIT_KEYS 128
// The round's 4 dot products summed over the warp's 32 lanes, into every lane (times scale), in 10
// shuffles instead of 4 x 5: the lanes first trade halves of their 4 partials (xor 16: keys 0,1 |
// 2,3; xor 8: one key each), so that lane L ends with the whole sum of key 2 (L >> 4 & 1) + (L >> 3
// & 1) after 3 more xor steps, which lanes 0, 8, 16, 24 then broadcast. Shuffles (the MIO pipe,
// shared with shared memory) were what the kernel's "L1/TEX" throughput counted: with 3 heads a
// block, a third of the K/V loads, it still read 81%. A fixed tree per (head, round): the same bits
// whatever the block holds.
__device__ __forceinline__ void att_round_sums(float (&d)[ATT_KEYS], int lane, float scale) {
    const bool hi16 = (lane & 16) != 0, hi8 = (lane & 8) != 0;
    const float k0 = hi16 ? d[2] : d[0], k1 = hi16 ? d[3] : d[1];          // kept: keys 2b4, 2b4+1
    const float e0 = k0 + shfl_xor(hi16 ? d[0] : d[2], 16);
    const float e1 = k1 + shfl_xor(hi16 ? d[1] : d[3], 16);
    float f = (hi8 ? e1 : e0) + shfl_xor(hi8 ? e0 : e1, 8);                // key 2b4 + b3
    f += shfl_xor(f, 4);
    f += shfl_xor(f, 2);
    f += shfl_xor(f, 1);
    const u32 fs = __float_as_uint(f * scale);
#pragma unroll
    for (int u = 0; u < ATT_KEYS; ++u) d[u] = __uint_as_float(shfl(fs, 8 * u));
}
// Split s of a row with n_keys keys: [j0, j1), chunk = ceil(n_keys / n_split) rounded up to 16,
// n_split = clamp(ceil(n_keys / ATT_SPLIT_KEYS), ATT_MIN_SPLITS, split_cap). chunk and j1 grow with
// n_keys (rows of one block cover the union [first row's j0, last row's j1)); from 2049 keys below
// the cap chunk is ATT_SPLIT_KEYS.
__device__ __forceinline__ void att_split_range(int n_keys, int split_cap, int s, int& j0, int& j1) {
    const int n_split = min(split_cap, max(ATT_MIN_SPLITS, (n_keys + ATT_SPLIT_KEYS - 1) / ATT_SPLIT_KEYS));
    int chunk = (n_keys + n_split - 1) / n_split;
    chunk = (chunk + ATT_WARPS * ATT_KEYS - 1) / (ATT_WARPS * ATT_KEYS) * (ATT_WARPS * ATT_KEYS);
    j0 = s * chunk;
    j1 = min(j0 + chunk, n_keys);
}
template <int R>
__device__ __forceinline__ void attn_partial_impl(const float* __restrict__ q, const int* __restrict__ params,
                                                  const unsigned long long* __restrict__ tbl, int slot,
                                                  float* __restrict__ part_o, float* __restrict__ part_ml, int H,
                                                  int Hkv, int D, int split_cap, float scale) {
    __shared__ float s_m[R][ATT_WARPS], s_l[R][ATT_WARPS];
    __shared__ float s_o[R][ATT_WARPS][256];
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    grid_dependency_wait();
    const int s = blockIdx.x, h0 = blockIdx.y * R, t = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h0 / (H / Hkv);
    const int n_keys = params[0] + t + 1;
    const int ctx = (int)tbl[slot + 2];
    const float* kc = (const float*)tbl[slot] + (size_t)kvh * ctx * D;
    const float* vc = (const float*)tbl[slot + 1] + (size_t)kvh * ctx * D;
    int j0, j1;
    att_split_range(n_keys, split_cap, s, j0, j1);
    // Lane L holds dims 8L .. 8L+7 (D % 8 == 0, D <= 256): a key's K and V rows are two 16-byte
    // loads per lane, and the ATT_KEYS keys of a round are all requested at once, K and V together
    // (V does not wait for the scores), so a round costs one memory latency.
    const int d0 = 8 * lane;
    const bool live = d0 < D;
    float qv[R][8], acc[R][8], m[R], l[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float* qr = q + ((size_t)t * H + h0 + r) * D;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qv[r][e] = live ? qr[d0 + e] : 0.0f;
            acc[r][e] = 0.0f;
        }
        m[r] = NEG_INF;
        l[r] = 0.0f;
    }
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int jb = j0 + warp * ATT_KEYS; jb < j1; jb += ATT_WARPS * ATT_KEYS) {
        float4 kq[ATT_KEYS][2], vq[ATT_KEYS][2];
#pragma unroll
        for (int u = 0; u < ATT_KEYS; ++u) {
            const bool ok = live && jb + u < j1;
            const float4* kr = (const float4*)(kc + (size_t)(jb + u) * D + d0);
            const float4* vr = (const float4*)(vc + (size_t)(jb + u) * D + d0);
            kq[u][0] = ok ? kr[0] : zero4;
            kq[u][1] = ok ? kr[1] : zero4;
            vq[u][0] = ok ? vr[0] : zero4;
            vq[u][1] = ok ? vr[1] : zero4;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float dot[ATT_KEYS];
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) {
                const float4 a = kq[u][0], b = kq[u][1];
                dot[u] = ((qv[r][0] * a.x + qv[r][1] * a.y) + (qv[r][2] * a.z + qv[r][3] * a.w)) +
                         ((qv[r][4] * b.x + qv[r][5] * b.y) + (qv[r][6] * b.z + qv[r][7] * b.w));
            }
            att_round_sums(dot, lane, scale);
            float m_new = m[r];
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u)
                if (jb + u < j1) m_new = fmaxf(m_new, dot[u]);
            const float corr = expf(m[r] - m_new);
            float p[ATT_KEYS];
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) p[u] = jb + u < j1 ? expf(dot[u] - m_new) : 0.0f;
            l[r] = l[r] * corr + ((p[0] + p[1]) + (p[2] + p[3]));
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float a = acc[r][e] * corr;
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const float4 vv = vq[u][e >> 2];
                    const float ve = (e & 3) == 0 ? vv.x : ((e & 3) == 1 ? vv.y : ((e & 3) == 2 ? vv.z : vv.w));
                    a += p[u] * ve;
                }
                acc[r][e] = a;
            }
            m[r] = m_new;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (lane == 0) { s_m[r][warp] = m[r]; s_l[r][warp] = l[r]; }
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (live) s_o[r][warp][d0 + e] = acc[r][e];
    }
    __syncthreads();
    for (int r = 0; r < R; ++r) {
        float M = NEG_INF;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (s_l[r][w] > 0.0f) M = fmaxf(M, s_m[r][w]);
        const size_t slot_i = ((size_t)t * H + h0 + r) * ATT_MAX_SPLITS + s;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w)
                if (s_l[r][w] > 0.0f) o += s_o[r][w][d] * expf(s_m[r][w] - M);
            part_o[slot_i * D + d] = o;
        }
        if (threadIdx.x == 0) {
            float L = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w)
                if (s_l[r][w] > 0.0f) L += s_l[r][w] * expf(s_m[r][w] - M);
            part_ml[slot_i * 2] = M;
            part_ml[slot_i * 2 + 1] = L;
        }
    }
}
#define ATT_ARGS                                                                                                   \
    const float* __restrict__ q, const int* __restrict__ params, const unsigned long long* __restrict__ tbl,      \
        int slot, float* __restrict__ part_o, float* __restrict__ part_ml, int H, int Hkv, int D, int split_cap,  \
        float scale
#define ATT_CALL q, params, tbl, slot, part_o, part_ml, H, Hkv, D, split_cap, scale
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attn_partial_g1(ATT_ARGS) { TL_SCOPE; attn_partial_impl<1>(ATT_CALL); }
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attn_partial_g2(ATT_ARGS) { TL_SCOPE; attn_partial_impl<2>(ATT_CALL); }
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attn_partial_g3(ATT_ARGS) { TL_SCOPE; attn_partial_impl<3>(ATT_CALL); }

// attn_partial_tc: attn_partial's splits on tensor cores. A block (two warps) takes 16 rows of the
// flat (row t, head g of KV group kvh) space, m = t * G + g (G = H / Hkv), and one split; grid
// (splits, Hkv, ceil(T * G / 16)). The split's keys go through shared memory in 16-key tiles, two
// stages deep (K rows padded to D + 16 floats, V rows to D + 4: conflict-free fragment reads), each
// row one bulk copy; the tiles wholly below n_past (rows no launch of this step writes) are requested
// before the dependency wait. Per tile the scores S = Q K^T come from m16n8k16 MMAs, each warp
// summing half of the k-steps (interleaved) and the two halves added through shared memory (S0 + S1,
// the same bits in both warps), and O += P V from more, each warp keeping half of D in its
// accumulators. A lane's k indices 2c, 2c+1, 2c+8, 2c+9 of a k-step are dims 4c .. 4c+3 (the same
// for Q and K: any pairing sums the same products), so a lane reads its K values as one 16-byte load.
// Every f32 operand (q, k, p, v) goes in as two f16 halves, x = hi + lo with lo = f16(x - hi), and
// each product as hi*hi + hi*lo + lo*hi accumulated in f32: about 22 bits of each operand instead of
// f16's 11 (f16 alone moved the attention weights by ~1e-3 relative). Per row the online softmax
// runs over the same 16-key tiles (aligned: j0 is a multiple of 16) whatever rows share its block; a
// tile where the row has no keys leaves it unchanged exactly (corr = 1, p = 0), and keys outside the
// row's range score -inf (selected, so whatever the cache holds there). MMA outputs are independent
// per row, so a row's bits do not depend on T (decode and verify rows stay equal). Rows past the
// tile's last valid key are not copied: their V values are read as 0 (stale shared memory).
// D % 16 == 0, D <= 256; |v| < 65504 (f16 range of the hi half).
#define ATT_TC_ROWS 16
#define ATT_TC_MAXD 256
#define ATT_TC_S_LD 24          // the score halves' row stride in shared memory
// (x, y) as an f16 pair (x in the low half), each rounded to nearest even: one cvt on CUDA.
__device__ __forceinline__ u32 f2h2(float x, float y) {
#if !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(y), "f"(x));
    return d;
#else
    return (u32)f2h(x) | ((u32)f2h(y) << 16);
#endif
}
__device__ __forceinline__ void hl_split(float x, float y, u32& hi, u32& lo) {
    hi = f2h2(x, y);
    lo = f2h2(x - h2f((u16)(hi & 0xffffu)), y - h2f((u16)(hi >> 16)));
}
// hi*hi + hi*lo + lo*hi into d (the fixed order every row gets)
__device__ __forceinline__ void mma3(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], u32 bh0, u32 bh1,
                                     u32 bl0, u32 bl1) {
    mma16816(d, ah, bh0, bh1);
    mma16816(d, ah, bl0, bl1);
    mma16816(d, al, bh0, bh1);
}
// The pieces of a tile both tensor-core kernels share, so that a row's operations are the same ones
// whichever kernel runs it (attn_partial_tc for verify, attn_partial_tcd for decode).
// This lane's q fragments of one half of the score k-steps (ks = half + 2u): rows m0 + g, m0 + g + 8,
// dims 16 ks + 4c .. + 3, as hi / lo f16 pairs.
__device__ __forceinline__ void tc_load_q(u32 (&qh)[ATT_TC_MAXD / 32][4], u32 (&ql)[ATT_TC_MAXD / 32][4],
                                          const float* __restrict__ q, int m0, int M, int G, int H, int kvh, int D,
                                          int half, int g, int c) {
    float4 qv[ATT_TC_MAXD / 32][2];
#pragma unroll
    for (int u = 0; u < ATT_TC_MAXD / 32; ++u) {
        const int ks = half + 2 * u;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int m = m0 + g + 8 * i;
            qv[u][i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (ks < D / 16 && m < M) {
                const int t = m / G, h = kvh * G + (m - t * G);
                qv[u][i] = *(const float4*)(q + ((size_t)t * H + h) * D + 16 * ks + 4 * c);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_TC_MAXD / 32; ++u)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            hl_split(qv[u][i].x, qv[u][i].y, qh[u][i], ql[u][i]);
            hl_split(qv[u][i].z, qv[u][i].w, qh[u][2 + i], ql[u][2 + i]);
        }
}
// One half of a tile's scores: sc[nt][e] = row g + 8 (e >> 1), key 8 nt + 2c + (e & 1) of the tile
// whose K rows are tk (stride KLD), summed over the k-steps ks = half + 2u.
__device__ __forceinline__ void tc_scores_half(float (&sc)[2][4], const float* tk, int KLD, int half, int D,
                                               const u32 (&qh)[ATT_TC_MAXD / 32][4],
                                               const u32 (&ql)[ATT_TC_MAXD / 32][4], int g, int c) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
    for (int u = 0; u < ATT_TC_MAXD / 32; ++u) {
        const int ks = half + 2 * u;
        if (ks < D / 16) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float4 kv = *(const float4*)(tk + (8 * nt + g) * KLD + 16 * ks + 4 * c);
                u32 bh0, bl0, bh1, bl1;
                hl_split(kv.x, kv.y, bh0, bl0);
                hl_split(kv.z, kv.w, bh1, bl1);
                mma3(sc[nt], qh[u], ql[u], bh0, bh1, bl0, bl1);
            }
        }
    }
}
__device__ __forceinline__ void tc_store_half(float* s, const float (&sc)[2][4], int g, int c) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i2 = 0; i2 < 2; ++i2)
            *(float2*)(s + (g + 8 * i2) * ATT_TC_S_LD + 8 * nt + 2 * c) = make_float2(sc[nt][2 * i2], sc[nt][2 * i2 + 1]);
}
// The online-softmax step of a tile (keys kb..) for this lane's rows: sc holds the whole scores on
// entry; out: corr (the old state's factor) and P as the A fragments of P V (hi / lo).
__device__ __forceinline__ void tc_softmax_tile(float (&sc)[2][4], int kb, const int (&j0r)[2], const int (&j1r)[2],
                                                float scale, int c, float (&mrow)[2], float (&lrow)[2],
                                                float (&corr)[2], u32 (&ph)[4], u32 (&pl)[4]) {
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i2 = e >> 1, key = kb + 8 * nt + 2 * c + (e & 1);
            const float v = (key >= j0r[i2] && key < j1r[i2]) ? sc[nt][e] * scale : NEG_INF;
            sc[nt][e] = v;
            mx[i2] = fmaxf(mx[i2], v);
        }
    float mn[2];
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
        mx[i2] = fmaxf(mx[i2], shfl_xor(mx[i2], 1));
        mx[i2] = fmaxf(mx[i2], shfl_xor(mx[i2], 2));
        mn[i2] = fmaxf(mrow[i2], mx[i2]);
        corr[i2] = mn[i2] == NEG_INF ? 1.0f : expf(mrow[i2] - mn[i2]);
    }
    float p[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[nt][e] = sc[nt][e] == NEG_INF ? 0.0f : expf(sc[nt][e] - mn[e >> 1]);
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
        float ps = (p[0][2 * i2] + p[0][2 * i2 + 1]) + (p[1][2 * i2] + p[1][2 * i2 + 1]);
        ps += shfl_xor(ps, 1);
        ps += shfl_xor(ps, 2);
        lrow[i2] = lrow[i2] * corr[i2] + ps;
        mrow[i2] = mn[i2];
    }
    // the scores' C layout is the A layout of a 16-key k-step
    hl_split(p[0][0], p[0][1], ph[0], pl[0]);
    hl_split(p[0][2], p[0][3], ph[1], pl[1]);
    hl_split(p[1][0], p[1][1], ph[2], pl[2]);
    hl_split(p[1][2], p[1][3], ph[3], pl[3]);
}
// O's column tile at dims dcol.. (8 wide) += P V for the tile whose V rows are tv (stride VLD), keys
// kb + 2c, +1, +8, +9 read as 0 from hi on (not copied).
__device__ __forceinline__ void tc_pv_cols(float (&acc)[4], const float* tv, int VLD, int dcol, int kb, int hi,
                                           int g, int c, const float (&corr)[2], const u32 (&ph)[4],
                                           const u32 (&pl)[4]) {
    const int r0 = 2 * c;
    const float* vcol = tv + dcol + g;
    const float v0 = kb + r0 < hi ? vcol[r0 * VLD] : 0.0f, v1 = kb + r0 + 1 < hi ? vcol[(r0 + 1) * VLD] : 0.0f;
    const float v8 = kb + r0 + 8 < hi ? vcol[(r0 + 8) * VLD] : 0.0f, v9 = kb + r0 + 9 < hi ? vcol[(r0 + 9) * VLD] : 0.0f;
    acc[0] *= corr[0];
    acc[1] *= corr[0];
    acc[2] *= corr[1];
    acc[3] *= corr[1];
    u32 bh0, bl0, bh1, bl1;
    hl_split(v0, v1, bh0, bl0);
    hl_split(v8, v9, bh1, bl1);
    mma3(acc, ph, pl, bh0, bh1, bl0, bl1);
}
// This lane's rows g and g + 8 of the m-tile at m0 and their keys in split s, and the key range
// [lo, hi) the block walks: the union of its rows mb .. mb + n_rows - 1 (lo from the first, hi from the
// last; shared by both kernels).
__device__ __forceinline__ void tc_rows(int p0, int m0, int mb, int n_rows, int M, int G, int split_cap, int s, int g,
                                        int (&j0r)[2], int (&j1r)[2], int& lo, int& hi) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int m = m0 + g + 8 * i;
        if (m < M) att_split_range(p0 + m / G + 1, split_cap, s, j0r[i], j1r[i]);
        else j0r[i] = j1r[i] = 0;
    }
    int unused;
    att_split_range(p0 + mb / G + 1, split_cap, s, lo, unused);
    att_split_range(p0 + min(M - 1, mb + n_rows - 1) / G + 1, split_cap, s, unused, hi);
}
// A tile's K and V rows (those below hi) into shared memory, one bulk copy a row, by one warp.
__device__ __forceinline__ void tc_copy_tile(float* k_dst, float* v_dst, const float* kc, const float* vc, int kb,
                                             int hi, int D, int KLD, int VLD, unsigned long long* bar, int lane) {
    const int nrow = min(16, hi - kb);
    for (int r = 0; r < nrow; ++r) {
        stage_copy(k_dst + r * KLD, kc + (size_t)(kb + r) * D, (unsigned)D * 4u, bar, lane);
        stage_copy(v_dst + r * VLD, vc + (size_t)(kb + r) * D, (unsigned)D * 4u, bar, lane);
    }
}
__device__ __forceinline__ unsigned tc_tile_bytes(int kb, int hi, int D) {
    return 2u * (unsigned)(min(16, hi - kb) * D) * 4u;
}
#define ATT_TC_ARGS                                                                                          \
    const float* __restrict__ q, const int* __restrict__ params, const unsigned long long* __restrict__ tbl, \
        int slot, float* __restrict__ part_o, float* __restrict__ part_ml, int H, int Hkv, int D,               \
        int split_cap, float scale, int T
// attn_partial_tc<MT>: MT m-tiles of 16 (row, head) pairs of one KV group a block, two warps an m-tile
// (warp w: m-tile w >> 1, score half and D half w & 1), all of them reading the same staged K and V
// tiles, so a verify step's rows of one KV group read each tile from L2 once every MT m-tiles. The
// block walks the union of its rows' key ranges in tiles at lo + 16 i, like one m-tile's block (tiles
// start on multiples of 16 either way, and a tile wholly outside a row's range leaves its state as it
// was), so a row's operations and bits do not depend on MT: decode (attn_partial_tcd) and verify rows
// agree whichever MT verify takes. Warps of an m-tile past the rows only take part in the barriers.
template <int MT>
__device__ __forceinline__ void attn_partial_tc_impl(ATT_TC_ARGS) {
    __shared__ __align__(8) unsigned long long s_full[2];
    // K [2][16][D + 16], V [2][16][D + 4], score halves [MT][2][16][ATT_TC_S_LD]
    DYN_SMEM(float, sm);
    const int KLD = D + 16, VLD = D + 4;
    float* sk = sm;
    float* sv = sk + 2 * ATT_TC_ROWS * KLD;
    float* ss = sv + 2 * ATT_TC_ROWS * VLD;
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int half = warp & 1, mt = warp >> 1;
    const int s = blockIdx.x, kvh = blockIdx.y, mb = blockIdx.z * MT * ATT_TC_ROWS, m0 = mb + mt * ATT_TC_ROWS;
    const int G = H / Hkv, M = T * G;
    const bool rows_ok = MT == 1 || m0 < M;    // this warp's m-tile holds rows
    const int p0 = params[0];
    const int ctx = (int)tbl[slot + 2];
    const float* kc = (const float*)tbl[slot] + (size_t)kvh * ctx * D;
    const float* vc = (const float*)tbl[slot + 1] + (size_t)kvh * ctx * D;
    // this lane's rows of its m-tile and their keys; the block walks the union of its MT m-tiles' ranges
    int j0r[2], j1r[2], lo, hi;
    tc_rows(p0, rows_ok ? m0 : mb, mb, MT * ATT_TC_ROWS, M, G, split_cap, s, g, j0r, j1r, lo, hi);
    const int n_tiles = hi > lo ? (hi - lo + 15) / 16 : 0;
    auto issue = [&](int i) {   // warp 0: tile i into stage i & 1
        const int kb = lo + 16 * i, st = i & 1;
        if (lane == 0) mbar_expect(&s_full[st], tc_tile_bytes(kb, hi, D));
        warp_sync();
        tc_copy_tile(sk + st * ATT_TC_ROWS * KLD, sv + st * ATT_TC_ROWS * VLD, kc, vc, kb, hi, D, KLD, VLD,
                     &s_full[st], lane);
    };
    int issued = 0;             // warp 0: tiles requested so far (the first two, in order)
    if (warp == 0) {
        if (lane == 0) {
            mbar_init(&s_full[0], 1);
            mbar_init(&s_full[1], 1);
        }
        warp_sync();
        // a tile's keys below n_past (no launch of this step writes them) may be requested before the wait
        while (issued < min(2, n_tiles) && lo + 16 * (issued + 1) <= p0) issue(issued++);
    }
    grid_dependency_wait();
    if (warp == 0)
        while (issued < min(2, n_tiles)) issue(issued++);
    u32 qh[ATT_TC_MAXD / 32][4], ql[ATT_TC_MAXD / 32][4];
    if (rows_ok) tc_load_q(qh, ql, q, m0, M, G, H, kvh, D, half, g, c);
    __syncthreads();            // the barriers' initialisation, seen by the other warps before they wait
    const int DH = D / 2, NJ = DH / 8, d0 = half * DH;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    float acc[ATT_TC_MAXD / 16][4];
#pragma unroll
    for (int j = 0; j < ATT_TC_MAXD / 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float* ss_mine = ss + (2 * mt + half) * ATT_TC_ROWS * ATT_TC_S_LD;
    const float* ss_other = ss + (2 * mt + (half ^ 1)) * ATT_TC_ROWS * ATT_TC_S_LD;
    for (int i = 0; i < n_tiles; ++i) {
        const int kb = lo + 16 * i, st = i & 1;
        const float* tk = sk + st * ATT_TC_ROWS * KLD;
        const float* tv = sv + st * ATT_TC_ROWS * VLD;
        float sc[2][4];
        if (rows_ok) {
            mbar_wait(&s_full[st], (unsigned)(i >> 1) & 1u);
            tc_scores_half(sc, tk, KLD, half, D, qh, ql, g, c);
            tc_store_half(ss_mine, sc, g, c);
        }
        __syncthreads();
        if (rows_ok) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)      // S0 + S1 = S1 + S0: the same in both warps
                    sc[nt][e] = sc[nt][e] + ss_other[(g + 8 * (e >> 1)) * ATT_TC_S_LD + 8 * nt + 2 * c + (e & 1)];
            float corr[2];
            u32 ph[4], pl[4];
            tc_softmax_tile(sc, kb, j0r, j1r, scale, c, mrow, lrow, corr, ph, pl);
#pragma unroll
            for (int j = 0; j < ATT_TC_MAXD / 16; ++j)
                if (j < NJ) tc_pv_cols(acc[j], tv, VLD, d0 + 8 * j, kb, hi, g, c, corr, ph, pl);
        }
        __syncthreads();        // every warp is done with the stage and the score halves
        if (warp == 0 && i + 2 < n_tiles) issue(i + 2);
    }
    if (!rows_ok) return;
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
        const int m = m0 + g + 8 * i2;
        if (m >= M) continue;
        const int t = m / G, h = kvh * G + (m - t * G);
        const size_t slot_i = ((size_t)t * H + h) * ATT_MAX_SPLITS + s;
#pragma unroll
        for (int j = 0; j < ATT_TC_MAXD / 16; ++j)
            if (j < NJ) {
                float* o = part_o + slot_i * D + d0 + 8 * j + 2 * c;
                o[0] = acc[j][2 * i2];
                o[1] = acc[j][2 * i2 + 1];
            }
        if (half == 0 && c == 0) {
            part_ml[slot_i * 2] = lrow[i2] > 0.0f ? mrow[i2] : NEG_INF;
            part_ml[slot_i * 2 + 1] = lrow[i2];
        }
    }
}
extern "C" __global__ void __launch_bounds__(64) attn_partial_tc(ATT_TC_ARGS) { TL_SCOPE;
    attn_partial_tc_impl<1>(q, params, tbl, slot, part_o, part_ml, H, Hkv, D, split_cap, scale, T); }
// Two m-tiles: 204 registers; 2 or 3 blocks a multiprocessor (3: 168 registers and a few spilled)
#define ATT_TC2_MIN_BLOCKS 2
extern "C" __global__ void __launch_bounds__(128, ATT_TC2_MIN_BLOCKS) attn_partial_tc2(ATT_TC_ARGS) { TL_SCOPE;
    attn_partial_tc_impl<2>(q, params, tbl, slot, part_o, part_ml, H, Hkv, D, split_cap, scale, T); }

// attn_partial_tcd: attn_partial_tc's rows computed with more warps, for launches whose rows fit one
// m-tile (T * G <= 16: decode), where the verify kernel's two warps walk the split's tiles alone
// (on the H200: 64 blocks, under one warp a scheduler, an instruction every ~7 cycles). Eight warps;
// the tiles come in chunks of ATT_TCD_CHUNK, two chunks in flight. Per chunk, 2 * ATT_TCD_CHUNK
// warps compute the tiles' score halves at once (warp w: half w & 1 of tile w >> 1, the verify
// kernel's k-steps for that half), then every warp runs the tiles' softmax steps in order and the
// P V products of its own column tiles of D (w, w + 8, ...). Each of a row's operations is the one
// attn_partial_tc does (the same helpers; S0 + S1 added in the same order), so its bits are the
// verify kernel's: decode may take this kernel while verify takes that one.
#define ATT_TCD_WARPS 8
#define ATT_TCD_CHUNK 2
extern "C" __global__ void __launch_bounds__(ATT_TCD_WARPS * 32) attn_partial_tcd(ATT_TC_ARGS) { TL_SCOPE;
    __shared__ __align__(8) unsigned long long s_full[2];
    // K [2][CHUNK][16][D + 16], V [2][CHUNK][16][D + 4], score halves [CHUNK][2][16][ATT_TC_S_LD]
    DYN_SMEM(float, sm);
    const int KLD = D + 16, VLD = D + 4;
    float* sk = sm;
    float* sv = sk + 2 * ATT_TCD_CHUNK * ATT_TC_ROWS * KLD;
    float* ss = sv + 2 * ATT_TCD_CHUNK * ATT_TC_ROWS * VLD;
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    const int s = blockIdx.x, kvh = blockIdx.y, m0 = 0;
    const int G = H / Hkv, M = T * G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int p0 = params[0];
    const int ctx = (int)tbl[slot + 2];
    const float* kc = (const float*)tbl[slot] + (size_t)kvh * ctx * D;
    const float* vc = (const float*)tbl[slot + 1] + (size_t)kvh * ctx * D;
    int j0r[2], j1r[2], lo, hi;
    tc_rows(p0, m0, m0, ATT_TC_ROWS, M, G, split_cap, s, g, j0r, j1r, lo, hi);
    const int n_tiles = hi > lo ? (hi - lo + 15) / 16 : 0;
    const int n_chunks = (n_tiles + ATT_TCD_CHUNK - 1) / ATT_TCD_CHUNK;
    auto issue = [&](int ci) {  // warp 0: chunk ci into stage ci & 1
        const int st = ci & 1, i0 = ci * ATT_TCD_CHUNK, nt = min(ATT_TCD_CHUNK, n_tiles - i0);
        unsigned bytes = 0;
        for (int t = 0; t < nt; ++t) bytes += tc_tile_bytes(lo + 16 * (i0 + t), hi, D);
        if (lane == 0) mbar_expect(&s_full[st], bytes);
        warp_sync();
        for (int t = 0; t < nt; ++t)
            tc_copy_tile(sk + (st * ATT_TCD_CHUNK + t) * ATT_TC_ROWS * KLD,
                         sv + (st * ATT_TCD_CHUNK + t) * ATT_TC_ROWS * VLD, kc, vc, lo + 16 * (i0 + t), hi, D, KLD,
                         VLD, &s_full[st], lane);
    };
    int issued = 0;
    if (warp == 0) {
        if (lane == 0) {
            mbar_init(&s_full[0], 1);
            mbar_init(&s_full[1], 1);
        }
        warp_sync();
        while (issued < min(2, n_chunks) && min(hi, lo + 16 * ATT_TCD_CHUNK * (issued + 1)) <= p0) issue(issued++);
    }
    grid_dependency_wait();
    if (warp == 0)
        while (issued < min(2, n_chunks)) issue(issued++);
    const bool s_warp = warp < 2 * ATT_TCD_CHUNK;
    const int half = warp & 1, tsub = warp >> 1;
    u32 qh[ATT_TC_MAXD / 32][4], ql[ATT_TC_MAXD / 32][4];
    if (s_warp) tc_load_q(qh, ql, q, m0, M, G, H, kvh, D, half, g, c);
    __syncthreads();            // the barriers' initialisation, seen by every warp before it waits
    const int NJ8 = D / 8;      // column tiles of D; this warp's: warp, warp + 8, ...
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    float acc[ATT_TC_MAXD / 64][4];
#pragma unroll
    for (int k = 0; k < ATT_TC_MAXD / 64; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.0f;
    for (int ci = 0; ci < n_chunks; ++ci) {
        const int st = ci & 1, i0 = ci * ATT_TCD_CHUNK, nt = min(ATT_TCD_CHUNK, n_tiles - i0);
        mbar_wait(&s_full[st], (unsigned)(ci >> 1) & 1u);
        if (s_warp && tsub < nt) {
            float sc[2][4];
            tc_scores_half(sc, sk + (st * ATT_TCD_CHUNK + tsub) * ATT_TC_ROWS * KLD, KLD, half, D, qh, ql, g, c);
            tc_store_half(ss + (2 * tsub + half) * ATT_TC_ROWS * ATT_TC_S_LD, sc, g, c);
        }
        __syncthreads();
        for (int t = 0; t < nt; ++t) {
            const int kb = lo + 16 * (i0 + t);
            const float* s0 = ss + (2 * t) * ATT_TC_ROWS * ATT_TC_S_LD;
            const float* s1 = s0 + ATT_TC_ROWS * ATT_TC_S_LD;
            float sc[2][4];
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int at = (g + 8 * (e >> 1)) * ATT_TC_S_LD + 8 * nt2 + 2 * c + (e & 1);
                    sc[nt2][e] = s0[at] + s1[at];
                }
            float corr[2];
            u32 ph[4], pl[4];
            tc_softmax_tile(sc, kb, j0r, j1r, scale, c, mrow, lrow, corr, ph, pl);
            const float* tv = sv + (st * ATT_TCD_CHUNK + t) * ATT_TC_ROWS * VLD;
#pragma unroll
            for (int k = 0; k < ATT_TC_MAXD / 64; ++k) {
                const int jj = warp + ATT_TCD_WARPS * k;
                if (jj < NJ8) tc_pv_cols(acc[k], tv, VLD, 8 * jj, kb, hi, g, c, corr, ph, pl);
            }
        }
        __syncthreads();        // every warp is done with the stage and the score halves
        if (warp == 0 && ci + 2 < n_chunks) issue(ci + 2);
    }
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
        const int m = m0 + g + 8 * i2;
        if (m >= M) continue;
        const int t = m / G, h = kvh * G + (m - t * G);
        const size_t slot_i = ((size_t)t * H + h) * ATT_MAX_SPLITS + s;
#pragma unroll
        for (int k = 0; k < ATT_TC_MAXD / 64; ++k) {
            const int jj = warp + ATT_TCD_WARPS * k;
            if (jj < NJ8) {
                float* o = part_o + slot_i * D + 8 * jj + 2 * c;
                o[0] = acc[k][2 * i2];
                o[1] = acc[k][2 * i2 + 1];
            }
        }
        if (warp == 0 && c == 0) {
            part_ml[slot_i * 2] = lrow[i2] > 0.0f ? mrow[i2] : NEG_INF;
            part_ml[slot_i * 2 + 1] = lrow[i2];
        }
    }
}

// attn_combine_prep: o[t, h] = merge of the splits, times sigmoid(gate[t, h]) (gate = the second D
// values of head h in qg), then act16. grid (T, ceil(H*D / 256)): a block writes 256 columns.
// n_scan = the attn_partial launch's split count (its grid): every split s < n_scan was written.
extern "C" __global__ void __launch_bounds__(FUSED_THREADS) attn_combine_prep(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const float* __restrict__ qg, int H,
    int D, int n_scan, u16* __restrict__ out16, u16* __restrict__ outxs) { TL_SCOPE;
    __shared__ float vals[PREP_COLS];
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    grid_dependency_wait();
    const int t = blockIdx.x, n0 = blockIdx.y * PREP_COLS;
    const int count = min(PREP_COLS, H * D - n0);
    if ((int)threadIdx.x < count) {
        const int idx = n0 + threadIdx.x, h = idx / D, d = idx % D;
        const size_t base = ((size_t)t * H + h) * ATT_MAX_SPLITS;
        const float gt = qg[(size_t)t * 2 * H * D + (size_t)h * 2 * D + D + d];
        // The splits merged in split order; a split with no keys (l == 0) is skipped, its o never
        // read as a number. Up to ATT_MIN_SPLITS (every short context) all loads go out at once;
        // beyond, groups of ATT_MIN_SPLITS in two passes (the maximum first): the same operations
        // in the same order, so a row's bits do not depend on n_scan.
        float ms[ATT_MIN_SPLITS], ls[ATT_MIN_SPLITS], os[ATT_MIN_SPLITS];
        float M = NEG_INF, L = 0.0f, o = 0.0f;
        if (n_scan <= ATT_MIN_SPLITS) {
#pragma unroll
            for (int s = 0; s < ATT_MIN_SPLITS; ++s) {
                const bool in = s < n_scan;
                ms[s] = in ? part_ml[(base + s) * 2] : 0.0f;
                ls[s] = in ? part_ml[(base + s) * 2 + 1] : 0.0f;
                os[s] = in ? part_o[(base + s) * D + d] : 0.0f;
            }
#pragma unroll
            for (int s = 0; s < ATT_MIN_SPLITS; ++s)
                if (ls[s] > 0.0f) M = fmaxf(M, ms[s]);
#pragma unroll
            for (int s = 0; s < ATT_MIN_SPLITS; ++s)
                if (ls[s] > 0.0f) {
                    const float f = expf(ms[s] - M);
                    L += ls[s] * f;
                    o += os[s] * f;
                }
        } else {
            for (int s0 = 0; s0 < n_scan; s0 += ATT_MIN_SPLITS) {
#pragma unroll
                for (int s = 0; s < ATT_MIN_SPLITS; ++s) {
                    const bool in = s0 + s < n_scan;
                    ms[s] = in ? part_ml[(base + s0 + s) * 2] : 0.0f;
                    ls[s] = in ? part_ml[(base + s0 + s) * 2 + 1] : 0.0f;
                }
#pragma unroll
                for (int s = 0; s < ATT_MIN_SPLITS; ++s)
                    if (ls[s] > 0.0f) M = fmaxf(M, ms[s]);
            }
            for (int s0 = 0; s0 < n_scan; s0 += ATT_MIN_SPLITS) {
#pragma unroll
                for (int s = 0; s < ATT_MIN_SPLITS; ++s) {
                    const bool in = s0 + s < n_scan;
                    ms[s] = in ? part_ml[(base + s0 + s) * 2] : 0.0f;
                    ls[s] = in ? part_ml[(base + s0 + s) * 2 + 1] : 0.0f;
                    os[s] = in ? part_o[(base + s0 + s) * D + d] : 0.0f;
                }
#pragma unroll
                for (int s = 0; s < ATT_MIN_SPLITS; ++s)
                    if (ls[s] > 0.0f) {
                        const float f = expf(ms[s] - M);
                        L += ls[s] * f;
                        o += os[s] * f;
                    }
            }
        }
        o = L > 0.0f ? o / L : 0.0f;
        vals[threadIdx.x] = o / (1.0f + expf(-gt));
    }
    __syncthreads();
    prep_cols(vals, n0, count, t, out16, outxs);
}

// ---------------------------------------------------------------------------------------------
// argmax_rows: out[t] = argmax of x[t][0..V) (row stride ld), numpy's rules.
__device__ __forceinline__ bool am_better(float a, int ia, float b, int ib) {
    if (ib < 0) return ia >= 0;
    if (ia < 0) return false;
    const bool na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

// grid (n_chunks, rows): block c scans columns [c*len, (c+1)*len) of its row and leaves its best
// (value, index); the last block of a row to finish (a counter per row, reset by it) reduces the
// chunks. The order of (value, index) is total, so the result does not depend on who finishes last.
extern "C" __global__ void __launch_bounds__(FUSED_THREADS) argmax_rows(
    const float* __restrict__ x, int V, int ld, int* __restrict__ out, float* __restrict__ part_v,
    int* __restrict__ part_i, int* __restrict__ counters) { TL_SCOPE;
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int s_last;
    trigger_dependents();   // the next launch may start (it waits for us before reading)
    grid_dependency_wait();
    const int c = blockIdx.x, t = blockIdx.y, n_chunks = gridDim.x;
    const int len = (V + n_chunks - 1) / n_chunks;
    const int i0 = c * len, i1 = min(V, i0 + len);
    const float* xr = x + (size_t)t * ld;
    float bv = 0.0f;
    int bi = -1;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        const float v = xr[i];
        if (am_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const float ov = shfl_xor(bv, m);
        const int oi = shfl_xor(bi, m);
        if (am_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (am_better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
        part_v[(size_t)t * n_chunks + c] = bv;
        part_i[(size_t)t * n_chunks + c] = bi;
        __threadfence();
        s_last = atomicAdd(&counters[t], 1) == n_chunks - 1;
    }
    __syncthreads();
    if (!s_last) return;
    if (threadIdx.x == 0) {
        __threadfence();
        float v = 0.0f;
        int idx = -1;
        for (int k = 0; k < n_chunks; ++k) {
            const float pv = ldcg_f32(part_v + (size_t)t * n_chunks + k);
            const int pi = *(volatile const int*)(part_i + (size_t)t * n_chunks + k);
            if (am_better(pv, pi, v, idx)) { v = pv; idx = pi; }
        }
        out[t] = idx;
        counters[t] = 0;
    }
}

// ---------------------------------------------------------------------------------------------
// step_chain: the params block of the next decode step, written by this step's graph: position + 1
// and the token this step's argmax chose. Greedy decoding then queues the next step before the host
// has read this one's token (daemons/qwen35_gpu.py GreedyChain), so the host's time between steps
// (reading the id, launching the graph) overlaps the device's work instead of adding to it.
extern "C" __global__ void step_chain(int* __restrict__ params, const int* __restrict__ ids) { TL_SCOPE;
    trigger_dependents();
    grid_dependency_wait();
    if (threadIdx.x == 0) {
        params[0] += 1;
        params[2] = ids[0];
    }
}

// ---------------------------------------------------------------------------------------------
// topk_row: the k largest values of each row x[t][0..V) (row stride ld, 1 <= k <= V), ties at the
// k-th value to the lowest indices (daemons/sampling.py's top_k rule), written in ascending index
// order to ids[t][k], vals[t][k] (row stride k); meta[t] = the row's count of NaN / +inf values (the
// sampler rejects such logits: the caller then reads the whole row). So a sampled token needs only
// k candidates on the host instead of the vocabulary.
// One block per row: a radix select of the k-th largest key, 8 bits a pass over the row (counts in a
// shared histogram: the same whatever order the adds land in), then each thread takes a contiguous
// run of the row, and a scan of the per-thread counts places the chosen values in index order.
// Keys order like the floats (negatives complemented; -0 as +0, so the two zeros tie as they do in
// numpy); NaN keys sit above +inf and are only counted.
#define TOPK_THREADS 512
__device__ __forceinline__ unsigned topk_key(float v) {
    unsigned u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_row(
    const float* __restrict__ x, int V, int ld, int k, int* __restrict__ out_ids, float* __restrict__ out_vals,
    int* __restrict__ meta) { TL_SCOPE;
    __shared__ int hist[256];
    __shared__ unsigned s_prefix;
    __shared__ int s_rem, s_bad;
    __shared__ int s_above[TOPK_THREADS], s_ties[TOPK_THREADS];
    trigger_dependents();
    grid_dependency_wait();
    const int tid = threadIdx.x, nth = blockDim.x;
    const float* xr = x + (size_t)blockIdx.x * ld;
    if (tid == 0) s_bad = 0;
    unsigned prefix = 0u, mask = 0u;
    int rem = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += nth) hist[i] = 0;
        __syncthreads();
        int bad = 0;
        for (int i = tid; i < V; i += nth) {
            const float v = xr[i];
            if (shift == 24 && !(v < __int_as_float(0x7f800000))) ++bad;     // NaN or +inf
            const unsigned key = topk_key(v);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        if (bad) atomicAdd(&s_bad, bad);
        __syncthreads();
        if (tid == 0) {               // the digit holding the rem-th largest key among those left
            int cum = 0, d = 255;
            for (; d > 0; --d) {
                if (cum + hist[d] >= rem) break;
                cum += hist[d];
            }
            s_prefix = prefix | ((unsigned)d << shift);
            s_rem = rem - cum;
        }
        __syncthreads();
        prefix = s_prefix;
        rem = s_rem;                  // how many keys equal to the selected prefix to take
        mask |= 255u << shift;
    }
    const unsigned kth = prefix;
    // per-thread contiguous runs, counted, scanned, then written in index order
    const int len = (V + nth - 1) / nth, i0 = min(V, tid * len), i1 = min(V, i0 + len);
    int above = 0, ties = 0;
    for (int i = i0; i < i1; ++i) {
        const unsigned key = topk_key(xr[i]);
        above += key > kth;
        ties += key == kth;
    }
    s_above[tid] = above;
    s_ties[tid] = ties;
    __syncthreads();
    if (tid == 0) {
        int a = 0, t = 0;
        for (int j = 0; j < nth; ++j) {
            const int na = s_above[j], nt = s_ties[j];
            s_above[j] = a;
            s_ties[j] = t;
            a += na;
            t += nt;
        }
        meta[blockIdx.x] = s_bad;
    }
    __syncthreads();
    int tie_rank = s_ties[tid];
    int pos = s_above[tid] + min(tie_rank, rem);
    int* ids = out_ids + (size_t)blockIdx.x * k;
    float* vals = out_vals + (size_t)blockIdx.x * k;
    for (int i = i0; i < i1; ++i) {
        const float v = xr[i];
        const unsigned key = topk_key(v);
        bool take = key > kth;
        if (key == kth) take = tie_rank++ < rem;
        if (take) {
            ids[pos] = i;
            vals[pos] = v;
            ++pos;
        }
    }
}
