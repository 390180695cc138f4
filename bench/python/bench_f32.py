"""float32 attention on CUDA: flashport (src/gpu/f32) against torch SDPA's memory-efficient backend
(CUTLASS; fp32 through 3xTF32 tensor-core products) and its MATH backend, forward and
forward+backward, in one process; and the error of each against an fp64 computation.

    PYTHONPATH=build-py/site-cuda python3 bench/python/bench_f32.py --out bench/results   # CUDA
    (after `bash python/device_test.sh build`; writes <out>/gpu_f32.{md,json})
    python3 bench/python/bench_f32.py --out /tmp/f32 --quick                            # smoke run

Metrics per call, as the benchmark of record reports them (bench_api.py): kernel (torch.profiler's
device time of every kernel, memset and copy the call launches, mean of --reps profiled calls after
two warm-up calls), eager (CUDA events around the call, synced after each, median of --reps), graph
(one replay of the call captured in a CUDA graph, median of --reps; SDPA's is left out where its
capture fails) and host (calls issued back to back without waiting, median of 3 batches of 20);
forward (no grad) and forward+backward. The MATH backend is timed by kernel only (a reference, not
a peer). Ratios: SDPA efficient / flashport (> 1: flashport faster).
Shapes: D in {64, 128, 256}, S in {1k, 4k}, causal or not, B*S = 8k tokens, H*D = 1024; GQA 32/8
D128 causal Sq 1k / Sk 4k; GQA 4:1 decode (forward only).
Errors: max |x - x64| / max |x64| of out (forward) and of dq, dk, dv (backward), one call per point
against the same inputs in float64 (MATH backend).
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

LIBS = ("flashport", "sdpa_efficient", "sdpa_math")


def kernel_us(fn, reps):
    """µs of device time per call (bench_api.time_kernels: torch.profiler, every CUDA activity of
    `reps` calls, averaged) after two warm-up calls."""
    for _ in range(2):
        fn()
    return time_kernels(fn, reps)


def attention(lib, q, k, v, causal):
    """(B, S, H, D) tensors -> out (B, S, H, D)."""
    if lib == "flashport":
        return fa.flash_attn_func(q, k, v, causal=causal)
    backend = SDPBackend.EFFICIENT_ATTENTION if lib == "sdpa_efficient" else SDPBackend.MATH
    rep = q.shape[2] // k.shape[2]
    kt, vt = (x.transpose(1, 2) for x in (k, v))
    if rep > 1:
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    sq, sk = q.shape[1], k.shape[1]
    with sdpa_kernel(backend):
        if causal and sq != sk:
            # SDPA's is_causal is top-left aligned; flashport's (flash_attn's) bottom-right: row i
            # sees keys j <= i + sk - sq, torch's causal_lower_right bias (the efficient kernel
            # takes it natively).
            from torch.nn.attention.bias import causal_lower_right
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=causal_lower_right(sq, sk))
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, is_causal=causal)
    return o.transpose(1, 2)


def shape_name(pt):
    return (f"B{pt['b']} S{pt['sq']}/{pt['sk']} H{pt['hq']}/{pt['hkv']} D{pt['d']}"
            + (" causal" if pt["causal"] else ""))


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_point(b, sq, sk, hq, hkv, d, causal, reps, bwd_ok=True):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=gen)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=gen)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=gen)
    dout = torch.randn(b, sq, hq, d, device="cuda", generator=gen)
    # fp64 oracle (MATH backend in float64).
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    o64 = attention("sdpa_math", q64, k64, v64, causal)
    o64.backward(dout.double())
    ref = {"out": o64.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}
    row = {}
    for lib in LIBS:
        res = {}
        try:
            with torch.no_grad():
                out = attention(lib, q, k, v, causal)
            res["err_out"] = rel_err(out, ref["out"])
            qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
            kinds = ("fwd", "fwd_bwd") if bwd_ok else ("fwd",)
            for kind in kinds:
                fn = call_of_kind(kind, lambda: attention(lib, qg, kg, vg, causal), qg, kg, vg)
                res[kind + "_us"] = kernel_us(fn, reps)
                if lib == "sdpa_math":
                    continue
                res[kind + "_eager"] = time_eager(fn, reps, "cuda")
                res[kind + "_host"] = time_host(fn, 20, 3, "cuda")
                if lib == "flashport" or SDPA_GRAPH["ok"]:
                    try:
                        res[kind + "_graph"] = time_graph(fn, reps)
                    except Exception as e:  # noqa: BLE001 - a failed capture turns SDPA's graph timing off
                        SDPA_GRAPH["ok"] = lib == "flashport" and SDPA_GRAPH["ok"]
                        res[kind + "_graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        torch.cuda.synchronize()
            if bwd_ok:
                o = attention(lib, qg, kg, vg, causal)
                grads = torch.autograd.grad(o, (qg, kg, vg), dout)
                res["err_grad"] = max(rel_err(g, ref[n]) for g, n in zip(grads, ("dq", "dk", "dv")))
        except Exception as e:  # noqa: BLE001 - a backend that cannot run a point is reported
            res["error"] = str(e).splitlines()[0][:200]
        row[lib] = res
        torch.cuda.empty_cache()
    return row


# A failed CUDA-graph capture of SDPA can leave torch's generator in capture state: after the
# first failure SDPA's graph column is not measured again.
SDPA_GRAPH = {"ok": True}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/flashport-f32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="two small points")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_f32: needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # MATH backend and the oracle: fp32 products
    points = []
    dims = (64, 128) if args.quick else (64, 128, 256)
    seqs = (1024,) if args.quick else (1024, 4096)
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                points.append(dict(b=max(1, 8192 // s), sq=s, sk=s, hq=1024 // d, hkv=1024 // d,
                                   d=d, causal=causal))
    if not args.quick:  # GQA 32/8 prefill over a longer KV (the issue-18 reference shape, 5.6 ms SIMT fwd)
        points.append(dict(b=2, sq=1024, sk=4096, hq=32, hkv=8, d=128, causal=True))
    if not args.quick:  # decode: GQA 32/8, one query row, long KV (forward only)
        points.append(dict(b=8, sq=1, sk=8192, hq=32, hkv=8, d=128, causal=False, bwd=False))
    rows = []
    for pt in points:
        bwd_ok = pt.pop("bwd", True)
        res = run_point(reps=args.reps, bwd_ok=bwd_ok, **pt)
        rows.append({"point": pt, "results": res})
        line = shape_name(pt)
        for lib, r in res.items():
            if "error" in r:
                line += f" | {lib}: {r['error']}"
            else:
                line += f" | {lib}: fwd {r['fwd_us']:.0f} us"
                if "fwd_bwd_us" in r:
                    line += f", fwd+bwd {r['fwd_bwd_us']:.0f} us"
                line += f", err {r['err_out']:.1e}"
                if "err_grad" in r:
                    line += f"/{r['err_grad']:.1e}"
        print(line, flush=True)

    os.makedirs(args.out, exist_ok=True)
    dev = device_line("cuda")
    command = "PYTHONPATH=build-py/site-cuda python3 " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    with open(os.path.join(args.out, "gpu_f32.json"), "w") as f:
        json.dump({"command": command, "device": dev, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "gpu_f32.md"), "w") as f:
        f.write(markdown(rows, command, dev) + "\n")
    print(f"wrote {args.out}/gpu_f32.md")


def markdown(rows, command, dev):
    """The table: per shape and call, flashport and SDPA efficient side by side (kernel, eager,
    graph, host µs) with the efficient / flashport ratios, MATH's kernel time, and the errors."""
    def val(r, key):
        return None if r is None else r.get(key)

    def us(x):
        return "-" if x is None else f"{x:,.0f}"

    def ratio(num, den):
        return "-" if not num or not den else f"{num / den:.2f}x"

    def err(r, key):
        return "-" if val(r, key) is None else f"{r[key]:.1e}"

    md = ["# float32 attention: flashport vs torch SDPA memory-efficient (and MATH)", "",
          f"Command: `{command}`  ", f"Device: {dev}", "",
          "µs per call: kernel (torch.profiler device time), eager (synced per call), graph (one "
          "CUDA-graph replay), host (calls back to back); ratio = SDPA efficient / flashport (> 1: "
          "flashport faster). Error: max |x - x64| / max |x64| (out; worst of dq, dk, dv).", "",
          "| shape | call | kernel flashport | kernel efficient | kernel ratio | eager ratio | "
          "graph ratio | host flashport | host efficient | kernel math | err flashport | "
          "err efficient | err math |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        pt, res = row["point"], row["results"]
        fp, eff, mth = (res.get(lib) for lib in LIBS)
        for kind, name in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
            if val(fp, kind + "_us") is None and val(eff, kind + "_us") is None:
                continue
            ek = "err_out" if kind == "fwd" else "err_grad"
            cells = [us(val(fp, kind + "_us")), us(val(eff, kind + "_us")),
                     ratio(val(eff, kind + "_us"), val(fp, kind + "_us")),
                     ratio(val(eff, kind + "_eager"), val(fp, kind + "_eager")),
                     ratio(val(eff, kind + "_graph"), val(fp, kind + "_graph")),
                     us(val(fp, kind + "_host")), us(val(eff, kind + "_host")),
                     us(val(mth, kind + "_us")), err(fp, ek), err(eff, ek), err(mth, ek)]
            md.append(f"| {shape_name(pt)} | {name} | " + " | ".join(cells) + " |")
    notes = sorted({f"{lib}: {r[key]}" for row in rows for lib, r in row["results"].items()
                    for key in r if key == "error" or key.endswith("graph_error")})
    return "\n".join(md + ([""] + notes if notes else []))


if __name__ == "__main__":
    main()
