// The CPU kernels built for avx2 (see cpu_kernels.inc; flags in src/cpu/CMakeLists.txt).
#define FP_ISA_NAME avx2
#define FP_ISA_STRING "avx2"
#define FP_VW 8  // floats per vector
#define FP_MR 6  // micro-kernel rows
#define FP_NV 2  // micro-kernel vectors per row
#include "cpu_kernels.inc"
