# Why the API's kernel-time ratio (record) and the C harness's event ratio disagree at S1k: the same
# tensors through flashport's Python API, the C entry (fpbench) and cuDNN SDPA, each timed by
# torch.profiler (kernel names and device time per call) and by CUDA events over 10 calls, in rounds.
import sys, statistics
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path[:0] = ["bench/gpu", "bench/python"]
import bench_fwd as bf
import flashport.torch as fa
from bench_api import kernel_times

lib = bf.load_lib(sys.argv[1])

def kernels(fn, calls=10):
    """{kernel name: (launches, µs) per call} (bench_api's kernel_times)."""
    return {k: (n / calls, us / calls) for k, (n, us) in kernel_times(fn, calls).items()}

def events(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) * 1e3 / reps

for d, S, causal in ((128, 1024, True), (128, 1024, False), (64, 1024, False), (64, 1024, True), (128, 4096, False), (256, 16384, False)):
    b, h = 16384 // S, 2048 // d
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, S, h, d, generator=g).to(device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    cfb = bf.Flashport(lib).prepare(q, k, v, torch.empty_like(q), causal, 1)
    cfb0 = bf.Flashport(lib).prepare(q, k, v, torch.empty_like(q), causal, 0)
    def api():
        with torch.no_grad():
            return fa.flash_attn_func(q, k, v, causal=causal)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    fns = {"api": api, "c_splits1": cfb, "c_splits0": cfb0, "cudnn": cudnn}
    ev = {n: [] for n in fns}; kt_ = {n: [] for n in fns}
    for r in range(5):
        for n, f in fns.items():
            ev[n].append(events(f))
            kt_[n].append(sum(us for _, us in kernels(f).values()))
    print(f"## D{d} S{S} causal={causal}: median us (events over 10 calls | profiler device time per call)")
    for n in fns:
        print(f"  {n:10s} events {statistics.median(ev[n]):8.1f}  profiler {statistics.median(kt_[n]):8.1f}")
    for n in ("api", "c_splits1", "cudnn"):
        for name, (cnt, us) in kernels(fns[n]).items():
            print(f"    {n}: {cnt:.1f}x {us:8.1f} us  {name[:110]}")
    print(f"  C-entry kernel: {cfb.kernel} / splits0: {cfb0.kernel}", flush=True)
