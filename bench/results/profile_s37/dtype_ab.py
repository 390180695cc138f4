# fp16 vs bf16 forward at the points where the s36 record read fp16 8-15% slower: interleaved rounds
# of flashport and cuDNN in both dtypes, plus fp16 holding bf16-representable values (low mantissa
# bits zero: the data-dependent tensor-core power hypothesis), with SM clock and power sampled.
import subprocess, sys, threading, time, statistics
import torch
sys.path.insert(0, "bench/gpu")
import bench_fwd as bf
from bench_ab_fwd import interleaved_medians
from torch.nn.attention import SDPBackend

lib = bf.load_lib(sys.argv[1])
samples = []
stop = False
def poll():
    while not stop:
        r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        try:
            c, p = (float(x) for x in r.stdout.strip().split(","))
            samples.append((time.time(), c, p))
        except ValueError:
            pass
        time.sleep(0.05)
threading.Thread(target=poll, daemon=True).start()

def clocked(fn, secs=0.6):
    fn(); torch.cuda.synchronize()
    t0 = time.time(); n = 0
    while time.time() - t0 < secs:
        for _ in range(5): fn()
        torch.cuda.synchronize(); n += 5
    t1 = time.time()
    s = [(c, p) for t, c, p in samples if t0 + 0.15 <= t <= t1]
    return (statistics.median(c for c, _ in s) if s else 0, statistics.median(p for _, p in s) if s else 0)

print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
print("| D | S | causal | fp bf16 us | fp fp16 us | fp fp16(bf16 vals) us | cuDNN bf16 | cuDNN fp16 | cuDNN fp16(bf16 vals) | fp fp16/bf16 | cuDNN fp16/bf16 | clock MHz / W: fp bf16, fp16, fp16b; cuDNN bf16, fp16 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for d, s, causal in ((64, 1024, False), (64, 1024, True), (128, 1024, False), (128, 1024, True), (128, 4096, False), (256, 1024, False)):
    b, h = 16384 // s, 2048 // d
    torch.manual_seed(0)
    base = [torch.randn(b, s, h, d, device="cuda") for _ in range(3)]
    sets = {"bf16": [x.to(torch.bfloat16) for x in base], "fp16": [x.to(torch.float16) for x in base],
            "fp16b": [x.to(torch.bfloat16).to(torch.float16) for x in base]}
    fns = {}
    for name, (q, k, v) in sets.items():
        fns["fp_" + name] = bf.Flashport(lib).prepare(q, k, v, torch.empty_like(q), causal, 1)
        fns["cd_" + name] = bf.sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, False)
    ms = interleaved_medians(fns)
    us = {k: v * 1e3 for k, v in ms.items()}
    clk = {k: clocked(fns[k]) for k in ("fp_bf16", "fp_fp16", "fp_fp16b", "cd_bf16", "cd_fp16")}
    print(f"| {d} | {s} | {'y' if causal else 'n'} | {us['fp_bf16']:.1f} | {us['fp_fp16']:.1f} | {us['fp_fp16b']:.1f} | "
          f"{us['cd_bf16']:.1f} | {us['cd_fp16']:.1f} | {us['cd_fp16b']:.1f} | {us['fp_fp16']/us['fp_bf16']:.3f} | "
          f"{us['cd_fp16']/us['cd_bf16']:.3f} | " + ", ".join(f"{c:.0f}/{p:.0f}" for c, p in clk.values()) + " |", flush=True)
stop = True
