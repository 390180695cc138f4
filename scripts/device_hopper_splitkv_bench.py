"""v3 split-KV timings (scripts/device_hopper.sh splitkv): long-KV shapes with v3 split (auto),
v3 unsplit, the mma.sync kernel's split (FLASHPORT_HOPPER_FWD=0), torch flash and cuDNN, all as
CUDA-graph replays of 5 calls (bench_fwd.py's long-KV method); a forced-split sweep of v3 on the
(1, 16, 16, 128, 65535, 64) point; and prefill points with v3's split-KV on and off (no split at
those sizes: the same kernel, so any difference is the epilogue branch or noise).

usage: python3 scripts/device_hopper_splitkv_bench.py BUILD/bench/gpu/libfpbench.so
"""
import os
import sys

sys.path.insert(0, "bench/gpu")
import torch  # noqa: E402
from bench_fwd import Flashport, load_lib, time_ms, time_graph_ms, try_time, sdpa_fn, rel_err  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

fp = Flashport(load_lib(sys.argv[1]))
dt = torch.bfloat16


def env(**kw):
    for k, v in kw.items():
        os.environ[k] = v


print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}\n")
print("## Long KV, bf16, non-causal (ms, CUDA-graph replays of 5 calls)\n")
print("| (B, Hq, Hkv, Sq, Sk, D) | v3 split (auto) | splits | v3 split again | v3 no split | mma.sync split (auto) | "
      "splits | torch flash | cuDNN | flash / v3 split | mma.sync / v3 split | err v3 split | kernel |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
# (torch's fused kernels take no GQA with dense inputs: MHA shapes only.)
shapes = ((1, 2, 2, 40000, 40000, 64), (1, 16, 16, 128, 65535, 64), (1, 16, 16, 128, 65535, 128),
          (2, 8, 8, 256, 32768, 128), (1, 4, 4, 1024, 131072, 128))
for (B, Hq, Hkv, Sq, Sk, D) in shapes:
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    gqa = Hq != Hkv
    ref = sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, False, gqa)().transpose(1, 2)
    env(FLASHPORT_HOPPER_FWD="1", FLASHPORT_HOPPER_SPLIT="1")
    f = fp.prepare(q, k, v, out, False, 0)
    out.fill_(float("nan"))
    f()
    torch.cuda.synchronize()
    err, kern, ns = rel_err(out, ref), f.kernel, f.used_splits
    t_v3 = time_graph_ms(f, calls=5)
    t_v3b = time_graph_ms(f, calls=5)
    t_v3n = time_graph_ms(fp.prepare(q, k, v, out, False, 1), calls=5)
    env(FLASHPORT_HOPPER_FWD="0")
    g = fp.prepare(q, k, v, out, False, 0)
    t_mma, ns_mma = time_graph_ms(g, calls=5), g.used_splits
    env(FLASHPORT_HOPPER_FWD="1")
    t_fa, _ = try_time(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, False, gqa), graph=True)
    t_cd, _ = try_time(sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, False, gqa), graph=True)
    print(f"| ({B}, {Hq}, {Hkv}, {Sq}, {Sk}, {D}) | {t_v3:.3f} | {ns} | {t_v3b:.3f} | {t_v3n:.3f} | {t_mma:.3f} | "
          f"{ns_mma} | {t_fa:.3f} | {t_cd:.3f} | {t_fa / t_v3:.2f} | {t_mma / t_v3:.2f} | {err:.1e} | {kern} |",
          flush=True)
    if (Sq, Sk, D) == (128, 65535, 64):
        row = []
        for s in (4, 7, 8, 14, 16, 33, 64):
            fs = fp.prepare(q, k, v, out, False, s)
            row.append(f"{fs.used_splits}: {time_graph_ms(fs, calls=5):.3f}")
        print(f"\nforced splits, v3, (1, 16, 16, 128, 65535, 64), splits: ms = {'; '.join(row)}\n", flush=True)
    del q, k, v, out
    torch.cuda.empty_cache()

print("\n## Prefill, bf16, B*S = 16k, H*D = 2048: v3 with split-KV on vs off (TFLOPS)\n")
print("| D | S | B | causal | v3 split on | v3 split off | on again | torch flash | cuDNN | on/off | on/flash | "
      "on/cuDNN | kernel |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for D in (64, 128, 256):
    for S in (1024, 4096):
        B, H = 16384 // S, 2048 // D
        q = torch.randn(B, S, H, D, device="cuda", dtype=dt)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out = torch.empty_like(q)
        for causal in (False, True):
            fl = 4 * B * H * S * S * D / (2 if causal else 1)
            res = {}
            for name, sp in (("on", "1"), ("off", "0"), ("on2", "1")):
                env(FLASHPORT_HOPPER_SPLIT=sp)
                f = fp.prepare(q, k, v, out, causal, 0)
                res[name] = time_ms(f)
            t_fa, _ = try_time(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal, False))
            t_cd, _ = try_time(sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, False))

            def tf(t):
                return fl / (t * 1e-3) / 1e12
            print(f"| {D} | {S} | {B} | {'y' if causal else 'n'} | {tf(res['on']):.0f} | {tf(res['off']):.0f} | "
                  f"{tf(res['on2']):.0f} | {tf(t_fa):.0f} | {tf(t_cd):.0f} | {res['off'] / res['on']:.2f} | "
                  f"{t_fa / res['on']:.2f} | {t_cd / res['on']:.2f} | {f.kernel} |", flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
