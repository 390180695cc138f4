"""One backward (run twice, for ncu's --launch-skip 1) through fpbench's C entry or cuDNN's SDPA, at
head dim D (argv 2), S (argv 3, default 4096), causal (argv 4: 1, default 0), B*S = 16k, H*D = 2048,
bf16; argv 1: a libfpbench.so or 'cudnn'. From the repository root, e.g.

    ncu --clock-control none -k regex:bwd_hopper_d256 --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 bench/gpu/ncu_bwd.py build/bench/gpu/libfpbench.so 256
    ncu --clock-control none --launch-count 14 ... python3 bench/gpu/ncu_bwd.py cudnn 256
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import bench_fwd as bf
from bench_ab_fwd import FlashportBwd
D = int(sys.argv[2]); S = int(sys.argv[3]) if len(sys.argv) > 3 else 4096; B = 16384 // S; H = 2048 // D
causal = len(sys.argv) > 4 and sys.argv[4] == "1"
q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
if sys.argv[1] == "cudnn":
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with bf.sdpa_kernel(bf.SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    for _ in range(2):
        torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
else:
    lib = bf.load_lib(sys.argv[1])
    out = torch.empty_like(q); lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    bf.Flashport(lib).prepare(q, k, v, out, causal, 1, lse)()
    f = FlashportBwd(lib, q, k, v, out, lse, dout, causal)
    f(); f()
torch.cuda.synchronize()
print("ok", sys.argv[1], D)
