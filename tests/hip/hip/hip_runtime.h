// A stand-in for what hiprtc gives every kernel source without an include (and what the sources
// get from <hip/hip_runtime.h>): the kernel attributes, the built-in index variables, barriers,
// fences, warp shuffles, atomics, vector types, bit casts and the math functions the kernels call,
// written from the HIP API's documented semantics on clang's AMDGPU builtins. Only for
// tests/test_hip_compile.py, which compiles the kernels for AMD GPUs with a stock clang (no ROCm
// on these machines) so that the `__HIP_PLATFORM_AMD__` branches are at least built and
// type-checked; the real builds use ROCm's hiprtc.
#pragma once

// hiprtc compiles with __HIPCC_RTC__ and its implicit header defines the platform, as
// hip/hip_common.h does for clang's HIP mode; the sources branch on __HIP_PLATFORM_AMD__.
#define __HIPCC_RTC__ 1
#if defined(__HIP__) && !defined(__HIP_PLATFORM_AMD__)
#define __HIP_PLATFORM_AMD__ 1
#endif

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __HIP_LB_FIRST(n, ...) n
#define __launch_bounds__(...) __attribute__((amdgpu_flat_work_group_size(1, __HIP_LB_FIRST(__VA_ARGS__, 0))))

typedef unsigned long long __hip_u64;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;

struct __hip_dim3 { unsigned int x, y, z; };
__device__ __forceinline__ __hip_dim3 __hip_thread_idx() {
    return {__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(), __builtin_amdgcn_workitem_id_z()};
}
__device__ __forceinline__ __hip_dim3 __hip_block_idx() {
    return {__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(), __builtin_amdgcn_workgroup_id_z()};
}
__device__ __forceinline__ __hip_dim3 __hip_block_dim() {
    return {__builtin_amdgcn_workgroup_size_x(), __builtin_amdgcn_workgroup_size_y(), __builtin_amdgcn_workgroup_size_z()};
}
__device__ __forceinline__ __hip_dim3 __hip_grid_dim() {
    return {__builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(),
            __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(),
            __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z()};
}
#define threadIdx (__hip_thread_idx())
#define blockIdx (__hip_block_idx())
#define blockDim (__hip_block_dim())
#define gridDim (__hip_grid_dim())
#define warpSize (__builtin_amdgcn_wavefrontsize())

__device__ __forceinline__ void __threadfence_block() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup"); }
__device__ __forceinline__ void __threadfence() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
__device__ __forceinline__ void __syncthreads() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// Shuffles over `width` lanes (a power of two <= warpSize), as HIP defines them.
__device__ __forceinline__ int __hip_lane() { return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)); }
__device__ __forceinline__ int __hip_shfl_bits(int v, int src_lane) { return __builtin_amdgcn_ds_bpermute(src_lane << 2, v); }
__device__ __forceinline__ int __shfl(int v, int src, int width = warpSize) {
    const int lane = __hip_lane();
    return __hip_shfl_bits(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
__device__ __forceinline__ int __shfl_xor(int v, int m, int width = warpSize) {
    const int lane = __hip_lane();
    const int j = lane ^ m;
    return __hip_shfl_bits(v, j >= ((lane + width) & ~(width - 1)) ? lane : j);
}
__device__ __forceinline__ int __shfl_down(int v, unsigned int d, int width = warpSize) {
    const int lane = __hip_lane();
    const int j = lane + (int)d;
    return __hip_shfl_bits(v, (j & (width - 1)) < (lane & (width - 1)) || (j & ~(width - 1)) != (lane & ~(width - 1)) ? lane : j);
}
__device__ __forceinline__ unsigned int __shfl(unsigned int v, int src, int width = warpSize) { return (unsigned int)__shfl((int)v, src, width); }
__device__ __forceinline__ unsigned int __shfl_xor(unsigned int v, int m, int width = warpSize) { return (unsigned int)__shfl_xor((int)v, m, width); }
__device__ __forceinline__ float __shfl(float v, int src, int width = warpSize) {
    return __builtin_bit_cast(float, __shfl(__builtin_bit_cast(int, v), src, width));
}
__device__ __forceinline__ float __shfl_xor(float v, int m, int width = warpSize) {
    return __builtin_bit_cast(float, __shfl_xor(__builtin_bit_cast(int, v), m, width));
}
__device__ __forceinline__ float __shfl_down(float v, unsigned int d, int width = warpSize) {
    return __builtin_bit_cast(float, __shfl_down(__builtin_bit_cast(int, v), d, width));
}

__device__ __forceinline__ int atomicAdd(int* p, int v) { return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
__device__ __forceinline__ unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ __hip_u64 atomicAdd(__hip_u64* p, __hip_u64 v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ float atomicAdd(float* p, float v) { return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }

struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) longlong2 { long long x, y; };
__device__ __forceinline__ uint4 make_uint4(unsigned int a, unsigned int b, unsigned int c, unsigned int d) { return {a, b, c, d}; }
__device__ __forceinline__ uint2 make_uint2(unsigned int a, unsigned int b) { return {a, b}; }
__device__ __forceinline__ int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
__device__ __forceinline__ float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
__device__ __forceinline__ float2 make_float2(float a, float b) { return {a, b}; }
__device__ __forceinline__ longlong2 make_longlong2(long long a, long long b) { return {a, b}; }

__device__ __forceinline__ float __int_as_float(int v) { return __builtin_bit_cast(float, v); }
__device__ __forceinline__ float __uint_as_float(unsigned int v) { return __builtin_bit_cast(float, v); }
__device__ __forceinline__ int __float_as_int(float v) { return __builtin_bit_cast(int, v); }
__device__ __forceinline__ unsigned int __float_as_uint(float v) { return __builtin_bit_cast(unsigned int, v); }
__device__ __forceinline__ long long __float2ll_rn(float v) { return (long long)__builtin_rintf(v); }
__device__ __forceinline__ float __fmul_rn(float a, float b) {
#pragma clang fp contract(off)
    return a * b;
}
__device__ __forceinline__ float __fadd_rn(float a, float b) {
#pragma clang fp contract(off)
    return a + b;
}
__device__ __forceinline__ float __fsub_rn(float a, float b) {
#pragma clang fp contract(off)
    return a - b;
}
__device__ __forceinline__ unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const __hip_u64 v = (__hip_u64)x | ((__hip_u64)y << 32);
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
__device__ __forceinline__ long long clock64() { return (long long)__builtin_readcyclecounter(); }
__device__ __forceinline__ int __popc(unsigned int v) { return __builtin_popcount(v); }
__device__ __forceinline__ int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned int)v); }

__device__ __forceinline__ int min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
__device__ __forceinline__ long long min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float min(float a, float b) { return __builtin_fminf(a, b); }
__device__ __forceinline__ float max(float a, float b) { return __builtin_fmaxf(a, b); }

// What the backend cannot lower by itself is a call into ROCm's device library (ocml), as in a
// real HIP build; -S output keeps the calls unresolved.
extern "C" __device__ float __ocml_log_f32(float x);
extern "C" __device__ float __ocml_log1p_f32(float x);
extern "C" __device__ float __ocml_tanh_f32(float x);
extern "C" __device__ float __ocml_sin_f32(float x);
extern "C" __device__ float __ocml_cos_f32(float x);
extern "C" __device__ float __ocml_pow_f32(float a, float b);
extern "C" __device__ double __ocml_pow_f64(double a, double b);
extern "C" __device__ double __ocml_fmod_f64(double a, double b);
extern "C" __device__ float __ocml_fmod_f32(float a, float b);
extern "C" __device__ double __ocml_exp_f64(double x);
extern "C" __device__ double __ocml_log_f64(double x);
extern "C" __device__ double __ocml_sin_f64(double x);
extern "C" __device__ double __ocml_cos_f64(double x);
__device__ __forceinline__ float expf(float x) { return __builtin_expf(x); }
__device__ __forceinline__ float __expf(float x) { return __builtin_expf(x); }
__device__ __forceinline__ float logf(float x) { return __ocml_log_f32(x); }
__device__ __forceinline__ float sqrtf(float x) { return __builtin_sqrtf(x); }
__device__ __forceinline__ double sqrt(double x) { return __builtin_sqrt(x); }
__device__ __forceinline__ float rsqrtf(float x) { return 1.0f / __builtin_sqrtf(x); }
__device__ __forceinline__ float fabsf(float x) { return __builtin_fabsf(x); }
__device__ __forceinline__ float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
__device__ __forceinline__ float fminf(float a, float b) { return __builtin_fminf(a, b); }
__device__ __forceinline__ float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
__device__ __forceinline__ float log1pf(float x) { return __ocml_log1p_f32(x); }
__device__ __forceinline__ float tanhf(float x) { return __ocml_tanh_f32(x); }
__device__ __forceinline__ float sinf(float x) { return __ocml_sin_f32(x); }
__device__ __forceinline__ float cosf(float x) { return __ocml_cos_f32(x); }
__device__ __forceinline__ float powf(float a, float b) { return __ocml_pow_f32(a, b); }
__device__ __forceinline__ bool isfinite(float x) { return __builtin_isfinite(x); }
__device__ __forceinline__ bool isfinite(double x) { return __builtin_isfinite(x); }
__device__ __forceinline__ bool isnan(float x) { return __builtin_isnan(x); }
__device__ __forceinline__ bool isinf(float x) { return __builtin_isinf(x); }
__device__ __forceinline__ double pow(double a, double b) { return __ocml_pow_f64(a, b); }
__device__ __forceinline__ float pow(float a, float b) { return __ocml_pow_f32(a, b); }
__device__ __forceinline__ double fmod(double a, double b) { return __ocml_fmod_f64(a, b); }
__device__ __forceinline__ float fmodf(float a, float b) { return __ocml_fmod_f32(a, b); }
__device__ __forceinline__ double exp(double x) { return __ocml_exp_f64(x); }
__device__ __forceinline__ double log(double x) { return __ocml_log_f64(x); }
__device__ __forceinline__ double sin(double x) { return __ocml_sin_f64(x); }
__device__ __forceinline__ double cos(double x) { return __ocml_cos_f64(x); }
__device__ __forceinline__ double fabs(double x) { return __builtin_fabs(x); }
__device__ __forceinline__ float __frcp_rn(float x) { return 1.0f / x; }
