"""One KV-cache prefill chunk (bench_ab_fwd.py cache's shape: B2, Sq 1024 after 3072 cached keys,
Hq/Hkv 32/8, D128, bf16, causal), run twice for ncu's --launch-skip 1, through fpbench's C entry;
argv 1: a libfpbench.so, argv 2: the page size (0: the contiguous cache). From the repository root:

    ncu --clock-control none -k regex:fwd_hopper --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
        python3 bench/gpu/ncu_cache.py build/bench/gpu/libfpbench.so 1
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import bench_fwd as bf
from bench_ab_fwd import FlashportCache

B, Sq, Sk, D, Hq, Hkv = 2, 1024, 4096, 128, 32, 8
page = int(sys.argv[2])
cap = Sk + 512
torch.manual_seed(0)
q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16)
seqlens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
if page == 0:
    k, v = (torch.randn(B, cap, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = None
else:
    blocks = (cap + page - 1) // page
    table = torch.randperm(B * blocks, device="cuda").to(torch.int32).view(B, blocks)
    k, v = (torch.randn(B * blocks, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
f = FlashportCache(bf.load_lib(sys.argv[1]), q, k, v, seqlens, table)
f(); f()
torch.cuda.synchronize()
print("ok", f.kernel)
