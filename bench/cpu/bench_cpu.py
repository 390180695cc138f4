#!/usr/bin/env python3
"""flashport CPU backend vs PyTorch CPU scaled_dot_product_attention, side by side.

flashport is timed through its C API by bench_cpu_driver (bench/cpu/bench_cpu_driver.cpp, built
by this script against an existing flashport build's libflashport.a; the Python bindings are not
used). PyTorch is timed in this process. Both run at the same thread count, alternately per
configuration (best of --reps after a warm-up, and the pair is repeated --rounds times keeping
each side's best), so background load hits both alike. Peak memory is measured in fresh
processes: the resident memory a call adds on top of its inputs (VmHWM after a reset through
/proc/self/clear_refs, minus VmRSS before the call).

  python3 bench/cpu/bench_cpu.py --build-dir build-cpu [--quick] [--threads 2]

Writes bench/results/cpu_bench.md and bench/results/cpu_bench.json.
"""
import argparse
import datetime
import json
import os
import platform
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


def flops(op, b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * 2.5 if op == "bwd" else f


def torch_inputs(torch, op, dtype, b, h, s, d):
    dt = torch.float32 if dtype == "f32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float32).to(dt) for _ in range(3))
    return q, k, v


def torch_callable(torch, op, dtype, b, h, s, d, causal):
    import torch.nn.functional as F
    q, k, v = torch_inputs(torch, op, dtype, b, h, s, d)
    if op == "fwd":
        def run():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        return run
    for t in (q, k, v):
        t.requires_grad_(True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
    dout = torch.randn_like(out)

    def run():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return run


def time_torch(torch, op, dtype, b, h, s, d, causal, reps, clock=time.perf_counter):
    fn = torch_callable(torch, op, dtype, b, h, s, d, causal)
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return -1


def torch_mem_child(args):
    import torch
    torch.set_num_threads(args.threads)
    op, dtype, b, h, s, d, causal = args.mem_child
    b, h, s, d, causal = int(b), int(h), int(s), int(d), int(causal)
    fn = torch_callable(torch, op, dtype, b, h, s, d, causal)
    before = status_kb("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    print(json.dumps({"extra_peak_bytes": (status_kb("VmHWM:") - before) * 1024}))


def torch_mem(args, op, dtype, b, h, s, d, causal):
    out = subprocess.check_output([sys.executable, __file__, "--threads", str(args.threads), "--mem-child",
                                   op, dtype, str(b), str(h), str(s), str(d), str(causal)], text=True)
    return json.loads(out.strip().splitlines()[-1])["extra_peak_bytes"]


def grid(quick):
    pts = []
    for dtype in ("f32", "bf16"):
        for d in (64, 128):
            for causal in (0, 1):
                for s in ((512, 2048) if quick else (512, 1024, 2048, 4096)):
                    pts.append((dtype, 1, 8, s, d, causal))
                for s in ((512,) if quick else (512, 1024)):
                    pts.append((dtype, 4, 16, s, d, causal))
                if not quick:
                    pts.append((dtype, 2, 12, 2048, d, causal))
    return pts


def cpu_model():
    try:
        out = subprocess.check_output(["lscpu"], text=True)
        info = dict(l.split(":", 1) for l in out.splitlines() if ":" in l)
        return (f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs "
                f"({info.get('Core(s) per socket', '?').strip()} cores/socket, "
                f"{info.get('Thread(s) per core', '?').strip()} thread/core), "
                f"L2 {info.get('L2 cache', '?').strip()}, L3 {info.get('L3 cache', '?').strip()}")
    except Exception:
        return platform.processor()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-cpu"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ops", default="fwd,bwd")
    ap.add_argument("--skip-single", action="store_true", help="skip the 1-thread CPU-time table")
    ap.add_argument("--skip-decode", action="store_true", help="skip the decode (split-KV) table")
    ap.add_argument("--skip-grid", action="store_true", help="skip the main fwd/bwd grid")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_bench"))
    ap.add_argument("--mem-child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mem_child:
        return torch_mem_child(args)

    import torch
    torch.set_num_threads(args.threads)
    exe = build_driver(args.build_dir)
    peaks = [driver(exe, "fma-peak", "--threads", args.threads) for _ in range(3)]
    peak_wall = max(p["gflops"] for p in peaks)
    # The cores' peak: FLOPs per CPU-second of the FMA loop (unaffected by other load), x threads.
    peak = max(p["gflops_cpu"] for p in peaks)
    print(f"fp32 FMA peak ({args.threads} threads): {peak:.1f} GFLOP/s per CPU time, "
          f"{peak_wall:.1f} wall clock now", flush=True)

    rows = []
    for op in ([] if args.skip_grid else args.ops.split(",")):
        for (dtype, b, h, s, d, causal) in grid(args.quick):
            fp_best, fp_cpu, th_best, kernel = float("inf"), float("inf"), float("inf"), ""
            for _ in range(args.rounds):
                r = driver(exe, "attn", "--op", op, "--dtype", dtype, "--b", b, "--h", h, "--s", s, "--d", d,
                           *(["--causal"] if causal else []), "--threads", args.threads, "--reps", args.reps)
                fp_best = min(fp_best, r["best_s"])
                fp_cpu = min(fp_cpu, r["best_cpu_s"])
                kernel = r["kernel"]
                th_best = min(th_best, time_torch(torch, op, dtype, b, h, s, d, causal, args.reps))
            gf = flops(op, b, h, s, d, causal) / fp_best * 1e-9
            gf_cpu = flops(op, b, h, s, d, causal) / fp_cpu * 1e-9 * args.threads
            row = dict(op=op, dtype=dtype, b=b, h=h, s=s, d=d, causal=causal, kernel=kernel,
                       flashport_ms=fp_best * 1e3, torch_ms=th_best * 1e3, speedup=th_best / fp_best,
                       flashport_gflops=gf, pct_fma_peak=100.0 * gf_cpu / peak,
                       pct_fma_peak_wall=100.0 * gf / peak)
            rows.append(row)
            print(f"{op} {dtype} B={b} H={h} S={s} D={d} causal={causal}: flashport {fp_best*1e3:.1f} ms, "
                  f"torch {th_best*1e3:.1f} ms, x{row['speedup']:.2f}, {gf:.1f} GFLOP/s "
                  f"({row['pct_fma_peak']:.0f}% of peak)", flush=True)

    # Single-thread comparison in CPU seconds (both sides single-threaded; robust to other load).
    st_rows = []
    if not args.skip_single:
        torch.set_num_threads(1)
        for op in args.ops.split(","):
            for dtype in ("f32", "bf16"):
                for d in (64, 128):
                    for causal in (0, 1):
                        for s_ in ((512, 2048) if args.quick else (512, 2048, 4096)):
                            b, h = 1, 4
                            r = driver(exe, "attn", "--op", op, "--dtype", dtype, "--b", b, "--h", h, "--s", s_,
                                       "--d", d, *(["--causal"] if causal else []), "--threads", 1,
                                       "--reps", args.reps)
                            tc = time_torch(torch, op, dtype, b, h, s_, d, causal, args.reps, time.process_time)
                            f = flops(op, b, h, s_, d, causal)
                            st_rows.append(dict(op=op, dtype=dtype, b=b, h=h, s=s_, d=d, causal=causal,
                                                flashport_cpu_ms=r["best_cpu_s"] * 1e3, torch_cpu_ms=tc * 1e3,
                                                speedup=tc / r["best_cpu_s"],
                                                flashport_pct_peak=100.0 * f / r["best_cpu_s"] * 1e-9 / (peak / args.threads),
                                                torch_pct_peak=100.0 * f / tc * 1e-9 / (peak / args.threads)))
                            print(f"1-thread cpu-time {op} {dtype} S={s_} D={d} causal={causal}: "
                                  f"x{st_rows[-1]['speedup']:.2f} (flashport {st_rows[-1]['flashport_pct_peak']:.0f}% "
                                  f"of peak, torch {st_rows[-1]['torch_pct_peak']:.0f}%)", flush=True)
        torch.set_num_threads(args.threads)

    # Decode: one query row per sequence against a long cache (GQA 32/8), the split-KV path.
    dec_rows = []
    if not args.skip_decode:
        import torch.nn.functional as F
        for dtype in ("f32", "bf16"):
            for (b, sk) in ((1, 4096), (1, 32768), (4, 8192)):
                hq, hkv, d = 32, 8, 128
                fp_best, th_best, kernel = float("inf"), float("inf"), ""
                dt = torch.float32 if dtype == "f32" else torch.bfloat16
                q = torch.randn(b, hq, 1, d).to(dt)
                k, v = (torch.randn(b, hkv, sk, d).to(dt) for _ in range(2))

                def run():
                    with torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                for _ in range(args.rounds):
                    r = driver(exe, "attn", "--op", "fwd", "--dtype", dtype, "--b", b, "--h", hq, "--hkv", hkv,
                               "--sq", 1, "--s", sk, "--d", d, "--threads", args.threads, "--reps", 5)
                    fp_best, kernel = min(fp_best, r["best_s"]), r["kernel"]
                    run()
                    for _ in range(5):
                        t0 = time.perf_counter()
                        run()
                        th_best = min(th_best, time.perf_counter() - t0)
                kv_bytes = 2 * b * hkv * sk * d * (4 if dtype == "f32" else 2)
                dec_rows.append(dict(dtype=dtype, b=b, hq=hq, hkv=hkv, sk=sk, d=d, kernel=kernel,
                                     flashport_us=fp_best * 1e6, torch_us=th_best * 1e6, speedup=th_best / fp_best,
                                     flashport_gbs=kv_bytes / fp_best * 1e-9))
                print(f"decode {dtype} B={b} Sk={sk}: flashport {fp_best*1e6:.0f} us ({kernel}), "
                      f"torch {th_best*1e6:.0f} us, x{th_best/fp_best:.2f}", flush=True)

    mem_rows = []
    mem_pts = [(op, dt, 1, 8, 4096, 128, 0) for op in args.ops.split(",") for dt in ("f32", "bf16")]
    mem_pts += [(op, "f32", 4, 16, 1024, 64, 1) for op in args.ops.split(",")]
    if args.quick:
        mem_pts = [(op, dt, 1, 8, 2048, 128, 0) for op in args.ops.split(",") for dt in ("f32", "bf16")]
    for (op, dtype, b, h, s, d, causal) in mem_pts:
        r = driver(exe, "attn", "--op", op, "--dtype", dtype, "--b", b, "--h", h, "--s", s, "--d", d,
                   *(["--causal"] if causal else []), "--threads", args.threads, "--mem")
        tm = torch_mem(args, op, dtype, b, h, s, d, causal)
        esize = 4 if dtype == "f32" else 2
        inputs = 3 * b * h * s * d * esize
        mem_rows.append(dict(op=op, dtype=dtype, b=b, h=h, s=s, d=d, causal=causal,
                             flashport_extra_mib=r["extra_peak_bytes"] / 2**20, torch_extra_mib=tm / 2**20,
                             qkv_mib=inputs / 2**20, scores_mib=b * h * s * s * 4 / 2**20))
        print(f"mem {op} {dtype} B={b} H={h} S={s} D={d}: flashport +{r['extra_peak_bytes']/2**20:.1f} MiB, "
              f"torch +{tm/2**20:.1f} MiB", flush=True)

    write_report(args, peak, peak_wall, rows, st_rows, dec_rows, mem_rows)


def write_report(args, peak, peak_wall, rows, st_rows, dec_rows, mem_rows):
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    import torch
    meta = dict(date=datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), machine=cpu_model(),
                threads=args.threads, torch=torch.__version__, fma_peak_gflops=peak,
                command="python3 bench/cpu/bench_cpu.py " + " ".join(sys.argv[1:]))
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, single_thread=st_rows, decode=dec_rows, memory=mem_rows), f, indent=1)
    L = []
    L.append("# flashport CPU backend vs PyTorch CPU SDPA\n")
    L.append(f"- Command: `{meta['command']}` (flashport through its C API via bench/cpu/bench_cpu_driver.cpp; "
             f"torch {meta['torch']} `scaled_dot_product_attention` in the same script)")
    L.append(f"- Machine: {meta['machine']}; {meta['date']}")
    L.append(f"- Threads: {args.threads} for both (torch.set_num_threads / fp_attn_params.num_threads)")
    L.append(f"- Measured fp32 FMA peak ({args.threads} threads, AVX-512 FMA loop): {peak:.1f} GFLOP/s "
             f"(FLOPs per CPU-second x threads, i.e. the cores' own peak; the wall-clock figure at the start "
             f"of the run was {peak_wall:.1f} GFLOP/s because the machine is shared)")
    L.append("- % FMA peak: flashport's FLOPs per CPU-second of the call (x threads) over that peak, i.e. "
             "the kernel's efficiency while it runs; the wall-clock tables are affected by other load on the "
             "machine, the single-thread CPU-time table below much less.")
    L.append("- Times: best of reps after a warm-up, each side's best over alternating rounds. "
             "Layouts: flashport [B,S,H,D], torch [B,H,S,D] (each its native layout). "
             "Causal = top-left (torch is_causal; same as bottom-right at Sq == Sk). "
             "FLOPs: 4·B·H·S²·D (×½ causal), backward ×2.5.\n")
    for op in ("fwd", "bwd"):
        sub = [r for r in rows if r["op"] == op]
        if not sub:
            continue
        target = 1.5 if op == "fwd" else 1.0
        met = sum(r["speedup"] >= target for r in sub)
        L.append(f"## {'Forward' if op == 'fwd' else 'Backward'} (target ≥ {target}x torch): "
                 f"{met}/{len(sub)} points meet it; speedup min {min(r['speedup'] for r in sub):.2f}x, "
                 f"max {max(r['speedup'] for r in sub):.2f}x\n")
        L.append("| dtype | B | H | S | D | causal | flashport ms | torch ms | speedup | GFLOP/s | % FMA peak | kernel |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sub:
            flag = "" if r["speedup"] >= target else " ✗"
            L.append(f"| {r['dtype']} | {r['b']} | {r['h']} | {r['s']} | {r['d']} | {r['causal']} | "
                     f"{r['flashport_ms']:.1f} | {r['torch_ms']:.1f} | {r['speedup']:.2f}x{flag} | "
                     f"{r['flashport_gflops']:.1f} | {r['pct_fma_peak']:.0f}% | {r['kernel']} |")
        L.append("")
    if st_rows:
        L.append("## Single thread, CPU seconds (B=1, H=4; both sides single-threaded, timed by process CPU time)\n")
        L.append("| op | dtype | S | D | causal | flashport ms | torch ms | speedup | flashport % peak | torch % peak |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in st_rows:
            L.append(f"| {r['op']} | {r['dtype']} | {r['s']} | {r['d']} | {r['causal']} | {r['flashport_cpu_ms']:.1f} | "
                     f"{r['torch_cpu_ms']:.1f} | {r['speedup']:.2f}x | {r['flashport_pct_peak']:.0f}% | "
                     f"{r['torch_pct_peak']:.0f}% |")
        L.append("")
    if dec_rows:
        L.append(f"## Decode (Sq = 1, Hq = 32, Hkv = 8, D = 128, {args.threads} threads; torch with enable_gqa=True)\n")
        L.append("| dtype | B | Sk | flashport us | torch us | speedup | flashport K+V GB/s | kernel |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in dec_rows:
            L.append(f"| {r['dtype']} | {r['b']} | {r['sk']} | {r['flashport_us']:.0f} | {r['torch_us']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['flashport_gbs']:.1f} | {r['kernel']} |")
        L.append("")
    if mem_rows:
        L.append("## Peak memory added by one call (MiB; inputs excluded)\n")
        L.append("| op | dtype | B | H | S | D | causal | flashport | torch | q+k+v size | one fp32 S×S score matrix per head×batch |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for m in mem_rows:
            L.append(f"| {m['op']} | {m['dtype']} | {m['b']} | {m['h']} | {m['s']} | {m['d']} | {m['causal']} | "
                     f"{m['flashport_extra_mib']:.1f} | {m['torch_extra_mib']:.1f} | {m['qkv_mib']:.1f} | "
                     f"{m['scores_mib']:.0f} |")
        L.append("")
    notes = os.path.join(HERE, "cpu_bench_notes.md")  # hand-written reading of the results
    if os.path.exists(notes):
        with open(notes) as f:
            L.append(f.read())
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()
