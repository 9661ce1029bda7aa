#!/usr/bin/env python3
"""Read the CSV bench/trace.c writes and summarise the work between cudaProfilerStart and
cudaProfilerStop (bench_moe profile: one layer step): its span on the GPU, how much of it some
kernel or copy was running, the idle gaps and what was on either side of each (and whether the
host had launched the next piece of work by then), and the time per kernel as it ran in the
program (concurrent kernels overlap, so their sum can exceed the span).

    python3 bench/trace_summary.py trace.csv [gap_us=2]
"""
import csv
import re
import shutil
import subprocess
import sys
from collections import defaultdict


def demangle(names):
    """CUPTI gives mangled kernel names; c++filt (binutils) reads them back where present."""
    if not shutil.which("c++filt") or not names:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


# CUpti_ActivityMemcpyKind, as bench/trace.c writes it ("kind<N>_<bytes>_bytes")
COPY_KINDS = {"1": "HtoD", "2": "DtoH", "8": "DtoD", "10": "PtoP"}


def short(name):
    name = re.sub(r"^kind(\d+)_", lambda m: COPY_KINDS.get(m.group(1), m.group(0)) + " ", name)
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<(?![^<>]{0,12}>$).*", "", name)  # keep short template arguments (<true>)
    return name.replace("void ", "")[:56]


def main(path, min_gap_us=2.0):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    readable = demangle(sorted({r["name"] for r in rows if r["kind"] == "kernel"}))
    for r in rows:
        r["start"], r["end"] = int(r["start_ns"]), int(r["end_ns"])
        r["corr"] = int(r["correlation"])
        if r["kind"] == "kernel":
            r["name"] = readable[r["name"]]
    api = sorted((r for r in rows if r["kind"] in ("api", "drv")), key=lambda r: r["start"])
    starts = [r for r in api if r["name"].startswith("cudaProfilerStart")]
    stops = [r for r in api if r["name"].startswith("cudaProfilerStop")]
    if not starts or not stops:
        sys.exit(f"{path}: no cudaProfilerStart/Stop pair")
    t0, t1 = starts[-1]["end"], stops[-1]["start"]
    calls = [r for r in api if t0 <= r["start"] and r["end"] <= t1]
    launched = {r["corr"]: r for r in calls}
    # the step ends in a synchronisation, so its work runs inside the window
    work = sorted((r for r in rows if r["kind"] not in ("api", "drv") and t0 <= r["start"]
                   and r["end"] <= t1), key=lambda r: r["start"])
    if not work:
        sys.exit(f"{path}: no GPU work in the window")
    g0, g1 = work[0]["start"], max(r["end"] for r in work)

    busy, gaps, reach, last = 0, [], g0, None
    for r in work:
        if r["start"] > reach:
            gap = (r["start"] - reach) / 1e3
            if gap >= min_gap_us:
                call = launched.get(r["corr"])
                host_late = call is not None and call["end"] > reach
                gaps.append((reach - g0, gap, last, r, host_late))
        if r["end"] > reach:
            busy += r["end"] - max(r["start"], reach)
            reach, last = r["end"], r

    span = (g1 - g0) / 1e3
    print(f"host: {(t1 - t0) / 1e3:.1f} us between start and stop, {len(calls)} runtime and driver calls")
    print(f"GPU: {span:.1f} us from the first to the last piece of work, busy {busy / 1e3:.1f} us "
          f"({100 * busy / 1e3 / span:.1f}%), idle {span - busy / 1e3:.1f} us")
    idle_host = sum(g[1] for g in gaps if g[4])
    print(f"gaps >= {min_gap_us:g} us: {len(gaps)}, {sum(g[1] for g in gaps):.1f} us in all, "
          f"{idle_host:.1f} us of them waiting for the host to launch the next work")
    for at, gap, before, after, host_late in gaps:
        print(f"  at {at / 1e3:9.1f} us  {gap:7.1f} us  {short(before['name']) if before else '-':>40}"
              f" -> {short(after['name'])}{'  (host late)' if host_late else ''}")

    per = defaultdict(lambda: [0, 0.0, set()])
    for r in work:
        p = per[(r["kind"], short(r["name"]))]
        p[0] += 1
        p[1] += (r["end"] - r["start"]) / 1e3
        p[2].add(r["stream"])
    print(f"{'kind':7} {'name':56} {'calls':>5} {'total us':>9} {'mean us':>8}  streams")
    for (kind, name), (n, tot, streams) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:7} {name:56} {n:5d} {tot:9.1f} {tot / n:8.2f}  {len(streams)}")

    host = defaultdict(lambda: [0, 0.0])
    for r in calls:
        h = host[("drv " if r["kind"] == "drv" else "") + re.sub(r"_v\d+$", "", r["name"])]
        h[0] += 1
        h[1] += (r["end"] - r["start"]) / 1e3
    print("host calls (calls, total us):", ", ".join(
        f"{name} {n} {tot:.1f}" for name, (n, tot) in sorted(host.items(), key=lambda kv: -kv[1][1])))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 2.0)
