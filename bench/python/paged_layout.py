"""Paged-KV prefill chunk (B2, Sq 1024, 4096 keys, Hq/Hkv 32/8, D128, bf16, causal): random and
sequential block tables at page sizes 64, 128, 256 against the contiguous cache; kernel time per
call (torch.profiler), two rounds. Separates the page walk's cost from the pages' placement.

    PYTHONPATH=build-py/site-cuda python3 bench/python/paged_layout.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_breakdown import breakdown, random_paged_cache  # noqa: E402
from bench_coverage import prefill_chunk_inputs  # noqa: E402
import flashport.torch as fa  # noqa: E402


def main():
    dev, dt = "cuda", torch.bfloat16
    B, Sq, Sk, Hq, Hkv, D = 2, 1024, 4096, 32, 8, 128
    _, q, k, v, k_cache, v_cache, seqlens, cap = prefill_chunk_inputs(B, Sq, Sk, Hq, Hkv, D, dev, dt)
    calls = [("contiguous", lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True))]
    for page in (64, 128, 256):
        for order in ("random", "sequential"):
            kp, vp, table = random_paged_cache(B, cap, page, Hkv, D, dev, dt, sequential=order == "sequential")
            calls.append((f"paged {page} {order}", lambda kp=kp, vp=vp, table=table: fa.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True)))
    for rnd in range(2):
        for name, fn in calls:
            rows = breakdown(fn, 20)
            print(f"round {rnd} {name:24s} {sum(r[3] for r in rows):8.1f} us  {rows[0][0][:60]}", flush=True)


if __name__ == "__main__":
    main()
