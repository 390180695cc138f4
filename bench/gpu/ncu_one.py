"""flashport forward calls for ncu (run under ncu on a GPU machine), each call three times (ncu's
`--launch-skip 2 --launch-count 1` then profiles a warm one), through the C entry (fpbench).

    python3 bench/gpu/ncu_one.py LIB                   prefill D128 S4k (B4 H16) and decode B1 Sk8k, bf16
    python3 bench/gpu/ncu_one.py LIB f32               the prefill call in float32 (src/gpu/f32)
    python3 bench/gpu/ncu_one.py LIB fwd:D:S:CAUSAL    a point of #17's grid (B*S = 16k, H*D = 2048), bf16
    python3 bench/gpu/ncu_one.py LIB decode:B:SK       decode, GQA 32/8, D128, bf16
    python3 bench/gpu/ncu_one.py LIB bwd:D:S:CAUSAL    the backward (fpb_bwd) at a grid point, bf16

`scripts/device.sh profile` runs #17's open points this way (ncu_summary.py reads the reports)."""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_fwd import Flashport, load_lib  # noqa: E402


def shapes_of(arg):
    """(B, Sq, Hq, D, Hkv, Sk, causal) tuples of a point argument."""
    if arg in (None, "f32"):
        both = ((4, 4096, 16, 128, 16, 4096, False), (1, 1, 32, 128, 8, 8192, False))
        return both[:1] if arg == "f32" else both
    kind, *nums = arg.split(":")
    if kind == "fwd" and len(nums) == 3:
        d, s, causal = (int(x) for x in nums)
        return ((16384 // s, s, 2048 // d, d, 2048 // d, s, bool(causal)),)
    if kind == "decode" and len(nums) == 2:
        b, sk = (int(x) for x in nums)
        return ((b, 1, 32, 128, 8, sk, False),)
    raise SystemExit(f"ncu_one.py: unknown point {arg!r} (fwd:D:S:CAUSAL, decode:B:SK, f32)")


def calls(lib, arg):
    """(label, call) pairs of a point argument."""
    if arg is not None and arg.startswith("bwd:"):
        from bench_ab_fwd import BwdPoint  # the backward's inputs, out and lse from the forward
        d, s, causal = (int(x) for x in arg.split(":")[1:])
        yield f"backward D{d} S{s} causal={causal}", BwdPoint(lib, d, s, 16384 // s, 2048 // d, bool(causal)).flashport(lib)
        return
    dt = torch.float32 if arg == "f32" else torch.bfloat16
    for (B, S, H, D, Hkv, Sk, causal) in shapes_of(arg):
        q = torch.randn(B, S, H, D, device="cuda", dtype=dt)  # held here while the call runs
        k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
        v, out = torch.randn_like(k), torch.empty_like(q)
        f = Flashport(lib).prepare(q, k, v, out, causal, 0)
        yield f"B{B} S{S}/{Sk} H{H}/{Hkv} D{D} causal={int(causal)}: {f.kernel}", f


def main():
    lib = load_lib(sys.argv[1])
    for label, f in calls(lib, sys.argv[2] if len(sys.argv) > 2 else None):
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        print(label, flush=True)


if __name__ == "__main__":
    main()
