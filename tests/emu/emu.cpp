// The emulator's launcher (see emu_runtime.h). Built by tests/emu/__init__.py together with the
// kernel sources into one shared library; every `extern "C" __global__` kernel gets an exported
// entry `emu_ptr_<name>()` returning a host function with the kernel's own signature that runs the
// whole grid configured by the last `emu_config` call.
//
// Each thread of a block is a fiber (makecontext/swapcontext) run by one scheduler on the calling
// OS thread: a fiber runs until it reaches a barrier (block or warp) or returns; when every live
// fiber of the scope waits, the barrier opens. A barrier that can never open (a kernel bug: some
// threads at __syncthreads, others at a warp operation or exited early) aborts with a message.
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "emu_runtime.h"

EmuDim threadIdx{0, 0, 0};
EmuDim blockIdx{0, 0, 0};
EmuDim blockDim{1, 1, 1};
EmuDim gridDim{1, 1, 1};

#if defined(__x86_64__)
// A minimal context switch (callee-saved registers and the stack pointer), because swapcontext also
// saves the signal mask with a system call and made the emulator 5x slower.
extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
)");
#define EMU_FAST_SWITCH 1
#endif

namespace {
constexpr size_t kStack = 256 * 1024;

enum class Wait { none, spin, block, named, warp, done };

struct Fiber {
    ucontext_t ctx;
    void* sp = nullptr;            // EMU_FAST_SWITCH: saved stack pointer
    Wait wait = Wait::none;
    int cluster_phase = 0;         // the cluster barrier phase this thread's last arrival completes
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<unsigned int> slots;          // [n_warps][32][8]
    std::vector<unsigned char> dyn;
    EmuDim idx{0, 0, 0};                      // blockIdx
    ucontext_t sched;
    void* sched_sp = nullptr;
    unsigned current = 0;
    const std::function<void()>* body = nullptr;
};

// A thread-block cluster: its blocks run side by side (their fibers interleaved by one scheduler),
// so that a block can wait on barrier.cluster for the others and read their shared memory.
struct Cluster {
    std::vector<Block*> blocks;
    unsigned n_threads = 0;                   // all blocks together
    unsigned arrived = 0;                     // arrivals in the current barrier phase
    int phase = 0;
};

Block* g_block = nullptr;
Cluster* g_cluster = nullptr;
EmuDim g_grid{1, 1, 1}, g_blockdim{1, 1, 1}, g_cluster_dim{1, 1, 1};
size_t g_smem = 0;
std::mutex g_launch;

void yield_with(Wait w) {
    Block* b = g_block;
    Fiber& f = b->fibers[b->current];
    f.wait = w;
#ifdef EMU_FAST_SWITCH
    emu_switch(&f.sp, b->sched_sp);
#else
    swapcontext(&f.ctx, &b->sched);
#endif
}

void fiber_entry() {
    (*g_block->body)();
    yield_with(Wait::done);
    std::abort();                  // a finished fiber is never resumed
}
}  // namespace

void emu_syncthreads() { yield_with(Wait::block); }
void emu_warp_sync() { yield_with(Wait::warp); }
// One named barrier in use at a time per block (the kernels use id 1 only).
static unsigned g_named_threads = 0;
void emu_named_sync(unsigned, unsigned n_threads) {
    g_named_threads = n_threads;
    yield_with(Wait::named);
}
void emu_spin() { yield_with(Wait::spin); }
void emu_fail(const char* what) {
    std::fprintf(stderr, "emu: block (%u,%u,%u) thread %u: %s\n", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, what);
    std::abort();
}
unsigned int* emu_warp_slots() { return g_block->slots.data() + (size_t)(threadIdx.x >> 5) * 32 * 8; }
void* emu_dyn_smem() { return g_block->dyn.data(); }

// barrier.cluster: an arrival counts toward the current phase; a wait returns once the phase the
// thread's last arrival belongs to has completed (every thread of every block of the cluster
// arrived). Only dynamic shared memory is per block here (a `__shared__` object is one static), so
// kernels that run as clusters keep their block-local data there.
unsigned emu_cluster_rank() {
    const EmuDim& d = g_cluster_dim;
    return (blockIdx.x % d.x) + d.x * ((blockIdx.y % d.y) + d.y * (blockIdx.z % d.z));
}
unsigned emu_cluster_size() { return g_cluster_dim.x * g_cluster_dim.y * g_cluster_dim.z; }
void emu_cluster_arrive() {
    Cluster* c = g_cluster;
    Fiber& f = g_block->fibers[g_block->current];
    f.cluster_phase = c->phase + 1;
    if (++c->arrived == c->n_threads) {
        c->arrived = 0;
        ++c->phase;
    }
}
void emu_cluster_wait() {
    const int target = g_block->fibers[g_block->current].cluster_phase;
    for (long spins = 0; g_cluster->phase < target; ++spins) {
        if (spins > 20000000L) emu_fail("barrier.cluster wait never completes (deadlock)");
        emu_spin();
    }
}
void* emu_cluster_map(const void* local, unsigned rank) {
    const unsigned char* base = g_block->dyn.data();
    const size_t off = (const unsigned char*)local - base;
    if ((const unsigned char*)local < base || off >= g_block->dyn.size())
        emu_fail("cluster shared-memory address outside the block's dynamic shared memory");
    if (rank >= g_cluster->blocks.size()) emu_fail("cluster rank out of range");
    return g_cluster->blocks[rank]->dyn.data() + off;
}

// Blocks run in grid order, or last to first (emu_block_order(1)): kernels whose blocks exchange
// partial results through global memory then see the other arrival order too.
static bool g_reverse_blocks = false;
extern "C" void emu_block_order(int reverse) { g_reverse_blocks = reverse != 0; }
// Blocks side by side (a cluster, or a co-resident grid) at different speeds (emu_skew(1)): block r of the
// group runs in one scheduling round of every 1 + r % 3 (blocks 0, 3, 6, ... every round, 2, 5, ... every
// third), so some run ahead of the others and a missing wait for another block's writes reads what is not
// there yet.
static bool g_skew = false;
extern "C" void emu_skew(int on) { g_skew = on != 0; }

extern "C" void emu_config(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned long long smem) {
    g_grid = EmuDim{gx, gy, gz};
    g_blockdim = EmuDim{bx, by, bz};
    g_smem = (size_t)smem;
}
// The next launch's cluster shape (1, 1, 1: every block alone).
extern "C" void emu_cluster_config(unsigned cx, unsigned cy, unsigned cz) { g_cluster_dim = EmuDim{cx, cy, cz}; }

// Opens the barriers of one block whose scope is complete; false when none could open.
static bool release_block(Block& blk, unsigned n_threads) {
    const unsigned n_warps = n_threads / 32;
    unsigned n_done = 0, n_block = 0, n_named = 0;
    for (auto& f : blk.fibers) {
        n_done += f.wait == Wait::done;
        n_block += f.wait == Wait::block;
        n_named += f.wait == Wait::named;
    }
    bool released = false;
    for (unsigned w = 0; w < n_warps; ++w) {
        unsigned n_warp = 0, n_live = 0;
        for (unsigned l = 0; l < 32; ++l) {
            const Wait s = blk.fibers[w * 32 + l].wait;
            n_warp += s == Wait::warp;
            n_live += s != Wait::done;
        }
        if (n_warp > 0 && n_warp == n_live) {
            for (unsigned l = 0; l < 32; ++l)
                if (blk.fibers[w * 32 + l].wait == Wait::warp) blk.fibers[w * 32 + l].wait = Wait::none;
            released = true;
        }
    }
    if (!released && n_block > 0 && n_block + n_done == n_threads) {
        for (auto& f : blk.fibers)
            if (f.wait == Wait::block) f.wait = Wait::none;
        released = true;
    }
    if (!released && n_named > 0 && n_named == g_named_threads) {
        for (auto& f : blk.fibers)
            if (f.wait == Wait::named) f.wait = Wait::none;
        released = true;
    }
    return released;
}

// Runs each runnable thread of a block until it yields; whether any ran.
static bool run_fibers(Block& blk, unsigned n_threads) {
    bool ran = false;
    g_block = &blk;
    blockIdx = blk.idx;
    for (unsigned t = 0; t < n_threads; ++t) {
        Fiber& f = blk.fibers[t];
        if (f.wait != Wait::none) continue;
        blk.current = t;
        threadIdx = EmuDim{t, 0, 0};
#ifdef EMU_FAST_SWITCH
        emu_switch(&blk.sched_sp, f.sp);
#else
        swapcontext(&blk.sched, &f.ctx);
#endif
        ran = true;
    }
    return ran;
}

// Runs the blocks of one cluster (one block, without clusters) to completion.
static void run_cluster(Cluster& cl, unsigned n_threads) {
    g_cluster = &cl;
    for (unsigned long long round = 0;; ++round) {
        bool ran = false;
        for (size_t r = 0; r < cl.blocks.size(); ++r) {
            Block* blk = cl.blocks[r];
            if (g_skew) {
                // A block's turn: its runnable threads run, then its barriers and its spinning waiters
                // are released (they look again at its next turn), whatever the other blocks do.
                if (round % (1 + r % 3) != 0) continue;
                bool any = false;
                for (const auto& f : blk->fibers) any = any || f.wait != Wait::done;
                if (!any) continue;
                ran = true;
                run_fibers(*blk, n_threads);
                while (release_block(*blk, n_threads)) {
                }
                for (auto& f : blk->fibers)
                    if (f.wait == Wait::spin) f.wait = Wait::none;
                continue;
            }
            ran = run_fibers(*blk, n_threads) || ran;
        }
        if (ran) continue;
        if (g_skew) {                            // (deadlocks end at a waiter's spin bound)
            bool all_done = true;
            for (Block* blk : cl.blocks)
                for (auto& f : blk->fibers) all_done = all_done && f.wait == Wait::done;
            if (all_done) break;
            continue;
        }
        // nobody runnable: open the barriers whose scope is complete
        bool all_done = true, released = false;
        unsigned n_spin = 0;
        for (Block* blk : cl.blocks) {
            for (auto& f : blk->fibers) {
                all_done = all_done && f.wait == Wait::done;
                n_spin += f.wait == Wait::spin;
            }
        }
        if (all_done) break;
        for (Block* blk : cl.blocks) {
            blockIdx = blk->idx;
            released = release_block(*blk, n_threads) || released;
        }
        if (!released && n_spin > 0) {           // mbarrier / cluster waiters look again (bounded)
            for (Block* blk : cl.blocks)
                for (auto& f : blk->fibers)
                    if (f.wait == Wait::spin) f.wait = Wait::none;
            released = true;
        }
        if (!released) {
            const Block& b0 = *cl.blocks[0];
            unsigned n_block = 0, n_done = 0;
            for (const auto& f : b0.fibers) {
                n_block += f.wait == Wait::block;
                n_done += f.wait == Wait::done;
            }
            std::fprintf(stderr, "emu: deadlock in block (%u,%u,%u): %u at __syncthreads, %u done, others at warp ops\n",
                         b0.idx.x, b0.idx.y, b0.idx.z, n_block, n_done);
            std::abort();
        }
    }
    g_cluster = nullptr;
}

static void start_fibers(Block& blk, unsigned n_threads, char* const* stacks) {
    for (unsigned t = 0; t < n_threads; ++t) {
        Fiber& f = blk.fibers[t];
        f.wait = Wait::none;
        f.cluster_phase = 0;
#ifdef EMU_FAST_SWITCH
        // initial frame for emu_switch's pops: six registers, then the return address
        uintptr_t top = ((uintptr_t)stacks[t] + kStack) & ~(uintptr_t)15;
        void** sp = (void**)(top - 16);          // return address at a 16-aligned slot
        sp[0] = (void*)&fiber_entry;
        sp[1] = nullptr;
        sp -= 6;
        for (int i = 0; i < 6; ++i) sp[i] = nullptr;
        f.sp = sp;
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks[t];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_entry, 0);
#endif
    }
}

static void emu_run(const std::function<void()>& body) {
    std::lock_guard<std::mutex> lock(g_launch);
    const unsigned n_threads = g_blockdim.x * g_blockdim.y * g_blockdim.z;
    if (g_blockdim.y != 1 || g_blockdim.z != 1 || n_threads % 32 != 0 || n_threads > 1024)
        throw std::runtime_error("emu: blocks must be 1-D with a multiple of 32 threads (<= 1024)");
    const EmuDim cd = g_cluster_dim;
    if (g_grid.x % cd.x || g_grid.y % cd.y || g_grid.z % cd.z)
        throw std::runtime_error("emu: the grid is not a whole number of clusters");
    const unsigned n_cl = cd.x * cd.y * cd.z;
    blockDim = g_blockdim;
    gridDim = g_grid;
    static std::vector<std::unique_ptr<char[]>> stacks;    // reused between blocks and launches
    while (stacks.size() < (size_t)n_threads * n_cl) stacks.emplace_back(new char[kStack]);
    std::vector<Block> blocks(n_cl);
    for (Block& blk : blocks) {
        blk.body = &body;
        blk.slots.assign((size_t)(n_threads / 32) * 32 * 8, 0u);
        blk.fibers.resize(n_threads);
    }
    std::vector<char*> stack_ptrs(stacks.size());
    for (size_t i = 0; i < stacks.size(); ++i) stack_ptrs[i] = stacks[i].get();
    const unsigned ncx = g_grid.x / cd.x;
    for (unsigned bz = 0; bz < g_grid.z; bz += cd.z)
        for (unsigned by = 0; by < g_grid.y; by += cd.y)
            for (unsigned ix = 0; ix < ncx; ++ix) {
                const unsigned cx = (g_reverse_blocks ? ncx - 1 - ix : ix) * cd.x;
                Cluster cl;
                cl.n_threads = n_threads * n_cl;
                for (unsigned r = 0; r < n_cl; ++r) {
                    Block& blk = blocks[r];
                    blk.idx = EmuDim{cx + r % cd.x, by + (r / cd.x) % cd.y, bz + r / (cd.x * cd.y)};
                    blk.dyn.assign(g_smem + 16, 0xcd);        // poisoned, as uninitialised smem is
                    start_fibers(blk, n_threads, stack_ptrs.data() + (size_t)r * n_threads);
                    cl.blocks.push_back(&blk);
                }
                run_cluster(cl, n_threads);
            }
    g_block = nullptr;
}

template <typename F> struct EmuExport;
template <typename... A> struct EmuExport<void(A...)> {
    template <void (*K)(A...)> static void run(A... args) {
        emu_run([=]() { K(args...); });
    }
};

#define EMU_EXPORT(name) \
    extern "C" void* emu_ptr_##name() { return (void*)&EmuExport<decltype(name)>::template run<&name>; }
