#!/usr/bin/env python3
"""Per-kernel CUDA codegen figures of a build, to compare two builds instruction by instruction.

Reads the ptxas -v log of a build (configure with -DFLASHPORT_CUDA_VERBOSE_PTXAS=ON and keep
ninja's output) and the SASS of its objects (cuobjdump -sass), and prints one row per
(arch, kernel): registers, stack, spill bytes, and SASS counts (total instructions, HMMA, LDSM,
LDGSTS, LDS, STS, SHFL, BAR, MUFU).

Usage: cuda_codegen_stats.py BUILD_DIR PTXAS_LOG [KERNEL_REGEX]
       cuda_codegen_stats.py --diff BEFORE.txt AFTER.txt
       cuda_codegen_stats.py --loops OBJECT_OR_CUBIN KERNEL_REGEX
--loops: each loop of the kernels (a backward branch and the code it jumps over) that holds tensor
instructions: its instruction count and its HMMA/HGMMA count, innermost first; a main loop's size
compared across two builds says what a change costs per iteration (the static count: branches
inside a loop count whether taken or not).
cuobjdump: $CUOBJDUMP, else the one on PATH, else triton's copy. A host without the CUDA toolkit's
cuobjdump can take NVIDIA's wheel: `pip download --no-deps nvidia-cuda-cuobjdump`, unzip, and set
CUOBJDUMP to nvidia/cu13/bin/cuobjdump (13.5 reads nvcc 13.0's sm_90a code).
"""
import glob
import os
import re
import shutil
import subprocess
import sys

OPS = ["HMMA", "LDSM", "LDGSTS", "LDS", "STS", "SHFL", "BAR", "MUFU"]


def cuobjdump():
    for c in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")):
        if c:
            return c
    hits = glob.glob(os.path.expanduser("~/.pyenv/versions/*/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump"))
    if hits:
        return hits[0]
    sys.exit("cuobjdump not found (set CUOBJDUMP)")


def ptxas_usage(log):
    usage, cur = {}, None
    for line in open(log, errors="replace"):
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            cur = (m.group(2).rstrip("a"), m.group(1))  # sm_90a: cuobjdump says sm_90
            usage[cur] = {"regs": 0, "stack": 0, "spill_st": 0, "spill_ld": 0}
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            usage[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            usage[cur]["regs"] = int(m.group(1))
    return usage


def sass_counts(objects):
    counts = {}
    tool = cuobjdump()
    for obj in objects:
        out = subprocess.run([tool, "-sass", obj], capture_output=True, text=True).stdout
        arch, fn = None, None
        for line in out.splitlines():
            m = re.search(r"code for (sm_\w+)", line)
            if m:
                arch = m.group(1).rstrip("a")  # as ptxas_usage keys it (cuobjdump may say sm_90a)
                continue
            m = re.search(r"Function : (\S+)", line)
            if m:
                fn = (arch, m.group(1))
                counts[fn] = {k: 0 for k in ["total"] + OPS}
                continue
            m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]*)?", line)
            if m and fn:
                op = m.group(1)
                counts[fn]["total"] += 1
                if op in OPS:
                    counts[fn][op] += 1
    return counts


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, out.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def report(build, log, pattern):
    objs = sorted(glob.glob(os.path.join(build, "src/gpu/CMakeFiles/**/*.cu.o"), recursive=True))
    usage, counts = ptxas_usage(log), sass_counts(objs)
    keys = sorted(k for k in counts if re.search(pattern, k[1]))
    names = demangle([k[1] for k in keys])
    cols = ["regs", "stack", "spill_st", "spill_ld", "total"] + OPS
    print("arch   " + " ".join(f"{c:>8}" for c in cols) + "  kernel")
    for k in keys:
        u = usage.get(k, {})
        row = [u.get("regs", -1), u.get("stack", -1), u.get("spill_st", -1), u.get("spill_ld", -1)]
        row += [counts[k][c] for c in ["total"] + OPS]
        short = names[k[1]].replace("flashport::gpu::", "").replace("(FwdArgs)", "")
        print(f"{k[0]:6} " + " ".join(f"{v:8}" for v in row) + "  " + short)


def diff(before, after):
    def rows(path):
        r = {}
        for line in open(path):
            if line.startswith("sm_"):
                parts = line.split()
                r[(parts[0], line.split("  ")[-1].strip())] = [int(x) for x in parts[1:14]]
        return r
    b, a = rows(before), rows(after)
    cols = ["regs", "stack", "spill_st", "spill_ld", "total"] + OPS
    same = 0
    for k in sorted(set(b) | set(a)):
        if k not in b or k not in a:
            print(f"{k[0]} {k[1]}: only in {'after' if k in a else 'before'}")
            continue
        d = [f"{c} {x}->{y}" for c, x, y in zip(cols, b[k], a[k]) if x != y]
        if d:
            print(f"{k[0]} {k[1]}: " + ", ".join(d))
        else:
            same += 1
    print(f"{same} kernels identical in every column")


def loops(obj, pattern):
    out = subprocess.run([cuobjdump(), "-sass", obj], capture_output=True, text=True).stdout
    kernels, fn = {}, None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            fn = m.group(1)
            kernels[fn] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and fn:
            kernels[fn].append((int(m.group(1), 16), m.group(2)))
    names = demangle(list(kernels))
    for fn, ins in kernels.items():
        if not re.search(pattern, fn):
            continue
        found = set()
        for addr, text in ins:
            m = re.search(r"BRA (0x[0-9a-f]+)", text)
            if m and int(m.group(1), 16) < addr:
                body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
                mma = sum(1 for t in body if "HMMA" in t or "HGMMA" in t)
                if mma:
                    found.add((len(body), mma))
        print(names[fn])
        print(f"  {len(ins)} instructions; loops (instructions, tensor instructions): " +
              ", ".join(f"({n}, {k})" for n, k in sorted(found)))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--loops":
        loops(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "--diff":
        diff(sys.argv[2], sys.argv[3])
    elif len(sys.argv) in (3, 4):
        report(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else ".")
    else:
        sys.exit(__doc__)
