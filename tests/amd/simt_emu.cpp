// Cooperative lanes for the CPU emulation of AMD workgroups (see simt_emu.hpp).
#include <ucontext.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <vector>

#ifndef FP_AMD_EMULATION_WAVE
#define FP_AMD_EMULATION_WAVE 64  // unused here; the header needs a value
#endif
#include "gpu/amd_layouts.hpp"
#include "simt_emu.hpp"

namespace simt {
namespace {

struct Lane {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  bool done = false;
};

ucontext_t g_scheduler;
std::vector<Lane>* g_lanes = nullptr;
const std::function<void()>* g_body = nullptr;
unsigned g_current = 0;
Idx3 g_block;
std::vector<uint32_t> g_exchange;
constexpr size_t kStackBytes = 256 * 1024;

void lane_entry() {
  (*g_body)();
  (*g_lanes)[g_current].done = true;  // returns to the scheduler through uc_link
}

}  // namespace

Idx3 thread_idx() { return {g_current, 0, 0}; }
Idx3 block_idx() { return g_block; }

uint32_t* exchange_words(size_t words) {
  if (g_exchange.size() < words) throw std::logic_error("exchange buffer resized inside a workgroup");
  return g_exchange.data();
}

void barrier() {
  if (g_lanes == nullptr) return;
  swapcontext(&(*g_lanes)[g_current].ctx, &g_scheduler);
}

void run_block(unsigned threads, Idx3 block, const std::function<void()>& body) {
  std::vector<Lane> lanes(threads);
  g_exchange.assign(size_t(1) << 20, 0u);
  g_lanes = &lanes;
  g_body = &body;
  g_block = block;
  for (unsigned t = 0; t < threads; ++t) {
    Lane& l = lanes[t];
    l.stack.reset(new char[kStackBytes]);
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = l.stack.get();
    l.ctx.uc_stack.ss_size = kStackBytes;
    l.ctx.uc_link = &g_scheduler;
    makecontext(&l.ctx, lane_entry, 0);
  }
  // Rounds: every live lane runs to its next barrier (or its end); then the next round.
  for (bool live = true; live;) {
    live = false;
    for (unsigned t = 0; t < threads; ++t) {
      if (lanes[t].done) continue;
      g_current = t;
      swapcontext(&g_scheduler, &lanes[t].ctx);
      live |= !lanes[t].done;
    }
  }
  g_lanes = nullptr;
  g_body = nullptr;
}

}  // namespace simt
