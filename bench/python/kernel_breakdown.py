"""Where a call's device time goes: every kernel (and memset/memcpy) one public-API call launches,
with its mean device time, for flashport and torch SDPA's cuDNN and flash backends side by side in
one process. The benchmark of record (bench_api.py) reports the sum; this splits it, so the part
to work on (main kernel, preprocess, dQ conversion, split combine, ...) is named by measurement.

    PYTHONPATH=build-py/site-cuda python3 bench/python/kernel_breakdown.py [--points fwd_bwd,decode]
        [--out DIR]     (after `bash python/device_test.sh build`)

Points: splits -- decode B1/B8 with num_splits forced (0 = auto); coverage -- the prefill-chunk calls of bench_coverage.py below the featureless speed
(append + rotary, dropout, the contiguous cache, pages of 16, 64 and 256); fwd_bwd -- forward+backward, bf16, B*S = 16k, H*D = 2048, D in {64, 128, 256} x S in
{1k, 4k} x causal; decode -- flash_attn_with_kvcache, GQA 32/8, D128, B in {1, 8, 64} x Sk in
{8k, 64k}. Prints one block per point (kernel name, calls per call, mean us) and, with --out,
writes kernel_breakdown.md there.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_api import (attention_call, decode_call, device_line, kernel_times, make_qkv,  # noqa: E402
                       with_backend)

LIBS = ("flashport", "sdpa_cudnn", "sdpa_flash")


def breakdown(fn, calls=10, warmup=3):
    """[(kernel name, launches per call, mean us per launch, us per call)], heaviest first."""
    for _ in range(warmup):
        fn()
    per = kernel_times(fn, calls)
    rows = [(name, n / calls, tot / n, tot / calls) for name, (n, tot) in per.items()]
    return sorted(rows, key=lambda r: -r[3])


def short(name, width=90):
    return name if len(name) <= width else name[:width - 3] + "..."


def split_sweep(calls):
    """Decode device time per forced num_splits (0 = the planner's count), B1 and B8, GQA 32/8, D128."""
    import flashport.torch as fa
    lines = ["## decode split sweep (us per call, all kernels; 0 = planner's choice)"]
    for b, sk in ((1, 8192), (1, 65536), (8, 8192)):
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        sl = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        cells = []
        for ns in (0, 8, 16, 24, 32, 48, 64, 96, 128):
            fn = lambda ns=ns: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, num_splits=ns)
            cells.append(f"{ns}: {sum(r[3] for r in breakdown(fn, calls * 5)):.1f}")
        lines.append(f"- B{b} Sk{sk}: " + ", ".join(cells))
    print("\n".join(lines), flush=True)
    return lines


def random_paged_cache(B, rows, page, Hkv, D, dev, dt, sequential=False):
    """Paged K/V caches of random values holding `rows` rows per sequence and their block table:
    pages in random order (sequential: sequence b's pages one after another)."""
    blocks = (rows + page - 1) // page
    ids = torch.arange(B * blocks, device=dev) if sequential else torch.randperm(B * blocks, device=dev)
    kp = torch.randn(B * blocks, page, Hkv, D, device=dev, dtype=dt)
    return kp, torch.randn_like(kp), ids.to(torch.int32).view(B, blocks)


def coverage_points(calls):
    """The prefill-chunk calls of bench_coverage.py whose speed is below the featureless call's:
    B2, Sq 1024, keys 4096, Hq/Hkv 32/8, D128, bf16, causal."""
    import flashport.torch as fa
    from bench_coverage import prefill_chunk_inputs
    dev, dt = "cuda", torch.bfloat16
    B, Sq, Sk, Hq, Hkv, D = 2, 1024, 4096, 32, 8, 128
    _, q, k, v, k_cache, v_cache, seqlens, cap = prefill_chunk_inputs(B, Sq, Sk, Hq, Hkv, D, dev, dt)
    kn, vn = k[:, Sk - Sq:].clone(), v[:, Sk - Sq:].clone()
    before = seqlens - Sq
    ro = torch.rand(cap + Sq, D // 4, device=dev, dtype=torch.float32)
    cos32, sin32 = ro.cos(), ro.sin()
    cos16, sin16 = cos32.to(dt), sin32.to(dt)

    calls_of = [("featureless causal", lambda: fa.flash_attn_func(q, k, v, causal=True)),
                ("append", lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn,
                                                               cache_seqlens=before, causal=True)),
                ("append + rotary (fp32 tables)", lambda: fa.flash_attn_with_kvcache(
                    q, k_cache, v_cache, k=kn, v=vn, rotary_cos=cos32, rotary_sin=sin32,
                    cache_seqlens=before, causal=True)),
                ("append + rotary (bf16 tables)", lambda: fa.flash_attn_with_kvcache(
                    q, k_cache, v_cache, k=kn, v=vn, rotary_cos=cos16, rotary_sin=sin16,
                    cache_seqlens=before, causal=True)),
                ("dropout 0.1", lambda: fa.flash_attn_func(q, k, v, dropout_p=0.1, causal=True)),
                ("kv cache (contiguous)", lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                             cache_seqlens=seqlens, causal=True))]
    for page in (16, 64, 256):
        kp, vp, table = random_paged_cache(B, cap, page, Hkv, D, dev, dt)
        calls_of.append((f"paged {page}", lambda kp=kp, vp=vp, table=table: fa.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True)))
    lines = ["## coverage calls (B2 Sq1024 keys 4096 Hq/Hkv 32/8 D128 causal)"]
    for name, fn in calls_of:
        rows = breakdown(fn, calls)
        lines.append(f"- **{name}** total {sum(r[3] for r in rows):.1f} us")
        for kname, n, mean, per_call in rows:
            lines.append(f"  - {per_call:8.1f} us  ({n:.0f} x {mean:.1f})  {short(kname)}")
    print("\n".join(lines), flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="fwd_bwd,decode,splits,coverage")
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    kinds = args.points.split(",")
    lines = [f"# Kernel breakdown per call", "", f"Device: {device_line('cuda')}", "",
             "Command: `python3 bench/python/kernel_breakdown.py --points " + args.points + "`", ""]
    if "fwd_bwd" in kinds:
        for d in (64, 128, 256):
            for s in (1024, 4096):
                for causal in (False, True):
                    b, h = 16384 // s, 2048 // d
                    first = len(lines)
                    lines.append(f"## fwd_bwd D{d} S{s} B{b} H{h} causal={causal}")
                    for lib in LIBS:
                        q, k, v = make_qkv(b, s, h, d, torch.bfloat16, "cuda", requires_grad=True)
                        fn = with_backend(lib, attention_call(lib, "fwd_bwd", q, k, v, causal))
                        try:
                            rows = breakdown(fn, args.calls)
                        except Exception as e:  # noqa: BLE001
                            lines.append(f"- {lib}: {type(e).__name__}: {str(e)[:120]}")
                            continue
                        total = sum(r[3] for r in rows)
                        lines.append(f"- **{lib}** total {total:.1f} us")
                        for name, n, mean, per_call in rows:
                            lines.append(f"  - {per_call:8.1f} us  ({n:.0f} x {mean:.1f})  {short(name)}")
                    print("\n".join(lines[first:]), flush=True)  # this point's lines only
                    lines.append("")
    if "decode" in kinds:
        for b, sk in ((1, 8192), (1, 65536), (8, 8192), (8, 65536), (64, 8192)):
            lines.append(f"## decode B{b} Sk{sk} Hq32 Hkv8 D128")
            for lib in ("flashport", "sdpa_cudnn"):
                fn = decode_call(lib, b, sk, torch.bfloat16)
                rows = breakdown(fn, args.calls * 5)
                total = sum(r[3] for r in rows)
                lines.append(f"- **{lib}** total {total:.1f} us")
                for name, n, mean, per_call in rows:
                    lines.append(f"  - {per_call:8.1f} us  ({n:.0f} x {mean:.1f})  {short(name)}")
                fn = None
                torch.cuda.empty_cache()
            lines.append("")
    if "splits" in kinds:
        lines += split_sweep(args.calls)
    if "coverage" in kinds:
        lines += coverage_points(args.calls)
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernel_breakdown.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
