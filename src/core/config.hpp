// The process's user settings from the environment, read once (the first call) and cached: no
// call reads the environment. Every FLASHPORT_* variable the library honours is listed here and in
// the README; nothing else in src/ calls getenv.
#pragma once
#include <string>

namespace flashport {

struct RuntimeConfig {
  bool log = false;            // FLASHPORT_LOG=1: print the chosen kernel and the skipped ones
  std::string backend;         // FLASHPORT_BACKEND=reference|cpu|cuda|hip|auto ("" = auto)
  int num_threads = 0;         // FLASHPORT_NUM_THREADS: CPU threads (0 = all cores)
  std::string cpu_isa;         // FLASHPORT_CPU_ISA=avx512bf16|avx512|avx2|portable: cap the CPU kernels
  bool hopper_fwd = true;      // FLASHPORT_HOPPER_FWD=0: kill switch for the sm_90a forward
  bool hopper_bwd = true;      // FLASHPORT_HOPPER_BWD=0: kill switch for the sm_90a backward
};

// The cached settings (read from the environment on first use).
const RuntimeConfig& runtime_config();

// Re-reads the environment (for tests that change a variable inside one process).
void reload_runtime_config();

}  // namespace flashport
