// The sm_90a wgmma backward (src/gpu/hopper/bwd_hopper.cu) against the fp64 reference backward: head
// dims 64/128/256 in both dtypes (D256: its own kernel, 64-key blocks), other head dims (multiples
// of 8) and Dq != Dv padded inside the 64/128/256 instances, odd lengths (tails in both directions), several query blocks per key
// block (the Q/dO ring; step counts around its size: PipelineStepCounts), causal in both alignments, windows, GQA (dK/dV summed over
// the group), varlen, seqused_k, strided q / dout (the TMA views), softcap (with its derivative), ALiBi, sinks with d_sinks, rows
// without keys, graph capture on the caller's stream; poisoned outputs, sentinels, NaN checks. Each
// case also checks which kernel ran: the Hopper kernel on an sm_90 device where the capability
// check allows it, the mma.sync backward (still correct) where it declines: head dims that are
// not multiples of 8, unaligned dout, FLASHPORT_HOPPER_BWD=0. Skipped without a CUDA device.
//
// The call helpers (BwdCall, DeviceBwd, run_reference_bwd, check_bwd) are bwd_harness.hpp.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/config.hpp"
#include "gpu/common/driver_entry.hpp"
#include "gpu/hopper/bwd_hopper.hpp"
#include "bwd_harness.hpp"

namespace gputest {
namespace {

using flashport::test::close;

constexpr const char* kHopperBwdName = "sm90_wgmma_bwd";

// Whether the Hopper backward takes head dims (d, dv) at all: up to 256, multiples of 8.
bool hopper_takes(int64_t d, int64_t dv) { return d <= 256 && dv <= 256 && d % 8 == 0 && dv % 8 == 0; }
bool hopper_takes(int64_t d) { return hopper_takes(d, d); }
// The Hopper backward's instance for head dims (d, dv): 64, 128 or 256 (smaller dims run padded).
int64_t hopper_bucket(int64_t d, int64_t dv) {
  const int64_t m = std::max(d, dv);
  return m <= 64 ? 64 : m <= 128 ? 128 : 256;
}

// A non-blocking stream of a green context holding about `want` SMs of the current device (the
// driver's split rounds up to its partition rules; `sms` is what it gave), through driver entry
// points (no -lcuda); `why` says why there is none (a driver or device without green contexts).
struct GreenStream {
  CUgreenCtx ctx = nullptr;
  CUstream stream = nullptr;
  int sms = 0;
  std::string why;
  PFN_cuGreenCtxDestroy_v12040 destroy_ctx = nullptr;
  PFN_cuStreamDestroy_v4000 destroy_stream = nullptr;

  explicit GreenStream(unsigned want) {
    auto entry = [&](const char* name, int version) -> void* {
      void* f = flashport::gpu::driver_entry_point(name, version);
      if (f == nullptr && why.empty()) why = std::string("driver has no ") + name;
      return f;
    };
    auto device_get = reinterpret_cast<PFN_cuDeviceGet_v2000>(entry("cuDeviceGet", 2000));
    auto get_resource = reinterpret_cast<PFN_cuDeviceGetDevResource_v12040>(entry("cuDeviceGetDevResource", 12040));
    auto split = reinterpret_cast<PFN_cuDevSmResourceSplitByCount_v12040>(entry("cuDevSmResourceSplitByCount", 12040));
    auto make_desc = reinterpret_cast<PFN_cuDevResourceGenerateDesc_v12040>(entry("cuDevResourceGenerateDesc", 12040));
    auto create = reinterpret_cast<PFN_cuGreenCtxCreate_v12040>(entry("cuGreenCtxCreate", 12040));
    auto stream_create = reinterpret_cast<PFN_cuGreenCtxStreamCreate_v12050>(entry("cuGreenCtxStreamCreate", 12050));
    destroy_ctx = reinterpret_cast<PFN_cuGreenCtxDestroy_v12040>(entry("cuGreenCtxDestroy", 12040));
    destroy_stream = reinterpret_cast<PFN_cuStreamDestroy_v4000>(entry("cuStreamDestroy", 4000));
    if (!why.empty()) return;
    int ordinal = 0;
    CUdevice dev = 0;
    CUdevResource all{}, group{}, rest{};
    unsigned groups = 1;
    CUdevResourceDesc desc = nullptr;
    if (cudaGetDevice(&ordinal) != cudaSuccess || device_get(&dev, ordinal) != CUDA_SUCCESS ||
        get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS ||
        split(&group, &groups, &all, &rest, 0, want) != CUDA_SUCCESS || groups != 1 ||
        make_desc(&desc, &group, 1) != CUDA_SUCCESS ||
        create(&ctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM) != CUDA_SUCCESS ||
        stream_create(&stream, ctx, CU_STREAM_NON_BLOCKING, 0) != CUDA_SUCCESS) {
      why = "the driver declined the green context";
      return;
    }
    sms = static_cast<int>(group.sm.smCount);
  }
  ~GreenStream() {
    if (stream != nullptr) destroy_stream(stream);
    if (ctx != nullptr) destroy_ctx(ctx);
  }
  GreenStream(const GreenStream&) = delete;
  GreenStream& operator=(const GreenStream&) = delete;
};

// Runs the case on the CUDA backend against the reference; checks which kernel ran.
// `repeats` > 1: the call runs again and must be bit-identical (deterministic mode). `rotated`
// (deterministic, Hopper): whether the plan must take the rotated walk (1) or not (0); -1: either.
void check_hopper_bwd(const Case& cs, bool expect_hopper, bool det = false, int repeats = 1, int rotated = -1,
                      cudaStream_t stream = nullptr) {
  fp_selection sel{};
  check_bwd(cs, det, repeats, &sel, stream);
  if (sel.kernel[0] == '\0') return;  // the call itself failed: check_bwd reported why
  SCOPED_TRACE(cs.describe() + (det ? " deterministic" : ""));
  const bool took = std::string(sel.kernel).find(kHopperBwdName) != std::string::npos;
  EXPECT_EQ(took, expect_hopper && device_is_sm90() && hopper_built()) << "ran " << sel.kernel;
  if (took && det && rotated >= 0)
    EXPECT_EQ(std::string(sel.kernel).find(":deterministic-rotated") != std::string::npos, rotated == 1)
        << "ran " << sel.kernel;
  if (took) {  // a padded call's plan names its dims
    const int64_t bucket = hopper_bucket(cs.d, cs.dv);
    const std::string dims = ":d" + std::to_string(cs.d) + "_dv" + std::to_string(cs.dv) + ":";
    EXPECT_EQ(std::string(sel.kernel).find(dims) != std::string::npos, cs.d != bucket || cs.dv != bucket)
        << "ran " << sel.kernel;
  }
}

TEST(CudaHopperBwd, HeadDimsDtypesAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256})
    for (fp_dtype t : {FP_BF16, FP_F16})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}, {200, 77},
                            {1025, 130}, {77, 1025}, {256, 256}, {63, 65}, {65, 63}}) {
        Case c;
        c.dtype = t;
        c.batch = rand_int(1, 2);
        c.hq = 2, c.hkv = 2, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
        check_hopper_bwd(c, hopper_takes(d));
      }
}

// At D128 (64-row steps, two 64-key halves per key block) the diagonal window (0, 0) hides one half
// from every step and the causal diagonal one half of each block's first step: the steps the kernel
// runs without that half's products (bwd_hopper.cu).
TEST(CudaHopperBwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  struct W { bool causal, top_left; int wl, wr; };
  for (int64_t d : {64, 128, 256})
    for (W w : {W{true, false, -1, -1}, W{true, true, -1, -1}, W{false, false, 100, 0}, W{false, false, 37, 200},
                W{false, true, 0, 0}, W{false, false, -1, 5}, W{true, false, 300, -1}})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{700, 700}, {200, 600}, {600, 200}, {129, 131}, {1, 64}, {65, 1}}) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = 2, c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
        c.causal = w.causal, c.top_left = w.top_left, c.wl = w.wl, c.wr = w.wr;
        check_hopper_bwd(c, hopper_takes(d));
      }
}

TEST(CudaHopperBwd, GqaRatios) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256})
    for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}, {12, 3}}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = d, c.dv = d, c.sq = rand_int(1, 300), c.sk = 517;
      c.causal = rand_int(0, 1);
      check_hopper_bwd(c, hopper_takes(d));
    }
}

TEST(CudaHopperBwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case base;
    base.dtype = rand_dtype();
    base.batch = 2, base.hq = 4, base.hkv = 2, base.d = d, base.dv = d, base.sq = 300, base.sk = 333;
    Case c = base;
    c.softcap = 30.0f, c.input_std = 3.0;
    check_hopper_bwd(c, hopper_takes(d));
    c.causal = true, c.softcap = 5.0f;
    check_hopper_bwd(c, hopper_takes(d));
    c = base;
    c.alibi = true, c.causal = true;
    check_hopper_bwd(c, hopper_takes(d));
    c = base;
    c.alibi = true, c.alibi_per_batch = true;
    check_hopper_bwd(c, hopper_takes(d));
    c = base;
    c.sinks = true;
    check_hopper_bwd(c, hopper_takes(d));
    c = base;
    c.sinks = true, c.causal = true, c.sq = 400, c.sk = 100;  // rows with no key: sink only
    check_hopper_bwd(c, hopper_takes(d));
    c = base;
    c.scale = 0.3f;
    c.softcap = 5.0f, c.alibi = true, c.sinks = true, c.causal = true, c.wl = 50;
    check_hopper_bwd(c, hopper_takes(d));
  }
}

TEST(CudaHopperBwd, RowsWithoutKeys) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_BF16;
  c.hq = 2, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 300, c.sk = 50;
  c.causal = true;  // bottom-right: the first 250 rows see nothing (lse = -inf, dq = 0)
  check_hopper_bwd(c, true);
  c.d = 256, c.dv = 256, c.dtype = FP_F16;
  check_hopper_bwd(c, hopper_takes(256));
}

TEST(CudaHopperBwd, VarlenAndSequsedK) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 6; ++rep) {
    Case c;
    c.dtype = rand_dtype();
    c.varlen = true;
    const int64_t nb = rand_int(1, 4);
    for (int64_t b = 0; b < nb; ++b) {
      c.lq.push_back(rand_int(0, 400));
      c.lk.push_back(rand_int(1, 400));
    }
    c.hq = 4, c.hkv = rand_int(0, 1) ? 4 : 1;
    c.d = rep % 3 == 0 ? 64 : rep % 3 == 1 ? 128 : 256, c.dv = c.d;
    c.causal = rand_int(0, 1), c.top_left = rand_int(0, 1);
    c.sinks = rand_int(0, 1);
    check_hopper_bwd(c, hopper_takes(c.d));
  }
  Case c;
  c.dtype = rand_dtype();
  c.batch = 3, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 20, c.sk = 300;
  c.cache = true;
  c.causal = true;  // rows past seqused_k[b] must get dk = dv = 0
  check_hopper_bwd(c, true);
  c.d = 256, c.dv = 256, c.sk = 190;  // 64-key blocks: the last one partly past seqused_k
  check_hopper_bwd(c, hopper_takes(256));
}

// The pipeline of both kernels (producer warpgroup, 2-stage Q/dO ring, dQ handed to the writer
// warp: staged in its own buffers at D64/D128, in the step's ring stage at D256): key blocks with
// 1, 2 and 3 steps (query blocks x heads of the group: each ring stage and staging buffer used
// once, reused, wrapped), many steps (GQA 8 over 9 or 17 query blocks; D256: 17 query blocks of
// 64 rows), Dq != Dv (192/128, padded in the 256 instance), and key blocks with no step at all
// (top-left causal, keys past the last query: dK = dV = 0 while the producer leaves at once).
TEST(CudaHopperBwd, PipelineStepCounts) {
  SKIP_WITHOUT_GPU();
  const std::pair<int64_t, int64_t> dims[] = {{64, 64}, {128, 128}, {256, 256}, {192, 128}};
  for (auto [d, dv] : dims)
    for (int64_t group : {1, 2, 3, 8}) {
      SCOPED_TRACE("d " + std::to_string(d) + " dv " + std::to_string(dv) + " group " + std::to_string(group));
      Case c;
      c.dtype = rand_dtype();
      c.batch = 1, c.hkv = 2, c.hq = 2 * group, c.d = d, c.dv = dv;
      c.sq = rand_int(1, 64), c.sk = 300;  // one query block per head: `group` steps
      check_hopper_bwd(c, hopper_takes(d, dv));
      c.sq = 1025, c.sk = 200;
      check_hopper_bwd(c, hopper_takes(d, dv));
    }
  for (auto [d, dv] : dims) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 2, c.hkv = 1, c.d = d, c.dv = dv, c.sq = 70, c.sk = 700;
    c.causal = true, c.top_left = true;  // no query sees keys from 70 on: key blocks from 128 have no step
    check_hopper_bwd(c, hopper_takes(d, dv));
  }
}

// More (key block, kv head, sequence) work items than an H100 or H200 has SMs (132), with short
// query blocks so the fp64 reference stays cheap: more items than one wave of blocks (the case a
// kernel that walks several items per block must get right), among them items of no step (keys no
// query sees, key blocks past a short sequence), whose keys' dK, dV must still come out 0; GQA,
// dropout, softcap, varlen and deterministic mode on the same shapes.
TEST(CudaHopperBwd, ManyWorkItems) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    Case c;
    c.dtype = rand_dtype();
    c.batch = 24, c.hq = 6, c.hkv = 3, c.d = d, c.dv = d, c.sq = rand_int(1, 100), c.sk = 390;
    check_hopper_bwd(c, hopper_takes(d));
    c.sq = 70, c.causal = true, c.top_left = true;  // keys from 70 on: no query, no step
    check_hopper_bwd(c, hopper_takes(d));
    c.causal = false, c.top_left = false, c.dropout = 0.15f, c.softcap = 20.0f;
    check_hopper_bwd(c, hopper_takes(d));
    c.dropout = 0.0f, c.softcap = 0.0f;
    check_hopper_bwd(c, hopper_takes(d), /*det=*/true, /*repeats=*/2);
    Case v;
    v.dtype = rand_dtype();
    v.varlen = true;
    for (int b = 0; b < 40; ++b) {
      v.lq.push_back(rand_int(0, 90));
      v.lk.push_back(rand_int(1, 600));
    }
    v.hq = 4, v.hkv = 2, v.d = d, v.dv = d, v.causal = rand_int(0, 1);
    check_hopper_bwd(v, hopper_takes(d));
  }
}

TEST(CudaHopperBwd, LongerSequences) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 1, c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 1300, c.sk = 1300;
    c.causal = d != 64;
    check_hopper_bwd(c, hopper_takes(d));
  }
}

// Deterministic mode: every query block's dQ parts are added in a fixed order (descending key
// block, or the rotated walk's: DeterministicRotatedWalk; semaphores in the workspace), so repeated
// calls are bit-identical. Many key blocks per
// query block (the waits), one step per block (Sq small), causal in both alignments (key blocks
// that start at different query blocks), windows, GQA (several heads per block walk), varlen and
// seqused_k, dropout, padded and Dq != Dv dims, and each instance (64/128/256).
TEST(CudaHopperBwd, DeterministicIsBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 700, c.sk = 1500;
    check_hopper_bwd(c, true, /*det=*/true, /*repeats=*/3);
    c.causal = true, c.sinks = true;
    check_hopper_bwd(c, true, true, 2);
    c.top_left = true, c.sq = 1500, c.sk = 700, c.hkv = 1;
    check_hopper_bwd(c, true, true, 2);
    c.causal = false, c.top_left = false, c.sinks = false, c.wl = 200, c.wr = 30;
    check_hopper_bwd(c, true, true, 2);
    c.wl = -1, c.wr = -1, c.sq = 5, c.sk = 2000;  // one query block: one step per key block
    check_hopper_bwd(c, true, true, 2);
    c.sq = 600, c.sk = 600, c.dropout = 0.2f, c.causal = true;
    check_hopper_bwd(c, true, true, 2);
    Case v;
    v.dtype = rand_dtype();
    v.varlen = true, v.lq = {1, 520, 77, 300}, v.lk = {700, 3, 300, 1100};
    v.hq = 4, v.hkv = 2, v.d = d, v.dv = d;
    v.causal = true, v.alibi = true;
    check_hopper_bwd(v, true, true, 2);
    Case k;
    k.dtype = rand_dtype();
    k.batch = 3, k.hq = 8, k.hkv = 1, k.d = d, k.dv = d, k.sq = 200, k.sk = 900;
    k.cache = true, k.causal = true;  // seqused_k
    check_hopper_bwd(k, true, true, 2);
  }
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{192, 128}, {96, 96}, {40, 64}}) {
    SCOPED_TRACE("d " + std::to_string(d) + " dv " + std::to_string(dv));
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 333, c.sk = 900;
    c.causal = true, c.softcap = 30.0f, c.input_std = 3.0;
    check_hopper_bwd(c, true, true, 2);
  }
}

// Deterministic mode's rotated walk (bwd_hopper.cu DqRotation): without a causal mask or window,
// and with a head's key blocks within half a wave, key block n starts at query block n and each
// query block adds its dQ parts in an order of its own, still fixed. Sequences with as many, fewer
// and more key blocks than query blocks (the last keep the descending order inside a rotated
// plan), GQA, dropout and softcap, varlen mixing both kinds and empty sequences, padded head dims;
// causal calls and key blocks past half a wave take the descending order.
TEST(CudaHopperBwd, DeterministicRotatedWalk) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const int rot = flashport::gpu::hopper_bwd_rotates(int(d)) ? 1 : 0;  // the instance rotates at all
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 6, c.hkv = 2, c.d = d, c.dv = d, c.sq = 1000, c.sk = 1000;
    check_hopper_bwd(c, true, /*det=*/true, /*repeats=*/3, /*rotated=*/rot);
    c.sq = 777, c.sk = 600, c.dropout = 0.2f, c.softcap = 25.0f;
    check_hopper_bwd(c, true, true, 2, rot);
    c.dropout = 0.0f, c.softcap = 0.0f, c.sq = 300, c.sk = 1400;  // more key blocks than query blocks
    check_hopper_bwd(c, true, true, 2, rot);
    c.sq = 1000, c.sk = 1000, c.causal = true;
    check_hopper_bwd(c, true, true, 2, 0);
    c.causal = false, c.batch = 1, c.hq = 2, c.hkv = 1, c.sq = 40, c.sk = 20000;  // past half a wave
    check_hopper_bwd(c, true, true, 2, 0);
    Case v;
    v.dtype = rand_dtype();
    v.varlen = true, v.lq = {900, 5, 640, 0, 333, 1}, v.lk = {700, 600, 640, 50, 1, 1};
    v.hq = 4, v.hkv = 1, v.d = d, v.dv = d;
    check_hopper_bwd(v, true, true, 2, rot);
  }
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{192, 128}, {96, 96}}) {
    SCOPED_TRACE("d " + std::to_string(d) + " dv " + std::to_string(dv));
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 650, c.sk = 500, c.input_std = 2.0;
    check_hopper_bwd(c, true, true, 2, flashport::gpu::hopper_bwd_rotates(int(hopper_bucket(d, dv))) ? 1 : 0);
  }
}

// The rotated walk on a stream of a green context: the plan sizes the wave from the partition's
// SMs, not the device's, so a head's key blocks that would not fit in half of the partition take
// the descending order (the rotated walk could wait for a block no SM of the partition takes:
// a hang) and the call completes with the right gradients; a chain that fits still rotates.
TEST(CudaHopperBwd, DeterministicOnGreenContextStream) {
  SKIP_WITHOUT_GPU();
  if (!device_is_sm90() || !hopper_built()) GTEST_SKIP() << "needs the Hopper backward";
  const GreenStream gs(8);
  if (gs.stream == nullptr) GTEST_SKIP() << gs.why;
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(gs.stream);
  SCOPED_TRACE("green context of " + std::to_string(gs.sms) + " SMs");
  Case c;  // D64: 128-key blocks, one block per SM
  c.dtype = rand_dtype();
  c.batch = 1, c.hq = 2, c.hkv = 1, c.d = 64, c.dv = 64;
  // 2 key blocks: rotates in any partition of 4 SMs or more; sms + 2 key blocks: more than half a
  // wave even at 2 blocks per SM, so the descending order.
  for (int64_t key_blocks : {int64_t(2), int64_t(gs.sms) + 2}) {
    c.sq = 128 * key_blocks, c.sk = 128 * key_blocks;
    check_hopper_bwd(c, true, /*det=*/true, /*repeats=*/2, /*rotated=*/key_blocks == 2 ? 1 : 0, stream);
  }
}

TEST(CudaHopperBwd, DeclinesToMmaSync) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 130, c.sk = 260;
  c.dropout = 0.2f;  // dropout: the Hopper backward replays it (dropout_hopper_test.cpp)
  check_hopper_bwd(c, true);
  c.dropout = 0.0f;
  for (int64_t d : {96, 32}) {  // padded in the 128 / 64 instance
    c.d = d, c.dv = d;
    check_hopper_bwd(c, hopper_takes(d));
  }
  c.d = 256, c.dv = 256;
  check_hopper_bwd(c, hopper_takes(256));
  c.dropout = 0.2f;
  check_hopper_bwd(c, hopper_takes(256));
  c.dropout = 0.0f;
  c.strided = true;
  check_hopper_bwd(c, false);
  c.strided = false;
  c.d = 256, c.dv = 128;
  check_hopper_bwd(c, hopper_takes(256, 128));
  c.d = 128, c.dv = 64;
  check_hopper_bwd(c, hopper_takes(128, 64));
  c.d = 36, c.dv = 36;  // not a multiple of 8 (and head strides of 36: not 16-byte aligned)
  check_hopper_bwd(c, false);
  c.d = 64, c.dv = 64;
  c.strided = true;  // dout copies out's padded rows: not 16-byte aligned
  check_hopper_bwd(c, false);
  c.strided = false;
  setenv("FLASHPORT_HOPPER_BWD", "0", 1);  // the user's kill switch, read once: reload
  flashport::reload_runtime_config();
  check_hopper_bwd(c, false);
  unsetenv("FLASHPORT_HOPPER_BWD");
  flashport::reload_runtime_config();
  check_hopper_bwd(c, true);
}

// Strided q (head-major: [B, H, S, D] memory) and dout with padded rows and an extra head (strides
// of 16-byte multiples, so the Hopper backward takes them): the TMA views of q and dout carry the
// caller's strides (full query blocks by boxes, the tail block by the loaders' copies: Sq = 300),
// every instance and Dq != Dv, causal and GQA.
TEST(CudaHopperBwd, StridedLayouts) {
  SKIP_WITHOUT_GPU();
  const std::pair<int64_t, int64_t> dims[] = {{64, 64}, {128, 128}, {256, 256}, {192, 128}, {96, 96}};
  for (auto [d, dv] : dims)
    for (bool causal : {false, true}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = causal ? 1 : 4, c.d = d, c.dv = dv, c.sq = 300, c.sk = 333;
      c.strided = true, c.strided_aligned = true;
      c.causal = causal;
      check_hopper_bwd(c, true);
    }
}

// dK and dV leave through shared memory in 16-byte row chunks where their rows allow it; rows of
// 4-byte strides (dk, dv in their own padded layout) take the stores from the registers. Both
// against the reference at every instance: batched causal with GQA, varlen (an empty sequence,
// key counts ending mid-block) and seqused_k (rows past it get dK = dV = 0).
TEST(CudaHopperBwd, GradientRowAlignments) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256})
    for (bool unaligned : {false, true})
      for (int layout = 0; layout < 3; ++layout) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = 3, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 200, c.sk = 173;
        c.causal = true;
        if (layout == 1) c.varlen = true, c.lq = {130, 0, 200}, c.lk = {173, 64, 91}, c.causal = false;
        if (layout == 2) c.cache = true, c.sq = 20, c.sk = 300;
        c.grads_unaligned = unaligned;
        check_hopper_bwd(c, true);
      }
}

// Head dims other than the instances' 64/128/256 run padded inside the next instance (the copies
// zero-fill the columns past D and Dv, the dK/dV/dQ stores skip them), and Dq != Dv both ways
// (192/128 as DeepSeek-V3 prefill): awkward lengths, causal in both alignments, windows, GQA,
// varlen, seqused_k, softcap, ALiBi, sinks.
TEST(CudaHopperBwd, AnyHeadDim) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {32, 40, 80, 96, 112, 160, 192, 224, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 2, c.hkv = 2, c.d = d, c.dv = d, c.sq = 129, c.sk = 257;
    check_hopper_bwd(c, true);
    c.sq = 300, c.sk = 113, c.hq = 4, c.hkv = 1;
    c.causal = true, c.top_left = d % 16 == 0;
    check_hopper_bwd(c, true);
    c.causal = false, c.wl = 37, c.wr = 5;
    c.softcap = 20.0f, c.input_std = 2.0, c.sinks = true;
    check_hopper_bwd(c, true);
    Case v;
    v.dtype = rand_dtype();
    v.varlen = true, v.lq = {1, 200, 77}, v.lk = {65, 3, 300};
    v.hq = 4, v.hkv = 2, v.d = d, v.dv = d;
    v.causal = true, v.alibi = true;
    check_hopper_bwd(v, true);
  }
  const std::pair<int64_t, int64_t> pairs[] = {{192, 128}, {128, 64}, {64, 128}, {128, 192}, {256, 64}, {96, 32}};
  for (auto [d, dv] : pairs) {
    SCOPED_TRACE("d " + std::to_string(d) + " dv " + std::to_string(dv));
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 200, c.sk = 333;
    check_hopper_bwd(c, true);
    c.causal = true, c.sinks = true, c.sq = 333, c.sk = 200;
    check_hopper_bwd(c, true);
    c.causal = false, c.sinks = false, c.hkv = 1, c.wl = 64, c.wr = 0, c.softcap = 30.0f, c.input_std = 3.0;
    check_hopper_bwd(c, true);
    Case v;
    v.dtype = rand_dtype();
    v.varlen = true, v.lq = {130, 1, 257}, v.lk = {300, 77, 400};
    v.hq = 2, v.hkv = 1, v.d = d, v.dv = dv;
    v.causal = true, v.top_left = true;
    check_hopper_bwd(v, true);
    Case k;
    k.dtype = rand_dtype();
    k.batch = 3, k.hq = 4, k.hkv = 2, k.d = d, k.dv = dv, k.sq = 20, k.sk = 190;
    k.cache = true, k.causal = true;  // rows past seqused_k[b] must get dk = dv = 0
    check_hopper_bwd(k, true);
  }
}

// Captured into a CUDA graph on a non-blocking stream (no allocation, sync or host read inside
// the call) and replayed twice: both replays close to the reference (atomic dQ: not bitwise).
void check_graph_capture(int64_t d) {
  SCOPED_TRACE("d " + std::to_string(d));
  Case c;
  c.dtype = FP_BF16;
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 300, c.sk = 300;
  c.causal = true, c.sinks = true;
  BwdCall bc(c);
  ASSERT_TRUE(bc.ok) << bc.error;
  const BwdOutputs ref = run_reference_bwd(bc);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceBwd dev(bc);
  const BwdOutputs first = dev.run(bc, false);  // sizes the workspace
  ASSERT_TRUE(first.ok) << first.error;
  EXPECT_EQ(std::string(first.sel.kernel).find(kHopperBwdName) != std::string::npos,
            device_is_sm90() && hopper_built() && hopper_takes(d))
      << first.sel.kernel;
  BwdGraph g;
  ASSERT_NO_FATAL_FAILURE(capture_bwd(bc, dev, /*det=*/false, &g));
  const double tol = flashport::test::grad_tolerance(c.dtype);
  for (int r = 0; r < 2; ++r) {
    CUDA_OK(cudaGraphLaunch(g.exec, g.stream));
    CUDA_OK(cudaStreamSynchronize(g.stream));
    BwdOutputs got;
    dev.download_grads(&got);
    EXPECT_TRUE(close(got.dq.to_double(), ref.dq.to_double(), tol, "dq (graph replay)"));
    EXPECT_TRUE(close(got.dk.to_double(), ref.dk.to_double(), tol, "dk (graph replay)"));
    EXPECT_TRUE(close(got.dv.to_double(), ref.dv.to_double(), tol, "dv (graph replay)"));
    EXPECT_TRUE(close(got.dsinks.to_double(), ref.dsinks.to_double(), tol, "d_sinks (graph replay)"));
  }
}

TEST(CudaHopperBwd, GraphCaptureOnCallerStream) {
  SKIP_WITHOUT_GPU();
  check_graph_capture(128);
  check_graph_capture(256);
  check_graph_capture(96);  // padded in the 128 instance
}

}  // namespace
}  // namespace gputest
