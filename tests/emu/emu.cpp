// The emulator's launcher (see emu_runtime.h). Built by tests/emu/__init__.py together with the
// kernel sources into one shared library; every `extern "C" __global__` kernel gets an exported
// entry `emu_ptr_<name>()` returning a host function with the kernel's own signature that runs the
// whole grid configured by the last `emu_config` call.
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "emu_runtime.h"

thread_local EmuDim threadIdx;
thread_local EmuDim blockIdx;
EmuDim blockDim{1, 1, 1};
EmuDim gridDim{1, 1, 1};

namespace {
struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
    std::vector<unsigned int> slots;          // [n_warps][32][8]
    std::vector<unsigned char> dyn;
};
Block* g_block = nullptr;
EmuDim g_grid{1, 1, 1}, g_blockdim{1, 1, 1};
size_t g_smem = 0;
std::mutex g_launch;
}  // namespace

void emu_syncthreads() { g_block->bar->arrive_and_wait(); }
void emu_warp_sync() { g_block->warp_bars[threadIdx.x >> 5]->arrive_and_wait(); }
unsigned int* emu_warp_slots() { return g_block->slots.data() + (size_t)(threadIdx.x >> 5) * 32 * 8; }
void* emu_dyn_smem() { return g_block->dyn.data(); }

extern "C" void emu_config(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned long long smem) {
    g_grid = EmuDim{gx, gy, gz};
    g_blockdim = EmuDim{bx, by, bz};
    g_smem = (size_t)smem;
}

static void emu_run(const std::function<void()>& body) {
    std::lock_guard<std::mutex> lock(g_launch);
    const unsigned n_threads = g_blockdim.x * g_blockdim.y * g_blockdim.z;
    if (g_blockdim.y != 1 || g_blockdim.z != 1 || n_threads % 32 != 0 || n_threads > 1024)
        throw std::runtime_error("emu: blocks must be 1-D with a multiple of 32 threads (<= 1024)");
    blockDim = g_blockdim;
    gridDim = g_grid;
    const unsigned n_warps = n_threads / 32;
    for (unsigned bz = 0; bz < g_grid.z; ++bz)
        for (unsigned by = 0; by < g_grid.y; ++by)
            for (unsigned bx = 0; bx < g_grid.x; ++bx) {
                Block blk;
                blk.bar = std::make_unique<std::barrier<>>(n_threads);
                for (unsigned w = 0; w < n_warps; ++w) blk.warp_bars.push_back(std::make_unique<std::barrier<>>(32));
                blk.slots.assign((size_t)n_warps * 32 * 8, 0u);
                blk.dyn.assign(g_smem + 16, 0xcd);        // poisoned, as uninitialised smem is
                g_block = &blk;
                std::vector<std::thread> threads;
                threads.reserve(n_threads);
                for (unsigned t = 0; t < n_threads; ++t) {
                    threads.emplace_back([&, t, bx, by, bz]() {
                        threadIdx = EmuDim{t, 0, 0};
                        blockIdx = EmuDim{bx, by, bz};
                        body();
                        // a thread that returned no longer takes part in barriers
                        blk.warp_bars[t >> 5]->arrive_and_drop();
                        blk.bar->arrive_and_drop();
                    });
                }
                for (auto& th : threads) th.join();
                g_block = nullptr;
            }
}

template <typename F> struct EmuExport;
template <typename... A> struct EmuExport<void(A...)> {
    template <void (*K)(A...)> static void run(A... args) {
        emu_run([=]() { K(args...); });
    }
};

#define EMU_EXPORT(name) \
    extern "C" void* emu_ptr_##name() { return (void*)&EmuExport<decltype(name)>::template run<&name>; }
