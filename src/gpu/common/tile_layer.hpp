// The tile-MMA layer of the GPU family this translation unit compiles for (gpu_target.hpp): the AMD
// one (tile_mma_amd.hpp: MFMA / WMMA) or the NVIDIA one (tile_mma.hpp: mma.sync). Code shared by
// both families includes this; NVIDIA-only code may include tile_mma.hpp itself.
#pragma once
#include "gpu/common/gpu_target.hpp"
#if defined(FP_TARGET_AMD)
#include "gpu/amd/tile_mma_amd.hpp"
#else
#include "gpu/common/tile_mma.hpp"
#endif
