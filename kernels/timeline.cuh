// The step's timeline, for benchmarks only (tests/bench/timeline_gpu_step.py builds every module
// with -DSTEP_TIMELINE; every other build compiles TL_SCOPE and tl_mark to nothing).
//
// Why: inside a CUDA graph with programmatic dependent launch, a kernel starts while the one before
// it drains, so its time alone (launches back to back between events) is not what it adds to the
// step. Each launch records, into its module's table at the slot of its grid id (%gridid, unique
// and increasing per launch), from thread 0 of every block: the earliest block start, the first
// and the last block's return from grid_dependency_wait, the latest block end (%globaltimer, ns;
// it ticks coarsely, so only means over many launches are sharp) and the number of blocks. A block
// whose thread 0 returns early records its end there.
#ifndef DFLASH_TIMELINE_CUH
#define DFLASH_TIMELINE_CUH
#if defined(STEP_TIMELINE) && !defined(DFLASH_EMU) && !defined(__HIP_PLATFORM_AMD__)
#define TL_SLOTS 4096
#define TL_FIELDS 6          // grid id, start (min), released (min), released (max), end (max), blocks
extern "C" {
__device__ unsigned long long tl_tab[TL_SLOTS * TL_FIELDS];    // the host reads it by name (RawModule.get_global)
}
__device__ __forceinline__ void tl_mark(int what) {
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
    unsigned long long g, t;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned long long* e = tl_tab + (g % TL_SLOTS) * TL_FIELDS;
    e[0] = g;
    if (what == 0) {
        atomicMin(e + 1, t);
        atomicAdd(e + 5, 1ull);
    } else if (what == 1) {
        atomicMin(e + 2, t);
        atomicMax(e + 3, t);
    } else {
        atomicMax(e + 4, t);
    }
}
struct TlScope {
    __device__ __forceinline__ TlScope() { tl_mark(0); }
    __device__ __forceinline__ ~TlScope() { tl_mark(2); }
};
#define TL_SCOPE TlScope tl_scope_
#else
#define TL_SCOPE
#define tl_mark(what) ((void)0)
#endif
#endif
