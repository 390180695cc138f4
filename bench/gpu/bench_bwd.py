#!/usr/bin/env python3
"""flashport CUDA backward vs torch SDPA (flash = FlashAttention-2, cuDNN) backward, side by side.

Grid of the forward benchmark: bf16, B*S = 16k tokens, H*D = 2048, D in {64, 128, 256},
S in {1k, 4k, 16k}, causal and not. FLOPs of the backward = 2.5 x the forward's
(4*B*H*S*S*D, halved when causal), as in /work/shared/notes/baselines.md.

flashport is timed through its C API by bench_bwd_driver (built here against a CUDA build's
libflashport.a): the whole backward call (preprocess + main loop + dq conversion), median of
--iters after warm-up, CUDA events. torch is timed in this process: the backward alone
(torch.autograd.grad on a retained graph), median of --iters, CUDA events.

  python3 bench/gpu/bench_bwd.py --build-dir build-gpu [--out-dir bench/results] [--quick]

Writes gpu_bwd_bench.md, gpu_bwd_bench.json and gpu_bwd_bench.png into --out-dir.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def build_driver(build_dir):
    lib = os.path.join(build_dir, "libflashport.a")
    if not os.path.exists(lib):
        sys.exit(f"{lib} not found: build flashport with -DFLASHPORT_CUDA=ON first")
    exe = os.path.join(build_dir, "bench_bwd_driver")
    src = os.path.join(HERE, "bench_bwd_driver.cpp")
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    subprocess.check_call(["c++", "-O2", "-std=c++17", "-I", os.path.join(ROOT, "include"),
                           "-I", os.path.join(cuda, "include"), src, lib,
                           "-L", os.path.join(cuda, "lib64"), "-lcudart", "-lpthread", "-o", exe])
    return exe


def torch_bwd_ms(torch, backend, B, S, H, D, causal, iters):
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda: torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    q, k, v = mk(), mk(), mk()
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            for _ in range(3):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1))
    except Exception as ex:  # a backend that declines a shape
        print(f"torch {backend} D={D} S={S} causal={causal}: {ex}", file=sys.stderr)
        return None
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", default="64,128,256", help="head dims to run, comma-separated")
    ap.add_argument("--seqs", default=None, help="sequence lengths to run, comma-separated (overrides --quick)")
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    exe = build_driver(args.build_dir)
    dev = torch.cuda.get_device_name()
    dims = [int(x) for x in args.dims.split(",")]
    seqs = [1024, 4096, 16384] if not args.quick else [4096]
    if args.seqs:
        seqs = [int(x) for x in args.seqs.split(",")]
    rows = []
    for D in dims:
        for S in seqs:
            for causal in (0, 1):
                B, H = 16384 // S, 2048 // D
                flops = 4.0 * B * H * S * S * D * 2.5 * (0.5 if causal else 1.0)
                r = {"D": D, "S": S, "B": B, "H": H, "causal": causal}
                p = subprocess.run([exe, str(D), str(S), str(B), str(H), str(causal), str(args.iters)],
                                   capture_output=True, text=True)
                if p.returncode == 0:
                    r.update(json.loads(p.stdout.strip().splitlines()[-1]))
                else:
                    print(p.stderr, file=sys.stderr)
                    r["error"] = p.stderr.strip()[-300:]
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    ms = torch_bwd_ms(torch, be, B, S, H, D, causal, args.iters)
                    r[f"{name}_ms"] = ms
                    r[f"{name}_tflops"] = flops / ms * 1e-9 if ms else None
                rows.append(r)
                print(json.dumps(r), flush=True)

    os.makedirs(args.out_dir, exist_ok=True)
    fmt = lambda x: "-" if x is None else f"{x:.0f}"
    ratio = lambda a, b: "-" if (a is None or b is None) else f"{a / b:.2f}"
    lines = [
        "# GPU backward: flashport vs torch SDPA flash (FA2) and cuDNN",
        "",
        f"Device: {dev}; torch {torch.__version__}. bf16, B*S = 16k, H*D = 2048; TFLOPS = 2.5 x forward "
        "FLOPs (4*B*H*S*S*D, halved when causal) / time of the backward alone; median of "
        f"{args.iters} CUDA-event timings after warm-up.",
        "",
        "Command: `python3 bench/gpu/bench_bwd.py --build-dir <cuda build>` (scripts/device.sh bench).",
        "",
        "| D | S | B | causal | flashport | flashport det | torch flash | cuDNN | vs flash | vs cuDNN | kernel |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ft = r.get("tflops")
        lines.append(f"| {r['D']} | {r['S']} | {r['B']} | {'y' if r['causal'] else 'n'} | {fmt(ft)} | "
                     f"{fmt(r.get('tflops_det'))} | {fmt(r.get('flash_tflops'))} | {fmt(r.get('cudnn_tflops'))} | "
                     f"{ratio(ft, r.get('flash_tflops'))} | {ratio(ft, r.get('cudnn_tflops'))} | "
                     f"{r.get('kernel', r.get('error', ''))} |")
    with open(os.path.join(args.out_dir, "gpu_bwd_bench.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "gpu_bwd_bench.json"), "w") as fh:
        json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, fh, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
        for ax, causal in zip(axes, (0, 1)):
            sel = [r for r in rows if r["causal"] == causal]
            labels = [f"D{r['D']}\nS{r['S'] // 1024}k" for r in sel]
            x = range(len(sel))
            w = 0.27
            for off, key, name in ((-w, "tflops", "flashport"), (0, "flash_tflops", "torch flash (FA2)"),
                                   (w, "cudnn_tflops", "cuDNN")):
                ax.bar([i + off for i in x], [r.get(key) or 0 for r in sel], w, label=name)
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_title(f"backward, bf16, {'causal' if causal else 'non-causal'} ({dev})")
            ax.set_ylabel("TFLOPS")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "gpu_bwd_bench.png"), dpi=110)
    except Exception as ex:
        print(f"plot skipped: {ex}", file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
