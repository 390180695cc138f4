"""Summary of an ncu source page (SASS lines with warp-state samples and executed instructions) of a
warp-specialised kernel, split at its register hand-over: the lines before the producer's
`USETMAXREG.DEALLOC` are the consumer / MMA warpgroups' code, those after it the producer's.

    ncu --clock-control none -k regex:KERNEL --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o rep python3 ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 bench/gpu/ncu_source_summary.py src.csv [--top 20]

Prints per region: stall samples and executed warp instructions, the stall reasons, samples and
instructions by opcode, and the lines holding the most samples (session 22's dropout forward
analysis: bench/results/gpu_dropout.md).
"""
import argparse
import collections
import csv
import gzip


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    # Row 0 names the kernel; row 1 is the header.
    header = rows[1]
    return rows[0], [dict(zip(header, r)) for r in rows[2:]], header


def num(x):
    try:
        return int(x)
    except ValueError:
        return 0


def opcode(source):
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def summarize(name, lines, reasons, top):
    samples = sum(num(d["Warp Stall Sampling (All Samples)"]) for d in lines)
    executed = sum(num(d["Instructions Executed"]) for d in lines)
    print(f"\n## {name}: {len(lines)} SASS lines, {samples} stall samples, {executed} warp instructions executed")
    by_reason = collections.Counter()
    for d in lines:
        for r in reasons:
            by_reason[r] += num(d[r])
    print("stall reasons:", ", ".join(f"{r[6:]} {v / max(samples, 1):.1%}" for r, v in by_reason.most_common(8)))
    ops_s, ops_e = collections.Counter(), collections.Counter()
    for d in lines:
        op = opcode(d["Source"])
        ops_s[op] += num(d["Warp Stall Sampling (All Samples)"])
        ops_e[op] += num(d["Instructions Executed"])
    print("samples by opcode:", ", ".join(f"{o} {v / max(samples, 1):.1%}" for o, v in ops_s.most_common(12)))
    print("executed by opcode:", ", ".join(f"{o} {v / max(executed, 1):.1%}" for o, v in ops_e.most_common(12)))
    print(f"top {top} lines (index, samples, executed, SASS):")
    for i, d in sorted(enumerate(lines), key=lambda x: -num(x[1]["Warp Stall Sampling (All Samples)"]))[:top]:
        print(f"  {i:6d} {num(d['Warp Stall Sampling (All Samples)']):8d} {num(d['Instructions Executed']):12d}  "
              f"{d['Source'].strip()[:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    kernel, lines, header = load(args.csv)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    print(" ".join(kernel)[:200])
    split = next((i for i, d in enumerate(lines) if "USETMAXREG.DEALLOC" in d["Source"]), None)
    if split is None:
        summarize("whole kernel", lines, reasons, args.top)
        return
    summarize("before the producer's register hand-over (consumers / MMA warpgroups)", lines[:split], reasons,
              args.top)
    summarize("after it (producer)", lines[split:], reasons, args.top)


if __name__ == "__main__":
    main()
