"""Hugging Face transformers forward time on flashport (flashport.transformers) against sdpa.

Random-weight decoder models built from configs (no downloads), one model per architecture with
the same weights under both implementations; for each (batch, sequence length, padding) the
median time of one no-grad forward over the whole batch (prefill) and of one decoding step on a
cache holding the batch (decode), and the largest logit difference between the two (a sanity
column: both are approximations in the model's dtype).

  * llama: Llama with GQA, every layer full attention;
  * qwen2: Qwen2 with a sliding window on every other layer.
Padding "left" pads the sequences of the batch to the longest with lengths spread from 1/4 to
the full length (flashport: varlen over the tokens; sdpa: a materialised 4D mask).

    python bench/python/bench_transformers.py --out bench/results/transformers_h100.md  # CUDA bf16
    python bench/python/bench_transformers.py --quick --out /tmp/transformers_cpu.md     # CPU fp32
"""
import argparse
import datetime
import inspect
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers

import flashport.transformers

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _config(arch, quick):
    if quick:
        size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    else:  # a ~0.5B-parameter shape: head dim 128, GQA 4:1
        size = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4)
    common = dict(vocab_size=32000, max_position_embeddings=32768, **size)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        layers = size["num_hidden_layers"]
        return transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=64 if quick else 1024,
            layer_types=["sliding_attention" if i % 2 else "full_attention"
                         for i in range(layers)], **common)
    raise ValueError(arch)


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
    return statistics.median(times)


def _inputs(batch, seqlen, padding, device, gen):
    ids = torch.randint(1, 32000, (batch, seqlen), generator=gen)
    if padding == "none":
        return dict(input_ids=ids.to(device))
    lengths = [max(1, seqlen - (seqlen * 3 // 4) * b // max(1, batch - 1)) for b in range(batch)]
    mask = torch.zeros(batch, seqlen, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, seqlen - n:] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=(ids * mask).to(device), attention_mask=mask.to(device),
                position_ids=position_ids.to(device))


def _prefill(model, inputs, device):
    """One forward over the whole batch; the positions compared are the tokens."""
    keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else None
    return (lambda: model(**inputs)), keep


def _decode_step(model, inputs, device):
    """One decoding step (the same token for every sequence, drawn once) on a cache holding the
    batch's prompts. Each timed step appends its token (a sliding-window cache cannot be cropped
    back), so the cache grows by one per call, identically under both implementations."""
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    cache = getattr(model(**inputs, use_cache=True), cache_arg)
    batch, prompt_len = inputs["input_ids"].shape
    token = torch.full((batch, 1), 17, dtype=torch.long, device=device)
    mask = inputs.get("attention_mask")
    positions = (inputs["position_ids"][:, -1:] if mask is not None
                 else torch.full((batch, 1), prompt_len - 1, device=device))

    def fn():
        grown = cache.get_seq_length() - prompt_len + 1  # tokens appended, this one included
        step = {"input_ids": token, "position_ids": positions + grown, cache_arg: cache}
        if mask is not None:
            step["attention_mask"] = torch.cat([mask, mask.new_ones(batch, grown)], dim=1)
        return model(**step, use_cache=True)

    return fn, None


def run(args):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    name = flashport.transformers.register()
    if device.type == "cpu":
        torch.set_num_threads(args.threads or torch.get_num_threads())
    rows = []
    for arch in args.archs:
        config = _config(arch, args.quick)
        torch.manual_seed(0)
        models = {}
        for impl in (name, "sdpa"):
            m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                              dtype=dtype)
            if models:
                m.load_state_dict(next(iter(models.values())).state_dict())
            models[impl] = m.to(device).eval()
        for batch, seqlen in args.shapes:
            for padding in args.padding:
                for phase in args.phases:
                    gen = torch.Generator().manual_seed(batch * 100003 + seqlen)
                    inputs = _inputs(batch, seqlen, padding, device, gen)
                    with torch.no_grad():
                        step = _prefill if phase == "prefill" else _decode_step
                        result, logits, keep = {}, [], None
                        for impl, model in models.items():
                            fn, keep = step(model, inputs, device)
                            result[impl] = _time(fn, device, args.warmup, args.iters)
                            logits.append(fn().logits.float())
                    diff = (logits[0] - logits[1]).abs()
                    diff = (diff[keep] if keep is not None else diff).max().item()
                    rows.append((arch, phase, batch, seqlen, padding, result[name] * 1e3,
                                 result["sdpa"] * 1e3, diff))
                    print(f"{arch} {phase} B={batch} S={seqlen} {padding}: flashport "
                          f"{result[name] * 1e3:.2f} ms, sdpa {result['sdpa'] * 1e3:.2f} ms, "
                          f"max |dlogit| {diff:.3g}", flush=True)
        del models
    return rows


def _device_line(args):
    if args.device == "cuda":
        return (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA "
                f"{torch.version.cuda}, transformers {transformers.__version__}")
    return (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
            f"({torch.get_num_threads()} threads), torch {torch.__version__}, transformers "
            f"{transformers.__version__}")


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _markdown(args, rows, argv):
    command = "python " + " ".join([os.path.relpath(__file__)] + argv)
    lines = [
        "# transformers forward: flashport vs sdpa",
        "",
        f"command: `{command}`  ",
        f"device: {_device_line(args)}  ",
        f"commit: {_commit()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"dtype {args.dtype}, median of {args.iters} forwards (no grad) after {args.warmup} "
        f"warm-up. prefill: one forward over the batch's prompts; decode: one token per sequence "
        f"on a DynamicCache holding them (growing by one token per timed step)",
        "",
        "| model | phase | batch | seqlen | padding | flashport ms | sdpa ms | sdpa / flashport "
        "| max abs logit diff |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for arch, phase, batch, seqlen, padding, ours, sdpa, diff in rows:
        lines.append(f"| {arch} | {phase} | {batch} | {seqlen} | {padding} | {ours:.2f} | "
                     f"{sdpa:.2f} | {sdpa / ours:.2f}x | {diff:.3g} |")
    return "\n".join(lines) + "\n"


def _shape(text):
    batch, seqlen = text.lower().split("x")
    return int(batch), int(seqlen)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny models and short sequences on the CPU in fp32 (a smoke run)")
    p.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--archs", nargs="+", default=["llama", "qwen2"], choices=["llama", "qwen2"])
    p.add_argument("--shapes", nargs="+", type=_shape, default=None,
                   help="BATCHxSEQLEN, e.g. 8x1024 (default: 8x1024 4x4096 1x16384; --quick: "
                        "4x64 2x256)")
    p.add_argument("--padding", nargs="+", default=["none", "left"], choices=["none", "left"])
    p.add_argument("--phases", nargs="+", default=["prefill", "decode"],
                   choices=["prefill", "decode"],
                   help="prefill: one forward over the prompts; decode: one token per sequence "
                        "on a cache of the prompts")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="markdown file for the table")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.shapes is None:
        args.shapes = [(4, 64), (2, 256)] if args.quick else [(8, 1024), (4, 4096), (1, 16384)]
    if args.quick:
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
    rows = run(args)
    text = _markdown(args, rows, argv)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
