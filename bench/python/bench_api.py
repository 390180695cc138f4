"""The benchmark of record: flashport as users call it (the public Python API), side by side in one
process with torch SDPA's flash (FA2) and cuDNN backends, and flashport.jax next to
jax.nn.dot_product_attention.

    PYTHONPATH=build-py/site-cuda python bench/python/bench_api.py --out bench/results   # CUDA
    (after `bash python/device_test.sh build`; writes bench/results/python_api.{md,json,png})
    python bench/python/bench_api.py --out /tmp/api --quick                          # smoke run
    python bench/python/bench_api.py --out /tmp/cpu --device cpu                     # CPU: host + tiny + jax

Metrics (per call; medians):
  eager   CUDA events around the Python call, synchronized after every call (end to end)
  graph   the same call captured once in a CUDA graph, one replay (events; the median of at least
          12 replays, up to 200 for calls under 1 ms)
  kernel  torch.profiler: the device time of every kernel (and memset/memcpy) the call launches
  host    wall time of the Python call, calls issued back to back (the device is not waited on)
Modes (--modes, comma separated; default: all that apply to the device):
  grid    D in {64,128,256} (--dims) x S in {1k,4k,16k} x causal, B*S = 16k, H*D = 2048: forward without
          grad, forward with requires_grad, forward+backward (+ varlen forward and forward+backward
          with ragged lengths around S, against torch.nn.attention.varlen when torch has it)
  decode  flash_attn_with_kvcache, GQA 32/8, D128, B in {1,8,64} x Sk in {8k,64k}, vs SDPA
  host    host time per call of every call kind at B1 S128 H8 D64 (the overhead of the API)
  tiny    CPU: B1, S in 1..16, H1, D64 per-call time vs torch CPU SDPA (and their ratio)
  jax     jitted per-call time of flashport.jax vs jax.nn.dot_product_attention (xla, cudnn)
Writes <out>/<name>.md (tables with the command and device line), <name>.json and, when
matplotlib is installed, <name>.png (--name, default python_api).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

try:  # run from a checkout without installing: python/ holds the package sources
    import flashport.torch as fa
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import flashport.torch as fa

from torch.nn.attention import SDPBackend, sdpa_kernel

LIBS = ("flashport", "sdpa_flash", "sdpa_cudnn")
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_cpu": None}


# ------------------------------------------------------------------------------------------------
# Timers
# ------------------------------------------------------------------------------------------------

def _median(xs):
    return statistics.median(xs) if xs else None


def time_eager(fn, reps, device):
    """µs per call, events around the call and a sync after each (CUDA); wall time on the CPU."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1e3)
    return _median(times)


def time_host(fn, calls, batches, device):
    """µs of host time per call: `calls` calls back to back (not waited on), median of batches."""
    per = []
    for _ in range(batches):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter_ns() - t0) / 1e3 / calls)
        if device == "cuda":
            torch.cuda.synchronize()
    return _median(per)


def time_graph(fn, reps):
    """µs per replay of fn captured in a CUDA graph (torch's warm-up-on-a-side-stream recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return _median(times)


def kernel_times(fn, calls):
    """{kernel name: [launches, total µs]} of every device activity torch.profiler records over
    `calls` calls (kernels, memsets, copies)."""
    import collections
    from torch.autograd import DeviceType
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
    return per


def time_kernels(fn, calls):
    """µs of device time per call: every device activity torch.profiler records, summed."""
    return sum(total for _, total in kernel_times(fn, calls).values()) / calls


def measure(fn, device, args, graph_ok=True):
    """Every metric of one call (None where it cannot run)."""
    res = {}
    try:
        for _ in range(args.warmup):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        res["eager"] = time_eager(fn, 3, device)
        # Repetitions bounded by time (~0.2 s of calls per timer), so the full grid stays short.
        reps = max(3, min(args.reps, int(2e5 / max(res["eager"], 1.0))))
        res["eager"] = time_eager(fn, reps, device)
        calls = max(5, min(args.host_calls, int(2e5 / max(res["eager"], 1.0))))
        res["host"] = time_host(fn, calls, 3, device)
        if device == "cuda":
            res["kernel"] = time_kernels(fn, max(2, reps // 5))
            # Short calls get more replays (up to 200, ~0.2 s): the median of 12 single replays of
            # a ~20 µs decode call read 28 µs in session 36's record and 17 µs over 200 (s37).
            graph_reps = max(reps, min(200, int(2e5 / max(res["eager"], 1.0))))
            res["graph"] = time_graph(fn, graph_reps) if graph_ok else None
    except Exception as e:  # noqa: BLE001 - a backend that cannot run a point is reported, not fatal
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if device == "cuda":
            torch.cuda.synchronize()
    return res


# ------------------------------------------------------------------------------------------------
# Calls, built once per point (inputs outside the timed region)
# ------------------------------------------------------------------------------------------------

def make_qkv(b, s, h, d, dtype, device, requires_grad=False, hkv=None):
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = ((b, s, h, d), (b, s, hkv or h, d), (b, s, hkv or h, d))
    return [torch.randn(*sh, generator=g).to(device=device, dtype=dtype)
            .requires_grad_(requires_grad) for sh in shapes]


def call_of_kind(kind, fwd, q, k, v):
    """A zero-argument callable of `kind` over a forward `fwd`: fwd (under no_grad), fwd_grad (the
    forward recording the graph), fwd_bwd (forward and backward from a fixed dout into q, k, v)."""
    if kind == "fwd":
        def call():
            with torch.no_grad():
                return fwd()
        return call
    if kind == "fwd_grad":
        return fwd
    dout = torch.randn_like(fwd()).detach()

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fwd().backward(dout)
    return fwd_bwd


def attention_call(lib, kind, q, k, v, causal):
    """A zero-argument callable: one call of `kind` (fwd, fwd_grad, fwd_bwd) through `lib`."""
    if lib == "flashport":
        def fwd():
            return fa.flash_attn_func(q, k, v, causal=causal)
    else:  # SDPA takes [B, H, S, D]: views of the same tensors
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fwd():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return call_of_kind(kind, fwd, q, k, v)


def with_backend(lib, fn):
    """Runs fn under the SDPA backend of lib (entered per call: part of what users pay)."""
    backend = SDPA_BACKENDS.get(lib)
    if backend is None:
        return fn

    def call():
        with sdpa_kernel(backend):
            return fn()
    return call


def ragged_lengths(total, s):
    """Deterministic lengths in [s/2, 3s/2] summing to `total`."""
    lens, i = [], 0
    while sum(lens) < total:
        lens.append(max(1, int(s * (0.5 + ((i * 0.618) % 1.0)))))
        i += 1
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def varlen_call(lib, kind, q, k, v, cu, max_len, causal):
    if lib == "flashport":
        def fwd():
            return fa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)
    elif lib == "torch_varlen":
        from torch.nn.attention import varlen
        import inspect
        params = inspect.signature(varlen.varlen_attn).parameters
        kw = ({"is_causal": causal} if "is_causal" in params
              else {"window_size": (-1, 0) if causal else (-1, -1)})

        def fwd():
            return varlen.varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    else:
        raise ValueError(lib)
    return call_of_kind(kind, fwd, q, k, v)


# ------------------------------------------------------------------------------------------------
# Modes
# ------------------------------------------------------------------------------------------------

def mode_grid(args, dtype, rows):
    ds, ss = ((args.dims, (1024, 4096, 16384)) if not args.quick else ((128,), (1024,)))
    tokens = 16384 if not args.quick else 4096
    for d in ds:
        for s in ss:
            b, h = max(1, tokens // s), 2048 // d
            for causal in (False, True):
                for kind in ("fwd", "fwd_grad", "fwd_bwd"):
                    for lib in LIBS:
                        q, k, v = make_qkv(b, s, h, d, dtype, "cuda", kind != "fwd")
                        fn = with_backend(lib, attention_call(lib, kind, q, k, v, causal))
                        # torch 2.11's SDPA forward+backward failed graph capture on the H100
                        # ("Offset increment outside graph capture") and left the generator in
                        # capture state: its graph column is not measured.
                        r = measure(fn, "cuda", args,
                                    graph_ok=lib == "flashport" or kind != "fwd_bwd")
                        rows.append(dict(mode="grid", call=kind, lib=lib, d=d, s=s, b=b, h=h,
                                         causal=causal, dtype=str(dtype)[6:], **r))
                        report(rows[-1])
                        del q, k, v, fn
                # varlen: ragged lengths around s, the same token count
                lens = ragged_lengths(b * s, s)
                cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                                  device="cuda")
                for kind in ("fwd", "fwd_bwd"):
                    for lib in ("flashport", "torch_varlen"):
                        q, k, v = (t[0] for t in make_qkv(1, sum(lens), h, d, dtype, "cuda",
                                                          kind != "fwd"))
                        q, k, v = (t.detach().requires_grad_(kind != "fwd") for t in (q, k, v))
                        try:
                            fn = varlen_call(lib, kind, q, k, v, cu, max(lens), causal)
                            r = measure(fn, "cuda", args)
                        except Exception as e:  # noqa: BLE001
                            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                        rows.append(dict(mode="varlen", call=kind, lib=lib, d=d, s=s,
                                         b=len(lens), h=h, causal=causal, dtype=str(dtype)[6:],
                                         **r))
                        report(rows[-1])


def decode_call(lib, b, sk, dtype):
    hq, hkv, d = 32, 8, 128
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(b, 1, hq, d, generator=g).to("cuda", dtype)
    if lib == "flashport":
        kc = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
        vc = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
        seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")

        def call():
            return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
        return call
    qt = q.transpose(1, 2)
    kt = torch.randn(b, hkv, sk, d, dtype=dtype, device="cuda")
    vt = torch.randn(b, hkv, sk, d, dtype=dtype, device="cuda")
    backend = SDPA_BACKENDS[lib]
    try:  # GQA as SDPA takes it; else the keys expanded to every query head (outside the timing)
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return call
    except RuntimeError:
        ke, ve = (t.repeat_interleave(hq // hkv, dim=1) for t in (kt, vt))

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, ke, ve)
        return call


def mode_decode(args, dtype, rows):
    points = [(1, 8192)] if args.quick else [(1, 8192), (1, 65536), (8, 8192), (8, 65536),
                                             (64, 8192), (64, 65536)]
    for b, sk in points:
        for lib in LIBS:
            try:
                fn = decode_call(lib, b, sk, dtype)
                r = measure(fn, "cuda", args)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory for expanded keys
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            kv_bytes = 2 * b * sk * 8 * 128 * torch.finfo(dtype).bits // 8
            rows.append(dict(mode="decode", call="kvcache", lib=lib, b=b, sk=sk, hq=32, hkv=8,
                             d=128, dtype=str(dtype)[6:], kv_bytes=kv_bytes, **r))
            report(rows[-1])
            fn = None
            torch.cuda.empty_cache()


def mode_host(args, dtype, rows, device):
    """Host time of every call kind at a small shape: the API's own cost (on the CPU, where the
    call includes its compute, a smaller one)."""
    b, s, h, d = (1, 128, 8, 64) if device == "cuda" else (1, 16, 2, 64)
    sk, hq, hkv, dk = (4096, 32, 8, 128) if device == "cuda" else (64, 4, 1, 64)
    libs = ("flashport", "sdpa_flash", "sdpa_cudnn") if device == "cuda" else ("flashport",
                                                                             "sdpa_cpu")
    dt = str(dtype)[6:]
    for kind in ("fwd", "fwd_grad", "fwd_bwd"):
        for lib in libs:
            q, k, v = make_qkv(b, s, h, d, dtype, device, kind != "fwd")
            fn = with_backend(lib, attention_call(lib, kind, q, k, v, True))
            rows.append(dict(mode="host", call=kind, lib=lib, b=b, s=s, h=h, d=d, causal=True,
                             dtype=dt, **measure(fn, device, args, graph_ok=False)))
            report(rows[-1])
    # varlen: two sequences of the same s tokens; torch's varlen_attn where torch has it
    cu = torch.tensor([0, s // 3, s], dtype=torch.int32, device=device)
    q, k, v = (t[0] for t in make_qkv(1, s, h, d, dtype, device))
    for lib in ("flashport", "torch_varlen"):
        try:
            r = measure(varlen_call(lib, "fwd", q, k, v, cu, s - s // 3, True), device, args,
                        False)
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        rows.append(dict(mode="host", call="varlen_fwd", lib=lib, b=2, s=s, h=h, d=d,
                         causal=True, dtype=dt, **r))
        report(rows[-1])
    # decode: one query row against sk cached keys, GQA hq/hkv
    g = torch.Generator(device="cpu").manual_seed(1)
    qd = torch.randn(1, 1, hq, dk, generator=g).to(device, dtype)
    kc, vc = (torch.randn(1, sk, hkv, dk, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.full((1,), sk, dtype=torch.int32, device=device)
    qt, kt, vt = qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    for lib in libs:
        if lib == "flashport":
            def fn():
                return fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens)
        else:
            fn = with_backend(lib, lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                          enable_gqa=True))
        rows.append(dict(mode="host", call="kvcache", lib=lib, b=1, s=sk, h=hq, d=dk,
                         causal=False, dtype=dt, **measure(fn, device, args, False)))
        report(rows[-1])


def mode_tiny(args, rows):
    """CPU tiny calls: B1, S in 1..16, H1, D64, fp32 (the per-call time is the API's cost)."""
    for s in (1, 2, 4, 8, 16) if not args.quick else (1, 16):
        q, k, v = make_qkv(1, s, 1, 64, torch.float32, "cpu")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fp = measure(lambda: fa.flash_attn_func(q, k, v), "cpu", args)
        sd = measure(lambda: F.scaled_dot_product_attention(qt, kt, vt), "cpu", args)
        for lib, r in (("flashport", fp), ("sdpa_cpu", sd)):
            rows.append(dict(mode="tiny", call="fwd", lib=lib, b=1, s=s, h=1, d=64,
                             dtype="float32", **r))
            report(rows[-1])


def mode_jax(args, rows, device):
    try:
        import jax
        import jax.numpy as jnp
        import flashport.jax as fj
    except ImportError as e:
        print(f"jax mode skipped: {e}")
        return
    dev = jax.devices("cpu")[0] if device == "cpu" else jax.devices()[0]
    dtype = jnp.bfloat16 if dev.platform == "gpu" else jnp.float32
    shapes = [(1, 128, 8, 64)] if args.quick else [(1, 16, 1, 64), (1, 128, 8, 64),
                                                   (4, 1024, 16, 128) if device == "cuda"
                                                   else (1, 1024, 8, 64)]
    impls = {"flashport": lambda q, k, v: fj.flash_attn_func(q, k, v, causal=True),
             "jax_xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                     implementation="xla")}
    if dev.platform == "gpu":
        impls["jax_cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")
    for shape in shapes:
        key = jax.random.key(0)
        q, k, v = (jax.device_put(jax.random.normal(kk, shape, dtype), dev)
                   for kk in jax.random.split(key, 3))
        for name, f in impls.items():
            for kind in ("fwd", "fwd_bwd"):
                if kind == "fwd":
                    jf = jax.jit(f)
                else:
                    jf = jax.jit(jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32)
                                          .sum(), argnums=(0, 1, 2)))
                try:
                    def synced():
                        return jax.block_until_ready(jf(q, k, v))
                    synced()
                    first = time_eager(synced, 3, "cpu")
                    reps = max(3, min(args.reps * 2, int(4e5 / max(first, 1.0))))
                    r = {"eager": time_eager(synced, reps, "cpu")}
                    calls = max(5, min(args.host_calls, int(2e5 / max(r["eager"], 1.0))))
                    r["host"] = time_host(lambda: jf(q, k, v), calls, 5, "cpu")
                    synced()
                except Exception as e:  # noqa: BLE001
                    r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                rows.append(dict(mode="jax", call=kind, lib=name, b=shape[0], s=shape[1],
                                 h=shape[2], d=shape[3], causal=True,
                                 dtype=jnp.dtype(dtype).name, platform=dev.platform, **r))
                report(rows[-1])


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------

def report(row):
    keys = ("mode", "call", "lib", "b", "s", "sk", "h", "d", "causal")
    head = " ".join(f"{k}={row[k]}" for k in keys if k in row)
    vals = " ".join(f"{k}={row[k]:.1f}" for k in ("eager", "graph", "kernel", "host")
                    if row.get(k) is not None)
    print(f"{head} {vals} {row.get('error', '')}", flush=True)


def fmt(x):
    return "–" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}")


def _uses_c_exchange():
    f = getattr(fa._C, "uses_c_exchange", None)  # absent before the eager fast path
    return f() if f else "n/a"


def device_line(device):
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        return (f"{p.name} ({p.multi_processor_count} SMs), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
                f"flashport {fa._C.version()} (C exchange: {_uses_c_exchange()})")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), flashport "
            f"{fa._C.version()} (C exchange: {_uses_c_exchange()})")


def grid_ratios(rows):
    """Markdown: the grid's peer / flashport ratios per point (above 1: flashport faster), the
    figures the issues' targets are stated in; empty when the grid has no cuDNN rows."""
    sel = {(r["call"], r["d"], r["s"], r["causal"], r.get("dtype"), r["lib"]): r for r in rows if r["mode"] == "grid"}

    def ratio(peer, mine, metric):
        a, b = (peer or {}).get(metric), (mine or {}).get(metric)
        return f"{a / b:.2f}" if a and b else "–"
    points = []
    for (call, d, s, causal, dtype, lib) in sel:
        if lib == "flashport" and (call, d, s, causal, dtype) not in points:
            points.append((call, d, s, causal, dtype))
    if not any((*pt, "sdpa_cudnn") in sel for pt in points):
        return ""
    order = {"fwd": 0, "fwd_grad": 1, "fwd_bwd": 2}
    points.sort(key=lambda pt: (str(pt[4]), pt[1], pt[2], pt[3], order.get(pt[0], 3)))
    out = ["\n### grid ratios (peer / flashport: above 1, flashport faster)\n",
           "| call | dtype | D | S | causal | kernel: cuDNN / flashport | eager: cuDNN / flashport | "
           "graph: cuDNN / flashport | kernel: FA2 / flashport | backward kernel (fwd_bwd - fwd): "
           "cuDNN / flashport | host µs: flashport, cuDNN |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def backward(lib, d, s, causal, dtype):  # the backward's kernel time: fwd_bwd's minus the forward's
        both, fwd = sel.get(("fwd_bwd", d, s, causal, dtype, lib)), sel.get(("fwd", d, s, causal, dtype, lib))
        a, b = (both or {}).get("kernel"), (fwd or {}).get("kernel")
        return {"kernel": a - b} if a and b and a > b else None
    for call, d, s, causal, dtype in points:
        mine, cudnn, fa2 = (sel.get((call, d, s, causal, dtype, lib)) for lib in ("flashport", "sdpa_cudnn", "sdpa_flash"))
        host = ", ".join(fmt((r or {}).get("host")) for r in (mine, cudnn))
        bwd = (ratio(backward("sdpa_cudnn", d, s, causal, dtype), backward("flashport", d, s, causal, dtype), "kernel")
               if call == "fwd_bwd" else "–")
        out.append(f"| {call} | {dtype} | {d} | {s} | {'y' if causal else 'n'} | {ratio(cudnn, mine, 'kernel')} | "
                   f"{ratio(cudnn, mine, 'eager')} | {ratio(cudnn, mine, 'graph')} | "
                   f"{ratio(fa2, mine, 'kernel')} | {bwd} | {host} |")
    return "\n".join(out)


def tables(rows):
    """Markdown: one table per mode, libraries side by side."""
    out = []
    metrics = ("eager", "graph", "kernel", "host")

    def group(mode, key_fields, libs):
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            return
        keys = []
        for r in sel:
            k = tuple(r.get(f) for f in key_fields)
            if k not in keys:
                keys.append(k)
        present = [m for m in metrics if any(r.get(m) is not None for r in sel)]
        libs = [lib for lib in libs if any(r["lib"] == lib for r in sel)]
        cols = [f"{m} {lib}" for m in present for lib in libs]
        out.append(f"\n### {mode} (µs per call)\n")
        out.append("| " + " | ".join(key_fields) + " | " + " | ".join(cols) + " |")
        out.append("|" + "---|" * (len(key_fields) + len(cols)))
        for k in keys:
            cells = [str(x) for x in k]
            for m in present:
                for lib in libs:
                    r = next((r for r in sel if r["lib"] == lib and
                              tuple(r.get(f) for f in key_fields) == k), None)
                    cells.append("err" if r and "error" in r and r.get(m) is None
                                 else fmt(r.get(m)) if r else "–")
            out.append("| " + " | ".join(cells) + " |")
        errs = {(r["lib"], r["error"]) for r in sel if "error" in r}
        for lib, e in sorted(errs):
            out.append(f"\n{lib}: {e}")

    all_libs = ("flashport", "sdpa_flash", "sdpa_cudnn", "sdpa_cpu", "torch_varlen", "jax_xla",
                "jax_cudnn")
    group("host", ("call", "dtype", "b", "s", "h", "d"), all_libs)
    ratios_md = grid_ratios(rows)
    if ratios_md:
        out.append(ratios_md)
    # dtype in every key: a run over bf16 and fp16 has a row of each per point
    group("grid", ("call", "dtype", "d", "s", "b", "h", "causal"), all_libs)
    group("varlen", ("call", "dtype", "d", "s", "b", "h", "causal"), all_libs)
    group("decode", ("dtype", "b", "sk", "hq", "hkv", "d"), all_libs)
    group("tiny", ("s", "h", "d"), all_libs)
    tiny = {(r["lib"], r["s"]): r.get("host") for r in rows if r["mode"] == "tiny"}
    ratios = [(s, tiny[("flashport", s)] / tiny[("sdpa_cpu", s)]) for (lib, s) in tiny
              if lib == "flashport" and tiny.get(("sdpa_cpu", s)) and tiny[("flashport", s)]]
    if ratios:
        out.append("\ntiny-call ratio flashport / torch CPU SDPA (host time per call): " +
                   ", ".join(f"S{s}: {x:.2f}x" for s, x in ratios))
    group("jax", ("call", "b", "s", "h", "d", "platform"), all_libs)
    return "\n".join(out)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grid = [r for r in rows if r["mode"] == "grid" and r.get("eager")]
    host = [r for r in rows if r["mode"] in ("host", "tiny") and r.get("host")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    if grid:
        labels = sorted({(r["call"], r["d"], r["s"], r["causal"]) for r in grid})
        x = range(len(labels))
        for i, lib in enumerate(LIBS):
            ys = []
            for lab in labels:
                base = next((r["eager"] for r in grid if r["lib"] == "sdpa_flash" and
                             (r["call"], r["d"], r["s"], r["causal"]) == lab), None)
                mine = next((r["eager"] for r in grid if r["lib"] == lib and
                             (r["call"], r["d"], r["s"], r["causal"]) == lab), None)
                ys.append(base / mine if base and mine else 0)
            axes[0].bar([xx + 0.27 * i for xx in x], ys, width=0.27, label=lib)
        axes[0].set_xticks(list(x))
        axes[0].set_xticklabels([f"{c[0]} D{c[1]} S{c[2] // 1024}k{' c' if c[3] else ''}"
                                 for c in labels], rotation=90, fontsize=6)
        axes[0].axhline(1.0, color="k", lw=0.5)
        axes[0].set_ylabel("eager speed vs torch SDPA flash (higher is faster)")
        axes[0].legend()
    if host:
        labels = []
        for r in host:
            lab = (r["mode"], r["call"], r["s"])
            if lab not in labels:
                labels.append(lab)
        libs = sorted({r["lib"] for r in host})
        for i, lib in enumerate(libs):
            ys = [next((r["host"] for r in host if r["lib"] == lib and
                        (r["mode"], r["call"], r["s"]) == lab), 0) for lab in labels]
            axes[1].bar([xx + 0.8 / len(libs) * i for xx in range(len(labels))], ys,
                        width=0.8 / len(libs), label=lib)
        axes[1].set_xticks(range(len(labels)))
        axes[1].set_xticklabels([f"{m} {c} S{s}" for m, c, s in labels], rotation=90, fontsize=7)
        axes[1].set_ylabel("host µs per call")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for <name>.{md,json,png}")
    ap.add_argument("--name", default="python_api", help="file stem of the outputs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--modes", default=None, help="comma separated: grid,decode,host,tiny,jax")
    ap.add_argument("--dtypes", default="bf16", help="comma separated: bf16,fp16 (CUDA)")
    ap.add_argument("--dims", default="64,128,256",
                    help="comma separated head dims of the grid mode (a device call's time limit "
                         "may need the grid in parts)")
    ap.add_argument("--quick", action="store_true", help="one point per mode, few repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--host-calls", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch and flashport (default: torch's default)")
    args = ap.parse_args()
    args.dims = tuple(int(x) for x in args.dims.split(","))
    args.reps = args.reps or (5 if args.quick else 12)
    args.host_calls = args.host_calls or (20 if args.quick else 200)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["FLASHPORT_NUM_THREADS"] = str(args.threads)  # read at the first call
    modes = (args.modes.split(",") if args.modes else
             (["host", "grid", "decode", "jax"] if args.device == "cuda" else
              ["host", "tiny", "jax"]))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    rows = []
    t0 = time.time()
    for mode in modes:
        if mode == "tiny":
            mode_tiny(args, rows)
        elif mode == "jax":
            mode_jax(args, rows, args.device)
        elif mode == "host":
            for name in (args.dtypes.split(",") if args.device == "cuda" else ["fp32"]):
                mode_host(args, dtypes.get(name, torch.float32), rows, args.device)
        elif args.device != "cuda":
            print(f"mode {mode} needs CUDA; skipped")
        else:
            for name in args.dtypes.split(","):
                (mode_grid if mode == "grid" else mode_decode)(args, dtypes[name], rows)
    os.makedirs(args.out, exist_ok=True)
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    header = (f"# flashport through its public Python API, side by side in one process\n\n"
              f"Command: `{command}`  \nDevice: {device_line(args.device)}  \n"
              f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{time.time() - t0:.0f} s\n\n"
              "eager: CUDA events around the Python call, synchronized per call (CPU: wall "
              "time); graph: one CUDA-graph replay; kernel: torch.profiler device time per call; "
              "host: wall time per call, calls back to back. Medians, µs.\n")
    stem = os.path.join(args.out, args.name)
    with open(stem + ".md", "w") as f:
        f.write(header + tables(rows) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "device": device_line(args.device), "rows": rows}, f,
                  indent=1)
    made = plot(rows, stem + ".png")
    print(f"wrote {stem}.md, .json{', .png' if made else ''} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
