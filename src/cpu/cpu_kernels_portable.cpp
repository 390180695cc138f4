// The CPU kernels built for portable (see cpu_kernels.inc; flags in src/cpu/CMakeLists.txt).
#define FP_ISA_NAME portable
#define FP_ISA_STRING "portable"
#define FP_VW 4  // floats per vector
#define FP_MR 4  // micro-kernel rows
#define FP_NV 2  // micro-kernel vectors per row
#include "cpu_kernels.inc"
