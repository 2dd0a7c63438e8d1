// Device helpers shared by the tensor-core matmul (mma_matmul.cu) and the fused step kernels
// (fused.cu): f16x2 arithmetic on raw 32-bit registers, the m16n8k16 f16 -> f32 MMA, conversions,
// 16-byte loads, and warp shuffles.
//
// Three builds of the same sources:
//   CUDA (NVRTC, sm_80+)     inline PTX (mma.sync, f16x2 fma/sub/mul, cvt);
//   HIP  (hiprtc)            _Float16 arithmetic and a shuffle-built MMA (`mma16816_portable`);
//   CPU emulator (DFLASH_EMU, tests/emu/)   the emulator's runtime provides the primitives.
// `-DMMA_PORTABLE` makes a CUDA build use the shuffle-built MMA too: the GPU tests compare the two,
// which checks the fragment layout this file assumes against the hardware.
//
// m16n8k16 fragment layout (PTX ISA, "row.col", f16 A/B, f32 C/D), lane = 4*g + c:
//   A (16x16, row-major) a[0] = (row g,   k 2c..2c+1)   a[1] = (row g+8, k 2c..2c+1)
//                        a[2] = (row g,   k 2c+8..+9)   a[3] = (row g+8, k 2c+8..+9)
//   B (16x8)             b[0] = (k 2c..2c+1, col g)     b[1] = (k 2c+8..+9, col g)
//   C/D (16x8, f32)      d[0], d[1] = (row g, col 2c, 2c+1)   d[2], d[3] = (row g+8, col 2c, 2c+1)
// The lower 16 bits of a register hold the lower k (A, B) element.
#pragma once

#if defined(DFLASH_EMU)
#include "emu_runtime.h"
#elif defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#endif
#include "timeline.cuh"

typedef unsigned int u32;

// Dynamically sized shared memory (the launch's third configuration value).
#if defined(DFLASH_EMU)
#define DYN_SMEM(type, name) type* name = (type*)emu_dyn_smem()
#else
#define DYN_SMEM(type, name) extern __shared__ type name[]
#endif
typedef unsigned short u16;

#if defined(DFLASH_EMU)
// provided by emu_runtime.h: h2fma, h2sub, h2mul, h2f, f2h, mma16816_hw, shfl_xor, shfl, ldcg_f32,
// grid_dependency_wait, trigger_dependents, mbar_* and bulk_copy
#define TC_HAVE_PRIMITIVES 1
#endif

#if !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ u32 h2fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 h2sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 h2mul(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {      // round to nearest even
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ u32 shfl(u32 v, int src) { return __shfl_sync(0xffffffffu, v, src); }
// A load that skips L1 (data another block of the same grid wrote: split-K partials).
__device__ __forceinline__ float ldcg_f32(const float* p) { return __ldcg(p); }
__device__ __forceinline__ long long ldcg_s64(const long long* p) { return __ldcg(p); }
__device__ __forceinline__ void mma16816_hw(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#define TC_HAVE_PRIMITIVES 1
#endif

#if defined(__HIP_PLATFORM_AMD__)
// Untested on ROCm hardware (no AMD machine here); written against hip_fp16's _Float16.
typedef _Float16 tc_h2v __attribute__((ext_vector_type(2)));
__device__ __forceinline__ tc_h2v tc_v(u32 a) { return __builtin_bit_cast(tc_h2v, a); }
__device__ __forceinline__ u32 tc_u(tc_h2v a) { return __builtin_bit_cast(u32, a); }
__device__ __forceinline__ u32 h2fma(u32 a, u32 b, u32 c) {
    tc_h2v x = tc_v(a), y = tc_v(b), z = tc_v(c), r;
    r.x = __builtin_fmaf16(x.x, y.x, z.x);
    r.y = __builtin_fmaf16(x.y, y.y, z.y);
    return tc_u(r);
}
__device__ __forceinline__ u32 h2sub(u32 a, u32 b) { return tc_u(tc_v(a) - tc_v(b)); }
__device__ __forceinline__ u32 h2mul(u32 a, u32 b) { return tc_u(tc_v(a) * tc_v(b)); }
__device__ __forceinline__ float h2f(u16 h) { return (float)__builtin_bit_cast(_Float16, h); }
__device__ __forceinline__ u16 f2h(float f) { return __builtin_bit_cast(u16, (_Float16)f); }
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor(v, m, 32); }
__device__ __forceinline__ int shfl_xor(int v, int m) { return __shfl_xor(v, m, 32); }
__device__ __forceinline__ u32 shfl(u32 v, int src) { return __shfl(v, src, 32); }
__device__ __forceinline__ float ldcg_f32(const float* p) { return __builtin_nontemporal_load(p); }
__device__ __forceinline__ long long ldcg_s64(const long long* p) { return __builtin_nontemporal_load(p); }
#define MMA_PORTABLE 1
#define TC_HAVE_PRIMITIVES 1
#endif

// Split-K arrival: one thread adds to a counter with acquire-release semantics at device scope,
// after a block barrier, so that the block's earlier stores (ordered before it by the barrier;
// release is cumulative) are visible to whichever block sees the count, and that block's later
// loads (ordered after it by the next barrier) see theirs: one fence for the block instead of a
// __threadfence per thread (the pattern of CUTLASS's semaphore).
#if defined(DFLASH_EMU)
inline int atomic_add_acq_rel(int* p, int v) {
    return std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_acq_rel);
}
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
#else
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
#endif
// The same arrival with release semantics only: the thread does not wait for the old count (no
// acquire fence after it) until it reads the result; a reader of the others' data then issues
// fence_acq_rel first.
#if defined(DFLASH_EMU)
inline int atomic_add_release(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_release); }
inline void fence_acq_rel() { std::atomic_thread_fence(std::memory_order_acq_rel); }
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ int atomic_add_release(int* p, int v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ void fence_acq_rel() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
#else
__device__ __forceinline__ int atomic_add_release(int* p, int v) {
    int old;
    asm volatile("atom.release.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
#endif

// A counter read with acquire semantics at device scope: what the counted blocks wrote before their
// release arrivals is visible to this thread's later loads (mm_tc's MM_TAIL_PREFETCH).
#if defined(DFLASH_EMU)
inline int ld_acquire(const int* p) { return std::atomic_ref<int>(*(int*)p).load(std::memory_order_acquire); }
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ int ld_acquire(const int* p) {
    return __hip_atomic_load((int*)p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
#else
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
#endif

// Residual adds in 64-bit fixed point (mm_tc MODE_ADD, folded by fused.cu prep_rows): a partial
// sum v is added as round(v * 2^32). Integer addition is exact, so a row's value is the same in
// whatever order its parts arrive: the blocks that share a row block need no exchange (no counter,
// no workspace, no block waiting for another), and rows stay batch-invariant. Range: a row's sum
// stays within +-2^27 (|acc| < 2^59); a non-finite v adds FIXED_POISON = 2^60, so any 1..15 of
// them leave |acc| >= 2^59 and the fold turns the element into NaN (the step's health check sees it).
#define FIXED_ONE 4294967296.0f
#define FIXED_POISON (1ll << 60)
#define FIXED_LIMIT (1ll << 59)
#if defined(DFLASH_EMU)
inline void red_add_fixed(long long* p, float v) {
    const long long q = std::isfinite(v) ? (long long)std::llrint((double)(v * FIXED_ONE)) : FIXED_POISON;
    std::atomic_ref<unsigned long long>(*(unsigned long long*)p).fetch_add((unsigned long long)q,
                                                                          std::memory_order_relaxed);
}
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ void red_add_fixed(long long* p, float v) {
    const long long q = isfinite(v) ? __float2ll_rn(v * FIXED_ONE) : FIXED_POISON;
    atomicAdd((unsigned long long*)p, (unsigned long long)q);
}
#else
// MM_RED_PROBE (benchmarks, timing only: wrong sums): the fixed-point adds as plain stores (what do the
// L2 atomics of the ADD epilogues cost a wide launch?)
#ifndef MM_RED_PROBE
#define MM_RED_PROBE 0
#endif
__device__ __forceinline__ void red_add_fixed(long long* p, float v) {
    const long long q = isfinite(v) ? __float2ll_rn(v * FIXED_ONE) : FIXED_POISON;
#if MM_RED_PROBE
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(q) : "memory");
#else
    // global and without a result (a generic atomicAdd also tests for shared memory)
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(q) : "memory");
#endif
}
#endif
__device__ __forceinline__ float fixed_to_float(long long a) {
    return (a >= FIXED_LIMIT || a <= -FIXED_LIMIT) ? __int_as_float(0x7fc00000) : (float)((double)a * (1.0 / FIXED_ONE));
}

// Every lane of the warp reaches this point before any goes on (lanes that issue copies after
// lane 0 armed the barrier).
#if defined(DFLASH_EMU)
inline void warp_sync() { emu_warp_sync(); }
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ void warp_sync() { __builtin_amdgcn_wave_barrier(); }
#else
__device__ __forceinline__ void warp_sync() { __syncwarp(); }
#endif

// An integer the compiler must keep in a register: ptxas otherwise recomputes lane-derived offsets
// from the lane index in every iteration of a loop (integer instructions on the matmul's issue-bound
// path), which an empty asm that "changes" the value prevents.
#if defined(DFLASH_EMU) || defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ int keep_reg(int v) { return v; }
#else
__device__ __forceinline__ int keep_reg(int v) {
    asm volatile("" : "+r"(v));
    return v;
}
#endif

// Bulk copies completing on mbarriers (sm_90: TMA, one instruction per contiguous run of bytes).
// A barrier completes a phase when `count` arrivals have happened and every byte announced by
// mbar_expect (itself one arrival) has landed; mbar_wait(bar, p) returns once the phase of parity p
// has completed. The matmul's pipeline uses a "full" barrier per stage (the issuer's expect, the
// copies' bytes) and an "empty" one (one arrival per computing warp once it is done reading).
// Without TMA (HIP, pre-Hopper) the same protocol runs as a software barrier: one 64-bit word in
// shared memory [phase:1][count:15][pending arrivals:16][bytes still due:32], updated atomically,
// the copy done synchronously by the issuing warp (stage_copy below); the emulator provides its own
// (emu_runtime.h).
#if !defined(DFLASH_EMU)
// TC_NO_TMA (a build define) forces the software path on sm_90 too: the GPU tests hold it equal to
// the TMA path there, which is how the code pre-Hopper GPUs run gets tested on this machine.
#if !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(TC_NO_TMA)
#define TC_HAVE_TMA 1
#endif
#ifdef TC_HAVE_TMA
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
// n bytes (a multiple of 16, 16-byte aligned both sides) global -> shared, completing on bar.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, unsigned n, unsigned long long* bar) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(d), "l"(gmem), "r"(n), "r"(b) : "memory");
}
// A barrier by its shared-window address (BarRef: what a loop keeps in a register; from a generic
// pointer ptxas recomputes the window address, an S2R and four integer instructions, every use).
typedef unsigned BarRef;
__device__ __forceinline__ BarRef bar_ref(unsigned long long* bar) { return (unsigned)__cvta_generic_to_shared(bar); }
__device__ __forceinline__ BarRef bar_at(BarRef b, int k) { return b + 8u * (unsigned)k; }
__device__ __forceinline__ BarRef keep_bar(BarRef b) {
    asm volatile("" : "+r"(b));
    return b;
}
__device__ __forceinline__ void mbar_wait(BarRef a, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(a), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void mbar_arrive(BarRef a) {   // release: this thread's reads are done
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) { mbar_wait(bar_ref(bar), parity); }
#else     // software mbarrier (untested on ROCm hardware: no AMD machine here)
#define TC_MB_ARRIVAL (1ull << 32)
#if defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ unsigned long long tc_mb_add(unsigned long long* p, unsigned long long v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_WORKGROUP) + v;
}
__device__ __forceinline__ unsigned long long tc_mb_load(unsigned long long* p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_WORKGROUP);
}
#else
__device__ __forceinline__ unsigned long long tc_mb_add(unsigned long long* p, unsigned long long v) {
    __threadfence_block();
    const unsigned long long r = atomicAdd(p, v) + v;
    __threadfence_block();
    return r;
}
__device__ __forceinline__ unsigned long long tc_mb_load(unsigned long long* p) {
    const unsigned long long r = *(volatile unsigned long long*)p;
    __threadfence_block();
    return r;
}
#endif
// After an update that left no arrival pending and no byte due, the updating thread opens the
// next phase (no other update of this phase can follow: the next one starts after its waiters).
__device__ __forceinline__ void tc_mb_settle(unsigned long long* bar, unsigned long long st) {
    if ((unsigned)st == 0u && ((st >> 32) & 0xffffu) == 0u)
        tc_mb_add(bar, (1ull << 63) + (((st >> 48) & 0x7fffu) << 32));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    *(volatile unsigned long long*)bar = ((unsigned long long)count << 48) | ((unsigned long long)count << 32);
    __threadfence_block();
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    tc_mb_add(bar, (unsigned long long)bytes);
    tc_mb_settle(bar, tc_mb_add(bar, 0ull - TC_MB_ARRIVAL));
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) { tc_mb_settle(bar, tc_mb_add(bar, 0ull - TC_MB_ARRIVAL)); }
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    while ((unsigned)(tc_mb_load(bar) >> 63) == parity) {
    }
}
#endif
#endif
#if !defined(TC_HAVE_TMA)      // the software barrier and the emulator's: a barrier is its pointer
typedef unsigned long long* BarRef;
__device__ __forceinline__ BarRef bar_ref(unsigned long long* bar) { return bar; }
__device__ __forceinline__ BarRef bar_at(BarRef b, int k) { return b + k; }
__device__ __forceinline__ BarRef keep_bar(BarRef b) { return b; }
#endif

// Shared memory this thread wrote with ordinary stores that a bulk copy (the async proxy) will
// overwrite next: the stores are ordered before that copy only through this fence, then a barrier
// before the copy is issued (PTX memory model: generic and async proxy). Without TMA the copies are
// ordinary stores: nothing to fence.
#if defined(TC_HAVE_TMA)
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#else
__device__ __forceinline__ void fence_proxy_async_smem() {}
#endif

// Global memory this thread has acquired (ordinary loads would see it) that a bulk copy it issues next
// reads: the copy runs in the async proxy, ordered after the acquire only through this fence (PTX
// memory model). Without TMA the copies are ordinary loads: nothing to fence.
#if defined(TC_HAVE_TMA)
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
#else
__device__ __forceinline__ void fence_proxy_async_global() {}
#endif

// n bytes global -> shared for a whole warp (every lane calls it, after the mbar_expect that
// announced them and a warp_sync): with TMA lane 0 issues one bulk copy; the software path copies
// 16 bytes a lane at a time across the warp and counts each lane's bytes off the barrier.
#if defined(DFLASH_EMU) || defined(TC_HAVE_TMA)
__device__ __forceinline__ void stage_copy(void* smem, const void* gmem, unsigned n, unsigned long long* bar, int lane) {
    if (lane == 0) bulk_copy(smem, gmem, n, bar);
}
#else
__device__ __forceinline__ void stage_copy(void* smem, const void* gmem, unsigned n, unsigned long long* bar, int lane) {
    unsigned mine = 0;
    for (unsigned i = 16u * (unsigned)lane; i < n; i += 512u, mine += 16u)
        *(uint4*)((char*)smem + i) = *(const uint4*)((const char*)gmem + i);
    if (mine) tc_mb_settle(bar, tc_mb_add(bar, 0ull - (unsigned long long)mine));
}
#endif

// The computing warps of a block with a separate issuer warp meet at a named barrier of their own
// (the issuer runs ahead in its own loop and never reaches it).
#if defined(DFLASH_EMU)
inline void compute_warps_sync(int n_threads) { emu_named_sync(1, (unsigned)n_threads); }
#elif defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ void compute_warps_sync(int) { __syncthreads(); }    // HIP: no issuer warp
#else
__device__ __forceinline__ void compute_warps_sync(int n_threads) {
    asm volatile("bar.sync 1, %0;" ::"r"(n_threads) : "memory");
}
#endif

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-serialization
// attribute may start while its predecessor drains; it must call grid_dependency_wait() before
// reading anything the predecessor writes. Everything before the wait may only read data that no
// earlier kernel of the step writes: weights, the params block and state table (host-written before
// the graph), and state that only this launch writes in a step (a DeltaNet layer's conv and
// recurrent state), since the launches before it may still run. Without the attribute (or on HIP /
// older GPUs) the wait is a no-op.
#if !defined(DFLASH_EMU)
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(__HIP_PLATFORM_AMD__)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    tl_mark(1);
}
__device__ __forceinline__ void trigger_dependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(__HIP_PLATFORM_AMD__)
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
#endif

// Thread-block clusters (sm_90): kernels compiled with `__cluster_dims__` are named ..._clx<N> /
// _cly<N> (N blocks along x / y), which tells tests/emu to run them as such clusters. The barrier
// comes as its two halves: what a thread wrote to shared memory before cluster_arrive() (release)
// is visible to every thread of the cluster after its cluster_wait() (acquire); cluster_ld_f32 reads
// the float at the same shared-memory address in the block of another rank (distributed shared
// memory: only dynamic shared memory in kernels the emulator runs, where a `__shared__` object is
// one static for all blocks). A block must not exit while another may still read its shared
// memory: such kernels arrive after their last remote read and wait before they return. HIP and
// GPUs before sm_90 have no clusters (TC_HAVE_CLUSTERS undefined): the host never launches these.
#if defined(DFLASH_EMU)
inline unsigned cluster_rank() { return emu_cluster_rank(); }
inline void cluster_arrive() { emu_cluster_arrive(); }
inline void cluster_wait() { emu_cluster_wait(); }
inline float cluster_ld_f32(const float* p, unsigned rank) { return *(const float*)emu_cluster_map(p, rank); }
#define TC_HAVE_CLUSTERS 1
#elif !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ float cluster_ld_f32(const float* p, unsigned rank) {
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#define TC_HAVE_CLUSTERS 1
#endif

// ---------------------------------------------------------------------------------------------
// The MMA, built from shuffles (HIP, or -DMMA_PORTABLE): each lane gathers the A row elements and
// B column elements its four outputs need from the lanes that hold them. Exact f16 products,
// f32 sums in k order. Every lane of the warp must call it (it shuffles).
__device__ __forceinline__ float h_lo(u32 v) { return h2f((u16)(v & 0xffffu)); }
__device__ __forceinline__ float h_hi(u32 v) { return h2f((u16)(v >> 16)); }

__device__ __forceinline__ void mma16816_portable(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    float acc[4] = {d[0], d[1], d[2], d[3]};
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {                    // k = 2cc, 2cc+1 (reg 0) and 2cc+8, 2cc+9 (reg 1/2)
        const u32 ar0 = shfl(a[0], 4 * g + cc), ar1 = shfl(a[1], 4 * g + cc);
        const u32 ar2 = shfl(a[2], 4 * g + cc), ar3 = shfl(a[3], 4 * g + cc);
        const u32 bl0 = shfl(b0, 4 * (2 * c) + cc), bl1 = shfl(b1, 4 * (2 * c) + cc);
        const u32 bh0 = shfl(b0, 4 * (2 * c + 1) + cc), bh1 = shfl(b1, 4 * (2 * c + 1) + cc);
        // col 2c uses lane (2c, cc)'s b; col 2c+1 uses lane (2c+1, cc)'s b
        acc[0] += h_lo(ar0) * h_lo(bl0) + h_hi(ar0) * h_hi(bl0) + h_lo(ar2) * h_lo(bl1) + h_hi(ar2) * h_hi(bl1);
        acc[1] += h_lo(ar0) * h_lo(bh0) + h_hi(ar0) * h_hi(bh0) + h_lo(ar2) * h_lo(bh1) + h_hi(ar2) * h_hi(bh1);
        acc[2] += h_lo(ar1) * h_lo(bl0) + h_hi(ar1) * h_hi(bl0) + h_lo(ar3) * h_lo(bl1) + h_hi(ar3) * h_hi(bl1);
        acc[3] += h_lo(ar1) * h_lo(bh0) + h_hi(ar1) * h_hi(bh0) + h_lo(ar3) * h_lo(bh1) + h_hi(ar3) * h_hi(bh1);
    }
    d[0] = acc[0]; d[1] = acc[1]; d[2] = acc[2]; d[3] = acc[3];
}

// d += A * B
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if defined(MMA_PORTABLE)
    mma16816_portable(d, a, b0, b1);
#else
    mma16816_hw(d, a, b0, b1);
#endif
}

// f16x2 constants (bit patterns)
#define H2_1024 0x64006400u        // (1024, 1024)
#define H2_1056 0x64206420u        // (1056, 1056) = 1024 + 32
#define H2_1152 0x64806480u        // (1152, 1152) = 1024 + 128
#define H2_M1024 0xE400E400u       // (-1024, -1024)
#define H2_M1152 0xE480E480u       // (-1152, -1152)
#define H2_M64 0xD400D400u         // (-64, -64)
#define H2_M72 0xD480D480u         // (-72, -72)
#define H2_M1536 0xE600E600u       // (-1536, -1536)
#define H2_1_16 0x2C002C00u        // (1/16, 1/16)

// (a & mask) | c in one LOP3. Written as C, nvcc emits an AND and an OR with two immediates and
// ptxas keeps them as two instructions (mask and c cannot both be immediates of one LOP3); in the
// Q4_K decode that was 64 extra instructions per 16x256 unit (of ~340). As one PTX lop3, ptxas
// keeps c in a register that is set once outside the loop.
template <u32 MASK> __device__ __forceinline__ u32 lop_and_or(u32 a, u32 c) {
#if !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
    return d;
#else
    return (a & MASK) | c;
#endif
}

// (lo, hi) as f16x2 for integers 0 <= lo, hi < 1024: their bits under the exponent of 1024, minus 1024.
__device__ __forceinline__ u32 h2_int_pair(u32 lo, u32 hi) { return h2sub(lo | (hi << 16) | H2_1024, H2_1024); }

// Natural column n of an activation row <-> its position in the tensor-core layout (see
// mma_matmul.cu, "activations"): within each 256-column block, n = [c:2][p:3][e:3] is stored at
// [p:3][c:2][e:3].
__device__ __forceinline__ int act_pos(int n) {
    const int w = n & 255;
    return (n & ~255) | (((w >> 3) & 7) << 5) | ((w >> 6) << 3) | (w & 7);
}
// Block sums: per 256-column block, 16 halves [c:2][hi(2c), hi(2c+1), lo(2c), lo(2c+1)] for its
// eight 32-column blocks (hi + lo = the f32 sum, two f16 terms). Returns the index of hi(j); lo(j)
// is 2 further.
__device__ __forceinline__ int xs_pos(int j) { return (j >> 3) * 16 + ((j & 7) >> 1) * 4 + (j & 1); }

// Activation buffers (kernels/fused_gpu.py ActBuffer) hold up to ACT_ROWS rows superblock-major, each
// superblock's block sums first (ACT_ROWS x 16 halves, the rows in reverse order) and then its rows
// cut in halves, for the T rows a step writes: the T first halves (stored positions 0..127: k-step
// pairs 0..3), then the T second halves (pairs 4..7): xs points at the buffer, x16 ACT_XS halves
// further, and both step ACT_SB a superblock. So the T rows of one superblock and their sums are one
// run of T * 544 bytes (sums of rows T-1..0, then the first halves, then the second) that a matmul
// stages with one bulk copy (each copy a verify-width launch's warp 0 issues delays all four warps of
// its block). At T = 1 this is the whole row in order. The layout depends on T, which every producer
// knows (the rows it writes) and every reader takes from the same step. Odd rows swap the two 64-byte
// halves of every 128 bytes (stored position ^ 32): the two rows a quarter-warp's 16-byte B loads read
// then fall on different banks although the staged half rows are 256 bytes apart.
#define ACT_ROWS 32
#define ACT_XS (ACT_ROWS * 16)
#define ACT_SB (ACT_XS + ACT_ROWS * 256)
__device__ __forceinline__ size_t act_index(int t, int n, int T) {
    const int p = (act_pos(n) & 255) ^ (32 * (t & 1));      // the stored position in row t
    return (size_t)(n >> 8) * ACT_SB + (size_t)(p >> 7) * (T * 128) + (size_t)t * 128 + (p & 127);
}
__device__ __forceinline__ size_t xs_index(int t, int j) {
    return (size_t)(j >> 3) * ACT_SB + (size_t)(ACT_ROWS - 1 - t) * 16 + (xs_pos(j) & 15);
}

