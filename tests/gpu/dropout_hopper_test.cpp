// Dropout on the sm_90a kernels (src/gpu/common/dropout_lanes.cuh): forward and backward against
// the fp64 reference (which applies the same Philox rule, core/philox.hpp) over head dims, masks,
// GQA, varlen, awkward lengths, split-KV, score features and the device-resident RNG state; and
// the keep mask itself, read back bit by bit from probe inputs, against the rule and against the
// mma.sync kernels (FLASHPORT_HOPPER_FWD=0 / FLASHPORT_HOPPER_BWD=0).
//
// The probes: q = 0 makes every score 0, so P = 1 / Sk exactly (Sk a power of two). Forward: value
// row j of v is 2^(j / Dv) in column j % Dv, so out[i][c] Sk (keep rate) is the integer whose bit t
// is the keep bit of (i, key c + t Dv). Backward: dout row i is 2^(i / Dv) in column i % Dv, so
// dv[j][c] Sk (keep rate) is the integer whose bit t is the keep bit of (query c + t Dv, key j).
// Skipped without a CUDA device; the kernel checks expect the Hopper kernels on sm_90 only.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "bwd_harness.hpp"
#include "core/config.hpp"
#include "core/philox.hpp"
#include "scenarios.hpp"

namespace gputest {
namespace {

bool hopper_here() { return device_is_sm90() && hopper_built(); }
bool ran(const fp_selection& sel, const char* name) { return std::string(sel.kernel).find(name) != std::string::npos; }
constexpr const char* kHopperFwd = "sm90_wgmma_prefill";
constexpr const char* kHopperBwd = "sm90_wgmma_bwd";

// The user's kill switch for one kernel family, for the scope (settings are read once: reload).
struct KillSwitch {
  const char* name;
  explicit KillSwitch(const char* n) : name(n) {
    setenv(name, "0", 1);
    flashport::reload_runtime_config();
  }
  ~KillSwitch() {
    unsetenv(name);
    flashport::reload_runtime_config();
  }
};

void check_fwd(const Case& c) {
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_EQ(ran(sel, kHopperFwd), hopper_here()) << c.describe() << " ran " << sel.kernel;
}

void check_bwd_hopper(const Case& c) {
  fp_selection sel{};
  check_bwd(c, /*det=*/false, /*repeats=*/1, &sel);
  if (sel.kernel[0] == '\0') return;  // the call failed: check_bwd said why
  EXPECT_EQ(ran(sel, kHopperBwd), hopper_here()) << c.describe() << " ran " << sel.kernel;
}

TEST(CudaHopperDropoutFwd, ForwardAgainstReference) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    for (float p : kDropoutRates) {
      // Head dims, GQA, odd lengths (tails of query blocks and key tiles in both directions).
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{129, 257}, {300, 333}, {77, 1025}, {1025, 77}}) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = sq, c.sk = sk, c.dropout = p;
        c.lse = rand_int(0, 1);
        check_fwd(c);
      }
    }
    // Causal in both alignments and windows.
    for (const MaskVariant& w : mask_variants(4)) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 3, c.hkv = 1, c.d = d, c.dv = d, c.sq = 700, c.sk = 500, c.dropout = 0.2f;
      w.apply(c);
      check_fwd(c);
    }
    // Varlen: empty sequences, one-row sequences, per-sequence key tails.
    Case v;
    v.dtype = rand_dtype();
    set_awkward_varlen(v);
    v.hq = 4, v.hkv = 2, v.d = d, v.dv = d, v.dropout = 0.3f;
    v.causal = true;
    check_fwd(v);
    // Score features with dropout: softcap, ALiBi, sinks (the sink is never dropped).
    Case f;
    f.dtype = rand_dtype();
    f.batch = 2, f.hq = 4, f.hkv = 2, f.d = d, f.dv = d, f.sq = 300, f.sk = 257, f.dropout = 0.25f;
    f.softcap = 30.0f, f.input_std = 3.0;
    check_fwd(f);
    f.softcap = 0.0f, f.input_std = 1.0, f.alibi = true, f.sinks = true, f.causal = true;
    check_fwd(f);
  }
}

// Split-KV (forced and automatic counts), padded head dims, paged KV caches, and the RNG state in
// device memory (direct and split).
TEST(CudaHopperDropoutFwd, ForwardSplitsCachesAndDeviceRng) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    Case s;
    s.dtype = rand_dtype();
    s.batch = 1, s.hq = 2, s.hkv = 2, s.d = d, s.dv = d, s.sq = 200, s.sk = 1500, s.dropout = 0.2f;
    s.splits = 3;
    check_fwd(s);
    s.splits = 0, s.sq = 130, s.sk = 9000;  // long keys, few work tiles: the heuristic splits
    check_fwd(s);
    Case r;
    r.dtype = rand_dtype();
    r.batch = 2, r.hq = 4, r.hkv = 1, r.d = d, r.dv = d, r.sq = 131, r.sk = 257, r.dropout = 0.3f;
    r.rng_on_device = true, r.causal = true;
    check_fwd(r);
    r.splits = 3;
    check_fwd(r);
  }
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{96, 96}, {160, 160}, {192, 128}}) {
    Case pd;  // padded head dims (96 in the 128 instance, 160 and 192/128 in the 192 one)
    pd.dtype = rand_dtype();
    pd.batch = 2, pd.hq = 4, pd.hkv = 2, pd.d = d, pd.dv = dv, pd.sq = 200, pd.sk = 333, pd.dropout = 0.2f;
    check_fwd(pd);
  }
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{128, 128}, {192, 128}}) {
    Case k;  // paged cache (pages of 64 rows, 96 at D192: TMA boxes), unused rows NaN
    k.dtype = rand_dtype();
    k.cache = true, k.paged = true, k.page_size = d == 192 ? 96 : 64, k.nan_unused_cache = true;
    k.batch = 2, k.hq = 4, k.hkv = 2, k.d = d, k.dv = dv, k.sq = 140, k.sk = 600, k.dropout = 0.2f;
    k.seqused = {500, 600};
    k.causal = true;
    check_fwd(k);
  }
}

TEST(CudaHopperDropoutBwd, BackwardAgainstReference) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    for (float p : kDropoutRates)
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{129, 257}, {300, 200}, {65, 63}}) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = sq, c.sk = sk, c.dropout = p;
        check_bwd_hopper(c);
      }
    for (const MaskVariant& w : mask_variants(3)) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 400, c.sk = 300, c.dropout = 0.2f;
      w.apply(c);
      check_bwd_hopper(c);
    }
    Case v;
    v.dtype = rand_dtype();
    v.varlen = true;
    v.hq = 4, v.hkv = 4, v.d = d, v.dv = d, v.dropout = 0.3f;
    v.lq = {1, 300, 0, 130};
    v.lk = {77, 250, 5, 129};
    v.causal = true;
    check_bwd_hopper(v);
    Case f;
    f.dtype = rand_dtype();
    f.batch = 2, f.hq = 4, f.hkv = 2, f.d = d, f.dv = d, f.sq = 300, f.sk = 333, f.dropout = 0.25f;
    f.softcap = 5.0f, f.alibi = true, f.sinks = true, f.causal = true;
    check_bwd_hopper(f);
    Case r;
    r.dtype = rand_dtype();
    r.batch = 2, r.hq = 4, r.hkv = 2, r.d = d, r.dv = d, r.sq = 97, r.sk = 150, r.dropout = 0.3f;
    r.rng_on_device = true, r.causal = true;
    check_bwd_hopper(r);
  }
  Case pd;  // padded head dims
  pd.dtype = rand_dtype();
  pd.batch = 2, pd.hq = 4, pd.hkv = 2, pd.d = 96, pd.dv = 96, pd.sq = 200, pd.sk = 333, pd.dropout = 0.2f;
  check_bwd_hopper(pd);
}

// ---- keep-mask probes ----------------------------------------------------------------------

uint32_t threshold_of(float p) { return flashport::dropout_threshold(p); }
double keep_rate_of(float p) { return (256.0 - threshold_of(p)) / 256.0; }

// Bit t of the decoded integer round(x * scale), t < bits; false and a failure when x is not
// within 0.25 of an integer in [0, 2^bits).
int decode_bits(double x, double scale, int bits) {
  const double y = x * scale;
  const double n = std::nearbyint(y);
  EXPECT_LT(std::fabs(y - n), 0.25) << "probe value " << x << " does not decode";
  EXPECT_GE(n, 0.0);
  EXPECT_LT(n, double(1 << bits));
  return int(n);
}

// Forward probe of a batched or varlen case (Sk a multiple of Dv, Sk / Dv <= 4, Sk a power of two):
// the keep bit of every (sequence, head, row, key), in that order.
std::vector<char> forward_mask(const Case& cs, fp_selection* sel) {
  Call call(cs);
  call.q.fill_value(0.0);
  call.v.fill_value(0.0);
  const int64_t dv = cs.dv, sk = cs.varlen ? cs.lk[0] : cs.sk, tiles = sk / dv;
  const auto ck = cs.varlen ? cumsum(cs.lk) : std::vector<int32_t>();
  const int64_t batch = cs.varlen ? int64_t(cs.lq.size()) : cs.batch;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < sk; ++j)
      for (int64_t h = 0; h < cs.hkv; ++h) {
        const double val = std::ldexp(1.0, int(j / dv));
        if (cs.varlen) call.v.set({ck[b] + j, h, j % dv}, val);
        else call.v.set({b, j, h, j % dv}, val);
      }
  DeviceCall dev(call);
  const Outputs got = run_cuda(call, dev);
  EXPECT_TRUE(got.ok) << got.error;
  *sel = got.sel;
  std::vector<char> mask;
  if (!got.ok) return mask;
  const auto cq = cs.varlen ? cumsum(cs.lq) : std::vector<int32_t>();
  const double scale = double(sk) * keep_rate_of(cs.dropout);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lq = cs.varlen ? cs.lq[b] : cs.sq;
    for (int64_t h = 0; h < cs.hq; ++h)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < sk; ++j) {
          const int64_t c = j % dv;
          const double x = cs.varlen ? got.out.get({cq[b] + i, h, c}) : got.out.get({b, i, h, c});
          mask.push_back(char((decode_bits(x, scale, int(tiles)) >> (j / dv)) & 1));
        }
  }
  return mask;
}

// The rule's keep bits in forward_mask's order (backward_mask's order with swap_ij).
std::vector<char> rule_mask(const Case& cs, int64_t rows, int64_t keys) {
  std::vector<char> mask;
  const int64_t batch = cs.varlen ? int64_t(cs.lq.size()) : cs.batch;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lq = cs.varlen ? cs.lq[b] : rows;
    for (int64_t h = 0; h < cs.hq; ++h)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < keys; ++j)
          mask.push_back(char(flashport::dropout_keep(Call::kSeed, Call::kOffset, threshold_of(cs.dropout), b, cs.hq,
                                                      h, i, j)));
  }
  return mask;
}

int64_t mismatches(const std::vector<char>& a, const std::vector<char>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t x = 0; x < a.size(); ++x) n += a[x] != b[x];
  return n;
}

TEST(CudaHopperDropoutFwd, ForwardKeepMaskIsTheRuleAndTheMmaKernels) {
  SKIP_WITHOUT_GPU();
  // 192/128: the D192 instance (the probe wants Sk = 4 Dv a power of two).
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{64, 64}, {128, 128}, {192, 128}, {256, 256}})
    for (int variant = 0; variant < 4; ++variant) {
      Case c;
      c.dtype = variant % 2 ? FP_F16 : FP_BF16;
      c.d = d, c.dv = dv;
      const int64_t sk = 4 * dv;  // 4 probe tiles of Dv keys (2 to 16 key tiles of the kernels)
      c.dropout = variant == 1 ? 0.5f : 0.17f;
      c.hq = 3, c.hkv = 1;  // GQA: the query head picks the Philox stream
      if (variant == 2) {
        c.varlen = true;  // positions relative to each sequence
        c.lq = {150, 70, 129};
        c.lk = {sk, sk, sk};
      } else {
        c.batch = 2, c.sq = 200, c.sk = sk;
      }
      if (variant == 3) c.splits = 3, c.rng_on_device = true;
      SCOPED_TRACE(c.describe());
      fp_selection hsel{}, msel{};
      const std::vector<char> hopper = forward_mask(c, &hsel);
      EXPECT_EQ(ran(hsel, kHopperFwd), hopper_here()) << hsel.kernel;
      std::vector<char> mma;
      {
        KillSwitch off("FLASHPORT_HOPPER_FWD");
        mma = forward_mask(c, &msel);
      }
      EXPECT_FALSE(ran(msel, kHopperFwd)) << msel.kernel;
      const std::vector<char> rule = rule_mask(c, c.sq, sk);
      EXPECT_EQ(mismatches(hopper, rule), 0) << hsel.kernel << " against the rule";
      EXPECT_EQ(mismatches(mma, rule), 0) << msel.kernel << " against the rule";
      EXPECT_EQ(mismatches(hopper, mma), 0) << hsel.kernel << " against " << msel.kernel;
      int64_t kept = 0;
      for (char x : rule) kept += x;
      EXPECT_GT(kept, 0);
      EXPECT_LT(kept, int64_t(rule.size()));  // both values occur: the probe can fail
    }
}

// Backward probe (Sq = 4 Dv queries, Sk a power of two, no GQA: dv sums over the heads of a
// group): the keep bit of every (sequence, head, query, key), in rule_mask's order.
std::vector<char> backward_mask(const Case& cs, fp_selection* sel) {
  BwdCall bc(cs);
  EXPECT_TRUE(bc.ok) << bc.error;
  if (!bc.ok) return {};
  bc.call.q.fill_value(0.0);
  const Outputs ref = run_reference(bc.call);  // out and lse of the probe's q
  EXPECT_TRUE(ref.ok) << ref.error;
  bc.out.from_double(ref.out.to_double());
  bc.lse.from_double(ref.lse.to_double());
  const int64_t dv = cs.dv, sq = cs.sq, sk = cs.sk, tiles = sq / dv;
  bc.dout.fill_value(0.0);
  for (int64_t b = 0; b < cs.batch; ++b)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t h = 0; h < cs.hq; ++h) bc.dout.set({b, i, h, i % dv}, std::ldexp(1.0, int(i / dv)));
  DeviceBwd dev(bc);
  const BwdOutputs got = dev.run(bc, /*det=*/false);
  EXPECT_TRUE(got.ok) << got.error;
  *sel = got.sel;
  std::vector<char> mask;
  if (!got.ok) return mask;
  const double scale = double(sk) * keep_rate_of(cs.dropout);
  std::vector<int> n(size_t(sk * dv));
  for (int64_t b = 0; b < cs.batch; ++b)
    for (int64_t h = 0; h < cs.hq; ++h) {
      for (int64_t j = 0; j < sk; ++j)
        for (int64_t c = 0; c < dv; ++c) n[size_t(j * dv + c)] = decode_bits(got.dv.get({b, j, h, c}), scale, int(tiles));
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t j = 0; j < sk; ++j) mask.push_back(char((n[size_t(j * dv + i % dv)] >> (i / dv)) & 1));
    }
  return mask;
}

TEST(CudaHopperDropoutBwd, BackwardKeepMaskIsTheRuleAndTheMmaKernels) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256})
    for (int variant = 0; variant < 2; ++variant) {
      Case c;
      c.dtype = variant ? FP_F16 : FP_BF16;
      c.d = d, c.dv = d;
      c.batch = 2, c.hq = 2, c.hkv = 2, c.sq = 4 * d, c.sk = variant ? 256 : 512;
      c.dropout = variant ? 0.5f : 0.17f;
      c.rng_on_device = variant == 1;
      SCOPED_TRACE(c.describe());
      fp_selection hsel{}, msel{};
      const std::vector<char> hopper = backward_mask(c, &hsel);
      EXPECT_EQ(ran(hsel, kHopperBwd), hopper_here()) << hsel.kernel;
      std::vector<char> mma;
      {
        KillSwitch off("FLASHPORT_HOPPER_BWD");
        mma = backward_mask(c, &msel);
      }
      EXPECT_FALSE(ran(msel, kHopperBwd)) << msel.kernel;
      const std::vector<char> rule = rule_mask(c, c.sq, c.sk);
      EXPECT_EQ(mismatches(hopper, rule), 0) << hsel.kernel << " against the rule";
      EXPECT_EQ(mismatches(mma, rule), 0) << msel.kernel << " against the rule";
      EXPECT_EQ(mismatches(hopper, mma), 0) << hsel.kernel << " against " << msel.kernel;
    }
}

}  // namespace
}  // namespace gputest
