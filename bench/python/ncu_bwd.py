"""One forward+backward through the public API, twice (the second for ncu's --launch-skip 1), at
B*S = 16k, S = 4k, H*D = 2048, bf16, non-causal; flashport or cuDNN's SDPA, for ncu's -k filter:

    PYTHONPATH=build-py/site-cuda ncu --clock-control none -k regex:bwd_hopper_kernel \
        --launch-skip 1 --launch-count 1 --section SpeedOfLight ... python3 bench/python/ncu_bwd.py flashport 128
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashport.torch as fa

lib = sys.argv[1] if len(sys.argv) > 1 else "flashport"
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
B, S, H = 4, 4096, 2048 // D
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    if lib == "flashport":
        o = fa.flash_attn_func(q, k, v)
    else:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2)).transpose(1, 2)
    o.backward(g)
torch.cuda.synchronize()
print("ok", lib, D)
