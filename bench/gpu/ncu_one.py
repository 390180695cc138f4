"""One flashport call per shape, for ncu (run under ncu on a GPU machine): prefill D128 S4k and
decode B=1 Sk=8k (main kernel + split combine), bf16; `ncu_one.py LIB f32`: the prefill call in
float32 alone (the fp32 kernels, src/gpu/f32)."""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_fwd import Flashport, load_lib  # noqa: E402

lib = load_lib(sys.argv[1])
fp = Flashport(lib)
f32 = len(sys.argv) > 2 and sys.argv[2] == "f32"
dt = torch.float32 if f32 else torch.bfloat16
shapes = ((4, 4096, 16, 128, 16, 4096, False), (1, 1, 32, 128, 8, 8192, False))
for (B, S, H, D, Hkv, Sk, causal) in shapes[:1] if f32 else shapes:
    q = torch.randn(B, S, H, D, device="cuda", dtype=dt)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    f = fp.prepare(q, k, v, out, causal, 0)
    f()
    torch.cuda.synchronize()
    print(f.kernel, flush=True)
