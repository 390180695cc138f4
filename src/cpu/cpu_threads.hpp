// A small persistent thread pool for the CPU backend, with one process-wide cap: at most
// (hardware threads - 1) helper threads exist, and a call only borrows helpers that are idle, so
// several callers at once never run more than the machine's threads between them (plus the
// callers themselves).
#pragma once
#include <cstdint>
#include <functional>

namespace flashport::cpu {

// Usable hardware threads (affinity mask aware), at least 1.
int hardware_threads();

// Thread count of a call: requested > 0, else FLASHPORT_NUM_THREADS, else hardware_threads();
// capped at hardware_threads().
int resolve_threads(int32_t requested);

// Runs fn(task) for every task in [0, num_tasks) on up to `threads` threads (the caller's
// included). Tasks are handed out dynamically; fn must not depend on which thread runs it.
void parallel_for(int64_t num_tasks, int threads, const std::function<void(int64_t)>& fn);

}  // namespace flashport::cpu
