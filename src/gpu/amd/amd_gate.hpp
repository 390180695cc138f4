// The host-side gate of the HIP backend: whether a device (by its gcnArchName, wave size and LDS
// per workgroup) can run the AMD kernels this library was built with, or the reason it can't.
// Host code only; tested on the CPU (tests/amd/gate_test.cpp).
#pragma once
#include <string>

#include "gpu/amd/amd_layouts.hpp"

namespace flashport::gpu::amd {

// "" when the device can run a kernel needing `kernel_lds` bytes of LDS; else the reason.
// `built` is the comma-separated target list the code objects were compiled for.
inline std::string device_refusal(const char* gcn_arch_name, int wave, int lds_per_block, int kernel_lds,
                                  const char* built) {
  const std::string name = gcn_arch_name != nullptr ? gcn_arch_name : "";
  const int gfx = gfx_number(gcn_arch_name);
  if (gfx == 0) return "device architecture '" + name + "' is not an AMD gfx target";
  if (!gfx_in_list(gfx, built))
    return "device is " + name + ", not among the built targets (" + std::string(built) +
           "); rebuild with -DFLASHPORT_HIP_ARCHS including it";
  if (wave != wave_size(gfx))
    return name + " runs wave" + std::to_string(wave) + ", the kernels were built for wave" +
           std::to_string(wave_size(gfx));
  const int lds = lds_per_block < lds_bytes_per_workgroup(gfx) ? lds_per_block : lds_bytes_per_workgroup(gfx);
  if (kernel_lds > lds)
    return "the kernel needs " + std::to_string(kernel_lds) + " bytes of LDS, " + name + " allows " +
           std::to_string(lds);
  return "";
}

}  // namespace flashport::gpu::amd
