"""Decode kernel check and timing: errors of flash_attn_with_kvcache against an fp32 reference on
several decode shapes (GQA, MQA, ragged cache_seqlens, a long cache), then kernel time per call
(torch.profiler, every kernel and memset of the call) beside cuDNN SDPA at the decode grid
(B in {1, 8, 64} x Sk in {8k, 64k}, Hq/Hkv 32/8, D128, bf16).

    PYTHONPATH=build-py/site-cuda python3 bench/python/decode_check.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_breakdown import breakdown  # noqa: E402
from bench_api import decode_call  # noqa: E402
import flashport.torch as fa  # noqa: E402


def main():
    torch.manual_seed(0)
    worst = 0.0
    for (b, sk, hq, hkv, lens) in ((1, 8192, 32, 8, None), (8, 8192, 32, 8, None), (3, 1000, 32, 8, (1000, 517, 1)),
                                   (2, 70000, 16, 16, (70000, 33333)), (4, 4096, 8, 1, (4096, 100, 2047, 3000))):
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        sl = torch.tensor(lens if lens else [sk] * b, dtype=torch.int32, device="cuda")
        out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl)
        for i in range(b):
            L = int(sl[i])
            kk = kc[i, :L].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
            vv = vc[i, :L].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
            ref = torch.softmax(q[i].float().transpose(0, 1) @ kk.transpose(1, 2) / 128 ** 0.5, -1) @ vv
            err = (out[i].float().transpose(0, 1) - ref).abs().max().item()
            worst = max(worst, err)
    print(f"max abs err {worst:.2e} {'OK' if worst < 2e-2 else 'FAIL'}", flush=True)
    if worst >= 2e-2:
        sys.exit(1)
    cells = []
    for b, sk in ((1, 8192), (1, 65536), (8, 8192), (8, 65536), (64, 8192)):
        t = {}
        for lib in ("flashport", "sdpa_cudnn"):
            rows = breakdown(decode_call(lib, b, sk, torch.bfloat16), 100)
            t[lib] = sum(r[3] for r in rows)
            if lib == "flashport":
                kname = rows[0][0]
        cells.append(f"B{b} Sk{sk}: {t['flashport']:.1f} vs cuDNN {t['sdpa_cudnn']:.1f} ({t['sdpa_cudnn'] / t['flashport']:.3f})")
    print("  " + "; ".join(cells), "|", kname[kname.find("decode_kernel"):kname.find("decode_kernel") + 50], flush=True)


if __name__ == "__main__":
    main()
