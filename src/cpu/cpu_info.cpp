#include "cpu_info.hpp"

#include <unistd.h>

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace flashport::cpu {
namespace {

int64_t sysconf_bytes(int name, int64_t fallback) {
  const long v = sysconf(name);
  return v > 0 ? static_cast<int64_t>(v) : fallback;
}

CpuInfo read_cpu_info() {
  CpuInfo c;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, cx = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &cx, &d)) {
    char v[13];
    std::memcpy(v, &b, 4);
    std::memcpy(v + 4, &d, 4);
    std::memcpy(v + 8, &cx, 4);
    v[12] = 0;
    c.vendor = std::strcmp(v, "GenuineIntel") == 0   ? CpuVendor::kIntel
               : std::strcmp(v, "AuthenticAMD") == 0 ? CpuVendor::kAmd
                                                      : CpuVendor::kOther;
  }
  if (__get_cpuid(1, &a, &b, &cx, &d)) {
    const int base_family = (a >> 8) & 0xF, base_model = (a >> 4) & 0xF;
    c.family = base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family;
    c.model = base_family >= 0x6 ? base_model | (((a >> 16) & 0xF) << 4) : base_model;
  }
#endif
  // glibc answers these from cpuid leaf 4 / 0x8000001D; the fallbacks are common sizes.
  c.l1d_bytes = sysconf_bytes(_SC_LEVEL1_DCACHE_SIZE, 32 << 10);
  c.l2_bytes = sysconf_bytes(_SC_LEVEL2_CACHE_SIZE, 1 << 20);
  c.l3_bytes = sysconf_bytes(_SC_LEVEL3_CACHE_SIZE, 0);
  return c;
}

}  // namespace

const CpuInfo& cpu_info() {
  static const CpuInfo info = read_cpu_info();
  return info;
}

bool prefer_bf16_dot(const CpuInfo& c) {
  // Family 19h parts with AVX512-BF16 are Zen 4; 1Ah is Zen 5.
  return c.vendor == CpuVendor::kAmd && c.family >= 0x19;
}

int decode_block_keys(const CpuInfo& c, const Problem& p) {
  const int64_t es = p.dtype == FP_F32 ? 4 : 2;
  const int64_t bytes_per_key = p.hkv * (p.d + p.dv) * es;
  int keys = 64;
  while (keys > 16 && keys * bytes_per_key > c.l2_bytes / 2) keys /= 2;
  return keys;
}

}  // namespace flashport::cpu
