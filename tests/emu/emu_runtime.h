// A small SIMT emulator: enough of the CUDA device model to run dflashd's kernel sources
// (kernels/*.cu, built with -DDFLASH_EMU) on the CPU, so the CPU test suite checks the CUDA code's
// logic (indexing, layouts, reductions, the split-K protocol) without a GPU.
//
// Model: a launch runs its thread blocks one after another; the threads of a block are fibers
// (ucontext) on one OS thread, switched at synchronisation points: __syncthreads waits for every
// thread of the block, warp operations (shuffles, the m16n8k16 MMA) for the 32 lanes of the warp,
// exchanging values through per-warp slots. Shared memory (`__shared__` = one static object per
// declaration) is therefore shared by the block. f16 arithmetic is exact-then-rounded (round to
// nearest even), which is what the hardware's fma.rn.f16x2 / sub.rn / mul.rn compute.
//
// What it is not: a timing model, a memory-model checker, or a model of divergent warp
// operations (every lane of a warp must reach each shuffle / MMA, as the kernels guarantee).
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstring>

struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct alignas(16) longlong2 { long long x, y; };
inline longlong2 make_longlong2(long long a, long long b) { return longlong2{a, b}; }
struct EmuDim { unsigned int x, y, z; };

extern EmuDim threadIdx;      // of the running fiber
extern EmuDim blockIdx;
extern EmuDim blockDim;
extern EmuDim gridDim;

#define __global__ __attribute__((used))   // marks kernels for tests/emu's exporter
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__
#define __align__(n) __attribute__((aligned(n)))
#define __cluster_dims__(...)      // the launcher sets the shape (tests/emu/__init__.py, "_cly<N>" kernels)

using std::min;
using std::max;

void emu_syncthreads();
void emu_warp_sync();
void emu_named_sync(unsigned id, unsigned n_threads);   // bar.sync id, n_threads
void emu_spin();                                         // a waiting thread lets the others run
[[noreturn]] void emu_fail(const char* what);
unsigned int* emu_warp_slots();   // [32][8] words of the calling thread's warp
void* emu_dyn_smem();
unsigned emu_cluster_rank();                             // thread-block clusters (emu.cpp)
unsigned emu_cluster_size();
void emu_cluster_arrive();
void emu_cluster_wait();
void* emu_cluster_map(const void* local_smem, unsigned rank);

inline void __syncthreads() { emu_syncthreads(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }

inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = (unsigned long long)x | ((unsigned long long)y << 32);
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 7u;
        r |= (unsigned int)((v >> (8 * sel)) & 0xffu) << (8 * i);
    }
    return r;
}

// ---- f16 ----------------------------------------------------------------------------------
inline double emu_h2d(unsigned short h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0) v = std::ldexp((double)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((double)(m | 1024), e - 25);
    return s ? -v : v;
}
// Round a double to the nearest f16 (ties to even); overflow to inf.
inline unsigned short emu_d2h(double v) {
    if (std::isnan(v)) return 0x7e00;
    const unsigned short sign = std::signbit(v) ? 0x8000 : 0;
    double a = std::fabs(v);
    if (a == 0.0) return sign;
    int e;
    std::frexp(a, &e);                     // a = f * 2^e, f in [0.5, 1)
    int exp16 = e - 1 + 15;                // biased exponent of a normal f16
    double q;                              // a in units of the f16 ulp at that exponent
    if (exp16 <= 0) { q = std::ldexp(a, 24); exp16 = 0; }
    else q = std::ldexp(a, 10 - (e - 1));
    double r = std::nearbyint(q);          // default rounding mode: to nearest even
    unsigned int mant = (unsigned int)r;
    if (exp16 == 0) {                      // subnormal (may round up into the normals)
        if (mant >= 1024) return sign | (unsigned short)(1 << 10 | (mant - 1024));
        return sign | (unsigned short)mant;
    }
    if (mant >= 2048) { mant >>= 1; exp16 += 1; }
    if (exp16 >= 31) return sign | 0x7c00;
    return sign | (unsigned short)(exp16 << 10) | (unsigned short)(mant - 1024);
}
inline float h2f(unsigned short h) { return (float)emu_h2d(h); }
inline unsigned short f2h(float f) { return emu_d2h((double)f); }
inline unsigned int emu_h2(double lo, double hi) { return (unsigned)emu_d2h(lo) | ((unsigned)emu_d2h(hi) << 16); }
inline double emu_lo(unsigned int v) { return emu_h2d((unsigned short)(v & 0xffff)); }
inline double emu_hi(unsigned int v) { return emu_h2d((unsigned short)(v >> 16)); }
inline unsigned int h2fma(unsigned a, unsigned b, unsigned c) {
    return emu_h2(emu_lo(a) * emu_lo(b) + emu_lo(c), emu_hi(a) * emu_hi(b) + emu_hi(c));
}
inline unsigned int h2sub(unsigned a, unsigned b) { return emu_h2(emu_lo(a) - emu_lo(b), emu_hi(a) - emu_hi(b)); }
inline unsigned int h2mul(unsigned a, unsigned b) { return emu_h2(emu_lo(a) * emu_lo(b), emu_hi(a) * emu_hi(b)); }

// ---- warp exchange -------------------------------------------------------------------------
inline unsigned int emu_exchange(unsigned int v, int src) {
    unsigned int* slots = emu_warp_slots();
    const int lane = threadIdx.x & 31;
    slots[lane * 8] = v;
    emu_warp_sync();
    const unsigned int r = slots[(src & 31) * 8];
    emu_warp_sync();
    return r;
}
inline float shfl_xor(float v, int m) {
    return __uint_as_float(emu_exchange(__float_as_uint(v), (int)(threadIdx.x & 31) ^ m));
}
inline int shfl_xor(int v, int m) { return (int)emu_exchange((unsigned)v, (int)(threadIdx.x & 31) ^ m); }
inline unsigned int shfl(unsigned int v, int src) { return emu_exchange(v, src); }
// The CUDA intrinsics the older kernel files use (32-lane warps).
static const int warpSize = 32;
inline float __shfl_xor_sync(unsigned, float v, int m, int = 32) { return shfl_xor(v, m); }
inline int __shfl_xor_sync(unsigned, int v, int m, int = 32) { return shfl_xor(v, m); }
inline float __shfl_down_sync(unsigned, float v, int off) {
    const int lane = threadIdx.x & 31;
    const float r = __uint_as_float(emu_exchange(__float_as_uint(v), lane + off < 32 ? lane + off : lane));
    return r;
}

inline float ldcg_f32(const float* p) { return *(volatile const float*)p; }
inline long long ldcg_s64(const long long* p) { return *(volatile const long long*)p; }
inline void grid_dependency_wait() {}
// mbarriers with the hardware's protocol (tc_common.cuh): a phase completes when `count` arrivals
// have happened and no announced byte is still due; bulk copies land at once (a memcpy by the
// issuing thread, counted off the barrier). A waiter yields to the block's other threads until
// its phase completes, so a pipeline that reuses a stage before its readers released it reads
// the wrong data here as on the GPU.
struct EmuMbar { unsigned short pending, count_phase; int tx; };   // count_phase: count | phase << 15
static_assert(sizeof(EmuMbar) == 8, "an mbarrier is one 64-bit word");
inline EmuMbar* emu_mbar(unsigned long long* bar) { return (EmuMbar*)bar; }
inline unsigned emu_mbar_phase(const EmuMbar* b) { return b->count_phase >> 15; }
inline void emu_mbar_settle(EmuMbar* b) {
    if (b->pending == 0 && b->tx == 0) {
        b->count_phase ^= 0x8000u;
        b->pending = b->count_phase & 0x7fffu;
    }
}
inline void mbar_init(unsigned long long* bar, unsigned count) {
    EmuMbar* b = emu_mbar(bar);
    b->pending = b->count_phase = (unsigned short)count;
    b->tx = 0;
}
inline void mbar_arrive(unsigned long long* bar) {
    EmuMbar* b = emu_mbar(bar);
    if (b->pending == 0) emu_fail("mbarrier: more arrivals than its count in one phase");
    --b->pending;
    emu_mbar_settle(b);
}
inline void mbar_expect(unsigned long long* bar, unsigned bytes) {
    emu_mbar(bar)->tx += (int)bytes;
    mbar_arrive(bar);
}
inline void bulk_copy(void* smem, const void* gmem, unsigned n, unsigned long long* bar) {
    // the hardware's rule (a misaligned copy is the GPU's "misaligned address" error); a shared destination
    // declared without __align__(16) fails here only when the host linker happened to place it off 16 bytes
    if ((((unsigned long long)smem | (unsigned long long)gmem | n) & 15u) != 0)
        emu_fail("bulk copy: shared and global addresses and the size must be multiples of 16 bytes");
    std::memcpy(smem, gmem, n);
    EmuMbar* b = emu_mbar(bar);
    b->tx -= (int)n;
    emu_mbar_settle(b);
}
inline void mbar_wait(unsigned long long* bar, unsigned parity) {
    for (long spins = 0; emu_mbar_phase(emu_mbar(bar)) == parity; ++spins) {
        if (spins > 20000000L) emu_fail("mbarrier wait never completes (deadlock)");
        emu_spin();
    }
}
inline void trigger_dependents() {}

// The m16n8k16 MMA from the documented fragment layout (tc_common.cuh), sums in double.
inline void mma16816_hw(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    unsigned int* slots = emu_warp_slots();
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 4; ++i) slots[lane * 8 + i] = a[i];
    slots[lane * 8 + 4] = b0;
    slots[lane * 8 + 5] = b1;
    emu_warp_sync();
    const int g = lane >> 2, c = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
        double s = 0.0;
        for (int k = 0; k < 16; ++k) {
            const int la = 4 * (row & 7) + ((k & 7) >> 1);
            const unsigned ar = slots[la * 8 + (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
            const int lb = 4 * col + ((k & 7) >> 1);
            const unsigned br = slots[lb * 8 + 4 + (k >= 8 ? 1 : 0)];
            const double av = (k & 1) ? emu_hi(ar) : emu_lo(ar);
            const double bv = (k & 1) ? emu_hi(br) : emu_lo(br);
            s += av * bv;
        }
        d[i] = (float)((double)d[i] + s);
    }
    emu_warp_sync();
}
