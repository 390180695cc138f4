// The sm_90a wgmma prefill kernel (src/gpu/fwd_hopper.cu) against the fp64 reference: odd
// lengths, causal in both alignments, windows, GQA, varlen, LSE, softcap/ALiBi/sinks, strided
// tensors, rows without keys; and the selection itself: taken on sm_90 where the capability check
// allows it, declined (and the mma.sync kernel still correct) where it does not, and under the
// schedule FLASHPORT_HOPPER_SCHED asks for (3, the default: TMA producer warp, mbarrier rings,
// ping-pong consumers; 1: cp.async, all threads load). scripts/device_hopper.sh runs the suite under both;
// BothSchedulesInOneProcess switches between them (and v3's ping-pong off) in-process.
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "gpu_harness.hpp"

namespace gputest {
namespace {

constexpr const char* kHopperName = "sm90_wgmma";

// The schedule the library will pick (the same rule as fwd_hopper.hpp's hopper_schedule()).
int requested_schedule() {
  const char* env = std::getenv("FLASHPORT_HOPPER_SCHED");
  return env != nullptr && env[0] == '1' ? 1 : 3;
}

// Runs the case against the reference and checks which kernel (and which schedule) ran.
void check_hopper(const Case& c, bool expect_hopper) {
  fp_selection sel{};
  check_case(c, &sel);
  const std::string ran(sel.kernel);
  const bool took = ran.find(kHopperName) != std::string::npos;
  const bool want = expect_hopper && device_is_sm90() && hopper_built();
  EXPECT_EQ(took, want) << c.describe() << " ran " << ran;
  if (took) {
    const char* sched_tag = requested_schedule() == 3 ? "_tma_ws" : "_cpasync";
    EXPECT_NE(ran.find(sched_tag), std::string::npos) << c.describe() << " ran " << ran;
  }
}

// Sets an environment variable for the scope, restoring the previous value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) had_ = true, old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(CudaHopperFwd, HeadDimsDtypesAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256})
    for (fp_dtype t : {FP_BF16, FP_F16})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}, {1025, 77},
                            {77, 1025}, {256, 256}, {300, 1000}}) {
        Case c;
        c.dtype = t;
        c.batch = rand_int(1, 2);
        c.hq = 2, c.hkv = 2, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
        // sq * pack <= 64 is a decode-shaped call: the mma.sync decode tile takes it.
        check_hopper(c, sq > 64);
      }
}

TEST(CudaHopperFwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  struct W { bool causal, top_left; int wl, wr; };
  for (int64_t d : {64, 128, 256})
    for (W w : {W{true, false, -1, -1}, W{true, true, -1, -1}, W{false, false, 100, 0}, W{false, false, 37, 200},
                W{false, true, 0, 0}, W{false, false, -1, 5}, W{true, false, 300, -1}})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1025, 1025}, {200, 700}, {700, 200}, {129, 131}}) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = 2, c.hq = 3, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
        c.causal = w.causal, c.top_left = w.top_left, c.wl = w.wl, c.wr = w.wr;
        check_hopper(c, true);
      }
}

TEST(CudaHopperFwd, GqaVarlenAndNoLse) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256})
    for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 1}, {8, 2}, {6, 3}, {4, 4}}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = d, c.dv = d, c.sq = 190, c.sk = 333;
      c.causal = rand_int(0, 1);
      c.lse = rand_int(0, 1);
      check_hopper(c, true);
    }
  for (int64_t d : {64, 128, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.varlen = true;
    c.hq = 4, c.hkv = 2, c.d = d, c.dv = d;
    c.lq = {1, 3, 113, 1025, 200, 0, 130};
    c.lk = {1, 113, 3, 1025, 700, 5, 0};
    c.causal = true;
    c.top_left = d == 64;
    check_hopper(c, true);
    c.causal = false;
    c.wl = 64, c.wr = 16;
    check_hopper(c, true);
  }
}

TEST(CudaHopperFwd, ScoreFeaturesAndStrides) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 300, c.sk = 257;
    c.softcap = 30.0f;
    c.input_std = 3.0;
    check_hopper(c, true);
    c.softcap = 0.0f, c.input_std = 1.0;
    c.alibi = true;
    c.causal = true;
    check_hopper(c, true);
    c.alibi_per_batch = true;
    c.sinks = true;
    check_hopper(c, true);
    c.alibi = false, c.alibi_per_batch = false;
    c.scale = 0.3f;
    check_hopper(c, true);
    Case s;
    s.dtype = rand_dtype();
    s.batch = 2, s.hq = 2, s.hkv = 2, s.d = d, s.dv = d, s.sq = 150, s.sk = 290;
    s.strided = true;
    check_case(s);  // permuted / padded layouts: correct on whichever kernel takes them
  }
}

TEST(CudaHopperFwd, RowsWithoutKeys) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c;  // bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key
    c.dtype = rand_dtype();
    c.hq = 2, c.hkv = 2, c.d = d, c.dv = d, c.sq = 400, c.sk = 130, c.causal = true;
    check_hopper(c, true);
    c.sinks = true;  // ... and with a sink they get lse = sink, out = 0
    check_hopper(c, true);
  }
}

TEST(CudaHopperFwd, DeclinedCallsFallBack) {
  SKIP_WITHOUT_GPU();
  Case base;
  base.dtype = FP_BF16;
  base.batch = 1, base.hq = 2, base.hkv = 2, base.d = 128, base.dv = 128, base.sq = 200, base.sk = 300;
  {
    Case c = base;
    c.dropout = 0.2f;
    check_hopper(c, false);
  }
  for (int64_t d : {96, 32, 192}) {
    Case c = base;
    c.d = d, c.dv = d;
    check_hopper(c, false);
  }
  {
    Case c = base;
    c.dv = 64;
    check_hopper(c, false);
  }
  {
    Case c = base;
    c.splits = 2;
    check_hopper(c, false);
  }
  {
    Case c = base;
    c.cache = true, c.paged = true, c.page_size = 16;
    check_hopper(c, false);
  }
  {
    Case c = base;
    c.cache = true;
    check_hopper(c, false);
  }
  {
    Case c = base;
    c.sq = 1;  // decode
    check_hopper(c, false);
  }
  {
    Case c = base;
    setenv("FLASHPORT_HOPPER_FWD", "0", 1);
    check_hopper(c, false);
    unsetenv("FLASHPORT_HOPPER_FWD");
    check_hopper(c, true);
  }
}

TEST(CudaHopperFwd, LongKeysManyTiles) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 130, c.sk = 2500;
    check_hopper(c, true);
    c.causal = true, c.top_left = true;
    check_hopper(c, true);
  }
}

TEST(CudaHopperFwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int it = 0; it < 24; ++it) {
    Case c;
    c.dtype = rand_dtype();
    c.d = std::vector<int64_t>{64, 128, 256}[rand_int(0, 2)];
    c.dv = c.d;
    const int64_t g = std::vector<int64_t>{1, 2, 4}[rand_int(0, 2)];
    c.hkv = rand_int(1, 2), c.hq = c.hkv * g;
    c.batch = rand_int(1, 3);
    c.sq = rand_int(65, 700), c.sk = rand_int(1, 900);
    c.causal = rand_int(0, 2) == 0;
    c.top_left = rand_int(0, 1);
    if (!c.causal && rand_int(0, 2) == 0) c.wl = int32_t(rand_int(0, 300)), c.wr = int32_t(rand_int(-1, 300));
    c.softcap = rand_int(0, 4) == 0 ? 20.0f : 0.0f;
    c.alibi = rand_int(0, 4) == 0;
    c.sinks = rand_int(0, 4) == 0;
    c.lse = rand_int(0, 3) != 0;
    check_hopper(c, true);
  }
}

// Both schedules (and v3 without ping-pong, v3 on a persistent grid) on the same cases in one
// process: each checked against the reference, and each must be the kernel that ran. The big case
// has more work tiles (9 x 8 x 3 = 216) than an H100 has SMs, so persistent blocks take several
// tiles each (ring and Q rounds carried across tiles).
TEST(CudaHopperFwd, BothSchedulesInOneProcess) {
  SKIP_WITHOUT_GPU();
  struct Variant { const char* sched; const char* pingpong; const char* persistent; const char* tag; };
  for (Variant v : {Variant{"1", "1", "0", "_cpasync"}, Variant{"3", "1", "0", "_tma_ws:"},
                    Variant{"3", "0", "0", "_tma_ws_nopp"}, Variant{"3", "1", "1", "_tma_ws_persist:"},
                    Variant{"3", "0", "1", "_tma_ws_persist_nopp"}}) {
    ScopedEnv sched("FLASHPORT_HOPPER_SCHED", v.sched), pp("FLASHPORT_HOPPER_PINGPONG", v.pingpong),
        persist("FLASHPORT_HOPPER_PERSISTENT", v.persistent);
    auto expect_tag = [&](const fp_selection& sel) {
      if (device_is_sm90() && hopper_built())
        EXPECT_NE(std::string(sel.kernel).find(v.tag), std::string::npos)
            << "FLASHPORT_HOPPER_SCHED=" << v.sched << " PINGPONG=" << v.pingpong
            << " PERSISTENT=" << v.persistent << " ran " << sel.kernel;
    };
    for (int64_t d : {64, 128, 256}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 333, c.sk = 1111;
      c.causal = rand_int(0, 1);
      c.lse = true;
      fp_selection sel{};
      check_case(c, &sel);
      expect_tag(sel);
      Case w = c;  // varlen with a window: per-sequence tails inside the packed tensor
      w.varlen = true, w.causal = false, w.wl = 90, w.wr = 7;
      w.lq = {200, 1, 129, 0, 640};
      w.lk = {777, 50, 129, 9, 300};
      check_case(w, &sel);
      expect_tag(sel);
    }
    Case big;
    big.dtype = rand_dtype();
    big.batch = 3, big.hq = 8, big.hkv = 2, big.d = 128, big.dv = 128, big.sq = 1100, big.sk = 700;
    big.causal = true;
    big.sinks = rand_int(0, 1);
    fp_selection sel{};
    check_case(big, &sel);
    expect_tag(sel);
  }
}

}  // namespace
}  // namespace gputest
