#!/usr/bin/env python3
"""Interleaved A/B of two flashport builds on the forward grid, with cuDNN in the same process.

Separate benchmark runs on the lent H100 drifted by up to 30% (cuDNN's own figures too), so a
kernel change is judged by loading both builds' fpbench libraries into one process and timing
them in rounds: each point runs 5 rounds of [A, B, cuDNN], 10 CUDA-event-timed calls each, and
reports the medians. bf16, B*S = 16k, H*D = 2048, S in {1k, 4k, 16k}, causal and not.

    python3 bench/gpu/bench_ab_fwd.py BUILD_A/bench/gpu/libfpbench.so BUILD_B/bench/gpu/libfpbench.so [64,128,256]

Prints a markdown table (TFLOPS; B/A, A/cuDNN, B/cuDNN ratios). Every table's A-B ratio is B's
speed-up (> 1: B faster): B/A of TFLOPS, A/B of microseconds (session 18 misread an A/B of TFLOPS
as B's speed-up). Timing helpers: bench_fwd.py.

Decode (flash_attn_with_kvcache shape: Sq = 1, Hq/Hkv = 32/8, D = 128, bf16, K/V [B, Sk, Hkv, D]):

    python3 bench/gpu/bench_ab_fwd.py A.so B.so decode

Dropout (p = 0.1, the same grid; the third column is SDPA's flash backend with dropout, which
cuDNN's SDPA does not take on every shape):

    python3 bench/gpu/bench_ab_fwd.py A.so B.so dropout:64,128,256

Backward (the whole fp_attn_bwd call: preprocess, main loop, dQ conversion; out and lse from B's
forward; the peer is cuDNN's backward alone, through autograd; with dropout: bwd-dropout:DIMS and
SDPA flash with dropout as the peer), and the same with deterministic dQ (A and B only); A and B
against the peer also by torch.profiler's kernel time (session 23: cuDNN's backward by CUDA events
ran 10-25% slower than the API benchmark's profiler figure):

    python3 bench/gpu/bench_ab_fwd.py A.so B.so bwd:64,128,256

float32 (the fp32 kernels, src/gpu/f32; the peer is SDPA's memory-efficient backend, CUTLASS
3xTF32; S in {1k, 4k}): the forward grid (then three decode-shaped calls) and the backward:

    python3 bench/gpu/bench_ab_fwd.py A.so B.so f32[:64,128,256]
    python3 bench/gpu/bench_ab_fwd.py A.so B.so bwd-f32[:64,128,256]

The backward's kernels one by one (B's fpb_bwd and cuDNN's backward; A is loaded, not run):

    python3 bench/gpu/bench_ab_fwd.py A.so B.so bwd-kernels:64,128

KV-cache prefill chunk (B2, Sq 1024 after 3072 cached keys: 4096 keys, Hq/Hkv 32/8 at D128 (Hq x D
= 4096, Hq/Hkv = 4 at other head dims), bf16, bottom-right causal): the contiguous cache and paged
caches of 256/128/64/48/32/16/8/200-row pages (random block tables; 16-row pages also with consecutive ids,
and in a pool whose K and V pages are interleaved, [pages, 2, page, Hkv, D]: pages not back to
back), and with left pads (cache_leftpad 37/200, the same keys after them: contiguous and 256/64/48/16-row
pages; both builds need fpb_set_leftpad), graph replay us per call, 5 rounds of [A, B]:

    python3 bench/gpu/bench_ab_fwd.py A.so B.so cache[:64,128,256]

The same with short chunks (B16, 128 new rows each after 3968 cached keys: a call of ~60 us at
D128, where per-call costs such as a memset node show; contiguous, 64- and 16-row pages):

    python3 bench/gpu/bench_ab_fwd.py A.so B.so cache-chunk[:64,128,256]

KV-cache append + rotary (flash_attn_with_kvcache with k_new, v_new, rotary_cos/sin: the same
prefill chunk, its 1024 rows appended after 3072 cached ones, contiguous cache and 64-row pages; the
rotated q's cost against the plain cache call and the append without rotary; both builds take this
fpbench.cpp's fpb_set_append):

    python3 bench/gpu/bench_ab_fwd.py A.so B.so append[:64,128,256]

Decode: B in {1, 8, 64} x Sk in {8k, 64k}; per point 5 rounds of [A, B, cuDNN], each a CUDA-graph replay of
20 back-to-back calls (us per call, medians), then the kernel time per call from torch.profiler
(every kernel and memset of the call: the decode kernel, which merges its own splits; main kernel +
combine on the other tiles).
"""
import ctypes
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fwd as bf  # noqa: E402


def profiled_kernels(fn, calls=10):
    """Device us per call of each kernel (and memset) fn launches, by torch.profiler, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t > 0:
            rows.append((e.key, t / calls, e.count / calls))
    return sorted(rows, key=lambda r: -r[1])


def profiled_us(fn, calls=20):
    """Device time per call of fn (kernels and memsets) from torch.profiler, after warm-up."""
    return sum(us for _, us, _ in profiled_kernels(fn, calls))


def peer_of(dropout_p, dtype):
    """The peer of a point, (SDPA backend, name): cuDNN; SDPA flash with dropout; SDPA memory-efficient
    for fp32 (cuDNN and flash take no fp32)."""
    if dtype == torch.float32:
        return SDPBackend.EFFICIENT_ATTENTION, "SDPA efficient (fp32)"
    if dropout_p:
        return SDPBackend.FLASH_ATTENTION, "SDPA flash (dropout)"
    return SDPBackend.CUDNN_ATTENTION, "cuDNN"


def interleaved_medians(fns, timer=lambda fn: bf.time_ms(fn, warmup=2, reps=10), rounds=5):
    """Medians of `rounds` rounds of the named calls fns {name: fn}, timed in turn by timer (ms by
    default) within each round, so drift over the run lands on every call alike."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: statistics.median(t) for name, t in times.items()}


class BwdPoint:
    """One backward grid point: bf16 (or fp32) inputs, out and lse from lib's forward, and the peer's
    backward (SDPA through autograd: cuDNN, SDPA flash with dropout, SDPA memory-efficient in fp32)."""

    def __init__(self, lib, d, s, b, h, causal, dropout_p=0.0, dtype=torch.bfloat16):
        self.q, self.k, self.v, self.dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype)
                                             for _ in range(4))
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        bf.Flashport(lib).prepare(self.q, self.k, self.v, self.out, causal, 1, self.lse)()
        self.causal = causal
        self.qkv_t = [x.transpose(1, 2).detach().requires_grad_() for x in (self.q, self.k, self.v)]
        with bf.sdpa_kernel(peer_of(dropout_p, dtype)[0]):
            self.ref_out = torch.nn.functional.scaled_dot_product_attention(
                *self.qkv_t, is_causal=causal, dropout_p=dropout_p)
        self.do_t = self.dout.transpose(1, 2)

    def flashport(self, lib, deterministic=False):
        return FlashportBwd(lib, self.q, self.k, self.v, self.out, self.lse, self.dout, self.causal, deterministic)

    def peer_bwd(self):
        torch.autograd.grad(self.ref_out, self.qkv_t, self.do_t, retain_graph=True)


def main_bwd_kernels(lib_b, dims):
    """The backward's kernels one by one: B's fpb_bwd and cuDNN's backward through autograd."""
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("Backward kernels, bf16, B*S = 16k, H*D = 2048: torch.profiler device us per call of each "
          "kernel (launches per call), B's fpb_bwd and cuDNN's backward through autograd.")
    print("| D | S | causal | who | kernel | us per call | launches per call | share |")
    print("|---|---|---|---|---|---|---|---|")
    for d, s, b, h, causal in grid_points(dims):
        pt = BwdPoint(lib_b, d, s, b, h, causal)
        for who, fn in (("flashport", pt.flashport(lib_b)), ("cuDNN", pt.peer_bwd)):
            rows = profiled_kernels(fn)
            total = sum(r[1] for r in rows)
            for name, us, n in rows:
                print(f"| {d} | {s} | {'y' if causal else 'n'} | {who} | `{name[:90]}` | {us:.1f} | {n:g} | "
                      f"{us / total:.3f} |")
            print(f"| {d} | {s} | {'y' if causal else 'n'} | {who} | total | {total:.1f} | | 1 |", flush=True)
        del pt
        torch.cuda.empty_cache()


def main_decode(lib_a, lib_b):
    dt = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("Decode: Sq=1, Hq=32, Hkv=8, D=128, bf16. Graph replay us/call (medians of 5 rounds); "
          "profiler: device us/call of every kernel and memset. err B: first two sequences.")
    print("| B | Sk | A us | B us | cuDNN us | A/B (>1: B faster) | cuDNN/B (>1: B faster) | A prof | B prof | cuDNN prof | "
          "cuDNN/B prof | splits A, B | kernel A | kernel B | err B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B in (1, 8, 64):
        for Sk in (8192, 65536):
            q = torch.randn(B, 1, 32, 128, device="cuda", dtype=dt)
            k = torch.randn(B, Sk, 8, 128, device="cuda", dtype=dt)
            v = torch.randn_like(k)
            out_a, out_b = torch.empty_like(q), torch.empty_like(q)
            fa = bf.Flashport(lib_a).prepare(q, k, v, out_a, False, 0)
            fb = bf.Flashport(lib_b).prepare(q, k, v, out_b, False, 0)
            cudnn = bf.sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, False, True)
            t = interleaved_medians({"A": fa, "B": fb, "C": cudnn}, lambda fn: bf.time_graph_ms(fn) * 1e3)
            prof = {n: profiled_us(fn) for n, fn in (("A", fa), ("B", fb), ("C", cudnn))}
            fa(), fb()
            # B's error on the first two sequences (an fp32 reference of B64 Sk64k would take 64 GiB).
            n = min(B, 2)
            ref = bf.sdpa_fn(SDPBackend.MATH, q[:n].float(), k[:n].float(), v[:n].float(), False, True)().transpose(1, 2)
            err = bf.rel_err(out_b[:n], ref)
            print(f"| {B} | {Sk} | {t['A']:.1f} | {t['B']:.1f} | {t['C']:.1f} | {t['A'] / t['B']:.3f} | "
                  f"{t['C'] / t['B']:.2f} | {prof['A']:.1f} | {prof['B']:.1f} | {prof['C']:.1f} | "
                  f"{prof['C'] / prof['B']:.2f} | {fa.used_splits}, {fb.used_splits} | {fa.kernel} | {fb.kernel} | "
                  f"{err:.1e} |", flush=True)
            del q, k, v, out_a, out_b, ref
            torch.cuda.empty_cache()


class FlashportCache:
    """fpb_fwd_cache of one build: a KV-cache forward (contiguous, or paged when table is given)."""

    def __init__(self, lib, q, kc, vc, seqlens, table=None, leftpad=None):
        self.lib, self.out = lib, torch.empty_like(q)
        self.leftpad = leftpad.data_ptr() if leftpad is not None else None
        self.qshape = (ctypes.c_int64 * 4)(*q.shape)
        self.kshape = (ctypes.c_int64 * 4)(*kc.shape)
        st = []
        for t in (q, kc, vc, self.out):
            st += list(t.stride())
        self.strides = (ctypes.c_int64 * 16)(*st)
        self.ptrs = [t.data_ptr() for t in (q, kc, vc, self.out, seqlens)] + \
            [table.data_ptr() if table is not None else None]
        self.bt_cols = table.shape[1] if table is not None else 0
        self.dtype = bf.dtype_code(q.dtype)
        need = ctypes.c_size_t(0)
        kern = ctypes.create_string_buffer(96)
        self.set_leftpad()
        rc = lib.fpb_fwd_cache(self.qshape, self.kshape, self.strides, *self.ptrs, self.bt_cols, self.dtype, 1,
                               None, 0, None, ctypes.byref(need), kern)
        if rc not in (0, 3):
            raise RuntimeError(lib.fpb_last_error().decode())
        self.ws = torch.empty(max(need.value, 1), dtype=torch.uint8, device="cuda")
        self.kernel = kern.value.decode()

    def set_leftpad(self):  # the library's setting for its next fpb_fwd_cache calls
        if self.leftpad is not None or hasattr(self.lib, "fpb_set_leftpad"):
            self.lib.fpb_set_leftpad(self.leftpad)

    def __call__(self):
        self.set_leftpad()
        rc = self.lib.fpb_fwd_cache(self.qshape, self.kshape, self.strides, *self.ptrs, self.bt_cols, self.dtype, 1,
                                    self.ws.data_ptr(), self.ws.numel(), torch.cuda.current_stream().cuda_stream,
                                    None, None)
        if rc != 0:
            raise RuntimeError(self.lib.fpb_last_error().decode())


def time_cache_pair(lib_a, lib_b, q, k, v, seqlens, table, leftpad=None):
    """One cache call of both builds: graph replay us (medians of 5 rounds of [A, B]), the relative
    difference of their outputs, and the two calls."""
    fa = FlashportCache(lib_a, q, k, v, seqlens, table, leftpad)
    fb = FlashportCache(lib_b, q, k, v, seqlens, table, leftpad)
    t = interleaved_medians({"A": fa, "B": fb}, lambda fn: bf.time_graph_ms(fn) * 1e3)
    fa(), fb()
    torch.cuda.synchronize()
    diff = ((fa.out - fb.out).float().norm() / fb.out.float().norm()).item()
    return t, diff, fa, fb


def main_cache(lib_a, lib_b, D=128, B=2, Sq=1024):
    Sk, dt = 4096, torch.bfloat16
    Hq = 4096 // D
    Hkv = Hq // 4
    cap = Sk + 512
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"KV-cache prefill chunk: B{B} Sq{Sq} keys {Sk} Hq/Hkv {Hq}/{Hkv} D{D} bf16 causal, caches of {cap} rows; "
          "graph replay us per call (medians of 5 rounds); vs contiguous = B's contiguous time / B's time.")
    print("| cache | A us | B us | A/B (>1: B faster) | vs contiguous (B) | max rel diff A-B | kernel A | kernel B |")
    print("|---|---|---|---|---|---|---|---|")
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
    kc, vc = (torch.randn(B, cap, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
    seqlens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    calls = [("contiguous", kc, vc, None)]
    # Random block tables; 16-row pages also with consecutive ids (a fresh allocator's tables: the
    # same speed as random ones in session 18, so page order is not what limits small pages).
    # 48- and 200-row pages share only 16 and 8 rows with a 128-key tile (boxes of that run).
    pages = ((256, False), (128, False), (64, False), (48, False), (32, False), (16, False), (16, True), (8, False),
             (200, False)) if Sq == 1024 else ((64, False), (16, False))
    for page, consecutive in pages:
        blocks = cap // page
        perm = torch.arange(B * blocks, device="cuda") if consecutive else torch.randperm(B * blocks, device="cuda")
        table = perm.to(torch.int32).view(B, blocks)
        kp, vp = (torch.empty(B * blocks, page, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
        # the same keys as the contiguous cache (its first blocks x page rows)
        kp[perm] = kc[:, :blocks * page].reshape(B * blocks, page, Hkv, D)
        vp[perm] = vc[:, :blocks * page].reshape(B * blocks, page, Hkv, D)
        calls.append((f"paged {page}" + (", consecutive ids" if consecutive else ""), kp, vp, table))
        if page == 16 and not consecutive:  # the same pages in a pool of K and V pages interleaved
            kv = torch.empty(B * blocks, 2, page, Hkv, D, device="cuda", dtype=dt)
            kv[:, 0], kv[:, 1] = kp, vp
            calls.append((f"paged {page}, K/V pages interleaved", kv[:, 0], kv[:, 1], table))
    calls = [c + (None,) for c in calls]
    # Left pads (cache_leftpad 37 and 200 rows, the same 4096 keys after them): the contiguous cache
    # and pages of 256, 64, 48 and 16 rows (the builds need fpb_set_leftpad).
    if Sq == 1024 and hasattr(lib_b, "fpb_set_leftpad"):
        pad = torch.tensor([37, 200][:B] + [0] * max(0, B - 2), dtype=torch.int32, device="cuda")
        named = {c[0]: c for c in calls}
        for key in ("contiguous", "paged 256", "paged 64", "paged 48", "paged 16"):
            _, k, v, table, _ = named[key]
            calls.append((key + ", left pad 37/200", k, v, table, pad))
    base = None
    for name, k, v, table, pad in calls:
        used = seqlens if pad is None else seqlens + pad
        t, diff, fa, fb = time_cache_pair(lib_a, lib_b, q, k, v, used, table, pad)
        base = base or t["B"]
        print(f"| {name} | {t['A']:.1f} | {t['B']:.1f} | {t['A'] / t['B']:.3f} | {base / t['B']:.3f} | {diff:.1e} | "
              f"{fa.kernel} | {fb.kernel} |", flush=True)


def main_append(lib_a, lib_b, D=128):
    B, Sq, cached, dt = 2, 1024, 3072, torch.bfloat16
    Hq = 4096 // D
    Hkv = Hq // 4
    cap, Sk = cached + Sq + 512, cached + Sq
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"KV-cache append prefill chunk: B{B}, {Sq} new rows after {cached} cached (keys {Sk}), Hq/Hkv {Hq}/{Hkv} "
          f"D{D} bf16 causal, caches of {cap} rows; graph replay us per call (medians of 5 rounds); "
          "vs plain = B's time of the call without append / B's time.")
    print("| cache | call | A us | B us | A/B (>1: B faster) | vs plain (B) | max rel diff A-B | kernel A | kernel B |")
    print("|---|---|---|---|---|---|---|---|---|")
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
    k_new, v_new = (torch.randn(B, Sq, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
    kc, vc = (torch.randn(B, cap, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
    full = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    before = torch.full((B,), cached, dtype=torch.int32, device="cuda")
    rows = cap

    def tables(rot, dtype):
        pos = torch.arange(rows, device="cuda", dtype=torch.float64)[:, None]
        ang = pos * torch.pow(10000.0, -2.0 * torch.arange(rot // 2, device="cuda", dtype=torch.float64) / rot)
        return torch.cos(ang).to(dtype).contiguous(), torch.sin(ang).to(dtype).contiguous()

    page = 64
    blocks = cap // page
    perm = torch.randperm(B * blocks, device="cuda")
    table = perm.to(torch.int32).view(B, blocks)
    kp, vp = (torch.empty(B * blocks, page, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
    kp[perm] = kc[:, :blocks * page].reshape(B * blocks, page, Hkv, D)
    vp[perm] = vc[:, :blocks * page].reshape(B * blocks, page, Hkv, D)
    # (call, rotary dim, interleaved, fp32 tables)
    variants = [("plain (no append)", None, False, True), ("append", 0, False, True),
                ("append + rotary 64 (fp32 tables)", 64, False, True),
                (f"append + rotary {D} interleaved (bf16 tables)", D, True, False)]
    for cache, k, v, tab in (("contiguous", kc, vc, None), (f"paged {page}", kp, vp, table)):
        base = None
        for name, rot, interleaved, f32 in variants:
            cs = tables(rot, torch.float32 if f32 else dt) if rot else (None, None)
            for lib in (lib_a, lib_b):
                if rot is None:
                    lib.fpb_set_append(None, None, 0, None, None, 0, 0, 0, 1)
                else:
                    lib.fpb_set_append(k_new.data_ptr(), v_new.data_ptr(), Sq, cs[0].data_ptr() if rot else None,
                                       cs[1].data_ptr() if rot else None, rows, rot, int(interleaved), int(f32))
            t, diff, fa, fb = time_cache_pair(lib_a, lib_b, q, k, v, full if rot is None else before, tab)
            base = base or t["B"]
            print(f"| {cache} | {name} | {t['A']:.1f} | {t['B']:.1f} | {t['A'] / t['B']:.3f} | {base / t['B']:.3f} | "
                  f"{diff:.1e} | {fa.kernel} | {fb.kernel} |", flush=True)
    for lib in (lib_a, lib_b):
        lib.fpb_set_append(None, None, 0, None, None, 0, 0, 0, 1)


def grid_points(dims, dtype=torch.bfloat16):
    """The grid's (D, S, B, H, causal): B*S = 16k, H*D = 2048, S in {1k, 4k, 16k} (fp32, whose calls
    run ~10x longer: {1k, 4k})."""
    for d in dims:
        for s in (1024, 4096) if dtype == torch.float32 else (1024, 4096, 16384):
            for causal in (False, True):
                yield d, s, 16384 // s, 2048 // d, causal


class FlashportBwd:
    """fpb_bwd of one build (bench_fwd.load_lib) on fixed tensors (the backward of fwd's call)."""

    def __init__(self, lib, q, k, v, out, lse, dout, causal, deterministic=False):
        self.lib = lib
        B, Sq, Hq, D = q.shape
        self.grads = [torch.empty_like(t) for t in (q, k, v)]
        self.dims = (ctypes.c_int64 * 7)(B, Sq, k.shape[1], Hq, k.shape[2], D, v.shape[3])
        st = []
        for t in (q, k, v, out, dout, *self.grads):
            st += list(t.stride())
        self.strides = (ctypes.c_int64 * 32)(*st)
        self.ptrs = [t.data_ptr() for t in (q, k, v, out, lse, dout, *self.grads)]
        self.dtype = bf.dtype_code(q.dtype)
        self.flags = [int(causal), int(deterministic)]
        need = ctypes.c_size_t(0)
        kern = ctypes.create_string_buffer(96)
        rc = lib.fpb_bwd(self.dims, self.strides, *self.ptrs, self.dtype, *self.flags, None, 0, None,
                         ctypes.byref(need), kern)
        if rc not in (0, 3):
            raise RuntimeError(lib.fpb_last_error().decode())
        self.ws = torch.empty(max(need.value, 1), dtype=torch.uint8, device="cuda")
        self.kernel = kern.value.decode()

    def __call__(self):
        rc = self.lib.fpb_bwd(self.dims, self.strides, *self.ptrs, self.dtype, *self.flags, self.ws.data_ptr(),
                              self.ws.numel(), torch.cuda.current_stream().cuda_stream, None, None)
        if rc != 0:
            raise RuntimeError(self.lib.fpb_last_error().decode())


def main_bwd(lib_a, lib_b, dims, dropout_p, dtype=torch.bfloat16):
    """Backward A/B over the grid (see the module docstring); also checks A's grads against B's."""
    peer = peer_of(dropout_p, dtype)[1]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; dropout p = {dropout_p}")
    print(f"Backward (preprocess + main loop + dQ conversion), {str(dtype)[6:]}, B*S = 16k, H*D = 2048; TFLOPS = "
          "2.5 x forward FLOPs / median time; det = deterministic dQ.")
    print("prof: the same ratio from torch.profiler's device time per call (kernels only, no gaps between "
          "them), the benchmark of record's clock.")
    print(f"| D | S | causal | A TF | B TF | {peer} TF | B/A (>1: B faster) | A/peer | B/peer | A/peer prof | "
          "B/peer prof | B det/A det | A det/A | max rel diff A-B | kernel A |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d, s, b, h, causal in grid_points(dims, dtype):
        pt = BwdPoint(lib_b, d, s, b, h, causal, dropout_p, dtype)
        fa, fb = pt.flashport(lib_a), pt.flashport(lib_b)
        fad, fbd = pt.flashport(lib_a, True), pt.flashport(lib_b, True)
        peer_bwd = pt.peer_bwd
        ms = interleaved_medians({"A": fa, "B": fb, "C": peer_bwd, "Ad": fad, "Bd": fbd})
        prof = {n: profiled_us(fn, calls=10) for n, fn in (("A", fa), ("B", fb), ("C", peer_bwd))}
        fa(), fb()
        torch.cuda.synchronize()
        diff = max(((x - y).float().norm() / y.float().norm().clamp_min(1e-30)).item()
                   for x, y in zip(fa.grads, fb.grads))
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        tf = {n: flops / (m * 1e-3) / 1e12 for n, m in ms.items()}
        print(f"| {d} | {s} | {'y' if causal else 'n'} | {tf['A']:.0f} | {tf['B']:.0f} | {tf['C']:.0f} | "
              f"{tf['B'] / tf['A']:.3f} | {tf['A'] / tf['C']:.2f} | {tf['B'] / tf['C']:.2f} | "
              f"{prof['C'] / prof['A']:.2f} | {prof['C'] / prof['B']:.2f} | "
              f"{tf['Bd'] / tf['Ad']:.3f} | {tf['Ad'] / tf['A']:.2f} | {diff:.1e} | {fa.kernel} |", flush=True)
        del pt, fa, fb, fad, fbd
        torch.cuda.empty_cache()


def main_grid(lib_a, lib_b, dims, dropout_p, dtype=torch.bfloat16):
    """The forward grid (grid_points) of two builds interleaved with cuDNN (or SDPA flash with dropout,
    SDPA memory-efficient in fp32)."""
    backend, peer = peer_of(dropout_p, dtype)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; dropout p = {dropout_p}; "
          f"{str(dtype)[6:]}")
    print(f"| D | S | causal | A TF | B TF | {peer} TF | B/A (>1: B faster) | A/peer | B/peer | kernel A |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d, s, b, h, causal in grid_points(dims, dtype):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
        fa = bf.Flashport(lib_a).prepare(q, k, v, torch.empty_like(q), causal, 1)
        fb = bf.Flashport(lib_b).prepare(q, k, v, torch.empty_like(q), causal, 1)
        peer_fn = bf.sdpa_fn(backend, q, k, v, causal, False, dropout_p)
        ms = interleaved_medians({"A": fa, "B": fb, "C": peer_fn})
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        tf = {n: flops / (m * 1e-3) / 1e12 for n, m in ms.items()}
        print(f"| {d} | {s} | {'y' if causal else 'n'} | {tf['A']:.0f} | {tf['B']:.0f} | {tf['C']:.0f} | "
              f"{tf['B'] / tf['A']:.3f} | {tf['A'] / tf['C']:.2f} | {tf['B'] / tf['C']:.2f} | {fa.kernel} |",
              flush=True)


def main_f32_decode(lib_a, lib_b):
    """fp32 decode-shaped calls (Sq = 1, Hq/Hkv = 32/8, D = 128, the split count of each build's
    heuristic) of two builds interleaved with SDPA's memory-efficient backend: us per call."""
    print("fp32 decode: Sq 1, Hq/Hkv 32/8, D128, K/V [B, Sk, Hkv, D], splits by each build's heuristic "
          "(the peer's K/V repeated to 32 heads); us per call (CUDA events, medians of 5 rounds)")
    print("| B | Sk | A us | B us | SDPA efficient us | A/B (>1: B faster) | efficient/B | splits A, B | kernel B |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, sk in ((1, 8192), (8, 8192), (1, 65536)):
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.float32)
        k, v = (torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.float32) for _ in range(2))
        fa = bf.Flashport(lib_a).prepare(q, k, v, torch.empty_like(q), False, 0)
        fb = bf.Flashport(lib_b).prepare(q, k, v, torch.empty_like(q), False, 0)
        # The peer on K/V repeated to 32 heads (its GQA support varies by torch version).
        peer = bf.sdpa_fn(SDPBackend.EFFICIENT_ATTENTION, q, k.repeat_interleave(4, dim=2),
                          v.repeat_interleave(4, dim=2), False, False)
        us = {n: m * 1e3 for n, m in interleaved_medians({"A": fa, "B": fb, "C": peer}).items()}
        print(f"| {b} | {sk} | {us['A']:.1f} | {us['B']:.1f} | {us['C']:.1f} | {us['A'] / us['B']:.3f} | "
              f"{us['C'] / us['B']:.2f} | {fa.used_splits}, {fb.used_splits} | {fb.kernel} |", flush=True)


# Head dims of a mode given without ":DIMS" (a bare list of dims is the forward grid).
DEFAULT_DIMS = {"grid": "64,128,256", "dropout": "64,128,256", "bwd": "64,128,256", "bwd-dropout": "64,128,256",
                "f32": "64,128,256", "bwd-f32": "64,128,256",
                "bwd-kernels": "64,128",
                "cache": "128", "cache-chunk": "128", "append": "128", "decode": "128"}


def main():
    lib_a, lib_b = bf.load_lib(sys.argv[1]), bf.load_lib(sys.argv[2])
    # Every table's A and B columns are the first and second library of the command line, not
    # "main" and "branch": a swapped run inverts B/A.
    print(f"A = {sys.argv[1]}\nB = {sys.argv[2]}", flush=True)
    arg = sys.argv[3] if len(sys.argv) > 3 else "grid"
    mode, _, dims_arg = arg.partition(":")
    if mode[:1].isdigit():
        mode, dims_arg = "grid", arg
    if mode not in DEFAULT_DIMS:
        raise SystemExit(f"bench_ab_fwd.py: unknown mode {mode!r} (one of {', '.join(DEFAULT_DIMS)}, or head dims)")
    dims = [int(x) for x in (dims_arg or DEFAULT_DIMS[mode]).split(",")]
    if mode == "decode":
        return main_decode(lib_a, lib_b)
    if mode in ("cache", "cache-chunk"):
        for d in dims:
            if mode == "cache-chunk":  # short chunks: B16 x 128 rows, a short call
                main_cache(lib_a, lib_b, d, B=16, Sq=128)
            else:
                main_cache(lib_a, lib_b, d)
        return
    if mode == "append":
        for d in dims:
            main_append(lib_a, lib_b, d)
        return
    if mode == "f32":
        main_grid(lib_a, lib_b, dims, 0.0, torch.float32)
        return main_f32_decode(lib_a, lib_b)
    if mode == "bwd-f32":
        return main_bwd(lib_a, lib_b, dims, 0.0, torch.float32)
    dropout_p = 0.1 if mode in ("dropout", "bwd-dropout") else 0.0
    if dropout_p or mode == "bwd":
        for lib in (lib_a, lib_b):
            lib.fpb_set_dropout(ctypes.c_float(dropout_p))
    if mode == "bwd-kernels":
        return main_bwd_kernels(lib_b, dims)
    if mode in ("bwd", "bwd-dropout"):
        return main_bwd(lib_a, lib_b, dims, dropout_p)
    return main_grid(lib_a, lib_b, dims, dropout_p)


if __name__ == "__main__":
    main()
