#!/usr/bin/env python3
"""Interleaved A/B of two flashport builds on the forward grid, with cuDNN in the same process.

Separate benchmark runs on the lent H100 drifted by up to 30% (cuDNN's own figures too), so a
kernel change is judged by loading both builds' fpbench libraries into one process and timing
them in rounds: each point runs 5 rounds of [A, B, cuDNN], 10 CUDA-event-timed calls each, and
reports the medians. bf16, B*S = 16k, H*D = 2048, S in {1k, 4k, 16k}, causal and not.

    python3 bench/gpu/bench_ab_fwd.py BUILD_A/bench/gpu/libfpbench.so BUILD_B/bench/gpu/libfpbench.so [64,128,256]

Prints a markdown table (TFLOPS; A/B, A/cuDNN, B/cuDNN ratios). Timing helpers: bench_fwd.py.
"""
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fwd as bf  # noqa: E402


def main():
    lib_a, lib_b = bf.load_lib(sys.argv[1]), bf.load_lib(sys.argv[2])
    dims = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "64,128,256").split(",")]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| D | S | causal | A TF | B TF | cuDNN TF | A/B | A/cuDNN | B/cuDNN | kernel A |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in dims:
        h = 2048 // d
        for s in (1024, 4096, 16384):
            b = 16384 // s
            for causal in (False, True):
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                fa = bf.Flashport(lib_a).prepare(q, k, v, torch.empty_like(q), causal, 1)
                fb = bf.Flashport(lib_b).prepare(q, k, v, torch.empty_like(q), causal, 1)
                cudnn = bf.sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, False)
                times = {"A": [], "B": [], "C": []}
                for _ in range(5):
                    for name, fn in (("A", fa), ("B", fb), ("C", cudnn)):
                        times[name].append(bf.time_ms(fn, warmup=2, reps=10))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                tf = {n: flops / (statistics.median(t) * 1e-3) / 1e12 for n, t in times.items()}
                print(f"| {d} | {s} | {'y' if causal else 'n'} | {tf['A']:.0f} | {tf['B']:.0f} | {tf['C']:.0f} | "
                      f"{tf['A'] / tf['B']:.3f} | {tf['A'] / tf['C']:.2f} | {tf['B'] / tf['C']:.2f} | {fa.kernel} |",
                      flush=True)


if __name__ == "__main__":
    main()
