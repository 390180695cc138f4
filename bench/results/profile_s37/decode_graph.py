# decode B1 Sk8k GQA 32/8 D128 bf16: graph replay time over many replays, graph node count (debug dump)
import torch, time, os, re, sys
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import flashport.torch as fa
torch.manual_seed(0)
b, sk, hq, hkv, d = 1, 8192, 32, 8, 128
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
seq = torch.full((b,), sk, dtype=torch.int32, device="cuda")
qt = q.transpose(1, 2); kt = kc.transpose(1, 2).contiguous(); vt = vc.transpose(1, 2).contiguous()
def mine(): return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq)
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
out = os.environ.get("OUT", "/tmp")
for name, fn in (("flashport", mine), ("cudnn", cudnn)):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(); g.enable_debug_mode()
    with torch.cuda.graph(g): fn()
    p = f"{out}/graph_{name}.dot"
    try:
        g.debug_dump(p); txt = open(p).read()
    except Exception as e:
        print(f"{name}: no debug dump ({e})"); txt = ""
    kinds = re.findall(r'(KERNEL|MEMSET|MEMCPY|EVENT_RECORD|WAIT_EVENT|HOST|EMPTY)', txt)
    torch.cuda.synchronize()
    for rep in (1, 20):
        ts = []
        for _ in range(200):
            e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(rep): g.replay()
            e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3 / rep)
        ts.sort()
        print(f"{name}: {rep} replay(s) per timing: median {ts[100]:.1f} us, p10 {ts[20]:.1f}, p90 {ts[180]:.1f}")
    print(f"{name}: node kinds {kinds}")
    names = sorted(set(re.findall(r'(?:decode|combine|merge|fwd|flash|cudnn|sm90|kernel)[A-Za-z0-9_]*', txt)))[:20]
    print(f"{name}: names in dump {names}")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20): g.replay()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            print(f"   {name} graph event: {e.key[:90]} count={e.count} avg_us={getattr(e, 'device_time', 0) or e.self_device_time_total / max(e.count, 1):.2f}")
