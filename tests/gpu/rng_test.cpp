// Dropout with the RNG state in device memory (fp_attn_params.dropout_rng): the kernels read
// (seed, offset) themselves, so the result must equal the reference run with the same values as
// host scalars, and a captured CUDA graph must follow new state written between replays.
#include "gpu_harness.hpp"

namespace gputest {
namespace {

TEST(CudaRng, ForwardReadsDeviceState) {
  SKIP_WITHOUT_GPU();
  for (int64_t sq : {1, 131}) {      // decode tile (packed GQA rows) and prefill
    for (int32_t splits : {1, 3}) {  // one pass and split-KV (partials + combine)
      Case c;
      c.dtype = rand_dtype();
      c.batch = 2, c.hq = 4, c.hkv = 1, c.d = 64, c.dv = 64, c.sq = sq, c.sk = 257;
      c.dropout = 0.3f, c.rng_on_device = true, c.splits = splits;
      c.causal = sq > 1;
      check_case(c);
    }
  }
}

TEST(CudaRng, GraphReplayFollowsNewDeviceState) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_BF16;
  c.batch = 1, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 70, c.sk = 300;
  c.dropout = 0.25f, c.rng_on_device = true;
  Call call(c);
  DeviceCall dev(call);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fp_selection sel{};
  fp_attn_params p;
  ASSERT_EQ(dev.run(call, &p, stream, &sel), FP_OK) << fp_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const fp_status st = fp_attn_fwd(&p);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(st, FP_OK) << fp_last_error();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  // For each new state: write it to the device buffer, replay, and compare with a direct call
  // that takes the same state as host scalars.
  const std::pair<uint64_t, uint64_t> states[] = {{7, 0}, {0xfeedfacecafebeefull, 12345}};
  std::vector<HostTensor> outs;
  for (const auto& s : states) {
    const HostTensor words = HostTensor::i32({4}, rng_words(s.first, s.second));
    CUDA_OK(cudaMemcpyAsync(dev.rng.ptr, words.storage(), 16, cudaMemcpyHostToDevice, stream));
    dev.out.upload(call.out);  // poison
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    HostTensor got = call.out;
    dev.out.download(got);

    fp_attn_params direct = p;
    direct.dropout_rng = fp_tensor{};
    direct.dropout_seed = s.first, direct.dropout_offset = s.second;
    direct.stream = nullptr;
    DevBuf out2;
    out2.upload(call.out);
    direct.out = out2.view(call.out);
    ASSERT_EQ(fp_attn_fwd(&direct), FP_OK) << fp_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    HostTensor want = call.out;
    out2.download(want);
    EXPECT_TRUE(got.all_written());
    EXPECT_TRUE(got.bitwise_equal(want)) << "replay with seed " << s.first << " differs from a direct call";
    outs.push_back(got);
  }
  EXPECT_FALSE(outs[0].bitwise_equal(outs[1])) << "a new seed must change the dropout pattern";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace gputest
