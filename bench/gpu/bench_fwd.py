"""flashport vs torch SDPA (flash = FA2, cuDNN) forward, side by side in one process on one GPU.

Tensors are allocated once in [B, S, H, D] memory; SDPA gets [B, H, S, D] views of the same
memory, flashport gets the strides through a ctypes shim (bench/gpu/fpbench.cpp). Each timing is
the median of CUDA-event-timed runs after warm-up; decode and long-KV shapes (short kernels) are
timed as CUDA-graph replays of 20 back-to-back calls, so host launch cost is not measured. Writes a markdown table, a CSV and a PNG.

usage: python3 bench/gpu/bench_fwd.py --lib build/bench/gpu/libfpbench.so --out DIR [--quick]
"""
import argparse
import ctypes
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def load_lib(path):
    lib = ctypes.CDLL(path)
    lib.fpb_fwd.restype = ctypes.c_int
    lib.fpb_fwd.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)] + \
        [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                       ctypes.POINTER(ctypes.c_size_t),
                                                       ctypes.POINTER(ctypes.c_int), ctypes.c_char_p]
    if hasattr(lib, "fpb_bwd"):  # builds before fpb_bwd (A/B against older trees) have none
        lib.fpb_bwd.restype = ctypes.c_int
        lib.fpb_bwd.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)] + \
            [ctypes.c_void_p] * 9 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                           ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p]
    if hasattr(lib, "fpb_fwd_cache"):
        lib.fpb_fwd_cache.restype = ctypes.c_int
        lib.fpb_fwd_cache.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 3 + [ctypes.c_void_p] * 6 + \
            [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
             ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p]
    if hasattr(lib, "fpb_set_append"):
        lib.fpb_set_append.restype = None
        lib.fpb_set_append.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + \
            [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    if hasattr(lib, "fpb_set_leftpad"):
        lib.fpb_set_leftpad.restype = None
        lib.fpb_set_leftpad.argtypes = [ctypes.c_void_p]
    lib.fpb_last_error.restype = ctypes.c_char_p
    return lib


def dtype_code(t):
    """fpbench's dtype argument: 0 fp16, 1 bf16, 2 fp32."""
    return {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[t]


class Flashport:
    def __init__(self, lib):
        self.lib = lib
        self.ws = torch.empty(0, dtype=torch.uint8, device="cuda")

    def prepare(self, q, k, v, out, causal, num_splits, lse=None):
        B, Sq, Hq, D = q.shape
        Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
        self.dims = (ctypes.c_int64 * 7)(B, Sq, Sk, Hq, Hkv, D, Dv)
        st = []
        for t in (q, k, v, out):
            st += list(t.stride())
        self.strides = (ctypes.c_int64 * 16)(*st)
        self.ptrs = [t.data_ptr() for t in (q, k, v, out)] + [lse.data_ptr() if lse is not None else None]
        self.dtype = dtype_code(q.dtype)
        self.causal, self.splits = int(causal), num_splits
        need = ctypes.c_size_t(0)
        used = ctypes.c_int(0)
        kern = ctypes.create_string_buffer(96)
        rc = self.lib.fpb_fwd(self.dims, self.strides, *self.ptrs, self.dtype, self.causal, self.splits,
                              None, 0, None, ctypes.byref(need), ctypes.byref(used), kern)
        if rc not in (0, 3):
            raise RuntimeError(self.lib.fpb_last_error().decode())
        if need.value > self.ws.numel():
            self.ws = torch.empty(need.value, dtype=torch.uint8, device="cuda")
        self.kernel, self.used_splits = kern.value.decode(), used.value
        return self

    def __call__(self):
        rc = self.lib.fpb_fwd(self.dims, self.strides, *self.ptrs, self.dtype, self.causal, self.splits,
                              self.ws.data_ptr() if self.ws.numel() else None, self.ws.numel(),
                              torch.cuda.current_stream().cuda_stream, None, None, None)
        if rc != 0:
            raise RuntimeError(self.lib.fpb_last_error().decode())


def time_ms(fn, warmup=5, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def time_graph_ms(fn, calls=20, reps=10):
    """Per-call time of `calls` back-to-back calls captured in a CUDA graph (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return time_ms(g.replay, warmup=2, reps=reps) / calls


def sdpa_fn(backend, q, k, v, causal, gqa, dropout_p=0.0):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa, dropout_p=dropout_p)
    return run


def try_time(fn, graph=False, **kw):
    try:
        return (time_graph_ms(fn) if graph else time_ms(fn, **kw)), ""
    except Exception as e:  # a backend that refuses the shape
        return float("nan"), type(e).__name__


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = time_ms(lambda: y.copy_(x), warmup=3, reps=10)
    return 2 * x.numel() / (t * 1e-3) / 1e12


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="prefill,decode,longkv")
    ap.add_argument("--dims", default="64,128,256", help="prefill head dims")
    ap.add_argument("--split-sweep", action="store_true", help="decode B=1: time forced split counts")
    args = ap.parse_args()
    torch.manual_seed(0)
    lib = load_lib(args.lib)
    fp = Flashport(lib)
    dev = torch.cuda.get_device_name()
    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    bw = copy_bandwidth()
    emit(f"# flashport GPU benchmark\n\ndevice: {dev}; torch {torch.__version__}; "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    emit(f"device-to-device copy: {bw:.2f} TB/s (bytes read + written)\n")
    dt = torch.bfloat16
    csv = ["section,D,S,B,H,causal,flashport,flash,cudnn,unit,kernel,splits,rel_err_vs_flash"]
    plot = []
    sections = args.only.split(",")

    if "prefill" in sections:
        emit("## Prefill forward, bf16, B*S = 16k, H*D = 2048 (TFLOPS; ratio = flashport / other)\n")
        emit("| D | S | B | causal | flashport | torch flash | cuDNN | vs flash | vs cuDNN | kernel |")
        emit("|---|---|---|---|---|---|---|---|---|---|")
        for D in [int(x) for x in args.dims.split(",")]:
            for S in (1024, 4096, 16384):
                if args.quick and S == 16384:
                    continue
                B, H = 16384 // S, 2048 // D
                q = torch.randn(B, S, H, D, device="cuda", dtype=dt)
                k = torch.randn_like(q)
                v = torch.randn_like(q)
                out = torch.empty_like(q)
                for causal in (False, True):
                    flops = 4 * B * H * S * S * D / (2 if causal else 1)
                    f = fp.prepare(q, k, v, out, causal, 0)
                    t_fp = time_ms(f)
                    t_fa, e1 = try_time(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal, False))
                    t_cd, e2 = try_time(sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, False))
                    f()
                    ref = sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal, False)().transpose(1, 2)
                    err = rel_err(out, ref)
                    tf = lambda t: flops / (t * 1e-3) / 1e12
                    emit(f"| {D} | {S} | {B} | {'y' if causal else 'n'} | {tf(t_fp):.0f} | {tf(t_fa):.0f} | "
                         f"{tf(t_cd):.0f} | {t_fa / t_fp:.2f} | {t_cd / t_fp:.2f} | {f.kernel} (err {err:.1e}) |")
                    csv.append(f"prefill,{D},{S},{B},{H},{int(causal)},{tf(t_fp):.1f},{tf(t_fa):.1f},{tf(t_cd):.1f},"
                               f"TFLOPS,{f.kernel},{f.used_splits},{err:.2e}")
                    plot.append((f"D{D} S{S // 1024}k{' c' if causal else ''}", tf(t_fp), tf(t_fa), tf(t_cd)))
                del q, k, v, out
                torch.cuda.empty_cache()
        emit()

    sweeps = []
    if "decode" in sections:
        emit("## Decode, Sq = 1, Hq = 32, Hkv = 8, D = 128, bf16 (TB/s of KV read; us)\n")
        emit(f"| B | Sk | flashport | torch flash | cuDNN | % of copy BW | vs cuDNN | splits | kernel |")
        emit("|---|---|---|---|---|---|---|---|---|")
        for B, Sk in ((1, 8192), (1, 65536), (8, 8192), (64, 4096), (16, 32768)):
            q = torch.randn(B, 1, 32, 128, device="cuda", dtype=dt)
            k = torch.randn(B, Sk, 8, 128, device="cuda", dtype=dt)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            kv_bytes = 2 * k.numel() * 2
            f = fp.prepare(q, k, v, out, False, 0)
            t_fp = time_graph_ms(f)
            t_fa, _ = try_time(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, False, True), graph=True)
            t_cd, _ = try_time(sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, False, True), graph=True)
            f()
            ref = sdpa_fn(SDPBackend.MATH, q.float(), k.float(), v.float(), False, True)().transpose(1, 2)
            err = rel_err(out, ref)
            tb = lambda t: kv_bytes / (t * 1e-3) / 1e12
            emit(f"| {B} | {Sk} | {tb(t_fp):.2f} ({t_fp * 1e3:.0f} us) | {tb(t_fa):.2f} ({t_fa * 1e3:.0f} us) | "
                 f"{tb(t_cd):.2f} ({t_cd * 1e3:.0f} us) | {100 * tb(t_fp) / bw:.0f}% | {t_cd / t_fp:.2f} | "
                 f"{f.used_splits} | {f.kernel} (err {err:.1e}) |")
            csv.append(f"decode,128,{Sk},{B},32,0,{tb(t_fp):.3f},{tb(t_fa):.3f},{tb(t_cd):.3f},TB/s,{f.kernel},"
                       f"{f.used_splits},{err:.2e}")
            if B == 1 and args.split_sweep:
                sweep = []
                for ns in (8, 16, 32, 48, 64, 96, 128):
                    g = fp.prepare(q, k, v, out, False, ns)
                    sweep.append(f"{ns}: {time_graph_ms(g) * 1e3:.1f} us")
                sweeps.append(f"B={B} Sk={Sk} forced splits -> " + ", ".join(sweep))
            del q, k, v, out
            torch.cuda.empty_cache()
        emit()
        for line in sweeps:
            emit(line + "  ")
        if sweeps:
            emit()

    if "longkv" in sections:
        emit("## Long KV, bf16, non-causal: split-KV (auto) vs no split (ms)\n")
        emit("| (B, Hq, Hkv, Sq, Sk, D) | flashport no split | flashport auto | splits | speedup | torch flash | cuDNN |")
        emit("|---|---|---|---|---|---|---|")
        for (B, Hq, Hkv, Sq, Sk, D) in ((1, 2, 2, 40000, 40000, 64), (1, 16, 16, 128, 65535, 64)):
            q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
            k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            t1 = time_graph_ms(fp.prepare(q, k, v, out, False, 1), calls=5)
            f = fp.prepare(q, k, v, out, False, 0)
            t0 = time_graph_ms(f, calls=5)
            t_fa, _ = try_time(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, False, False), graph=True)
            t_cd, _ = try_time(sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, False, False), graph=True)
            emit(f"| ({B}, {Hq}, {Hkv}, {Sq}, {Sk}, {D}) | {t1:.3f} | {t0:.3f} | {f.used_splits} | {t1 / t0:.2f}x | "
                 f"{t_fa:.3f} | {t_cd:.3f} |")
            csv.append(f"longkv,{D},{Sk},{B},{Hq},0,{t0:.4f},{t_fa:.4f},{t_cd:.4f},ms(auto;nosplit={t1:.4f}),"
                       f"{f.kernel},{f.used_splits},")
            del q, k, v, out
            torch.cuda.empty_cache()
        emit()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "gpu_bench.csv"), "w") as fh:
        fh.write("\n".join(csv) + "\n")
    if plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(14, 5))
            xs = range(len(plot))
            w = 0.27
            for i, (name, col) in enumerate((("flashport", 1), ("torch flash (FA2)", 2), ("cuDNN", 3))):
                ax.bar([x + (i - 1) * w for x in xs], [p[col] for p in plot], w, label=name)
            ax.set_xticks(list(xs))
            ax.set_xticklabels([p[0] for p in plot], rotation=60, ha="right", fontsize=8)
            ax.set_ylabel("TFLOPS (bf16 forward)")
            ax.set_title(f"Prefill forward, B*S=16k, H*D=2048 — {dev}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(args.out, "gpu_prefill.png"), dpi=110)
        except Exception as e:
            print("plot failed:", e)


if __name__ == "__main__":
    sys.exit(main())
