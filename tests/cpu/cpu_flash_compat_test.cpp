// flash_attn semantics on the CPU backend, against the fp64 reference: causal = 1 intersected
// with a window (any window_right >= -1), and left-padded KV caches (cache_leftpad).
#include <functional>

#include "cpu_harness.hpp"

namespace cputest {
namespace {

Case mk(std::string name, std::function<void(Case&)> f) {
  Case c;
  c.name = std::move(name);
  f(c);
  return c;
}

// The four window shapes flash_attn clients pass with causal = True: (w, w) (transformers'
// sliding windows), (w, 0), (-1, w) and (w, -1); both alignments; batched, varlen, KV cache.
std::vector<Case> causal_window_cases() {
  std::vector<Case> v;
  struct W { int wl, wr; const char* n; };
  const W windows[] = {{9, 9, "w_w"}, {9, 0, "w_0"}, {-1, 9, "none_w"}, {9, -1, "w_none"}};
  for (const W& w : windows)
    for (bool tl : {false, true}) {
      const std::string tag = std::string(w.n) + (tl ? "_tl" : "_br");
      v.push_back(mk("batched_" + tag, [&](Case& c) {
        c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.sq = 70; c.sk = 90; c.hq = 4; c.hkv = 2; c.bwd = true;
      }));
      v.push_back(mk("batched_sq_gt_sk_bf16_" + tag, [&](Case& c) {
        c.dt = FP_BF16; c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.sq = 100; c.sk = 40; c.hq = 4; c.hkv = 1; c.bwd = true; c.sinks = true; c.d_sinks = true;
      }));
      v.push_back(mk("varlen_" + tag, [&](Case& c) {
        c.varlen = true; c.b = 3; c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.sq = 60; c.sk = 80; c.bwd = true; c.alibi = 2;
      }));
      v.push_back(mk("cache_append_rotary_" + tag, [&](Case& c) {
        c.cache = Cache::Contiguous; c.snew = 4; c.sq = 4; c.sk = 150; c.b = 3; c.hq = 8; c.hkv = 2;
        c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.rotary = Rotary::Half; c.rotary_dim = 16;
      }));
      v.push_back(mk("paged_decode_splits_" + tag, [&](Case& c) {
        c.cache = Cache::Paged; c.page = 16; c.sq = 1; c.sk = 400; c.b = 2; c.hq = 8; c.hkv = 1;
        c.splits = 0; c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
      }));
    }
  return v;
}

class CpuCausalWindow : public ::testing::TestWithParam<Case> {};
TEST_P(CpuCausalWindow, MatchesReference) { run_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cases, CpuCausalWindow, ::testing::ValuesIn(causal_window_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace cputest
