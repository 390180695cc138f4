// Cooperative lanes for the CPU emulation of AMD workgroups (see simt_emu.hpp).
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef FP_AMD_EMULATION_WAVE
#define FP_AMD_EMULATION_WAVE 64  // unused here; the header needs a value
#endif
#include "gpu/amd/amd_layouts.hpp"
#include "simt_emu.hpp"

namespace simt {
namespace {

// Where a lane stopped: runnable, at a wave barrier, at a workgroup barrier, or finished.
enum class Wait { kNone, kWave, kBlock, kDone };

struct Lane {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  Wait wait = Wait::kNone;
};

ucontext_t g_scheduler;
std::vector<Lane>* g_lanes = nullptr;
const std::function<void()>* g_body = nullptr;
unsigned g_current = 0;
Idx3 g_block, g_grid;
unsigned g_threads = 0;
std::vector<uint32_t> g_exchange;
std::vector<unsigned char> g_smem;
constexpr size_t kStackBytes = 256 * 1024;

void lane_entry() {
  (*g_body)();
  (*g_lanes)[g_current].wait = Wait::kDone;  // returns to the scheduler through uc_link
}

void yield(Wait why) {
  if (g_lanes == nullptr) return;
  (*g_lanes)[g_current].wait = why;
  swapcontext(&(*g_lanes)[g_current].ctx, &g_scheduler);
}

}  // namespace

Idx3 thread_idx() { return {g_current, 0, 0}; }
Idx3 block_idx() { return g_block; }
Idx3 grid_dim() { return g_grid; }
Idx3 block_dim() { return {g_threads, 1, 1}; }
bool g_mutate_layout = false;

void unsatisfiable_wait() {
  std::fprintf(stderr, "simt: workgroup (%u, %u, %u) waits on a workgroup that has not run (launch order)\n",
               g_block.x, g_block.y, g_block.z);
  std::abort();
}

uint32_t* exchange_words(size_t words) {
  if (g_exchange.size() < words) throw std::logic_error("exchange buffer resized inside a workgroup");
  return g_exchange.data();
}

void* dynamic_smem() { return g_smem.data(); }

void barrier() { yield(Wait::kBlock); }
void wave_barrier() { yield(Wait::kWave); }

void run_block(unsigned threads, unsigned wave_size, Idx3 block, Idx3 grid, size_t smem_bytes,
               const std::function<void()>& body) {
  if (wave_size == 0 || threads % wave_size != 0) throw std::logic_error("threads must be whole waves");
  std::vector<Lane> lanes(threads);
  g_exchange.assign(size_t(1) << 20, 0u);
  g_smem.assign(smem_bytes, 0xff);
  g_lanes = &lanes;
  g_body = &body;
  g_block = block;
  g_grid = grid;
  g_threads = threads;
  for (unsigned t = 0; t < threads; ++t) {
    Lane& l = lanes[t];
    l.stack.reset(new char[kStackBytes]);
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = l.stack.get();
    l.ctx.uc_stack.ss_size = kStackBytes;
    l.ctx.uc_link = &g_scheduler;
    makecontext(&l.ctx, lane_entry, 0);
  }
  auto run = [&](unsigned t) {
    lanes[t].wait = Wait::kNone;
    g_current = t;
    swapcontext(&g_scheduler, &lanes[t].ctx);
  };
  // Rounds: every runnable lane runs to its next barrier (or its end). Then a wave whose live
  // lanes all wait at a wave barrier is released; when no wave can move, the workgroup is released
  // if every live lane waits at a workgroup barrier; anything else is a barrier mismatch.
  for (unsigned t = 0; t < threads; ++t) run(t);
  for (;;) {
    bool released = false;
    for (unsigned w0 = 0; w0 < threads; w0 += wave_size) {
      bool live = false, all_wave = true;
      for (unsigned t = w0; t < w0 + wave_size; ++t) {
        if (lanes[t].wait == Wait::kDone) continue;
        live = true;
        all_wave &= lanes[t].wait == Wait::kWave;
      }
      if (!live || !all_wave) continue;
      for (unsigned t = w0; t < w0 + wave_size; ++t)
        if (lanes[t].wait == Wait::kWave) run(t);
      released = true;
    }
    if (released) continue;
    bool live = false, all_block = true;
    for (const Lane& l : lanes) {
      if (l.wait == Wait::kDone) continue;
      live = true;
      all_block &= l.wait == Wait::kBlock;
    }
    if (!live) break;
    if (!all_block) {
      g_lanes = nullptr;
      throw std::logic_error("divergent barriers: lanes of one wave wait at different kinds of barrier");
    }
    for (unsigned t = 0; t < threads; ++t)
      if (lanes[t].wait == Wait::kBlock) run(t);
  }
  g_lanes = nullptr;
  g_body = nullptr;
}

}  // namespace simt
