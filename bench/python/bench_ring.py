"""Ring attention (flashport.distributed) benchmark: tokens/s and scaling efficiency.

Two measurements, written as markdown tables (with the command and device line) to --out:

* Ring over real ranks (--world N, default: every GPU, or 2 gloo processes on the CPU): each rank
  holds --tokens-per-rank tokens of one sequence (weak scaling: the sequence grows with the ranks),
  and the ring's time per call (slowest rank) gives tokens/s. Efficiency is against one device
  doing the same whole sequence in one flash_attn_func call, divided by N (--no-single skips that
  call where it would take too long):  efficiency = t_single(N * T) / (N * t_ring).

* Simulated ring on one device (--simulate-world W; the default when only one GPU exists): the
  per-rank loop of a W-rank ring for one rank, with each hop's transfer replaced by a
  device-to-device copy of the same bytes on a side stream. It gives the rank's compute alone,
  the loop with the overlapped copies, the copies alone, the overlap efficiency
  (compute / with copies), and the link bandwidth that would hide a hop behind one step's compute
  (bytes per hop / compute time per step). A D2D copy is faster than an NVLink or network hop, so
  compare the needed bandwidth with the link's rather than reading the overlap as the real one.

    python bench/python/bench_ring.py --quick --out /tmp/ring.md           # CPU, gloo, 2 procs
    python bench/python/bench_ring.py --out bench/results/ring_h100.md     # one GPU: simulated W=8
    python bench/python/bench_ring.py --world 8 --out bench/results/ring_8gpu.md
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashport.distributed as fpd
from flashport.torch import flash_attn_func

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(args, tokens, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPES[args.dtype]

    def rnd(h):
        return torch.randn((args.batch, tokens, h, args.dim), generator=gen).to(device, dtype)

    return rnd(args.heads), rnd(args.kv_heads), rnd(args.kv_heads)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, warmup, iters):
    """Median wall time of fn() in seconds, synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _passes(args):
    return ["fwd", "fwd+bwd"] if args.backward else ["fwd"]


def _timed_call(fn, q, k, v, with_backward):
    if not with_backward:
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def run_bwd():
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
    return run_bwd


# --------------------------------------------------------------------------------------------
# Ring over real ranks
# --------------------------------------------------------------------------------------------

def _ring_worker(rank, world, args, store_path, out_path):
    if args.device == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, args.threads_per_rank))
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    kw = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout), **kw)
    q, k, v = _inputs(args, args.tokens_per_rank, device, seed=rank)
    results = {}
    for name in _passes(args):
        fn = _timed_call(lambda a, b, c: fpd.ring_flash_attn_func(
            a, b, c, causal=args.causal, check_inputs=False), q, k, v, name != "fwd")
        fpd.ring_flash_attn_func(q, k, v, causal=args.causal)  # once with the input check
        dist.barrier()
        t = torch.tensor([_time(fn, device, args.warmup, args.iters)], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        results[name] = {"ring_s": float(t)}
    if rank == 0 and not args.no_single:
        # One device, the whole sequence, one call: the baseline the ring should scale from.
        fq, fk, fv = _inputs(args, args.tokens_per_rank * world, device, seed=world)
        for name in _passes(args):
            fn = _timed_call(lambda a, b, c: flash_attn_func(a, b, c, causal=args.causal),
                             fq, fk, fv, name != "fwd")
            results[name]["single_s"] = _time(fn, device, args.warmup, args.iters)
        del fq, fk, fv
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run_ring(args, world):
    tmp = tempfile.mkdtemp(prefix="fp_bench_ring_")
    out_path = os.path.join(tmp, "result.json")
    ctx = mp.start_processes(_ring_worker, args=(world, args, os.path.join(tmp, "store"),
                                                 out_path),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.time() + args.timeout * 4
    try:
        while not ctx.join(timeout=5):
            if time.time() > deadline:
                raise TimeoutError(f"ring benchmark workers still running after "
                                   f"{args.timeout * 4} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    with open(out_path) as f:
        results = json.load(f)
    rows = []
    total = args.tokens_per_rank * world
    for name, r in results.items():
        single = r.get("single_s")
        eff = f"{single / (world * r['ring_s']) * 100:.1f}%" if single else "n/a"
        rows.append(f"| {world} | {args.tokens_per_rank} | {total} | {name} | "
                    f"{r['ring_s'] * 1e3:.2f} | {total / r['ring_s']:.4g} | "
                    f"{single * 1e3 if single else float('nan'):.2f} | {eff} |")
    header = ("| ranks | tokens/rank | tokens | pass | ring ms | tokens/s | one device, whole "
              "sequence ms | efficiency |\n|---|---|---|---|---|---|---|---|")
    return header + "\n" + "\n".join(rows)


# --------------------------------------------------------------------------------------------
# Simulated ring on one device
# --------------------------------------------------------------------------------------------

class _Done:
    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


class _NoTransfer:
    """The ring loop with no hops: the rank's compute alone (every step sees the local shard)."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def start(self, tensors, tag):
        return _Done(tensors)


class _CopyTransfer(_NoTransfer):
    """Each hop is a device-to-device copy of the same tensors on a side stream (CUDA), ordered
    with events as the real transport is: the copy starts after the compute that produced its
    source and the step that needs it waits for it."""

    def __init__(self, rank, world_size, device):
        super().__init__(rank, world_size)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, tensors, tag):
        if self.stream is None:
            return _Done([t.clone() for t in tensors])
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            copies = [t.clone() for t in tensors]
            done = torch.cuda.Event()
            done.record(self.stream)
        for c in copies:
            c.record_stream(current)
        return _CopyDone(copies, done, current)


class _CopyDone:
    def __init__(self, copies, event, stream):
        self.copies, self.event, self.stream = copies, event, stream

    def wait(self):
        self.stream.wait_event(self.event)
        return self.copies


def _sim_loop(args, cfg, q, k, v, ring, with_backward):
    def run():
        out, lse = fpd._ring_forward(cfg, q, k, v, ring)
        if with_backward:
            fpd._ring_backward(cfg, torch.ones_like(out), q, k, v, out, lse, ring)
    return run


def run_simulated(args, world):
    device = torch.device(args.device if args.device == "cpu" else "cuda")
    q, k, v = _inputs(args, args.tokens_per_rank, device, seed=0)
    scale = args.dim ** -0.5
    cfg = fpd._Config(None, args.sim_rank, world, "zigzag", args.causal, (-1, -1), 0.0, scale,
                      False, fpd._backend_id(None))
    rows = []
    for name in _passes(args):
        bwd = name != "fwd"
        t_compute = _time(_sim_loop(args, cfg, q, k, v, _NoTransfer(args.sim_rank, world), bwd),
                          device, args.warmup, args.iters)
        copier = _CopyTransfer(args.sim_rank, world, device)
        t_overlap = _time(_sim_loop(args, cfg, q, k, v, copier, bwd), device, args.warmup,
                          args.iters)
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        # Hops per call: W-1 key/value hops forward; backward adds W-1 more and W fp32 dK/dV hops.
        hops_bytes = [kv_bytes] * (world - 1)
        if bwd:
            hops_bytes += [kv_bytes] * (world - 1) + [(k.numel() + v.numel()) * 4] * world

        sources = {n: torch.ones(n, dtype=torch.uint8, device=device) for n in set(hops_bytes)}

        def copies_only():
            for nbytes in hops_bytes:
                copier.start([sources[nbytes]], 0).wait()
        t_copies = _time(copies_only, device, args.warmup, args.iters)
        steps = world * (2 if bwd else 1)
        need_gbs = max(hops_bytes) / (t_compute / steps) / 1e9
        total = args.tokens_per_rank * world
        rows.append(f"| {world} | {args.tokens_per_rank} | {name} | {t_compute * 1e3:.2f} | "
                    f"{t_overlap * 1e3:.2f} | {t_copies * 1e3:.2f} | "
                    f"{t_compute / t_overlap * 100:.1f}% | {total / t_overlap:.4g} | "
                    f"{kv_bytes / 2**20:.1f} | {need_gbs:.1f} |")
    header = ("| simulated ranks | tokens/rank | pass | compute alone ms | with copies ms | "
              "copies alone ms | overlap efficiency | tokens/s (W ranks) | K+V MiB per hop | "
              "GB/s to hide a hop |\n|---|---|---|---|---|---|---|---|---|---|")
    return header + "\n" + "\n".join(rows)


# --------------------------------------------------------------------------------------------

def _device_line(args):
    if args.device == "cuda":
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return (f"{torch.cuda.device_count()} x {', '.join(sorted(names))}, torch "
                f"{torch.__version__}, CUDA {torch.version.cuda}")
    return (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}")


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small CPU run: gloo, 2 processes, plus a simulated 2-rank ring")
    p.add_argument("--world", type=int, default=None,
                   help="ranks for the real ring (default: GPUs present; 2 on the CPU)")
    p.add_argument("--simulate-world", type=int, default=None,
                   help="simulated ring size on one device (default 8 with one GPU)")
    p.add_argument("--sim-rank", type=int, default=0)
    p.add_argument("--tokens-per-rank", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--non-causal", dest="causal", action="store_false")
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--no-single", action="store_true",
                   help="skip the one-device whole-sequence baseline")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--timeout", type=int, default=300, help="seconds per collective")
    p.add_argument("--out", default=None, help="markdown file to write")
    args = p.parse_args(argv)

    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.quick:
        args.tokens_per_rank, args.heads, args.kv_heads, args.dim = 256, 2, 1, 32
        args.dtype, args.iters, args.warmup = "fp32", 5, 1
        args.world = args.world or 2
        args.simulate_world = args.simulate_world or 2
    world = args.world if args.world is not None else (gpus if gpus > 1 else
                                                       (0 if gpus == 1 else 2))
    if args.device == "cuda" and world > gpus:
        p.error(f"--world {world} needs {world} GPUs, {gpus} present")
    sim_world = args.simulate_world if args.simulate_world is not None else \
        (8 if gpus == 1 else 0)

    sections = []
    if world >= 2:
        transport = "NCCL" if args.device == "cuda" else "gloo"
        sections.append(f"### Ring over {world} ranks ({transport})\n\n" + run_ring(args, world))
    if sim_world >= 1:
        sections.append(f"### Simulated {sim_world}-rank ring on one device (rank "
                        f"{args.sim_rank}; hops are device-to-device copies)\n\n"
                        + run_simulated(args, sim_world))
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    text = (f"# Ring attention (flashport.distributed), {args.dtype}, "
            f"{'causal zigzag' if args.causal else 'non-causal'}, B={args.batch} "
            f"Hq={args.heads} Hkv={args.kv_heads} D={args.dim}\n\n"
            f"command: `{command}`  \n"
            f"device: {_device_line(args)}  \n"
            f"commit {_commit()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ};"
            f" median of {args.iters} after {args.warmup} warm-up\n\n" + "\n\n".join(sections)
            + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
