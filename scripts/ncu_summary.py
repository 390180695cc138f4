#!/usr/bin/env python3
"""Markdown summary of ncu reports exported as CSV (scripts/device.sh profile):

    python3 scripts/ncu_summary.py OUT/ncu_*.csv

Each NAME.csv is `ncu --import NAME.ncu-rep --page details --csv`; NAME_raw.csv, when present,
`--page raw --csv`. Per kernel: the duration, the speed-of-light, scheduler, warp-state, occupancy
and launch figures of the details page, and from the raw page the warp-stall samples
(smsp__pcsamp_warps_issue_stalled_*), largest first."""
import csv
import os
import sys

SECTIONS = ("GPU Speed Of Light Throughput", "Compute Workload Analysis", "Memory Workload Analysis",
            "Scheduler Statistics", "Warp State Statistics", "Occupancy", "Launch Statistics")
STALL = "smsp__pcsamp_warps_issue_stalled_"


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


def stalls(path):
    """{kernel id: [(reason, samples)]} largest first, from a raw-page CSV (row 2: units)."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path, newline="") as f:
        rows = list(csv.reader(line for line in f if not line.startswith("==")))
    if len(rows) < 3:
        return out
    head = rows[0]
    cols = [i for i, h in enumerate(head) if h.startswith(STALL) and not h.endswith("_not_issued")]
    for r in rows[2:]:
        got = []
        for i in cols:
            try:
                got.append((head[i][len(STALL):], float(r[i].replace(",", ""))))
            except (ValueError, IndexError):
                pass
        total = sum(v for _, v in got) or 1.0
        out[r[head.index("ID")] if "ID" in head else str(len(out))] = sorted(
            ((k, v / total) for k, v in got if v > 0), key=lambda kv: -kv[1])
    return out


def main():
    for path in sys.argv[1:]:
        if path.endswith("_raw.csv"):
            continue
        name = os.path.basename(path)[:-4]
        st = stalls(path[:-4] + "_raw.csv")
        for (kid, kernel), metrics in details(path).items():
            print(f"\n### {name}: {kernel[:110]}\n")
            print("| section | metric | value |\n|---|---|---|")
            for section, metric, unit, value in metrics:
                print(f"| {section} | {metric} | {value} {unit} |")
            if st.get(kid):
                print("\nwarp stall samples (share): " +
                      ", ".join(f"{k} {v:.1%}" for k, v in st[kid][:8]))


if __name__ == "__main__":
    main()
