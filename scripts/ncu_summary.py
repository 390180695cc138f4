#!/usr/bin/env python3
"""Markdown summary of ncu reports exported as CSV (scripts/device.sh profile):

    python3 scripts/ncu_summary.py OUT/ncu_*.csv

Each NAME.csv is `ncu --import NAME.ncu-rep --page details --csv`; NAME_raw.csv, when present,
`--page raw --csv`; NAME_source.csv, when present, `--page source --csv --print-source sass`. Per
kernel: the duration, the speed-of-light, scheduler, warp-state, occupancy and launch figures of
the details page; from the raw page the pipe utilisations (tensor, XU/MUFU, FMA, ALU, shared
memory) and the warp-stall samples (smsp__pcsamp_warps_issue_stalled_*), largest first; from the
source page where the stall samples sit, by opcode and by instruction."""
import csv
import os
import sys

SECTIONS = ("GPU Speed Of Light Throughput", "Compute Workload Analysis", "Memory Workload Analysis",
            "Scheduler Statistics", "Warp State Statistics", "Occupancy", "Launch Statistics")
STALL = "smsp__pcsamp_warps_issue_stalled_"
PIPES = (("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", "tensor pipe, % of elapsed"),
         ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "XU pipe (MUFU), % of active"),
         ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active", "FMA pipe, % of active"),
         ("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active", "ALU pipe, % of active"),
         ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
          "shared-memory wavefronts, % of elapsed"))


def details(path):
    """{(kernel id, kernel name): [(section, metric, unit, value)]} in file order."""
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(line for line in f if not line.startswith("==")):
            if row.get("Section Name") not in SECTIONS:
                continue
            key = (row.get("ID", ""), row.get("Kernel Name", ""))
            out.setdefault(key, []).append((row["Section Name"], row.get("Metric Name", ""),
                                            row.get("Metric Unit", ""), row.get("Metric Value", "")))
    return out


def raw_rows(path):
    """[{metric: value}] per kernel of a raw-page CSV (row 2: units), [] without the file."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        rows = list(csv.reader(line for line in f if not line.startswith("==")))
    return [dict(zip(rows[0], r)) for r in rows[2:]] if len(rows) >= 3 else []


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def source_summary(path, top=8):
    """Markdown lines per kernel of a source-page CSV: stall samples by opcode (the share of all
    samples, the three largest reasons) and the `top` instructions with the most samples."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]
    # One table per kernel, each after a "Kernel Name" line.
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')] or [-1]
    out = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        rows = list(csv.reader(lines[start + 1:end]))
        if len(rows) < 2:
            continue
        head = rows[0]
        data = [dict(zip(head, r)) for r in rows[1:] if len(r) == len(head)]
        reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
        samples = "Warp Stall Sampling (All Samples)"
        total = sum(number(d.get(samples)) or 0.0 for d in data) or 1.0
        by_op = {}
        for d in data:
            words = d.get("Source", "").split()
            words = words[1:] if words and words[0].startswith("@") else words
            if not words:
                continue
            parts = words[0].split(".")
            op = ".".join(parts[:2]) if parts[0] in ("HGMMA", "MUFU", "WARPGROUP", "SYNCS", "BAR") else parts[0]
            acc = by_op.setdefault(op, {"all": 0.0})
            acc["all"] += number(d.get(samples)) or 0.0
            for r in reasons:
                acc[r] = acc.get(r, 0.0) + (number(d.get(r)) or 0.0)
        title = lines[start].strip().split(",", 1)[1].strip('",') if start >= 0 else ""
        out.append(f"\nstall samples by SASS opcode{': ' + title[:100] if title else ''}\n")
        out.append("| opcode | share of samples | largest reasons |\n|---|---|---|")
        for op, acc in sorted(by_op.items(), key=lambda kv: -kv[1]["all"])[:top * 2]:
            big = sorted(((r[6:], acc.get(r, 0.0)) for r in reasons), key=lambda kv: -kv[1])[:3]
            out.append(f"| {op} | {acc['all'] / total:.1%} | " +
                       ", ".join(f"{r} {v / total:.1%}" for r, v in big if v) + " |")
        out.append("\ninstructions with the most samples:\n")
        for d in sorted(data, key=lambda d: -(number(d.get(samples)) or 0.0))[:top]:
            big = sorted(((r[6:], number(d.get(r)) or 0.0) for r in reasons), key=lambda kv: -kv[1])[:2]
            out.append(f"- {(number(d.get(samples)) or 0.0) / total:.1%} `{d.get('Source', '').strip()[:80]}` (" +
                       ", ".join(f"{r} {v / total:.1%}" for r, v in big if v) + ")")
    return out


def stalls(raw):
    """{kernel id: [(reason, share of samples)]} largest first, from raw_rows' kernels."""
    out = {}
    for row in raw:
        got = [(k[len(STALL):], number(v)) for k, v in row.items()
               if k.startswith(STALL) and not k.endswith("_not_issued")]
        got = [(k, v) for k, v in got if v is not None]
        total = sum(v for _, v in got) or 1.0
        out[row.get("ID", str(len(out)))] = sorted(((k, v / total) for k, v in got if v > 0), key=lambda kv: -kv[1])
    return out


def main():
    for path in sys.argv[1:]:
        if path.endswith(("_raw.csv", "_source.csv")):
            continue
        name = os.path.basename(path)[:-4]
        raw = raw_rows(path[:-4] + "_raw.csv")
        st = stalls(raw)
        for n, ((kid, kernel), metrics) in enumerate(details(path).items()):
            print(f"\n### {name}: {kernel[:110]}\n")
            print("| section | metric | value |\n|---|---|---|")
            for section, metric, unit, value in metrics:
                print(f"| {section} | {metric} | {value} {unit} |")
            for key, label in PIPES:
                if n < len(raw) and number(raw[n].get(key)) is not None:
                    print(f"| raw | {label} | {number(raw[n][key]):.1f} |")
            if st.get(kid):
                print("\nwarp stall samples (share): " +
                      ", ".join(f"{k} {v:.1%}" for k, v in st[kid][:8]))
        print("\n".join(source_summary(path[:-4] + "_source.csv")))


if __name__ == "__main__":
    main()
