// The sm_90a wgmma prefill kernel (src/gpu/hopper/fwd_hopper.cu) against the fp64 reference: odd
// lengths, causal in both alignments, windows, GQA, varlen, LSE, softcap/ALiBi/sinks, strided
// tensors, rows without keys; and the selection itself: taken on sm_90 where its candidate check
// allows it, declined (and the mma.sync kernel still correct) where it does not or when the user's
// kill switch FLASHPORT_HOPPER_FWD=0 is set.
// SplitKv*: split-KV (partials in the workspace, pre-filled with 0xFF bytes = NaN, then the
// combine kernel) with forced and automatic counts, every feature, CUDA graphs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <string>

#include "core/config.hpp"
#include "core/heuristics.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu/hopper/bwd_hopper.hpp"
#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu_harness.hpp"
#include "scenarios.hpp"

namespace gputest {
namespace {

constexpr const char* kHopperName = "sm90_wgmma";

// The Hopper kernel can run on this device and build.
bool hopper_here() { return device_is_sm90() && hopper_built(); }

// The plan's name says split-KV exactly when it splits.
void expect_split_tag(const fp_selection& sel, const std::string& what) {
  const bool tagged = std::string(sel.kernel).find(":splitkv+combine") != std::string::npos;
  EXPECT_EQ(tagged, sel.num_splits > 1) << what << " ran " << sel.kernel << " with " << sel.num_splits << " splits";
  if (sel.num_splits > 1) EXPECT_GT(sel.workspace_bytes, 0u) << what;
}

// Runs the case against the reference and checks which kernel (and which schedule) ran.
void check_hopper(const Case& c, bool expect_hopper) {
  fp_selection sel{};
  check_case(c, &sel);
  const std::string ran(sel.kernel);
  const bool took = ran.find(kHopperName) != std::string::npos;
  const bool want = expect_hopper && hopper_here();
  EXPECT_EQ(took, want) << c.describe() << " ran " << ran;
  if (took) {
    EXPECT_NE(ran.find("_tma_ws"), std::string::npos) << c.describe() << " ran " << ran;
    expect_split_tag(sel, c.describe());
  }
}

// check_case with the workspace filled with 0xFF bytes (NaN as fp32) before the call, so every
// partial and LSE the combine reads must come from this call; the call's workspace starts
// ws_offset bytes into the allocation. Returns the selection.
fp_selection check_case_garbage_ws(const Case& cs, size_t ws_offset = 0) {
  SCOPED_TRACE(cs.describe());
  fp_selection none{};
  Call call(cs);
  const Outputs ref = run_reference(call);
  EXPECT_TRUE(ref.ok) << ref.error;
  if (!ref.ok) return none;
  DeviceCall dev(call);
  dev.workspace_offset = ws_offset;
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  fp_selection sel{};
  EXPECT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
  if (sel.workspace_bytes > 0) {
    HostTensor sized(FP_F32, {static_cast<int64_t>((sel.workspace_bytes + ws_offset + 3) / 4)});
    dev.workspace.upload(sized);
    EXPECT_EQ(cudaMemset(dev.workspace.ptr, 0xFF, dev.workspace.bytes), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the call's stream does not wait for the legacy one
  }
  const Outputs got = run_cuda(call, dev);
  EXPECT_TRUE(got.ok) << got.error;
  if (!got.ok) return none;
  SCOPED_TRACE(std::string("kernel ") + got.sel.kernel);
  const double tol = flashport::test::tolerance(cs.dtype);
  EXPECT_TRUE(flashport::test::close(gather_rows(call, got.out, false), gather_rows(call, ref.out, false), tol, "out"));
  EXPECT_TRUE(got.out.all_written());
  EXPECT_TRUE(dev.out.sentinel_intact()) << "write past the end of out";
  if (cs.lse) {
    EXPECT_TRUE(flashport::test::close(gather_rows(call, got.lse, true), gather_rows(call, ref.lse, true), 1e-4, "lse"));
    EXPECT_TRUE(got.lse.all_written());
    EXPECT_TRUE(dev.lse.sentinel_intact()) << "write past the end of lse";
  }
  if (got.sel.workspace_bytes > 0) EXPECT_TRUE(dev.workspace.sentinel_intact()) << "write past the end of the workspace";
  return got.sel;
}

// Forced counts resolve as for the mma.sync kernel: clamped to its key blocks (64 keys).
int64_t forced_splits(const Case& c, int32_t s) {
  const int64_t bn = flashport::gpu::kTileConfigs[flashport::gpu::tile_id_for(c.d, false)].block_n;
  return std::min<int64_t>(s, std::max<int64_t>(1, (c.sk + bn - 1) / bn));
}

// A split case: correct with a garbage workspace; the Hopper kernel with ":splitkv+combine" on
// sm_90, the mma.sync kernel elsewhere; `want_splits` (0: any count > 1) splits either way.
fp_selection check_hopper_split(const Case& c, int64_t want_splits) {
  const fp_selection sel = check_case_garbage_ws(c);
  const std::string ran(sel.kernel);
  const bool took = ran.find(kHopperName) != std::string::npos;
  EXPECT_EQ(took, hopper_here()) << c.describe() << " ran " << ran;
  if (want_splits > 0) EXPECT_EQ(sel.num_splits, want_splits) << c.describe() << " ran " << ran;
  else EXPECT_GT(sel.num_splits, 1) << c.describe() << " ran " << ran;
  expect_split_tag(sel, c.describe());
  return sel;
}

// Sets an environment variable for the scope, restoring the previous value; the library reads its
// settings once (core/config.hpp), so both ends reload them.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) had_ = true, old_ = old;
    setenv(name, value, 1);
    flashport::reload_runtime_config();
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
    flashport::reload_runtime_config();
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(CudaHopperFwd, HeadDimsDtypesAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256})
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
  for (int64_t d : {64, 128, 192, 256})
    for (const MaskVariant& w : mask_variants())
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1025, 1025}, {200, 700}, {700, 200}, {129, 131}}) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = 2, c.hq = 3, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
        w.apply(c);
        check_hopper(c, true);
      }
}

TEST(CudaHopperFwd, GqaVarlenAndNoLse) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256})
    for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 1}, {8, 2}, {6, 3}, {4, 4}}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = d, c.dv = d, c.sq = 190, c.sk = 333;
      c.causal = rand_int(0, 1);
      c.lse = rand_int(0, 1);
      check_hopper(c, true);
    }
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;
    c.dtype = rand_dtype();
    set_awkward_varlen(c);
    c.hq = 4, c.hkv = 2, c.d = d, c.dv = d;
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
  for (int64_t d : {64, 128, 192, 256}) {
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
  for (int64_t d : {64, 128, 192, 256}) {
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
    c.dropout = 0.2f;  // dropout: the Hopper kernel takes it (dropout_hopper_test.cpp)
    check_hopper(c, true);
  }
  for (int64_t d : {36, 100, 20}) {  // head strides not 16-byte multiples: TMA cannot read them
    Case c = base;
    c.d = d, c.dv = d;
    check_hopper(c, false);
  }
  {
    Case c = base;
    c.splits = 2;  // split-KV: the Hopper kernel takes it
    check_hopper(c, true);
  }
  {
    Case c = base;
    c.sq = 1;  // decode
    check_hopper(c, false);
  }
  {
    Case c = base;
    {
      ScopedEnv off("FLASHPORT_HOPPER_FWD", "0");
      check_hopper(c, false);
    }
    check_hopper(c, true);
  }
}

TEST(CudaHopperFwd, LongKeysManyTiles) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 130, c.sk = 2500;
    check_hopper(c, true);
    c.causal = true, c.top_left = true;
    check_hopper(c, true);
  }
}

// With more work tiles than an H100's 132 slots every call runs on a persistent grid (one block
// per resident slot, each walking several tiles: hopper_grid): statically when all tiles cost the
// same, dynamically (tiles taken from the workspace's counter) when causal, windowed or varlen,
// the counter over garbage workspace too. Odd lengths (a partial last query block and key tile),
// GQA, every head-dim bucket and its padded dims, LSE and sinks, and a paged cache copied by rows.
TEST(CudaHopperFwd, PersistentGridWalksEveryTile) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256, 80}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 3, c.hq = 24, c.hkv = 8, c.d = d, c.dv = d == 80 ? 48 : d;
    c.sq = 401, c.sk = 333;  // D64: 3 x 24 x 3 = 216 query blocks of 192 rows; D128-D256: 4 x 72 = 288
    c.sinks = d == 128;
    check_hopper(c, true);
    c.causal = true;
    check_hopper(c, true);
    c.causal = false, c.wl = 100, c.wr = 7;
    check_hopper(c, true);
    check_case_garbage_ws(c);
    c.wl = c.wr = -1, c.causal = true, c.varlen = true, c.batch = 4;
    c.lq = {401, 17, 260, 388}, c.lk = {333, 500, 1, 290};
    check_hopper(c, true);
  }
  Case r;  // a paged cache of 3-row pages: the row-copy producer walks the tiles too
  r.dtype = rand_dtype();
  r.cache = true, r.paged = true, r.page_size = 3, r.nan_unused_cache = true;
  r.batch = 3, r.hq = 24, r.hkv = 8, r.d = 128, r.dv = 128, r.sq = 401, r.sk = 700;
  r.seqused = {700, 450, 401};
  r.causal = true;
  check_hopper(r, true);
}

// Calls with a right edge to their visible keys (causal, windows with one) place their query blocks
// so the last ends at the sequence's last row and a partial block sits at its first rows
// (HopperRows): its rows above the sequence read zero-filled q (batched) or the previous
// sequence's rows (packed) and must never be stored. Lengths around the block sizes (192 at D64,
// 128 at D128/D192/D256), both causal alignments, Sq != Sk, a window with a right edge, forced
// splits, LSE, dropout, and packed varlen sequences of 1 row and of block size +- 1.
TEST(CudaHopperFwd, RightEdgedCallsEndBlocksAtLastRow) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 1024, c.sk = 1024, c.causal = true;
    check_hopper(c, true);
    c.sq = 449, c.sk = 700, c.top_left = true;
    check_hopper(c, true);
    c.top_left = false;
    c.splits = 3;
    check_hopper(c, true);
    c.splits = 1, c.causal = false, c.wl = 90, c.wr = 20;
    check_hopper(c, true);
    c.wl = c.wr = -1, c.causal = true, c.dropout = 0.15f;
    check_hopper(c, true);
    c.dropout = 0.0f, c.varlen = true, c.batch = 5;
    c.lq = {1000, 1, 191, 193, 385}, c.lk = {1000, 64, 191, 300, 385};
    check_hopper(c, true);
  }
}

// Consumer warpgroups compute only the key tiles their own 64 rows see and pass the block's others
// (fwd_hopper_v3.cuh kOwnTiles: D64's three consumers, 192 rows over 128-key tiles; D192's and
// D256's ping-pong pair, 128 rows over 96 and 64 keys, which hand on their turns for the passed
// tiles): tiles above a warpgroup's rows (causal: the last rows' tile is hidden from the first
// rows), below them (a left window), all of them (rows without keys in the middle of a sequence,
// or above it: then Q is passed too), in a dynamic walk over many tiles, with split-KV, and over a
// KV cache whose unused rows are NaN (V tails zeroed by the producer).
TEST(CudaHopperFwd, ConsumersPassTilesTheirRowsDoNotSee) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 192, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 1024, c.sk = 1024, c.causal = true;
    check_hopper(c, true);
    c.batch = 6, c.hq = 16, c.hkv = 4;  // 576 to 768 work tiles: the dynamic walk
    check_hopper(c, true);
    c.batch = 2, c.hq = 2, c.hkv = 2, c.sq = 700, c.sk = 200;  // rows 0..499 see no key
    check_hopper(c, true);
    c.causal = false, c.wl = 0, c.wr = 0, c.sq = c.sk = 600, c.splits = 3;  // the diagonal alone
    check_hopper(c, true);
    c.wl = 40, c.wr = -1, c.splits = 1;  // a left window: a warpgroup's last tiles are hidden from it
    check_hopper(c, true);
    c.wl = 20, c.wr = 30, c.top_left = true;
    check_hopper(c, true);
    c.wl = c.wr = -1, c.top_left = false, c.causal = true, c.varlen = true, c.batch = 10;
    c.lq = {1, 63, 64, 65, 127, 128, 129, 191, 193, 385}, c.lk = {1, 63, 64, 65, 127, 128, 129, 191, 193, 385};
    check_hopper(c, true);
    Case k;
    k.dtype = rand_dtype();
    k.cache = true, k.nan_unused_cache = true;
    k.batch = 3, k.hq = 4, k.hkv = 2, k.d = d, k.dv = d, k.sq = 400, k.sk = 900;
    k.seqused = {900, 450, 629};
    k.leftpad = {0, 37, 500};
    k.wl = 60, k.wr = 0;
    check_hopper(k, true);
  }
}

// The persistent grids under CUDA-graph replay (every replay walks every tile again; the dynamic
// walk is restarted by each replay's block 0: NonceCounter).
TEST(CudaHopperFwd, PersistentGridGraphReplay) {
  SKIP_WITHOUT_GPU();
  for (bool causal : {false, true}) {
    Case c;
    c.dtype = FP_BF16;
    c.batch = 2, c.hq = 40, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 600, c.sk = 600;
    c.causal = causal;
    Call call(c);
    DeviceCall direct(call);
    const Outputs want = run_cuda(call, direct);
    ASSERT_TRUE(want.ok) << want.error;
    expect_graph_replay_equals(call, want, /*garbage_workspace=*/true);
  }
}

// The dynamic walk's state (kernel_args.hpp NonceCounter) lives in the caller's workspace with any
// contents and no memset node before the kernel: after a call its `ready` word is 0 again (a graph
// replay repeats the call's nonce: a word left at it would let the replay's blocks take tiles
// before block 0 restarts the count) and `count` holds one take per work tile. The workspace
// starts as 0xA5 bytes; the captured call is one kernel node, and six replays back to back (no
// sync between them) give the direct call's bits.
TEST(CudaHopperFwd, TileWalkNeedsNoMemset) {
  SKIP_WITHOUT_GPU();
  if (!hopper_here()) GTEST_SKIP() << "the Hopper forward does not run here";
  Case c;
  c.dtype = FP_BF16;
  c.batch = 2, c.hq = 40, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 600, c.sk = 600, c.causal = true;
  Call call(c);
  DeviceCall dev(call);
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  fp_selection sel{};
  ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
  ASSERT_NE(std::string(sel.kernel).find(kHopperName), std::string::npos) << sel.kernel;
  ASSERT_GE(sel.workspace_bytes, sizeof(flashport::gpu::NonceCounter)) << "a dynamic walk (causal, 200 work tiles)";
  HostTensor sized(FP_F32, {static_cast<int64_t>((sel.workspace_bytes + 3) / 4)});
  dev.workspace.upload(sized);
  CUDA_OK(cudaMemset(dev.workspace.ptr, 0xA5, dev.workspace.bytes));
  const Outputs want = run_cuda(call, dev);
  ASSERT_TRUE(want.ok) << want.error;
  const Outputs ref = run_reference(call);
  ASSERT_TRUE(ref.ok) << ref.error;
  EXPECT_TRUE(flashport::test::close(gather_rows(call, want.out, false), gather_rows(call, ref.out, false),
                                     flashport::test::tolerance(c.dtype), "out"));
  flashport::gpu::NonceCounter walk{};
  CUDA_OK(cudaMemcpy(&walk, dev.workspace.ptr, sizeof(walk), cudaMemcpyDeviceToHost));  // the only region
  EXPECT_EQ(walk.ready, 0ull);
  EXPECT_EQ(walk.count, (600 + 127) / 128 * 40 * 2) << "one take per work tile";

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  dev.out.upload(call.out);  // poisoned again
  fp_attn_params q = call.params(dev.views, FP_BACKEND_CUDA);
  q.workspace = dev.workspace.ptr, q.workspace_bytes = dev.workspace.bytes, q.stream = stream;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const fp_status st = fp_attn_fwd(&q);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 1u) << "the kernel alone: no memset node";
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 6; ++r) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor got = call.out;
  dev.out.download(got);
  EXPECT_TRUE(got.bitwise_equal(want.out)) << "six replays differ from the direct call";
  CUDA_OK(cudaMemcpy(&walk, dev.workspace.ptr, sizeof(walk), cudaMemcpyDeviceToHost));
  EXPECT_EQ(walk.ready, 0ull);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Which walk a call gets (host side): none while the tiles fit the slots; static for equal, short
// tiles; one block per tile for equal tiles past 64 key tiles; dynamic (a counter in the workspace)
// for causal, windowed, varlen, KV-cache and split calls.
TEST(HopperFwdPlan, GridChoice) {
  namespace g = flashport::gpu;
  const int64_t slots = 132;
  auto problem = [](int64_t d, int64_t b, int64_t h, int64_t s) {
    flashport::Problem p;
    p.dtype = FP_BF16;
    p.d = p.dv = d;
    p.hq = p.hkv = h;
    p.seq.batch = b, p.seq.sq = p.seq.sk = s;
    return p;
  };
  flashport::Problem p = problem(128, 16, 16, 1024);  // 8 x 16 x 16 = 2048 tiles
  g::HopperGrid grid = g::hopper_grid(p, 1, slots);
  EXPECT_EQ(grid.blocks, slots);
  EXPECT_FALSE(grid.dynamic);
  EXPECT_EQ(g::fwd_workspace(p, 1, grid.dynamic).total, 0u);
  p.rules.window_right = 0;  // causal, as the problem states it
  grid = g::hopper_grid(p, 1, slots);
  EXPECT_EQ(grid.blocks, slots);
  EXPECT_TRUE(grid.dynamic);
  const g::FwdWorkspace ws = g::fwd_workspace(p, 1, grid.dynamic);
  EXPECT_TRUE(ws.has_tile_counter);
  EXPECT_GE(ws.total, sizeof(g::NonceCounter));
  EXPECT_TRUE(g::hopper_grid(p, 4, slots).dynamic);  // splits
  p = problem(128, 1, 16, 16384);  // 2048 tiles of 128 key tiles each
  grid = g::hopper_grid(p, 1, slots);
  EXPECT_EQ(grid.blocks, 0);
  p.rules.window_left = 4096;
  EXPECT_TRUE(g::hopper_grid(p, 1, slots).dynamic);
  p = problem(64, 1, 8, 1024);  // 6 x 8 = 48 tiles: fewer than the slots
  p.rules.window_right = 0;
  EXPECT_EQ(g::hopper_grid(p, 1, slots).blocks, 0);
}

TEST(CudaHopperFwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int it = 0; it < 24; ++it) {
    Case c;
    c.dtype = rand_dtype();
    c.d = std::vector<int64_t>{64, 128, 192, 256}[rand_int(0, 3)];
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

// Several shapes in one process, each checked against the reference and each run by the Hopper
// kernel: batched, varlen with a window (per-sequence tails inside the packed tensor), and a
// causal case with more work tiles (9 x 8 x 3 = 216) than an H100 has SMs.
TEST(CudaHopperFwd, ShapesInOneProcess) {
  SKIP_WITHOUT_GPU();
  {
    auto expect_tag = [&](const fp_selection& sel) {
      if (device_is_sm90() && hopper_built())
        EXPECT_NE(std::string(sel.kernel).find("_tma_ws:"), std::string::npos) << " ran " << sel.kernel;
    };
    for (int64_t d : {64, 128, 192, 256}) {
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

// Head dims other than the instances' 64/128/192/256, padded inside the kernel (TMA zero-fills the
// columns past D and Dv), and Dq != Dv both ways (192/128 as DeepSeek-V3 prefill), with causal,
// GQA, varlen, split-KV and a KV cache.
TEST(CudaHopperFwd, AnyHeadDim) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {8, 32, 40, 72, 80, 96, 112, 136, 160, 176, 192, 200, 224, 248}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 200, c.sk = 333;
    c.causal = d % 16 == 0;
    check_hopper(c, true);
  }
  const std::pair<int64_t, int64_t> pairs[] = {{192, 128}, {128, 192}, {64, 128}, {256, 64}, {96, 32}, {256, 192}};
  for (auto [d, dv] : pairs) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 1, c.hq = 2, c.hkv = 1, c.d = d, c.dv = dv, c.sq = 300, c.sk = 500;
    c.causal = true, c.sinks = d == 192;
    check_hopper(c, true);
    Case v = c;
    v.varlen = true, v.causal = false, v.wl = 64, v.wr = 0;
    v.lq = {130, 1, 257}, v.lk = {300, 77, 400};
    check_hopper(v, true);
    Case s = c;
    s.sk = 3000, s.splits = 3;
    check_hopper_split(s, 3);
    Case k = c;
    k.cache = true, k.paged = true, k.page_size = 64, k.nan_unused_cache = true;
    k.seqused = {444};
    check_hopper(k, true);
  }
}

// The D192 instance (head dims in (128, 192], 192/128 included) with every feature its calls
// meet: GQA, causal, varlen with a window, LSE, paged caches of 16 rows (row copies) and 96 rows
// (TMA boxes), forced splits with a garbage workspace, dropout; the plan names the 192 instance.
TEST(CudaHopperFwd, HeadDim192Instance) {
  SKIP_WITHOUT_GPU();
  auto expect_d192 = [](const fp_selection& sel, const Case& c) {
    if (hopper_here())
      EXPECT_NE(std::string(sel.kernel).find("_d192_m128n96_tma_ws:"), std::string::npos)
          << c.describe() << " ran " << sel.kernel;
  };
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{192, 192}, {192, 128}, {160, 160}, {176, 176}, {136, 192}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 8, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 333, c.sk = 517;
    c.causal = true, c.lse = true;
    fp_selection sel{};
    check_case(c, &sel);
    expect_d192(sel, c);
    Case v = c;
    v.varlen = true, v.causal = false, v.wl = 100, v.wr = 30;
    v.lq = {1, 200, 130, 0}, v.lk = {77, 400, 300, 9};
    check_hopper(v, true);
    for (int64_t page : {16, 96}) {
      Case k = c;
      k.cache = true, k.paged = true, k.page_size = page, k.nan_unused_cache = true;
      k.hq = 4, k.sq = 140, k.sk = 600;
      k.seqused = {599, 77};
      check_case(k, &sel);
      expect_d192(sel, k);
      if (hopper_here())  // pages of 16 and 96 rows tile the 96-key tile: TMA boxes
        EXPECT_EQ(std::string(sel.kernel).find(":kv_rows"), std::string::npos) << sel.kernel;
    }
    Case s = c;
    s.sk = 2000, s.splits = 3;
    expect_d192(check_hopper_split(s, 3), s);
    Case dr = c;
    dr.dropout = 0.2f;
    check_case(dr, &sel);
    expect_d192(sel, dr);
  }
}

// The head-dim buckets and the plan names (no device needed): (128, 192] runs the forward's 192
// instance (named with its padded dims), (192, 256] the 256 one; the backward keeps 192 on its
// 256 instance. Shared memory of the 192 tile within an H100 block's 232,448 bytes.
TEST(HopperFwdPlan, HeadBucketsAndNames) {
  struct Want {
    int64_t d, dv;
    int fwd, bwd;
    const char* name;
  };
  const Want wants[] = {
      {64, 64, 64, 64, "cuda:sm90_wgmma_prefill_d64_m192n128_tma_ws:bf16"},
      {128, 128, 128, 128, "cuda:sm90_wgmma_prefill_d128_m128n128_tma_ws:bf16"},
      {129, 129, 192, 256, "cuda:sm90_wgmma_prefill_d192_m128n96_tma_ws:bf16:d129_dv129"},
      {160, 160, 192, 256, "cuda:sm90_wgmma_prefill_d192_m128n96_tma_ws:bf16:d160_dv160"},
      {192, 192, 192, 256, "cuda:sm90_wgmma_prefill_d192_m128n96_tma_ws:bf16"},
      {192, 128, 192, 256, "cuda:sm90_wgmma_prefill_d192_m128n96_tma_ws:bf16:d192_dv128"},
      {128, 192, 192, 256, "cuda:sm90_wgmma_prefill_d192_m128n96_tma_ws:bf16:d128_dv192"},
      {200, 200, 256, 256, "cuda:sm90_wgmma_prefill_d256_m128n64_tma_ws:bf16:d200_dv200"},
      {256, 256, 256, 256, "cuda:sm90_wgmma_prefill_d256_m128n64_tma_ws:bf16"},
  };
  for (const Want& w : wants) {
    flashport::Problem p;
    p.dtype = FP_BF16;
    p.d = w.d, p.dv = w.dv;
    const std::string what = "d " + std::to_string(w.d) + " dv " + std::to_string(w.dv);
    EXPECT_EQ(flashport::gpu::hopper_head_bucket(p), w.fwd) << what;
    EXPECT_EQ(flashport::gpu::hopper_bwd_head_bucket(p), w.bwd) << what;
    char name[160];
    flashport::gpu::hopper_kernel_name(name, sizeof(name), p, 1);
    EXPECT_EQ(std::string(name), w.name) << what;
  }
  using flashport::gpu::HopperTileV3;
  EXPECT_EQ(HopperTileV3::block_m(192), 128);
  EXPECT_EQ(HopperTileV3::block_n(192), 96);
  EXPECT_EQ(HopperTileV3::smem_bytes(192), 230536);
  for (int d : {64, 128, 192, 256}) {
    EXPECT_LE(HopperTileV3::smem_bytes(d), 232448) << "d " << d;
    EXPECT_LE(HopperTileV3::smem_bytes(d, HopperTileV3::block_n(d), true), 232448) << "d " << d << " dropout";
  }
  // D64 with dropout: two ping-pong consumers (128 rows), its own plan name.
  EXPECT_EQ(HopperTileV3::block_m(64), 192);
  EXPECT_EQ(HopperTileV3::block_m(64, true), 128);
  EXPECT_EQ(HopperTileV3::threads(64, true), 384);
  flashport::Problem p;
  p.dtype = FP_BF16;
  p.d = p.dv = 64;
  p.hq = p.hkv = 4;
  p.seq.batch = 1, p.seq.sq = p.seq.sk = 1000;
  p.rules.dropout_p = 0.1f;
  char name[160];
  flashport::gpu::hopper_kernel_name(name, sizeof(name), p, 1);
  EXPECT_EQ(std::string(name), "cuda:sm90_wgmma_prefill_d64_m128n128_tma_ws:bf16");
  EXPECT_EQ(flashport::gpu::hopper_work_tiles(p, 1), 8 * 4);
}

// ---- KV caches -----------------------------------------------------------------------------

// Contiguous caches: seqused_k (0, short, full), cache_batch_idx, cache_leftpad, every head dim,
// causal and windows, GQA with enough query rows not to be decode-shaped; unused cache rows NaN.
TEST(CudaHopperFwd, KvCacheContiguous) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.nan_unused_cache = true;
    c.batch = 3, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 150, c.sk = 700;
    c.seqused = {700, 0, 333};
    check_hopper(c, true);
    c.batch_idx = true, c.causal = true;
    c.seqused = {129, 700, 1};
    check_hopper(c, true);
    c.batch_idx = false, c.causal = false, c.wl = 100, c.wr = 20;
    c.leftpad = {0, 37, 600};
    c.seqused = {500, 400, 700};
    check_hopper(c, true);
  }
}

// The largest run of rows dividing both the page and the key tile (fwd_hopper.hpp kv_page_box_rows).
int64_t box_run(int64_t page, int64_t bn) { return std::gcd(page, bn); }

// The producer a paged call runs (fwd_hopper.hpp kv_by_rows): TMA boxes where the box run is a
// multiple of 8 rows and at least 16 (8 at D128 in pools of back-to-back pages; 32 at D64 with a
// left pad), left pads too (their key tiles start at the pad rounded down to a box:
// kv_key_align); row copies (":kv_rows") for the other pages.
void check_hopper_paged(const Case& c) {
  fp_selection sel{};
  check_case(c, &sel);
  const std::string ran(sel.kernel);
  EXPECT_EQ(ran.find(kHopperName) != std::string::npos, hopper_here()) << c.describe() << " ran " << ran;
  if (!hopper_here()) return;
  flashport::Problem dims;
  dims.d = c.d, dims.dv = c.dv;
  const int64_t bn = flashport::gpu::HopperTileV3::block_n(flashport::gpu::hopper_head_bucket(dims));
  const bool d128_groups = c.d == 128 && c.dv % 64 == 0 && c.page_gap_rows == 0;
  const int64_t min_rows = d128_groups ? 8 : std::max(c.d, c.dv) <= 64 && !c.leftpad.empty() ? 32 : 16;
  const int64_t run = box_run(c.page_size, bn);
  const bool rows = run % 8 != 0 || run < min_rows;
  EXPECT_EQ(ran.find(":kv_rows") != std::string::npos, rows) << c.describe() << " ran " << ran;
  expect_split_tag(sel, c.describe());
}

// Paged caches, pages 8 .. 512 rows (row copies at 8; TMA boxes from 16 rows: one per page dividing the
// key tile, or one per tile: the D256 instance's key tile is 64), a shuffled block table, unused rows NaN,
// causal, sinks, LSE.
TEST(CudaHopperFwd, KvCachePaged) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    for (int64_t page : {8, 16, 64, 128, 256, 512}) {
      Case c;
      c.dtype = rand_dtype();
      c.cache = true, c.paged = true, c.page_size = page, c.nan_unused_cache = true;
      c.batch = 2, c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 140, c.sk = 600;
      c.seqused = {std::min<int64_t>(599, 17 + page), 600};
      c.causal = page % 16 == 0;
      c.sinks = page == 64;
      check_hopper_paged(c);
    }
  }
}

// How the pool lies (fwd_hopper.hpp kv_grouped_boxes): pages back to back, with or without padded
// rows, read as 8-row groups with one box across every panel; a gap after each page (pages not back
// to back) or head dims of part panels, one box per panel. Each head-dim instance at pages that
// divide its key tile, at the tile and beyond, and at pages sharing only a shorter run with it (48
// and 200 rows with a 128-key tile: boxes of 16 and 8 rows; 64 with D192's 96: 32), V narrower
// than K (its box's last panel zero-filled), keys ending mid-page, NaN in unused rows.
TEST(CudaHopperFwd, KvCachePagedPoolLayouts) {
  SKIP_WITHOUT_GPU();
  struct Dims {
    int64_t d, dv, page;
  };
  const Dims dims[] = {{64, 64, 16},   {128, 128, 8},   {128, 128, 16}, {128, 128, 32}, {128, 64, 128},
                       {96, 96, 16},   {192, 192, 8},   {192, 192, 16}, {192, 128, 48}, {256, 256, 8},
                       {256, 256, 16}, {256, 256, 64},  {128, 128, 256}, {128, 128, 48}, {128, 128, 200},
                       {192, 192, 64}, {256, 256, 48}, {64, 64, 48}};
  int n = 0;
  for (const Dims& w : dims) {
    for (int layout = 0; layout < 3; ++layout) {
      Case c;
      c.dtype = rand_dtype();
      c.cache = true, c.paged = true, c.page_size = w.page, c.nan_unused_cache = true;
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = w.d, c.dv = w.dv, c.sq = 150, c.sk = 700;
      c.seqused = {699, 5 + 8 * int64_t(rand_int(0, 80))};
      c.causal = n % 2 == 0;
      c.strided = layout == 1;
      c.page_gap_rows = layout == 2 ? 1 : 0;
      ++n;
      check_hopper_paged(c);
    }
  }
}

// The grouped-box rule (no device needed): paged TMA-box calls whose k and v pages lie back to back
// and whose head dims fill whole 64-column panels, more than one; from pages of 8 rows at D128
// (16 elsewhere, and for boxes per panel); not row copies, contiguous caches, pages with a gap,
// head dims of part panels or of one.
TEST(HopperFwdPlan, GroupedPagedBoxes) {
  flashport::Problem p;
  p.dtype = FP_BF16;
  p.d = p.dv = 128;
  p.hkv = 8;
  p.seq.kv_layout = flashport::KvLayout::Paged;
  p.seq.page_size = 16;
  p.k = p.v = flashport::KvAddr{16 * 8 * 128, 8 * 128, 128, flashport::KvLayout::Paged};
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(p));
  flashport::Problem q = p;
  q.k.s1 = q.v.s1 = 8 * 136;  // padded rows, pages still back to back
  q.k.s0 = q.v.s0 = 16 * 8 * 136;
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.v.s0 = 2 * 16 * 8 * 128;  // V pages interleaved with K's
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.d = q.dv = 96;
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.dv = 64;
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.d = q.dv = 64;  // one panel: a box per page either way
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.k.s0 = q.k.s1 = q.v.s0 = q.v.s1 = 0;  // broadcast pools are not groups of rows
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.seq.page_size = 8;  // boxes across panels from 8-row pages, boxes per panel from 16
  q.k.s0 = q.v.s0 = 8 * 8 * 128;
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(q));
  EXPECT_FALSE(flashport::gpu::kv_by_rows(q));
  q.v.s0 = 2 * 8 * 8 * 128;
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
  EXPECT_TRUE(flashport::gpu::kv_by_rows(q));
  q = p;
  q.d = q.dv = 256;  // D256: 8-row pages by row copies (boxes across panels measured slower there)
  q.k = q.v = flashport::KvAddr{8 * 8 * 256, 8 * 256, 256, flashport::KvLayout::Paged};
  q.seq.page_size = 8;
  EXPECT_TRUE(flashport::gpu::kv_by_rows(q));
  q.seq.page_size = 16;
  q.k.s0 = q.v.s0 = 16 * 8 * 256;
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.seq.page_size = 200;  // boxes of one 8-row group: 200 and 128 share no longer run
  q.k.s0 = q.v.s0 = 200 * 8 * 128;
  EXPECT_EQ(flashport::gpu::kv_page_box_rows(q), 8);
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(q));
  q.seq.page_size = 48;  // 16-row boxes
  q.k.s0 = q.v.s0 = 48 * 8 * 128;
  EXPECT_EQ(flashport::gpu::kv_page_box_rows(q), 16);
  EXPECT_TRUE(flashport::gpu::kv_grouped_boxes(q));
  q.seq.page_size = 12;  // row copies
  q.k.s0 = q.v.s0 = 12 * 8 * 128;
  EXPECT_TRUE(flashport::gpu::kv_by_rows(q));
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
  q = p;
  q.seq.kv_layout = flashport::KvLayout::Batched;
  EXPECT_FALSE(flashport::gpu::kv_grouped_boxes(q));
}

// Pages sharing no 8-row run with the key tile (1, 3, 12, 100, 129; and 16, 48, 64, 200, which take
// boxes where their run with the instance's tile allows: check_hopper_paged says which): the
// producer warpgroup copies rows with cp.async; some calls with a left pad. Every head-dim
// instance, padded head dims (96; 160 and 192/128 in the D192 instance, whose rows of 24 chunks
// leave 8 lanes of a copy idle), causal and windows, NaN in unused rows.
TEST(CudaHopperFwd, KvCachePagedByRows) {
  SKIP_WITHOUT_GPU();
  const int64_t pages[] = {1, 3, 12, 16, 48, 64, 100, 129, 200};
  int n = 0;
  for (int64_t d : {64, 96, 128, 160, 192, 256}) {
    for (int64_t page : pages) {
      Case c;
      c.dtype = rand_dtype();
      c.cache = true, c.paged = true, c.page_size = page, c.nan_unused_cache = true;
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d == 192 ? 128 : d, c.sq = 130, c.sk = 520;
      c.seqused = {519, int64_t(rand_int(0, 520))};
      c.causal = (n % 2) == 0;
      if (n % 3 == 0) c.wl = 100, c.wr = 0;
      if (n % 4 == 1) {  // a left pad (TMA-tileable pages take boxes from the rounded-down pad)
        c.page_size = n % 8 == 1 ? 128 : page;
        c.leftpad = {30, 0};
        c.seqused = {519, 200};
      }
      ++n;
      check_hopper_paged(c);
    }
  }
}

// The producer a paged call gets (the plan's rule, no device needed): row copies for pages not
// dividing the key tile (128 rows; 96 at D192, 64 at D256) nor a multiple of it and for pages below
// 16 rows (32 at D64 with a left pad); TMA boxes for multiples of the tile and pages of 16 rows
// and up, a multiple of 8, dividing it, with or without a left pad; dropout (no row copies: the
// candidate declines those) keeps the boxes of 8-row pages too, but not with a left pad (its keep
// bits need tiles that start at a key). The plan's name says which.
TEST(HopperFwdPlan, PagedProducerChoice) {
  struct Want {
    int64_t d, page;
    bool leftpad, dropout, rows;
  };
  const Want wants[] = {
      {128, 16, false, false, false}, {128, 64, false, false, false}, {128, 1, false, false, true},
      {128, 48, false, false, false},  {128, 3, false, false, true},   {128, 200, false, false, true},
      {128, 128, false, false, false}, {128, 256, false, false, false}, {128, 256, true, false, false},
      {96, 16, false, false, false},  {64, 16, false, false, false},  {64, 512, false, false, false},
      {256, 16, false, false, false}, {256, 64, false, false, false}, {256, 128, false, false, false},
      {192, 32, false, false, false}, {128, 16, false, true, false},  {128, 64, false, true, false},
      {128, 96, false, false, false}, {128, 24, false, false, true},  {256, 48, false, false, false},
      {128, 200, false, true, false}, {128, 12, false, true, true},
      {128, 8, false, false, true},   {128, 4, false, false, true},   {128, 12, false, false, true},
      {128, 8, false, true, false},   {256, 8, false, false, true},   {256, 32, false, false, false},
      {128, 256, false, true, false}, {128, 48, false, true, false},    {128, 16, true, true, true},
      {192, 64, false, false, false}, {192, 256, false, false, false},  {160, 16, false, false, false},
      {192, 64, false, true, false},   {176, 32, false, true, false},   {192, 64, true, false, false},
      {160, 16, false, true, false},
      {192, 96, false, false, false}, {192, 192, false, false, false}, {192, 48, false, true, false},
      {128, 1, true, false, true},     {128, 12, true, false, true},     {64, 48, true, false, true},
      {64, 16, true, false, true},     {64, 64, true, false, false},     {64, 32, true, false, false},
      {256, 16, true, false, false},   {128, 64, true, true, true},
  };
  const int32_t pad = 0;
  for (const Want& w : wants) {
    flashport::Problem p;
    p.dtype = FP_BF16;
    p.d = p.dv = w.d;
    p.seq.kv_layout = flashport::KvLayout::Paged;
    p.seq.page_size = w.page;
    p.seq.cache_leftpad = w.leftpad ? &pad : nullptr;
    p.rules.dropout_p = w.dropout ? 0.1f : 0.0f;
    const std::string what = "d " + std::to_string(w.d) + " page " + std::to_string(w.page) +
                             (w.leftpad ? " leftpad" : "") + (w.dropout ? " dropout" : "");
    EXPECT_EQ(flashport::gpu::kv_by_rows(p), w.rows) << what;
    // Boxes with a left pad: key tiles from the pad rounded down to a box; else from the first key.
    const int64_t box = std::gcd(w.page, int64_t(flashport::gpu::hopper_block_n(p)));
    EXPECT_EQ(flashport::gpu::kv_key_align(p), w.leftpad && !w.rows ? box : 0) << what;
    char name[160];
    flashport::gpu::hopper_kernel_name(name, sizeof(name), p, 1);
    EXPECT_EQ(std::string(name).find(":kv_rows") != std::string::npos, w.rows) << what << ": " << name;
    p.seq.kv_layout = flashport::KvLayout::Batched;  // a contiguous cache: TMA boxes from any row
    EXPECT_FALSE(flashport::gpu::kv_by_rows(p)) << what;
    EXPECT_EQ(flashport::gpu::kv_key_align(p), 0) << what;
  }
}

// Paged caches with left pads on TMA boxes: each sequence's key tiles start at its pad rounded
// down to a box, the keys before the pad hidden and their V rows zeroed (the pad rows hold NaN).
// Pads below, at and past a box and a tile, 0, and equal to seqused_k (no keys); every head-dim
// instance with boxes per page (16, 48: 16-row boxes of a 128-key tile, row copies at D64; 64;
// 256: whole tiles), GQA, bottom-right and top-left causal, windows, softcap + ALiBi, sinks,
// split-KV, append + rotary after the pad, a call whose keys fit in one tile with the pad.
TEST(CudaHopperFwd, KvCachePagedLeftPadBoxes) {
  SKIP_WITHOUT_GPU();
  int n = 0;
  for (int64_t d : {64, 128, 192, 256}) {
    for (int64_t page : {16, 48, 64, 256}) {
      Case c;
      c.dtype = rand_dtype();
      c.cache = true, c.paged = true, c.page_size = page, c.nan_unused_cache = true;
      c.batch = 4, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d == 192 ? 128 : d, c.sq = 140, c.sk = 768;
      const int64_t box = std::gcd(page, int64_t(flashport::gpu::HopperTileV3::block_n(int(d))));
      c.leftpad = {box - 1, 1 + int64_t(rand_int(0, 300)), 0, 131};
      c.seqused = {700, 768, 333, 131};  // the last: pad = seqused_k, no keys
      switch (n++ % 5) {
        case 0: c.causal = true; break;
        case 1: c.causal = true, c.top_left = true; break;
        case 2: c.wl = 90, c.wr = 10; break;
        case 3: c.softcap = 20.0f, c.alibi = true, c.sinks = true; break;
        default: c.splits = 3; break;
      }
      check_hopper_paged(c);
    }
  }
  for (int64_t page : {16, 64}) {  // append + rotary after the pad; short sequences in one tile
    Case a;
    a.dtype = rand_dtype();
    a.cache = true, a.paged = true, a.page_size = page, a.nan_unused_cache = true;
    a.batch = 3, a.hq = 8, a.hkv = 2, a.d = 128, a.dv = 128, a.sq = 128, a.sk = 512;
    a.leftpad = {5, 77, 300};
    a.seqused = {40, 200, 380};
    a.causal = true;
    check_hopper_paged(a);
    a.snew = a.sq, a.rot_dim = 64, a.rot_interleaved = page == 16;
    check_hopper_paged(a);
  }
}

// Row copies with the rest of a serving call: GQA 8:1 and 4:1, split-KV (forced and automatic),
// append with rotary, a left pad, sequences without keys and with keys ending mid-page, pages of
// 1, 3, 16, 48, 64 and 256 (16, 64 and 256: TMA boxes, the same calls); and dropout, which has no row-copy
// instance: pages of a multiple of 8 dividing the key tile keep TMA boxes, the rest run on the
// mma.sync kernel (still correct).
TEST(CudaHopperFwd, KvCachePagedServing) {
  SKIP_WITHOUT_GPU();
  for (int64_t page : {1, 3, 16, 48, 64, 256}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.paged = true, c.page_size = page, c.nan_unused_cache = true;
    c.batch = 3, c.hq = 16, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 200, c.sk = 1100;
    c.seqused = {1100, 0, 517};
    c.causal = true;
    check_hopper_paged(c);
    Case s = c;  // split-KV over the cache, forced and automatic
    s.hq = 8, s.hkv = 2, s.sq = 129, s.splits = 3;
    s.seqused = {1100, 1, 700};
    check_hopper_paged(s);
    s.splits = 0, s.batch = 1, s.hq = 4, s.sk = 6000, s.seqused = {6000};
    check_hopper_paged(s);
    Case l = c;  // a left pad, then append + rotary after it
    l.leftpad = {100, 0, 17};
    l.seqused = {850, 300, 517};
    check_hopper_paged(l);
    l.snew = l.sq, l.rot_dim = 64, l.rot_interleaved = page % 2 == 1;
    check_hopper_paged(l);
    Case dr = c;  // dropout: TMA boxes where they tile, else the mma.sync kernel
    dr.hq = 4, dr.sq = 140, dr.dropout = 0.2f;
    dr.seqused = {1100, 1, 517};
    fp_selection sel{};
    check_case(dr, &sel);
    const std::string ran(sel.kernel);
    const bool boxes = box_run(page, 128) % 8 == 0;
    EXPECT_EQ(ran.find(kHopperName) != std::string::npos, boxes && hopper_here()) << dr.describe() << " ran " << ran;
    EXPECT_EQ(ran.find(":kv_rows"), std::string::npos) << dr.describe() << " ran " << ran;
  }
}

// Append + rotary (interleaved and half) then attend, chunked prefill over a cache (varlen q is
// not a cache layout here: batched q of several rows per sequence), split-KV over a cache.
TEST(CudaHopperFwd, KvCacheAppendRotaryAndSplits) {
  SKIP_WITHOUT_GPU();
  for (bool paged : {false, true}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.paged = paged, c.page_size = 64;
    c.batch = 2, c.hq = 4, c.hkv = 4, c.d = 128, c.dv = 128, c.sq = 130, c.sk = 1024;
    c.snew = 130;
    c.seqused = {300, 894};
    c.causal = true;
    check_hopper(c, true);
    c.rot_dim = 64, c.rot_interleaved = paged;
    check_hopper(c, true);
    Case s = c;
    s.rot_dim = 0, s.snew = 0, s.sq = 129, s.splits = 3;
    s.seqused = {1000, 1024};
    s.nan_unused_cache = true;
    check_hopper_split(s, 3);
  }
}

// Append + rotary then attend on the Hopper kernel (the pre-pass writes the rotated q into the
// workspace, which starts as NaN bytes here): every head-dim instance, rotary dims 8 .. D, both
// pair layouts, fp32 and 16-bit tables (16-bit rows of 12 pairs: the pre-pass's element path),
// causal (a position per query row) and not (one position for every row), a window, dropout,
// query rows ending mid-block, split-KV, a paged cache with boxes, and more work tiles than SMs.
TEST(CudaHopperFwd, AppendRotaryShapes) {
  SKIP_WITHOUT_GPU();
  struct R { int64_t d, rot; bool interleaved, tables16, causal; float dropout; int32_t window; };
  for (R r : {R{128, 64, false, false, true, 0, -1}, R{128, 128, true, true, true, 0, -1},
              R{128, 24, false, true, true, 0, -1}, R{128, 24, false, false, false, 0, -1},
              R{96, 8, true, false, true, 0, -1}, R{64, 64, false, false, true, 0, -1},
              R{64, 32, true, true, true, 0.15f, -1}, R{192, 64, false, true, true, 0, 300},
              R{256, 256, false, false, true, 0, -1}, R{256, 64, true, false, false, 0.1f, -1}}) {
    Case c;
    c.dtype = rand_dtype();
    c.cache = true, c.nan_unused_cache = true;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = r.d, c.dv = r.d, c.sq = 150, c.sk = 700, c.snew = 150;
    c.seqused = {120, 400};
    c.causal = r.causal, c.wl = r.window;
    if (r.window >= 0) c.wr = 0;
    c.dropout = r.dropout;
    c.rot_dim = r.rot, c.rot_interleaved = r.interleaved, c.rot_tables_16bit = r.tables16;
    for (int variant = 0; variant < 3; ++variant) {
      Case v = c;
      if (variant == 1) v.splits = 3;
      if (variant == 2) v.paged = true, v.page_size = 64;
      const fp_selection sel = check_case_garbage_ws(v);
      if (hopper_here())
        EXPECT_NE(std::string(sel.kernel).find(kHopperName), std::string::npos) << v.describe() << " ran " << sel.kernel;
    }
  }
  Case m;  // 144 work tiles: blocks walk several
  m.dtype = rand_dtype();
  m.cache = true, m.batch = 3, m.hq = 16, m.hkv = 4, m.d = 128, m.dv = 128, m.sq = 384, m.snew = 384, m.sk = 1400;
  m.seqused = {200, 900, 40};
  m.causal = true, m.rot_dim = 128;
  const fp_selection sel = check_case_garbage_ws(m);
  if (hopper_here()) EXPECT_NE(std::string(sel.kernel).find(kHopperName), std::string::npos) << sel.kernel;
}

// ---- split-KV ----------------------------------------------------------------------------

// Forced counts 2, 3, 7, 64: unequal ranges, query blocks x splits, and (64, and the short case)
// more splits than the Hopper kernel has key tiles: those splits are empty and must still store LSE = -inf.
TEST(CudaHopperFwd, SplitKvForcedCounts) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256})
    for (int32_t s : {2, 3, 7, 64}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 1, c.hq = 2, c.hkv = 2, c.d = d, c.dv = d, c.sq = 200, c.sk = 1500;
      c.splits = s;
      check_hopper_split(c, forced_splits(c, s));
    }
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;  // 130 keys: 3 mma.sync key blocks, 2 (D192, D256: 3) Hopper key tiles
    c.dtype = rand_dtype();
    c.batch = 2, c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = 129, c.sk = 130;
    c.splits = 64;
    check_hopper_split(c, forced_splits(c, 64));
  }
}

// Automatic counts on long-KV / small-grid shapes: the heuristic over the Hopper tiles and occupancy
// (1 block per SM).
TEST(CudaHopperFwd, SplitKvAutoLongKeys) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct S { int64_t d, hq, hkv, sq, sk; };
  for (S sh : {S{64, 4, 2, 130, 20000}, S{128, 2, 2, 128, 9000}, S{192, 2, 1, 200, 5000}, S{256, 2, 1, 200, 4000}}) {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 1, c.hq = sh.hq, c.hkv = sh.hkv, c.d = sh.d, c.dv = sh.d, c.sq = sh.sq, c.sk = sh.sk;
    c.splits = 0;
    if (hopper_here()) {
      using flashport::gpu::HopperTileV3;
      flashport::Problem dims;  // the call's key tile (D128 at 9000 keys: the wide one)
      dims.d = dims.dv = sh.d, dims.seq.sk = sh.sk;
      const int64_t bm = HopperTileV3::block_m(int(sh.d)), bn = flashport::gpu::hopper_block_n(dims);
      const int want = flashport::resolve_num_splits(0, (sh.sq + bm - 1) / bm * sh.hq, (sh.sk + bn - 1) / bn, sms,
                                                     flashport::gpu::kMaxSplits);
      ASSERT_GT(want, 1) << "the shape should split";
      check_hopper_split(c, want);
    } else {
      check_hopper_split(c, 0);  // the mma.sync kernel's own count
    }
  }
}

// Causal in both alignments (rows without keys in a split, splits without keys for a block),
// windows, GQA, sinks (split 0 only), ALiBi, softcap, no LSE.
TEST(CudaHopperFwd, SplitKvFeatures) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256})
    for (const MaskVariant& w : mask_variants(5))
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{300, 900}, {700, 200}}) {
        Case c;
        c.dtype = rand_dtype();
        c.batch = rand_int(1, 2), c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
        w.apply(c);
        c.splits = int32_t(rand_int(2, 5));
        c.sinks = rand_int(0, 2) == 0;
        c.lse = rand_int(0, 3) != 0;
        check_hopper_split(c, forced_splits(c, c.splits));
      }
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;  // bottom-right causal, Sq > Sk: the first rows see no key in any split; with sinks
    c.dtype = rand_dtype();
    c.hq = 2, c.hkv = 2, c.d = d, c.dv = d, c.sq = 400, c.sk = 300, c.causal = true, c.splits = 3;
    check_hopper_split(c, 3);
    c.sinks = true;
    check_hopper_split(c, 3);
    Case f;  // score features
    f.dtype = rand_dtype();
    f.batch = 2, f.hq = 4, f.hkv = 2, f.d = d, f.dv = d, f.sq = 300, f.sk = 1000, f.splits = 4;
    f.softcap = 30.0f, f.input_std = 3.0;
    check_hopper_split(f, 4);
    f.softcap = 0.0f, f.input_std = 1.0, f.alibi = true, f.alibi_per_batch = true, f.causal = true, f.sinks = true;
    check_hopper_split(f, 4);
  }
}

// Varlen (packed q/k/v/out, packed LSE): per-sequence key counts, empty sequences, splits past a
// sequence's keys.
TEST(CudaHopperFwd, SplitKvVarlen) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256}) {
    Case c;
    c.dtype = rand_dtype();
    set_awkward_varlen(c);
    c.hq = 4, c.hkv = 2, c.d = d, c.dv = d;
    c.causal = true;
    c.top_left = d == 64;
    c.splits = 4;
    check_hopper_split(c, 4);  // max_seqlen_k 1025: 17 key blocks
    c.causal = false;
    c.wl = 64, c.wr = 16;
    c.splits = 7;
    check_hopper_split(c, 7);
  }
}

// The epilogue's store paths (HopperRows::epilogue): O through the staging tile in 16-byte row
// chunks where out's rows and strides allow them (batched and varlen, a padded Dv: chunks past Dv
// not stored), else from the registers (out rows padded by 2 elements: 4-byte pairs); split-KV
// partials through the staging tile (a 16-byte aligned workspace) or from the registers (the
// workspace 4 bytes past an aligned address). Every head-dim instance, sinks and an odd row count.
TEST(CudaHopperFwd, EpilogueStorePaths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 192, 256})
    for (int64_t dv : {d, d - 24}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 333, c.sk = 517;
      c.causal = true, c.sinks = dv != d;
      check_hopper(c, true);
      Case v = c;
      v.varlen = true, v.lq = {1, 200, 130}, v.lk = {77, 400, 300};
      check_hopper(v, true);
      Case s = c;
      s.strided = true;  // out: [B, Sq, Hq + 1, Dv + 2]
      check_hopper(s, true);
      Case k = c;
      k.sk = 3000, k.splits = 3;
      check_hopper_split(k, 3);
      const fp_selection unaligned = check_case_garbage_ws(k, 4);
      EXPECT_EQ(std::string(unaligned.kernel).find(kHopperName) != std::string::npos, hopper_here()) << k.describe();
      EXPECT_EQ(unaligned.num_splits, 3) << k.describe();
    }
}

// Captured into a CUDA graph (no allocation, sync or host read inside the call) and replayed:
// the bits of a direct call.
TEST(CudaHopperFwd, SplitKvGraphReplay) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_BF16;
  c.batch = 1, c.hq = 4, c.hkv = 4, c.d = 64, c.dv = 64, c.sq = 128, c.sk = 16000, c.splits = 0;
  Call call(c);
  DeviceCall direct(call);
  const Outputs want = run_cuda(call, direct);
  ASSERT_TRUE(want.ok) << want.error;
  EXPECT_GT(want.sel.num_splits, 1);
  expect_split_tag(want.sel, c.describe());
  expect_graph_replay_equals(call, want, /*garbage_workspace=*/true);
}

// The kill switch FLASHPORT_HOPPER_FWD=0: split calls go to the mma.sync kernel (still right);
// back on, the Hopper kernel takes them again.
TEST(CudaHopperFwd, SplitKvKillSwitch) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 1, c.hq = 2, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 200, c.sk = 3000, c.splits = 3;
  {
    ScopedEnv off("FLASHPORT_HOPPER_FWD", "0");
    fp_selection sel{};
    check_case(c, &sel);
    EXPECT_EQ(sel.num_splits, 3) << sel.kernel;
    EXPECT_EQ(std::string(sel.kernel).find(kHopperName), std::string::npos) << "FLASHPORT_HOPPER_FWD=0 ran " << sel.kernel;
  }
  const fp_selection sel = check_hopper_split(c, 3);
  EXPECT_EQ(std::string(sel.kernel).find(kHopperName) != std::string::npos, hopper_here()) << sel.kernel;
}

// ---- D128's wide key tile (fwd_hopper.hpp hopper_wide_tile) --------------------------------

// Runs the case against the reference; on sm_90 the Hopper kernel takes it, with the 160-key tile
// exactly when `wide` (the plan's name shows the tile).
void check_key_tile(const Case& c, bool wide) {
  fp_selection sel{};
  check_case(c, &sel);
  const std::string ran(sel.kernel);
  EXPECT_EQ(ran.find(kHopperName) != std::string::npos, hopper_here()) << c.describe() << " ran " << ran;
  if (!hopper_here()) return;
  EXPECT_NE(ran.find(wide ? "_m128n160_" : "_m128n128_"), std::string::npos) << c.describe() << " ran " << ran;
  expect_split_tag(sel, c.describe());
}

// Long unmasked D128 calls: key lengths with a partial last 160-key tile (2001, 2100, 4095) and a
// whole one (2080 = 13 tiles), both dtypes, GQA and MQA, padded head dims (the 128 instance),
// with and without LSE; score features: softcap, ALiBi (per head and per batch), sinks, a
// non-positive scale.
TEST(CudaHopperFwd, WideKeyTileLongUnmaskedCalls) {
  SKIP_WITHOUT_GPU();
  for (fp_dtype t : {FP_BF16, FP_F16})
    for (int64_t sk : {2001, 2080, 2100, 4095}) {
      Case c;
      c.dtype = t;
      c.batch = 2, c.hq = 4, c.hkv = sk == 2100 ? 1 : 2, c.d = 128, c.dv = 128, c.sq = 257, c.sk = sk;
      c.lse = sk != 2080;
      check_key_tile(c, true);
    }
  {
    Case c;
    c.dtype = rand_dtype();
    c.batch = 1, c.hq = 6, c.hkv = 3, c.d = 112, c.dv = 72, c.sq = 130, c.sk = 2222;
    check_key_tile(c, true);
  }
  Case f;
  f.dtype = rand_dtype();
  f.batch = 2, f.hq = 4, f.hkv = 2, f.d = 128, f.dv = 128, f.sq = 200, f.sk = 2100;
  f.softcap = 30.0f, f.input_std = 3.0;
  check_key_tile(f, true);
  f.softcap = 0.0f, f.input_std = 1.0, f.alibi = true;
  check_key_tile(f, true);
  f.alibi_per_batch = true, f.sinks = true;
  check_key_tile(f, true);
  f.alibi = f.alibi_per_batch = false, f.scale = -0.05f;
  check_key_tile(f, true);
}

// The calls that keep the 128-key tile: shorter keys, causal (both alignments), windows, varlen,
// KV caches (contiguous and paged); each still right.
TEST(CudaHopperFwd, WideKeyTileDeclinedCalls) {
  SKIP_WITHOUT_GPU();
  Case base;
  base.dtype = rand_dtype();
  base.batch = 1, base.hq = 2, base.hkv = 1, base.d = 128, base.dv = 128, base.sq = 200, base.sk = 2100;
  check_key_tile(base, true);
  Case c = base;
  c.sk = flashport::gpu::HopperTileV3::kWideMinKeys - 1;
  check_key_tile(c, false);
  for (const MaskVariant& w : mask_variants()) {
    c = base;
    w.apply(c);
    check_key_tile(c, false);
  }
  c = base;
  c.varlen = true, c.batch = 3, c.lq = {200, 1, 130}, c.lk = {2100, 3000, 17};
  check_key_tile(c, false);
  c = base;
  c.cache = true, c.nan_unused_cache = true, c.seqused = {2050};
  check_key_tile(c, false);
  c.paged = true, c.page_size = 128;
  check_key_tile(c, false);
}

// Long unmasked D128 calls with dropout keep the 128-key tile (hopper_wide_tile): both rates of the
// suites, partial last tiles, GQA, LSE (the undropped softmax's), sinks, seed and offset on the
// device, and forced splits over a garbage workspace.
TEST(CudaHopperFwd, LongUnmaskedDropoutKeepsKeyTile) {
  SKIP_WITHOUT_GPU();
  for (float rate : kDropoutRates)
    for (int64_t sk : {2001, 4095}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 131, c.sk = sk, c.dropout = rate;
      c.sinks = sk == 2001;
      c.rng_on_device = rate == kDropoutRates[0];
      check_key_tile(c, false);
    }
  Case s;
  s.dtype = rand_dtype();
  s.batch = 1, s.hq = 2, s.hkv = 1, s.d = 128, s.dv = 128, s.sq = 200, s.sk = 2100, s.dropout = 0.2f;
  s.splits = 3;
  const fp_selection sel = check_hopper_split(s, 3);
  if (hopper_here()) EXPECT_NE(std::string(sel.kernel).find("_m128n128_"), std::string::npos) << sel.kernel;
}

// Split-KV over 160-key tiles: forced counts resolve in 64-key blocks (as on the mma.sync kernel),
// so 64 splits of 4095 keys leave 38 of the 26-tile ranges empty (LSE = -inf, skipped by the
// combine); 2, 3, 7 split unequally. Partials over a garbage workspace; automatic counts on a
// small grid.
TEST(CudaHopperFwd, WideKeyTileSplitKv) {
  SKIP_WITHOUT_GPU();
  for (int64_t sk : {2100, 4095})
    for (int32_t s : {2, 3, 7, 64}) {
      Case c;
      c.dtype = rand_dtype();
      c.batch = 1, c.hq = 2, c.hkv = 1, c.d = 128, c.dv = 128, c.sq = 150, c.sk = sk;
      c.splits = s;
      c.sinks = s == 3;
      const fp_selection sel = check_hopper_split(c, forced_splits(c, s));
      if (hopper_here()) EXPECT_NE(std::string(sel.kernel).find("_m128n160_"), std::string::npos) << sel.kernel;
    }
  Case a;
  a.dtype = rand_dtype();
  a.batch = 1, a.hq = 2, a.hkv = 2, a.d = 128, a.dv = 128, a.sq = 128, a.sk = 12000, a.splits = 0;
  const fp_selection sel = check_hopper_split(a, 0);
  if (hopper_here()) EXPECT_NE(std::string(sel.kernel).find("_m128n160_"), std::string::npos) << sel.kernel;
}

// More work tiles (query blocks x heads x batch) than an H100's 132 slots: the static persistent
// walk over 160-key tiles (13 tiles of 2001 keys, a partial last one; a partial last query block),
// GQA, LSE, sinks; and under CUDA-graph replay.
TEST(CudaHopperFwd, WideKeyTilePersistentGrid) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = rand_dtype();
  c.batch = 2, c.hq = 34, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 129, c.sk = 2001;  // 2 x 34 x 2 = 136 tiles
  c.sinks = true;
  check_key_tile(c, true);
  Call call(c);
  DeviceCall direct(call);
  const Outputs want = run_cuda(call, direct);
  ASSERT_TRUE(want.ok) << want.error;
  expect_graph_replay_equals(call, want, /*garbage_workspace=*/true);
}

// The choice rule and the plan names (no device needed): D128 (and dims padded into it) with at
// least kWideMinKeys keys and equal-cost tiles runs 160-key tiles; dropout, masks, varlen,
// caches, short keys and the other head dims keep theirs. Its shared memory fits an H100 block; the
// persistent grid's 64-key-tile limit counts its tiles.
TEST(HopperFwdPlan, WideKeyTileChoice) {
  namespace g = flashport::gpu;
  using g::HopperTileV3;
  auto problem = [](int64_t d, int64_t sk) {
    flashport::Problem p;
    p.dtype = FP_BF16;
    p.d = p.dv = d;
    p.hq = p.hkv = 16;
    p.seq.batch = 1, p.seq.sq = 10240, p.seq.sk = sk;
    return p;
  };
  auto name = [](const flashport::Problem& p, int splits) {
    char buf[160];
    g::hopper_kernel_name(buf, sizeof(buf), p, splits);
    return std::string(buf);
  };
  flashport::Problem p = problem(128, HopperTileV3::kWideMinKeys);
  EXPECT_TRUE(g::hopper_wide_tile(p));
  EXPECT_EQ(g::hopper_block_n(p), 160);
  EXPECT_EQ(name(p, 1), "cuda:sm90_wgmma_prefill_d128_m128n160_tma_ws:bf16");
  EXPECT_EQ(name(p, 3), "cuda:sm90_wgmma_prefill_d128_m128n160_tma_ws:bf16:splitkv+combine");
  p.d = 96, p.dv = 64;
  EXPECT_EQ(name(p, 1), "cuda:sm90_wgmma_prefill_d128_m128n160_tma_ws:bf16:d96_dv64");
  p.rules.dropout_p = 0.1f;  // dropout keeps the 128-key tile
  EXPECT_FALSE(g::hopper_wide_tile(p));
  EXPECT_EQ(g::hopper_block_n(p), 128);
  p = problem(128, HopperTileV3::kWideMinKeys - 1);
  EXPECT_EQ(g::hopper_block_n(p), 128);
  EXPECT_EQ(name(p, 1), "cuda:sm90_wgmma_prefill_d128_m128n128_tma_ws:bf16");
  for (int64_t d : {64, 192, 256}) {
    p = problem(d, 16384);
    EXPECT_FALSE(g::hopper_wide_tile(p)) << "d " << d;
    EXPECT_EQ(g::hopper_block_n(p), HopperTileV3::block_n(int(d))) << "d " << d;
  }
  const int32_t lengths[2] = {0, 4096};
  const flashport::Problem wide = problem(128, 4096);
  auto declined = [&](const char* what, auto change) {
    flashport::Problem q = wide;
    change(q);
    EXPECT_FALSE(g::hopper_wide_tile(q)) << what;
    EXPECT_EQ(g::hopper_block_n(q), 128) << what;
    EXPECT_NE(name(q, 1).find("_m128n128_"), std::string::npos) << what;
  };
  declined("causal", [](flashport::Problem& q) { q.rules.window_right = 0; });
  declined("window", [](flashport::Problem& q) { q.rules.window_left = 512; });
  declined("varlen", [&](flashport::Problem& q) { q.seq.cu_q = q.seq.cu_k = lengths; });
  declined("seqused_k", [&](flashport::Problem& q) { q.seq.seqused_k = lengths + 1; });
  declined("paged", [](flashport::Problem& q) { q.seq.kv_layout = flashport::KvLayout::Paged, q.seq.page_size = 160; });
  EXPECT_EQ(HopperTileV3::smem_bytes(128, HopperTileV3::kWideBlockN), 230536);
  EXPECT_LE(HopperTileV3::smem_bytes(128, HopperTileV3::kWideBlockN), 232448);
  const int64_t slots = 132;  // 80 query blocks x 16 heads = 1280 work tiles
  p = problem(128, 10240);    // 64 tiles of 160 keys: the static walk
  EXPECT_EQ(g::hopper_grid(p, 1, slots).blocks, slots);
  EXPECT_FALSE(g::hopper_grid(p, 1, slots).dynamic);
  p.seq.sk = 10241;           // 65 tiles: one block per work tile
  EXPECT_EQ(g::hopper_grid(p, 1, slots).blocks, 0);
}

}  // namespace
}  // namespace gputest
