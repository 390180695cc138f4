#!/usr/bin/env python3
"""flashport's CPU backend vs PyTorch's CPU scaled_dot_product_attention, side by side.

flashport is called as a user would: flashport.torch.flash_attn_func on CPU tensors (its native
[B, S, H, D] layout), torch.nn.functional.scaled_dot_product_attention on [B, H, S, D] tensors, in
this one process, at the same thread count, interleaved call by call (flashport, torch, flashport,
...) for --rounds rounds after a warm-up: medians of each side and the ratio of the medians, so
that load from other processes hits both alike. The C API is timed too (bench_cpu_driver.cpp, a
separate process, median of its calls); it names the kernel that ran.

The header records the CPU model, its vector flags and caches, the fp32 FMA peak and the plain
streaming-read bandwidth, both measured in this run (bench_cpu_driver fma-peak / read-bw, at the
start and at the end; the tables use the larger of the two).

  FLASHPORT_NUM_THREADS=2 python3 bench/cpu/bench_cpu.py --build-dir build-cpu [--quick]

Needs flashport installed in the running Python (pip install, FLASHPORT_CUDA=OFF) and a CMake
build (libflashport.a) for the driver. Writes bench/results/cpu_bench.md and cpu_bench.json.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def build_driver(build_dir):
    lib = os.path.join(build_dir, "libflashport.a")
    if not os.path.exists(lib):
        sys.exit(f"{lib} not found: build flashport first (cmake + ninja)")
    exe = os.path.join(build_dir, "bench", "bench_cpu_driver")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    src = os.path.join(HERE, "bench_cpu_driver.cpp")
    if not os.path.exists(exe) or os.path.getmtime(exe) < max(os.path.getmtime(src), os.path.getmtime(lib)):
        subprocess.check_call(["c++", "-O2", "-std=c++20", "-I", os.path.join(ROOT, "include"), src, lib,
                               "-lpthread", "-o", exe])
    return exe


def driver(exe, *args):
    out = subprocess.check_output([exe, *map(str, args)], text=True)
    return json.loads(out.strip().splitlines()[-1])


def cpu_description():
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if ":" in line:
                k, v = (x.strip() for x in line.split(":", 1))
                info.setdefault(k, v)
    flags = info.get("flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "avx2", "fma", "f16c"))]
    caches = {}
    try:
        out = subprocess.check_output(["lscpu"], text=True)
        for line in out.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("L1d cache", "L2 cache", "L3 cache"):
                caches[k.strip()] = v.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return dict(model=info.get("model name", "?"), vendor=info.get("vendor_id", "?"),
                family=info.get("cpu family", "?"), model_id=info.get("model", "?"),
                cpus=os.cpu_count(), flags=keep, caches=caches)


def attn_flops(b, hq, sq, sk, d, causal):
    return 4.0 * b * hq * sq * sk * d * (0.5 if causal and sq == sk else 1.0)


def make_pair(torch, fp, kind, dtype, b, hq, hkv, sq, sk, d, causal):
    """Returns (flashport_call, torch_call) for one configuration."""
    import torch.nn.functional as F
    dt = torch.float32 if dtype == "f32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32).to(dt)
    q, k, v = rnd(b, sq, hq, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d)  # flashport [B, S, H, D]
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # torch [B, H, S, D]
    gqa = dict(enable_gqa=True) if hkv != hq else {}
    if kind in ("fwd", "decode"):
        def fp_call():
            with torch.no_grad():
                return fp.flash_attn_func(q, k, v, causal=bool(causal))

        def torch_call():
            with torch.no_grad():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal), **gqa)
        return fp_call, torch_call
    dout = rnd(b, sq, hq, d)
    doutt = dout.transpose(1, 2).contiguous()
    for x in (q, k, v, qt, kt, vt):
        x.requires_grad_(True)

    def fp_call():
        out = fp.flash_attn_func(q, k, v, causal=bool(causal))
        return torch.autograd.grad(out, (q, k, v), dout)

    def torch_call():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal), **gqa)
        return torch.autograd.grad(out, (qt, kt, vt), doutt)
    return fp_call, torch_call


def interleaved(fp_call, torch_call, rounds, probe_call=None):
    """Medians of wall time of each side, and of flashport's process CPU time (all its threads;
    the other side's workers sleep meanwhile), which other jobs on the machine barely move.
    probe_call (decode): a plain read timed in the same rounds, so that decode's share of the
    read bandwidth compares two figures taken under the same load."""
    fp_call(), torch_call()  # warm-up (thread pools, scratch, allocator)
    if probe_call:
        probe_call()
    ft, fc, tt, pt = [], [], [], []
    for _ in range(rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        fp_call()
        t1, c1 = time.perf_counter(), time.process_time()
        torch_call()
        t2 = time.perf_counter()
        if probe_call:
            probe_call()
            pt.append(time.perf_counter() - t2)
        ft.append(t1 - t0)
        fc.append(c1 - c0)
        tt.append(t2 - t1)
    probe = statistics.median(pt) if pt else None
    return statistics.median(ft), statistics.median(tt), statistics.median(fc), probe


# Plain-read probe for the decode rows: a sum over a buffer 8x the L3 of this VM (32 MiB), through
# torch at the same thread count (vectorised; within a few % of bench_cpu_driver read-bw).
READ_PROBE_BYTES = 256 << 20


def grid(quick):
    seqs = [512, 1024] if quick else [512, 1024, 2048, 4096]
    fwd = [("fwd", dt, 1, 8, 8, s, s, d, c) for dt in ("f32", "bf16") for d in (64, 128) for s in seqs
           for c in (0, 1)]
    dec = [("decode", dt, b, 32, 8, 1, sk, 128, 0) for dt in ("f32", "bf16")
           for b, sk in ((1, 8192), (4, 4096))]
    fb = [("fwd+bwd", dt, 1, 8, 8, s, s, d, c) for dt in ("f32", "bf16") for d in (64, 128) for s in seqs
          for c in (0, 1)]
    return fwd + dec + fb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-cpu"))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved calls per side (median)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma list of kinds: fwd,decode,fwd+bwd")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_bench"))
    ap.add_argument("--update", action="store_true",
                    help="with --only: replace those kinds' rows in the existing --out tables (and the "
                         "peak/bandwidth figures, which then hold this run's), keep the rest")
    args = ap.parse_args()

    threads = int(os.environ.get("FLASHPORT_NUM_THREADS", "0")) or os.cpu_count()
    os.environ["FLASHPORT_NUM_THREADS"] = str(threads)  # before flashport reads its settings
    # torch's OpenMP workers spin after each call by default and would take the core that
    # flashport's (sleeping) workers need on the next, interleaved call: both sides sleep when idle.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import flashport.torch as fp
    torch.set_num_threads(threads)
    exe = build_driver(args.build_dir)

    def machine_peaks():
        runs = [driver(exe, "fma-peak", "--threads", threads) for _ in range(2)]
        fma = max(r["gflops"] for r in runs)
        fma_cpu = max(r["gflops_cpu"] for r in runs)  # per CPU-second x threads: the cores' own peak
        bw = driver(exe, "read-bw", "--threads", threads)["gbps"]
        return fma, fma_cpu, bw

    fma0, fmac0, bw0 = machine_peaks()
    print(f"FMA peak {fma0:.1f} GFLOP/s wall, {fmac0:.1f} per CPU-second x threads; plain read {bw0:.1f} GB/s",
          flush=True)
    rows = []
    kinds = set(args.only.split(",")) if args.only else None
    for kind, dtype, b, hq, hkv, sq, sk, d, causal in grid(args.quick):
        if kinds and kind not in kinds:
            continue
        fp_call, torch_call = make_pair(torch, fp, kind, dtype, b, hq, hkv, sq, sk, d, causal)
        rounds = args.rounds if kind != "decode" else 4 * args.rounds
        probe_call = None
        if kind == "decode":
            probe_buf = torch.ones(READ_PROBE_BYTES // 4, dtype=torch.float32)
            probe_call = probe_buf.sum
        fp_s, torch_s, fp_cpu_s, probe_s = interleaved(fp_call, torch_call, rounds, probe_call)
        c_args = ["--dtype", dtype, "--b", b, "--h", hq, "--hkv", hkv, "--sq", sq, "--s", sk, "--d", d,
                  "--threads", threads, "--reps", max(3, rounds // 2), *(["--causal"] if causal else [])]
        c = driver(exe, "attn", "--op", "fwd", *c_args)
        if kind == "fwd+bwd":  # the driver times the two calls separately
            cb = driver(exe, "attn", "--op", "bwd", *c_args)
            c = dict(median_s=c["median_s"] + cb["median_s"], kernel=c["kernel"] + " + " + cb["kernel"])
        flops = attn_flops(b, hq, sq, sk, d, causal) * (3.5 if kind == "fwd+bwd" else 1.0)
        kv_bytes = 2 * b * sk * hkv * d * (4 if dtype == "f32" else 2)
        row = dict(kind=kind, dtype=dtype, b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, causal=causal,
                   flashport_ms=fp_s * 1e3, torch_ms=torch_s * 1e3, speedup=torch_s / fp_s,
                   c_api_ms=c["median_s"] * 1e3, kernel=c["kernel"],
                   gflops=flops / fp_s * 1e-9, kv_gbps=kv_bytes / fp_s * 1e-9,
                   gflops_cpu=flops / fp_cpu_s * threads * 1e-9)
        if probe_s:
            row["read_gbps_same"] = READ_PROBE_BYTES / probe_s * 1e-9
        rows.append(row)
        print(f"{kind:8s} {dtype:4s} B{b} H{hq}/{hkv} S{sq}x{sk} D{d} c{causal}: flashport {row['flashport_ms']:.2f} ms"
              f" (C API {row['c_api_ms']:.2f}), torch {row['torch_ms']:.2f} ms, {row['speedup']:.2f}x,"
              f" {row['gflops']:.0f} GFLOP/s, {row['kv_gbps']:.1f} GB/s K/V  {row['kernel']}", flush=True)
    fma1, fmac1, bw1 = machine_peaks()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                cpu=cpu_description(), threads=threads, torch=torch.__version__, rounds=args.rounds,
                fma_peak_gflops=[fma0, fma1], fma_peak_gflops_cpu=[fmac0, fmac1], read_gbps=[bw0, bw1],
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                command="FLASHPORT_NUM_THREADS=%d python3 bench/cpu/bench_cpu.py %s" % (threads, " ".join(sys.argv[1:])))
    if args.update and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            old = json.load(f)
        redone = {r["kind"] for r in rows}
        kept = [r for r in old["rows"] if r["kind"] not in redone]
        meta["updated"] = "%s re-run at %s (%s); the other tables from %s (%s)" % (
            ",".join(sorted(redone)), meta["date"], meta["command"], old["meta"]["date"], old["meta"]["command"])
        order = ["fwd", "decode", "fwd+bwd"]
        rows = sorted(kept + rows, key=lambda r: order.index(r["kind"]))
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    write_report(args.out + ".md", meta, rows)


def write_report(path, meta, rows):
    fma, bw = max(meta["fma_peak_gflops_cpu"]), max(meta["read_gbps"])
    cpu = meta["cpu"]
    L = ["# flashport CPU backend vs PyTorch CPU SDPA", "",
         f"- Command: `{meta['command']}` ({meta['date']}; torch {meta['torch']})",
         f"- CPU: {cpu['model']} ({cpu['vendor']} family {cpu['family']} model {cpu['model_id']}), "
         f"{cpu['cpus']} CPUs; caches: " + ", ".join(f"{k} {v}" for k, v in cpu["caches"].items()),
         f"- Flags: {' '.join(cpu['flags'])}",
         *([f"- Partial re-run: {meta['updated']}"] if meta.get("updated") else []),
         f"- Threads: {meta['threads']} on both sides (FLASHPORT_NUM_THREADS, torch.set_num_threads)",
         f"- Measured in this run (start / end, bench_cpu_driver): fp32 FMA peak "
         f"{meta['fma_peak_gflops_cpu'][0]:.1f} / {meta['fma_peak_gflops_cpu'][1]:.1f} GFLOP/s per CPU-second x "
         f"threads (wall clock {meta['fma_peak_gflops'][0]:.1f} / {meta['fma_peak_gflops'][1]:.1f}: the machine is "
         f"shared); plain streaming read {meta['read_gbps'][0]:.1f} / {meta['read_gbps'][1]:.1f} GB/s (wall). "
         f"Percentages use the larger of each.",
         f"- % FMA peak = flashport's FLOPs per CPU-second of its call x threads over the FMA peak per "
         f"CPU-second x threads: the kernel's efficiency while it runs, which other jobs barely move; "
         f"GFLOP/s and GB/s columns are wall clock.",
         f"- Method: flashport.torch.flash_attn_func ([B,S,H,D]) and F.scaled_dot_product_attention "
         f"([B,H,S,D], enable_gqa for GQA) on CPU tensors in one process, interleaved call by call, "
         f"{meta['rounds']} rounds (decode 4x), medians; speedup = torch median / flashport median. "
         f"OMP_WAIT_POLICY={meta.get('omp_wait_policy')} (idle workers of both sides sleep). "
         f"C API: bench_cpu_driver, median (its kernel name is shown). The machine is shared with other "
         f"jobs: absolute times move, the interleaved ratio much less.",
         f"- FLOPs 4·B·H·Sq·Sk·D (x1/2 causal), fwd+bwd x3.5. Decode: GB/s of K and V read once.", ""]

    def table(kind, title, cols):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            return
        L.extend([f"## {title}", "", "| " + " | ".join(c[0] for c in cols) + " |",
                  "|" + "---|" * len(cols)])
        for r in sel:
            L.append("| " + " | ".join(c[1](r) for c in cols) + " |")
        L.append("")

    base = [("dtype", lambda r: r["dtype"]), ("B", lambda r: str(r["b"])),
            ("H (q/kv)", lambda r: f"{r['hq']}/{r['hkv']}"), ("S", lambda r: str(r["sk"])),
            ("D", lambda r: str(r["d"])), ("causal", lambda r: str(r["causal"]))]
    times = [("flashport ms", lambda r: f"{r['flashport_ms']:.2f}"), ("C API ms", lambda r: f"{r['c_api_ms']:.2f}"),
             ("torch ms", lambda r: f"{r['torch_ms']:.2f}"), ("speedup", lambda r: f"{r['speedup']:.2f}x")]
    table("fwd", "Forward (targets: bf16 >= 1.5x torch and >= fp32; fp32 >= 1.0x, >= 85% of the FMA peak at S >= 2k)",
          base + times + [("GFLOP/s", lambda r: f"{r['gflops']:.0f}"),
                          ("% FMA peak", lambda r: f"{100 * r['gflops_cpu'] / fma:.0f}%"),
                          ("kernel", lambda r: r["kernel"])])
    same = lambda r: r.get("read_gbps_same")
    table("decode", "Decode, Sq = 1 (targets: >= 70% of the plain-read bandwidth, >= 1.5x torch; "
          "plain read in the same rounds: a 256 MiB torch sum interleaved with the two calls)",
          base[:3] + [("Sk", lambda r: str(r["sk"]))] + times +
          [("K/V GB/s", lambda r: f"{r['kv_gbps']:.1f}"), ("% read bw (header)", lambda r: f"{100 * r['kv_gbps'] / bw:.0f}%"),
           ("plain read GB/s, same rounds", lambda r: f"{same(r):.1f}" if same(r) else "-"),
           ("% of it", lambda r: f"{100 * r['kv_gbps'] / same(r):.0f}%" if same(r) else "-"),
           ("kernel", lambda r: r["kernel"])])
    table("fwd+bwd", "Forward + backward (target >= 1.3x torch)",
          base + times + [("GFLOP/s", lambda r: f"{r['gflops']:.0f}"), ("kernel", lambda r: r["kernel"])])
    L.extend(["## History", "",
              "- Until 2026-11-24 this file held a table measured on an AMD EPYC (Zen 4) with the C API only, "
              "best-of timing and a different grid (git history: bench/results/cpu_bench.md at 9847e1a).", ""])
    with open(path, "w") as f:
        f.write("\n".join(L))
    print("wrote", path)


if __name__ == "__main__":
    main()
