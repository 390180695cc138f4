// Which GPU family a translation unit compiles the shared GPU code for, decided in one place:
// AMD (the HIP build, or tests/amd's CPU emulation of AMD workgroups) or NVIDIA (CUDA).
//
// Headers whose definitions differ per family (tile_config.hpp's rows, the tile-MMA layers, the
// forward main loop) put the AMD definitions in an inline namespace, so a library built with both
// CUDA and HIP holds two distinct sets of same-named templates and tables instead of letting the
// linker merge them. NVIDIA names are unchanged (no namespace is opened for them).
#pragma once

#if defined(__HIPCC__) || defined(FLASHPORT_HIP_HOST) || defined(FP_AMD_EMULATION)
#define FP_TARGET_AMD 1
#define FP_TARGET_NS_BEGIN inline namespace amd_target {
#define FP_TARGET_NS_END }
#else
#define FP_TARGET_NVIDIA 1
#define FP_TARGET_NS_BEGIN
#define FP_TARGET_NS_END
#endif
