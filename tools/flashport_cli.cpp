// `flashport`: runs attention calls of given shapes on the best available backend (or a forced
// one), checks each against the fp64 reference backend, and prints a table. With no shape
// options it runs two embedded defaults: a causal GQA prefill and a decode step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "flashport/flashport.h"

#ifdef FLASHPORT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

struct Case {
  std::string name = "custom";
  int64_t batch = 1, sq = 512, sk = 512, hq = 8, hkv = 8, d = 64, dv = -1;
  fp_dtype dtype = FP_BF16;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  float dropout = 0.0f;
  int splits = 0;
};

struct Options {
  fp_backend backend = FP_BACKEND_AUTO;
  bool cuda = false;
  int repeat = 5;
  int threads = 0;
  std::vector<Case> cases;
};

void usage() {
  std::puts(
      "usage: flashport [options]\n"
      "Runs attention on the best available backend, checks it against the fp64 reference,\n"
      "prints shape, backend/kernel, time, TFLOPS and error. Without shape options it runs an\n"
      "embedded prefill and decode case.\n\n"
      "  --batch B --seqlen-q S --seqlen-k S --heads-q H --heads-kv H --dim D [--dim-v D]\n"
      "  --dtype bf16|fp16|fp32   --causal   --window L,R   --softcap C   --alibi   --sinks\n"
      "  --dropout P   --splits N (0 auto, 1 off)   --backend auto|cpu|cuda|reference\n"
      "  --device cpu|cuda   --repeat N   --threads N   --help");
}

bool parse_dtype(const char* s, fp_dtype* t) {
  if (!std::strcmp(s, "bf16")) *t = FP_BF16;
  else if (!std::strcmp(s, "fp16")) *t = FP_F16;
  else if (!std::strcmp(s, "fp32")) *t = FP_F32;
  else return false;
  return true;
}

bool parse_backend(const char* s, fp_backend* b) {
  if (!std::strcmp(s, "auto")) *b = FP_BACKEND_AUTO;
  else if (!std::strcmp(s, "cpu")) *b = FP_BACKEND_CPU;
  else if (!std::strcmp(s, "cuda")) *b = FP_BACKEND_CUDA;
  else if (!std::strcmp(s, "reference")) *b = FP_BACKEND_REFERENCE;
  else return false;
  return true;
}

std::vector<Case> default_cases() {
  Case prefill;
  prefill.name = "prefill";
  prefill.batch = 2, prefill.sq = prefill.sk = 1024, prefill.hq = 8, prefill.hkv = 2;
  prefill.d = 128, prefill.causal = true;
  Case decode;
  decode.name = "decode";
  decode.batch = 4, decode.sq = 1, decode.sk = 8192, decode.hq = 32, decode.hkv = 8;
  decode.d = 128;
  return {prefill, decode};
}

// Host tensor in the storage dtype, contiguous.
struct Buffer {
  fp_dtype dtype = FP_F32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  Buffer(fp_dtype t, std::vector<int64_t> s) : dtype(t), shape(std::move(s)) {
    bytes.resize(size_t(numel()) * flashport::dtype_size(t));
  }
  fp_tensor view(void* data, fp_device_type dev) const {
    fp_tensor v{};
    v.data = data;
    v.dtype = dtype;
    v.ndim = int32_t(shape.size());
    int64_t stride = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      v.shape[i] = shape[i];
      v.stride[i] = stride;
      stride *= shape[i];
    }
    v.device_type = dev;
    return v;
  }
  fp_tensor host_view() { return view(bytes.data(), FP_DEVICE_CPU); }
  double at(int64_t i) const { return flashport::load_as_double(bytes.data(), dtype, i); }
};

void fill_normal(Buffer& b, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  for (int64_t i = 0; i < b.numel(); ++i) flashport::store_from_double(b.bytes.data(), b.dtype, i, dist(rng));
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "flashport: %s\n", what.c_str());
  std::exit(2);
}

void check(fp_status st, const char* what) {
  if (st != FP_OK) die(std::string(what) + ": " + fp_status_name(st) + ": " + fp_last_error());
}

// Device memory for one buffer (or the host buffer itself on the CPU).
struct DeviceCopy {
  void* ptr = nullptr;
  bool on_device = false;
  DeviceCopy(Buffer& b, bool cuda) : on_device(cuda) {
    if (!cuda) {
      ptr = b.bytes.data();
      return;
    }
#ifdef FLASHPORT_WITH_CUDA
    if (cudaMalloc(&ptr, b.bytes.size() ? b.bytes.size() : 1) != cudaSuccess) die("cudaMalloc failed");
    cudaMemcpy(ptr, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice);
#else
    die("this build has no CUDA support (configure with -DFLASHPORT_CUDA=ON)");
#endif
  }
  void copy_back(Buffer& b) const {
#ifdef FLASHPORT_WITH_CUDA
    if (on_device) cudaMemcpy(b.bytes.data(), ptr, b.bytes.size(), cudaMemcpyDeviceToHost);
#else
    (void)b;
#endif
  }
  ~DeviceCopy() {
#ifdef FLASHPORT_WITH_CUDA
    if (on_device) cudaFree(ptr);
#endif
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
};

struct Row {
  std::string name, shape, backend, kernel;
  double ms = 0, tflops = 0, max_err = 0, rel_err = 0;
  bool ok = false;
};

Row run_case(const Case& c, const Options& opt, uint64_t seed) {
  const int64_t dv = c.dv > 0 ? c.dv : c.d;
  std::mt19937_64 rng(seed);
  Buffer q(c.dtype, {c.batch, c.sq, c.hq, c.d}), k(c.dtype, {c.batch, c.sk, c.hkv, c.d}),
      v(c.dtype, {c.batch, c.sk, c.hkv, dv}), out(c.dtype, {c.batch, c.sq, c.hq, dv});
  Buffer lse(FP_F32, {c.batch, c.hq, c.sq});
  Buffer slopes(FP_F32, {c.hq}), sinks(FP_F32, {c.hq});
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  for (int64_t h = 0; h < c.hq; ++h) {
    reinterpret_cast<float*>(slopes.bytes.data())[h] = std::exp2(-8.0f * float(h + 1) / float(c.hq));
    reinterpret_cast<float*>(sinks.bytes.data())[h] = 0.5f * float(h % 3);
  }

  const fp_device_type dev = opt.cuda ? FP_DEVICE_CUDA : FP_DEVICE_CPU;
  DeviceCopy dq(q, opt.cuda), dk(k, opt.cuda), dvv(v, opt.cuda), dout(out, opt.cuda),
      dlse(lse, opt.cuda), dslopes(slopes, opt.cuda), dsinks(sinks, opt.cuda);

  fp_attn_params p;
  fp_attn_params_init(&p);
  p.q = q.view(dq.ptr, dev);
  p.k = k.view(dk.ptr, dev);
  p.v = v.view(dvv.ptr, dev);
  p.out = out.view(dout.ptr, dev);
  p.lse = lse.view(dlse.ptr, dev);
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.softcap = c.softcap;
  if (c.alibi) p.alibi_slopes = slopes.view(dslopes.ptr, dev);
  if (c.sinks) p.sinks = sinks.view(dsinks.ptr, dev);
  p.dropout_p = c.dropout;
  p.dropout_seed = seed;
  p.num_splits = c.splits;
  p.backend = opt.backend;
  p.num_threads = opt.threads;

  fp_selection sel{};
  check(fp_attn_fwd_select(&p, &sel), "select");
  Buffer workspace(FP_F32, {int64_t((sel.workspace_bytes + 3) / 4)});
  DeviceCopy dws(workspace, opt.cuda);
  p.workspace = sel.workspace_bytes ? dws.ptr : nullptr;
  p.workspace_bytes = sel.workspace_bytes;

  Row row;
  row.name = c.name;
  char shape[160];
  std::snprintf(shape, sizeof shape, "B%lld Sq%lld Sk%lld Hq%lld/%lld D%lld%s %s", (long long)c.batch,
                (long long)c.sq, (long long)c.sk, (long long)c.hq, (long long)c.hkv, (long long)c.d,
                c.causal ? " causal" : "", flashport::dtype_name(c.dtype));
  row.shape = shape;
  row.backend = fp_backend_name(sel.backend);
  row.kernel = sel.kernel;
  if (sel.num_splits > 1) row.kernel += " x" + std::to_string(sel.num_splits) + " splits";

  // Warm up once, then time `repeat` calls.
  check(fp_attn_fwd(&p), "forward");
  std::vector<double> times;
  for (int r = 0; r < opt.repeat; ++r) {
#ifdef FLASHPORT_WITH_CUDA
    if (opt.cuda) {
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0);
      check(fp_attn_fwd(&p), "forward");
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      times.push_back(ms);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      continue;
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    check(fp_attn_fwd(&p), "forward");
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  row.ms = times.empty() ? 0.0 : times[times.size() / 2];
  double flops = 4.0 * double(c.batch) * double(c.hq) * double(c.sq) * double(c.sk) * double(c.d);
  if (c.causal) flops *= 0.5;
  row.tflops = row.ms > 0 ? flops / (row.ms * 1e-3) / 1e12 : 0.0;
  dout.copy_back(out);

  // The fp64 reference on host copies of the same inputs.
  Buffer ref(FP_F64, {c.batch, c.sq, c.hq, dv});
  fp_attn_params r = p;
  r.q = q.host_view();
  r.k = k.host_view();
  r.v = v.host_view();
  r.out = ref.host_view();
  r.lse = fp_tensor{};
  if (c.alibi) r.alibi_slopes = slopes.host_view();
  if (c.sinks) r.sinks = sinks.host_view();
  r.backend = FP_BACKEND_REFERENCE;
  r.stream = nullptr;
  r.workspace = nullptr;
  r.workspace_bytes = 0;
  r.num_splits = 1;
  // The reference needs its output dtype equal to the inputs: run it on fp64 copies.
  Buffer q64(FP_F64, q.shape), k64(FP_F64, k.shape), v64(FP_F64, v.shape);
  for (int64_t i = 0; i < q.numel(); ++i) reinterpret_cast<double*>(q64.bytes.data())[i] = q.at(i);
  for (int64_t i = 0; i < k.numel(); ++i) reinterpret_cast<double*>(k64.bytes.data())[i] = k.at(i);
  for (int64_t i = 0; i < v.numel(); ++i) reinterpret_cast<double*>(v64.bytes.data())[i] = v.at(i);
  r.q = q64.host_view();
  r.k = k64.host_view();
  r.v = v64.host_view();
  check(fp_attn_fwd(&r), "reference");
  double num = 0, den = 0, max_err = 0;
  bool finite = true;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double a = out.at(i), b = ref.at(i);
    if (!std::isfinite(a)) finite = false;
    num += (a - b) * (a - b);
    den += b * b;
    max_err = std::max(max_err, std::fabs(a - b));
  }
  row.max_err = max_err;
  row.rel_err = std::sqrt(num / std::max(den, 1e-300));
  const double tol = c.dtype == FP_F32 ? 1e-4 : (c.dtype == FP_F16 ? 5e-3 : 3e-2);
  row.ok = finite && row.rel_err <= tol;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  Case custom;
  bool any_shape = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) die("option " + a + " needs a value");
      return argv[++i];
    };
    auto next_int = [&]() { return std::strtoll(next(), nullptr, 10); };
    if (a == "--help" || a == "-h") { usage(); return 0; }
    else if (a == "--batch") custom.batch = next_int(), any_shape = true;
    else if (a == "--seqlen-q") custom.sq = next_int(), any_shape = true;
    else if (a == "--seqlen-k") custom.sk = next_int(), any_shape = true;
    else if (a == "--seqlen") custom.sq = custom.sk = next_int(), any_shape = true;
    else if (a == "--heads-q") custom.hq = next_int(), any_shape = true;
    else if (a == "--heads-kv") custom.hkv = next_int(), any_shape = true;
    else if (a == "--dim") custom.d = next_int(), any_shape = true;
    else if (a == "--dim-v") custom.dv = next_int(), any_shape = true;
    else if (a == "--dtype") { if (!parse_dtype(next(), &custom.dtype)) die("--dtype: expected bf16, fp16 or fp32"); any_shape = true; }
    else if (a == "--causal") custom.causal = true, any_shape = true;
    else if (a == "--window") {
      const char* w = next();
      if (std::sscanf(w, "%d,%d", &custom.window_left, &custom.window_right) != 2) die("--window: expected L,R");
      any_shape = true;
    }
    else if (a == "--softcap") custom.softcap = std::strtof(next(), nullptr), any_shape = true;
    else if (a == "--alibi") custom.alibi = true, any_shape = true;
    else if (a == "--sinks") custom.sinks = true, any_shape = true;
    else if (a == "--dropout") custom.dropout = std::strtof(next(), nullptr), any_shape = true;
    else if (a == "--splits") custom.splits = int(next_int()), any_shape = true;
    else if (a == "--backend") { if (!parse_backend(next(), &opt.backend)) die("--backend: expected auto, cpu, cuda or reference"); }
    else if (a == "--device") {
      const std::string d = next();
      if (d == "cuda") opt.cuda = true;
      else if (d != "cpu") die("--device: expected cpu or cuda");
    }
    else if (a == "--repeat") opt.repeat = int(std::max<long long>(1, next_int()));
    else if (a == "--threads") opt.threads = int(next_int());
    else die("unknown option " + a + " (see --help)");
  }
  if (opt.backend == FP_BACKEND_CUDA) opt.cuda = true;
  if (opt.cuda && !fp_backend_available(FP_BACKEND_CUDA)) die("--device cuda: no CUDA backend or device available");
  opt.cases = any_shape ? std::vector<Case>{custom} : default_cases();

  std::printf("flashport %s — backends available:", fp_version());
  for (fp_backend b : {FP_BACKEND_REFERENCE, FP_BACKEND_CPU, FP_BACKEND_CUDA, FP_BACKEND_HIP})
    if (fp_backend_available(b)) std::printf(" %s", fp_backend_name(b));
  std::printf("\n\n%-8s %-44s %-10s %-40s %10s %9s %10s %10s %s\n", "case", "shape", "backend", "kernel",
              "time ms", "TFLOPS", "max err", "rel err", "check");
  bool all_ok = true;
  uint64_t seed = std::random_device{}();
  for (const Case& c : opt.cases) {
    const Row r = run_case(c, opt, seed++);
    all_ok &= r.ok;
    std::printf("%-8s %-44s %-10s %-40s %10.3f %9.3f %10.2e %10.2e %s\n", r.name.c_str(), r.shape.c_str(),
                r.backend.c_str(), r.kernel.c_str(), r.ms, r.tflops, r.max_err, r.rel_err, r.ok ? "ok" : "FAIL");
  }
  return all_ok ? 0 : 1;
}
