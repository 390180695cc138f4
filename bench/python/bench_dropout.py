"""Attention with dropout on CUDA: flashport against torch SDPA's flash backend (FlashAttention-2,
forced), forward and forward+backward, bf16, in one process (issue 18 item 3: >= 1.3x SDPA flash
on the H100). flashport without dropout is timed next to it: the price of the mask.

    PYTHONPATH=build-py/site-cuda python3 bench/python/bench_dropout.py --out bench/results   # CUDA
    (after `bash python/device_test.sh build`; writes <out>/gpu_dropout.{md,json})
    python3 bench/python/bench_dropout.py --out /tmp/dropout --quick                      # smoke run

Metric: kernel time per call, torch.profiler's device time of every kernel (and memset/memcpy)
the call launches (bench_api.time_kernels), averaged over --reps profiled calls after a warm-up;
next to it, as the benchmark of record reports them (bench_api.py): eager time per call (CUDA
events around the call, synced after each, median of --reps), one CUDA-graph replay (the call
captured once; SDPA's forward only) and host time per call (calls issued back to back without
waiting, median of 3 batches of 20).
Shapes: D in {64, 128, 256} x S in {1k, 4k} x causal, B*S = 16k tokens, H*D = 2048, dropout p
(--p, default 0.1). Ratio: SDPA flash time / flashport time (> 1: flashport faster).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # run from a checkout without installing: python/ holds the package sources
    import flashport.torch as fa
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import flashport.torch as fa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import call_of_kind, device_line, time_eager, time_graph, time_host, time_kernels  # noqa: E402  (the benchmark of record's timers)

LIBS = ("flashport", "sdpa_flash", "flashport_p0")  # flashport_p0: no dropout, for the mask's price


def kernel_us(fn, reps):
    """µs of device time per call after two warm-up calls."""
    for _ in range(2):
        fn()
    return time_kernels(fn, reps)


def make_call(lib, kind, q, k, v, causal, p):
    """A zero-argument callable: one forward (kind 'fwd', no grad) or forward+backward."""
    if lib == "sdpa_flash":
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)
    else:
        p_lib = 0.0 if lib == "flashport_p0" else p

        def fwd():
            return fa.flash_attn_func(q, k, v, dropout_p=p_lib, causal=causal)
    return call_of_kind(kind, fwd, q, k, v)


# SDPA's dropout forward+backward does not capture (torch 2.11: "Offset increment outside graph
# capture", the generator left in capture state), so its graph column is the forward only; a
# failed capture turns SDPA's graph timing off for the rest of the run.
SDPA_GRAPH = {"ok": True}


def run_point(b, s, h, d, causal, p, reps):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    res = {}
    for lib in LIBS:
        r = {}
        for kind in ("fwd", "fwd_bwd"):
            try:
                fn = make_call(lib, kind, q, k, v, causal, p)
                r[kind] = kernel_us(fn, reps)
                r[kind + "_eager"] = time_eager(fn, reps, "cuda")
                r[kind + "_host"] = time_host(fn, 20, 3, "cuda")
                if lib != "sdpa_flash":
                    r[kind + "_graph"] = time_graph(fn, reps)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run a point is reported
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                torch.cuda.synchronize()
        res[lib] = r
    if SDPA_GRAPH["ok"] and "error" not in res["sdpa_flash"]:  # last: a failed capture is not undone
        try:
            res["sdpa_flash"]["fwd_graph"] = time_graph(make_call("sdpa_flash", "fwd", q, k, v, causal, p), reps)
        except Exception as e:  # noqa: BLE001
            SDPA_GRAPH["ok"] = False
            res["sdpa_flash"]["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            torch.cuda.synchronize()
    del q, k, v
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/flashport-dropout")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--p", type=float, default=0.1, help="dropout probability")
    ap.add_argument("--quick", action="store_true", help="D128, S1k only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dropout: needs a CUDA device")
    dims = (128,) if args.quick else (64, 128, 256)
    seqs = (1024,) if args.quick else (1024, 4096)
    rows = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                pt = dict(b=16384 // s, s=s, h=2048 // d, d=d, causal=causal)
                res = run_point(p=args.p, reps=args.reps, **pt)
                rows.append({"point": pt, "results": res})
                line = f"D{d} S{s} B{pt['b']} H{pt['h']} {'causal' if causal else 'full'}"
                for lib, r in res.items():
                    line += f" | {lib}: " + (r["error"] if "error" in r else
                                             f"fwd {r['fwd']:.0f} us (eager {r['fwd_eager']:.0f}, host "
                                             f"{r['fwd_host']:.0f}), fwd+bwd {r['fwd_bwd']:.0f} us (eager "
                                             f"{r['fwd_bwd_eager']:.0f}, host {r['fwd_bwd_host']:.0f})")
                print(line, flush=True)

    os.makedirs(args.out, exist_ok=True)
    dev = device_line("cuda")
    with open(os.path.join(args.out, "gpu_dropout.json"), "w") as f:
        json.dump({"device": dev, "p": args.p, "rows": rows}, f, indent=1)

    def val(r, key):
        return None if r is None or key not in r else r[key]

    def us(x):
        return "-" if x is None else f"{x:,.0f}"

    def ratio(num, den):
        return "-" if num is None or den is None or den == 0 else f"{num / den:.2f}x"

    md = [f"# Attention with dropout (p = {args.p}), bf16, flashport vs torch SDPA flash", "",
          f"Device: {dev}", "",
          "Command: `PYTHONPATH=build-py/site-cuda python3 bench/python/bench_dropout.py --out bench/results`", "",
          "Kernel time per call (torch.profiler, µs, mean of --reps calls). SDPA / flashport: > 1 is "
          "flashport faster (target >= 1.3x). p=0: flashport without dropout, the same call.", "",
          "| D | S | B | H | causal | flashport fwd | SDPA flash fwd | SDPA / flashport | flashport p=0 fwd "
          "| flashport fwd+bwd | SDPA flash fwd+bwd | SDPA / flashport | flashport p=0 fwd+bwd |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        pt, res = row["point"], row["results"]
        fp, sd, p0 = (res.get(x) for x in LIBS)
        cells = [str(pt["d"]), str(pt["s"]), str(pt["b"]), str(pt["h"]), "yes" if pt["causal"] else "no"]
        for kind in ("fwd", "fwd_bwd"):
            cells += [us(val(fp, kind)), us(val(sd, kind)), ratio(val(sd, kind), val(fp, kind)), us(val(p0, kind))]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", "Through the public API, the way a user sees the call: eager µs per call (synced after each "
           "call; median), one CUDA-graph replay (median; SDPA's dropout forward+backward does not capture: "
           "-) and host µs per call (back-to-back calls, not waited on), flashport / SDPA flash; "
           "graph ratio: SDPA / flashport.", "",
           "| D | S | causal | fwd eager | fwd graph | fwd graph ratio | fwd host | fwd+bwd eager | fwd+bwd graph "
           "| fwd+bwd host |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        pt, res = row["point"], row["results"]
        fp, sd = res.get("flashport"), res.get("sdpa_flash")
        cells = [str(pt["d"]), str(pt["s"]), "yes" if pt["causal"] else "no"]
        for key in ("fwd_eager", "fwd_graph", "fwd_host", "fwd_bwd_eager", "fwd_bwd_graph", "fwd_bwd_host"):
            cells.append(f"{us(val(fp, key))} / {us(val(sd, key))}")
            if key == "fwd_graph":
                cells.append(ratio(val(sd, key), val(fp, key)))
        md.append("| " + " | ".join(cells) + " |")
    errs = [(lib, r[key]) for row in rows for lib, r in row["results"].items()
            for key in ("error", "graph_error") if key in r]
    for lib, e in sorted(set(errs)):
        md.append(f"\n{lib}: {e}")
    with open(os.path.join(args.out, "gpu_dropout.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {args.out}/gpu_dropout.md")


if __name__ == "__main__":
    main()
