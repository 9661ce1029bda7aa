#!/usr/bin/env python3
"""Sum an ncu CSV of gpu__time_duration.sum by kernel: calls, total and mean microseconds,
share of the whole. ncu runs kernels one at a time, so kernels that overlap in a real run
(side streams) are summed here: the total bounds the serial time, not the measured one.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        build/bench/bench_moe profile 0 > prof.csv
    python3 bench/kernel_times.py prof.csv
"""
import csv
import re
import sys
from collections import defaultdict


def short(name):
    name = re.sub(r"\(.*", "", name)          # drop argument lists
    name = re.sub(r"<.*", "", name)           # and template arguments
    return name[:60]


def main(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own log lines too
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        sys.exit(f"{path}: no gpu__time_duration.sum rows")
    unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    groups = defaultdict(lambda: [0, 0.0, ""])
    for r in rows:
        us = float(r["Metric Value"].replace(",", "")) * unit[r["Metric Unit"]]
        g = groups[short(r["Kernel Name"])]
        g[0] += 1
        g[1] += us
        g[2] = g[2] or f'grid {r["Grid Size"]} block {r["Block Size"]}'
    total = sum(g[1] for g in groups.values())
    print(f"{len(rows)} kernels, {total:.1f} us in all (serial sum)")
    print(f"{'kernel':60} {'calls':>6} {'total us':>10} {'mean us':>9} {'share':>6}  first launch")
    for name, (n, us, launch) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:60} {n:6d} {us:10.1f} {us / n:9.2f} {100 * us / total:5.1f}%  {launch}")


if __name__ == "__main__":
    main(sys.argv[1])
