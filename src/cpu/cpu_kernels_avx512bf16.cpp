// The CPU kernels built for AVX-512 with AVX512-BF16 dot products (vdpbf16ps for bf16 inputs; see
// cpu_kernels.inc; flags in src/cpu/CMakeLists.txt).
#define FP_ISA_NAME avx512bf16
#define FP_ISA_STRING "avx512bf16"
#define FP_BF16DOT 1
#define FP_VW 16  // floats per vector
#define FP_MR 8   // micro-kernel rows
#define FP_NV 2   // micro-kernel vectors per row
#include "cpu_kernels.inc"
