// Times flashport's CUDA backward through the C API (bench/gpu/bench_bwd.py builds and runs it).
// Per configuration: bf16 q, k, v, dout random normal; out and lse from flashport's forward; then
// the backward (preprocess + main loop + dq conversion) is timed with CUDA events, median of
// --iters after 3 warm-ups, in the default (atomic dq) and deterministic modes.
// Prints one JSON object per configuration.
//   bench_bwd_driver D S B H causal [iters]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "flashport/flashport.h"

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                 \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

static fp_tensor view4(void* p, fp_dtype t, int64_t a, int64_t b, int64_t c, int64_t d) {
  fp_tensor v{};
  v.data = p, v.dtype = t, v.ndim = 4;
  v.shape[0] = a, v.shape[1] = b, v.shape[2] = c, v.shape[3] = d;
  v.stride[3] = 1, v.stride[2] = d, v.stride[1] = c * d, v.stride[0] = b * c * d;
  v.device_type = FP_DEVICE_CUDA;
  return v;
}
static fp_tensor view3(void* p, fp_dtype t, int64_t a, int64_t b, int64_t c) {
  fp_tensor v{};
  v.data = p, v.dtype = t, v.ndim = 3;
  v.shape[0] = a, v.shape[1] = b, v.shape[2] = c;
  v.stride[2] = 1, v.stride[1] = c, v.stride[0] = b * c;
  v.device_type = FP_DEVICE_CUDA;
  return v;
}

static void* random_bf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<__nv_bfloat16> h(n);
  for (auto& x : h) x = __float2bfloat16(nd(rng));
  void* d = nullptr;
  CK(cudaMalloc(&d, n * 2));
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s D S B H causal [iters]\n", argv[0]);
    return 2;
  }
  const int64_t D = std::atoll(argv[1]), S = std::atoll(argv[2]), B = std::atoll(argv[3]),
                H = std::atoll(argv[4]);
  const int causal = std::atoi(argv[5]);
  const int iters = argc > 6 ? std::atoi(argv[6]) : 20;
  std::mt19937 rng(1234);
  const size_t n = size_t(B) * S * H * D;
  void *q = random_bf16(n, rng), *k = random_bf16(n, rng), *v = random_bf16(n, rng),
       *dout = random_bf16(n, rng);
  void *out, *dq, *dk, *dv, *lse;
  CK(cudaMalloc(&out, n * 2));
  CK(cudaMalloc(&dq, n * 2));
  CK(cudaMalloc(&dk, n * 2));
  CK(cudaMalloc(&dv, n * 2));
  CK(cudaMalloc(&lse, size_t(B) * H * S * 4));

  fp_attn_params f;
  fp_attn_params_init(&f);
  f.q = view4(q, FP_BF16, B, S, H, D);
  f.k = view4(k, FP_BF16, B, S, H, D);
  f.v = view4(v, FP_BF16, B, S, H, D);
  f.out = view4(out, FP_BF16, B, S, H, D);
  f.lse = view3(lse, FP_F32, B, H, S);
  f.causal = causal;
  f.backend = FP_BACKEND_CUDA;
  size_t fws = 0;
  if (fp_attn_fwd_workspace(&f, &fws) != FP_OK) {
    std::fprintf(stderr, "fwd select: %s\n", fp_last_error());
    return 1;
  }
  void* fw = nullptr;
  if (fws) CK(cudaMalloc(&fw, fws));
  f.workspace = fw, f.workspace_bytes = fws;
  if (fp_attn_fwd(&f) != FP_OK) {
    std::fprintf(stderr, "fwd: %s\n", fp_last_error());
    return 1;
  }
  CK(cudaDeviceSynchronize());

  double ms[2] = {0, 0};
  char kernel[2][96] = {{0}, {0}};
  for (int det = 0; det < 2; ++det) {
    fp_attn_bwd_params p;
    fp_attn_bwd_params_init(&p);
    p.fwd = f;
    p.fwd.workspace = nullptr, p.fwd.workspace_bytes = 0;
    p.dout = view4(dout, FP_BF16, B, S, H, D);
    p.dq = view4(dq, FP_BF16, B, S, H, D);
    p.dk = view4(dk, FP_BF16, B, S, H, D);
    p.dv = view4(dv, FP_BF16, B, S, H, D);
    p.deterministic = det;
    fp_selection sel;
    if (fp_attn_bwd_select(&p, &sel) != FP_OK) {
      std::fprintf(stderr, "bwd select: %s\n", fp_last_error());
      return 1;
    }
    std::snprintf(kernel[det], sizeof(kernel[det]), "%s", sel.kernel);
    void* ws = nullptr;
    if (sel.workspace_bytes) CK(cudaMalloc(&ws, sel.workspace_bytes));
    p.fwd.workspace = ws, p.fwd.workspace_bytes = sel.workspace_bytes;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int it = 0; it < iters + 3; ++it) {
      CK(cudaEventRecord(e0));
      if (fp_attn_bwd(&p) != FP_OK) {
        std::fprintf(stderr, "bwd: %s\n", fp_last_error());
        return 1;
      }
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float x = 0;
      CK(cudaEventElapsedTime(&x, e0, e1));
      if (it >= 3) t.push_back(x);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    ms[det] = t[t.size() / 2];
    if (ws) CK(cudaFree(ws));
  }
  double flops = 4.0 * B * H * double(S) * S * D * 2.5;
  if (causal) flops *= 0.5;
  std::printf("{\"D\": %lld, \"S\": %lld, \"B\": %lld, \"H\": %lld, \"causal\": %d, \"ms\": %.4f, "
              "\"tflops\": %.1f, \"ms_det\": %.4f, \"tflops_det\": %.1f, \"kernel\": \"%s\"}\n",
              (long long)D, (long long)S, (long long)B, (long long)H, causal, ms[0],
              flops / ms[0] * 1e-9, ms[1], flops / ms[1] * 1e-9, kernel[0]);
  return 0;
}
