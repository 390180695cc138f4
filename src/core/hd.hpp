// Host/device qualifiers shared by code compiled for the CPU, CUDA and HIP.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FP_HD __host__ __device__ __forceinline__
#define FP_DEVICE_COMPILE 1
#else
#define FP_HD inline
#endif
