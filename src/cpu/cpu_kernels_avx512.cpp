// The CPU kernels built for avx512 (see cpu_kernels.inc; flags in src/cpu/CMakeLists.txt).
#define FP_ISA_NAME avx512
#define FP_ISA_STRING "avx512"
#define FP_VW 16  // floats per vector
#define FP_MR 8  // micro-kernel rows
#define FP_NV 2  // micro-kernel vectors per row
#include "cpu_kernels.inc"
