// Times flashport's CPU backend through the public C API for one configuration and prints one
// JSON line. bench_cpu.py runs it next to PyTorch's CPU SDPA (the Python bindings are not used, so
// this measures the C API alone). Modes:
//   bench_cpu_driver attn --op fwd|bwd --dtype f32|bf16 --b B --h H --s S --d D [--causal]
//                    [--sq Sq] [--hkv Hkv] [--threads N] [--reps R] [--mem]
//   bench_cpu_driver fma-peak [--threads N]     measured fp32 FMA peak (GFLOP/s) of this machine
//   bench_cpu_driver read-bw [--threads N]      measured plain streaming-read bandwidth (GB/s)
// --mem reports the peak resident memory the timed call adds (VmHWM reset through
// /proc/self/clear_refs after the inputs are allocated and touched).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include "flashport/flashport.h"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU seconds this process has used (all threads): robust to other load on a shared machine.
double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

long status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + std::strlen(key));
  return -1;
}

void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Buf {
  std::vector<uint8_t> bytes;
  fp_tensor t{};
  Buf(fp_dtype dt, std::vector<int64_t> shape, std::mt19937& rng, bool random) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const size_t es = dt == FP_F32 ? 4 : 2;
    bytes.assign(static_cast<size_t>(n) * es, 0);
    if (random) {
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (int64_t i = 0; i < n; ++i) {
        const float x = nd(rng);
        if (dt == FP_F32) std::memcpy(bytes.data() + i * 4, &x, 4);
        else {
          const uint16_t h = to_bf16(x);
          std::memcpy(bytes.data() + i * 2, &h, 2);
        }
      }
    }
    t.data = bytes.data();
    t.dtype = dt;
    t.ndim = static_cast<int32_t>(shape.size());
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = shape[d];
      t.stride[d] = stride;
      stride *= shape[d];
    }
    t.device_type = FP_DEVICE_CPU;
  }
};

// 12 independent accumulator chains x 16 lanes x 2 flops per FMA.
__attribute__((target("avx512f,fma"))) double fma_loop(int64_t iters) {
  __m512 acc[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0];
}

int fma_peak(int threads) {
  const int64_t iters = 50'000'000;
  std::atomic<double> sink{0.0};
  fma_loop(iters / 50);  // warm up the clocks
  const double t0 = now(), c0 = cpu_seconds();
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i) ts.emplace_back([&] { sink = sink + fma_loop(iters); });
  for (auto& t : ts) t.join();
  const double dt = now() - t0, dc = cpu_seconds() - c0;
  const double flops = double(threads) * iters * 12 * 16 * 2;
  // gflops: wall clock; gflops_per_cpu_s * threads: what the cores do when they are not shared.
  std::printf("{\"mode\":\"fma-peak\",\"threads\":%d,\"gflops\":%.2f,\"gflops_cpu\":%.2f,\"sink\":%g}\n",
              threads, flops / dt * 1e-9, flops / dc * 1e-9 * threads, sink.load());
  return 0;
}

// Plain streaming read: each thread sums its share of a buffer far larger than the caches with
// 512-bit loads (4 independent chains); the best of several passes, in GB/s.
__attribute__((target("avx512f"))) float read_share(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

int read_bandwidth(int threads) {
  const int64_t n = int64_t{256} << 20;  // 1 GiB of floats
  std::vector<float> buf(static_cast<size_t>(n), 1.0f);
  const int64_t share = n / threads / 64 * 64;
  double best = 0.0;
  std::atomic<double> sink{0.0};
  for (int pass = 0; pass < 5; ++pass) {
    const double t0 = now();
    std::vector<std::thread> ts;
    for (int i = 0; i < threads; ++i)
      ts.emplace_back([&, i] { sink = sink + read_share(buf.data() + i * share, share); });
    for (auto& t : ts) t.join();
    best = std::max(best, double(threads) * share * 4 / (now() - t0) * 1e-9);
  }
  std::printf("{\"mode\":\"read-bw\",\"threads\":%d,\"gbps\":%.2f,\"sink\":%g}\n", threads, best,
              sink.load());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s attn|fma-peak|read-bw [options]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  std::string op = "fwd", dts = "f32";
  int64_t B = 1, H = 8, S = 1024, D = 64, Sq = -1, Hkv = -1;
  int causal = 0, threads = 0, reps = 3;
  float dropout = 0.0f;
  bool mem = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--op") op = next();
    else if (a == "--dtype") dts = next();
    else if (a == "--b") B = std::atoll(next().c_str());
    else if (a == "--h") H = std::atoll(next().c_str());
    else if (a == "--s") S = std::atoll(next().c_str());
    else if (a == "--d") D = std::atoll(next().c_str());
    else if (a == "--sq") Sq = std::atoll(next().c_str());    // queries (default S)
    else if (a == "--hkv") Hkv = std::atoll(next().c_str());  // kv heads (default H)
    else if (a == "--causal") causal = 1;
    else if (a == "--dropout") dropout = float(std::atof(next().c_str()));  // dropout_p, seed 1
    else if (a == "--threads") threads = std::atoi(next().c_str());
    else if (a == "--reps") reps = std::atoi(next().c_str());
    else if (a == "--mem") mem = true;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (mode == "fma-peak") return fma_peak(threads > 0 ? threads : 1);
  if (mode == "read-bw") return read_bandwidth(threads > 0 ? threads : 1);

  const fp_dtype dt = dts == "bf16" ? FP_BF16 : FP_F32;
  if (Sq < 0) Sq = S;
  if (Hkv < 0) Hkv = H;
  std::mt19937 rng(1234);
  Buf q(dt, {B, Sq, H, D}, rng, true), k(dt, {B, S, Hkv, D}, rng, true), v(dt, {B, S, Hkv, D}, rng, true);
  Buf out(dt, {B, Sq, H, D}, rng, false), lse(FP_F32, {B, H, Sq}, rng, false);
  fp_attn_params p;
  fp_attn_params_init(&p);
  p.q = q.t;
  p.k = k.t;
  p.v = v.t;
  p.out = out.t;
  p.lse = lse.t;
  p.causal = causal;
  p.dropout_p = dropout;
  p.dropout_seed = 1;
  p.causal_align = FP_CAUSAL_TOP_LEFT;  // torch's is_causal (the same for Sq == Sk)
  p.backend = FP_BACKEND_CPU;
  p.num_threads = threads;

  fp_attn_bwd_params bp;
  fp_attn_bwd_params_init(&bp);
  std::vector<Buf> grads;
  if (op == "bwd") {
    if (fp_attn_fwd(&p) != FP_OK) {
      std::fprintf(stderr, "fwd failed: %s\n", fp_last_error());
      return 1;
    }
    grads.emplace_back(dt, std::vector<int64_t>{B, Sq, H, D}, rng, true);  // dout
    grads.emplace_back(dt, std::vector<int64_t>{B, Sq, H, D}, rng, false);  // dq
    for (int i = 0; i < 2; ++i) grads.emplace_back(dt, std::vector<int64_t>{B, S, Hkv, D}, rng, false);
    for (auto& g : grads) std::memset(g.bytes.data(), 0, g.bytes.size());  // touch every page
    std::normal_distribution<float> nd;
    bp.fwd = p;
    bp.dout = grads[0].t;
    bp.dq = grads[1].t;
    bp.dk = grads[2].t;
    bp.dv = grads[3].t;
    bp.deterministic = 1;
  }
  std::memset(out.bytes.data(), 0, out.bytes.size());
  fp_selection sel{};
  const fp_status sst = op == "bwd" ? fp_attn_bwd_select(&bp, &sel) : fp_attn_fwd_select(&p, &sel);
  if (sst != FP_OK) {
    std::fprintf(stderr, "select failed: %s\n", fp_last_error());
    return 1;
  }
  auto call = [&] { return op == "bwd" ? fp_attn_bwd(&bp) : fp_attn_fwd(&p); };

  long mem_kb = -1;
  if (mem) {
    const long before = status_kb("VmRSS:");
    reset_peak_rss();
    if (call() != FP_OK) return 1;
    mem_kb = status_kb("VmHWM:") - before;
  } else if (call() != FP_OK) {  // warm-up (thread pool, scratch)
    std::fprintf(stderr, "call failed: %s\n", fp_last_error());
    return 1;
  }
  std::vector<double> times, cpu_times;
  for (int r = 0; r < (mem ? 0 : reps); ++r) {
    const double t0 = now(), c0 = cpu_seconds();
    call();
    times.push_back(now() - t0);
    cpu_times.push_back(cpu_seconds() - c0);
  }
  std::sort(cpu_times.begin(), cpu_times.end());
  const double best_cpu = cpu_times.empty() ? 0.0 : cpu_times.front();
  std::sort(times.begin(), times.end());
  const double best = times.empty() ? 0.0 : times.front();
  const double med = times.empty() ? 0.0 : times[times.size() / 2];
  std::printf(
      "{\"impl\":\"flashport\",\"op\":\"%s\",\"dtype\":\"%s\",\"b\":%lld,\"h\":%lld,\"hkv\":%lld,\"sq\":%lld,\"s\":%lld,"
      "\"d\":%lld,\"causal\":%d,\"threads\":%d,\"kernel\":\"%s\",\"best_s\":%.6f,\"median_s\":%.6f,"
      "\"best_cpu_s\":%.6f,\"extra_peak_bytes\":%ld}\n",
      op.c_str(), dts.c_str(), (long long)B, (long long)H, (long long)Hkv, (long long)Sq, (long long)S, (long long)D, causal,
      threads, sel.kernel, best, med, best_cpu, mem_kb < 0 ? -1L : mem_kb * 1024L);
  return 0;
}
