// What this CPU reports about itself (cpuid vendor/family/model, cache sizes from the OS), read
// once, and the per-microarchitecture choices made from it. Pure functions of the CpuInfo, so the
// choices are testable for CPUs other than the one running the tests.
#pragma once
#include <cstdint>

#include "core/problem.hpp"

namespace flashport::cpu {

enum class CpuVendor { kIntel, kAmd, kOther };

struct CpuInfo {
  CpuVendor vendor = CpuVendor::kOther;
  int family = 0, model = 0;  // cpuid display family / model
  int64_t l1d_bytes = 0;      // per core
  int64_t l2_bytes = 0;       // per core
  int64_t l3_bytes = 0;       // shared
};

// This machine (read on first use).
const CpuInfo& cpu_info();

// Whether bf16 inputs should use AVX512-BF16 pair dot products (vdpbf16ps) rather than being
// widened to fp32 for FMAs, on a CPU that has both. AMD Zen 4/5 issue vdpbf16ps at the FMA rate
// with two products per lane: measured 122-150% of the fp32 FMA peak on an EPYC (Zen 4). On the
// Intel Xeons this project runs on (AVX512-BF16 without AMX) the same kernels ran at ~60% of the
// fp32 path (issue 21), so Intel, and any CPU not known to be fast at it, widens to fp32.
bool prefer_bf16_dot(const CpuInfo& c);

// Keys per decode step: the largest of 64, 32, 16 whose prefetched next block (every kv head's K
// and V rows, prefetched while the current block is scored) takes at most half of the L2.
int decode_block_keys(const CpuInfo& c, const Problem& p);

}  // namespace flashport::cpu
