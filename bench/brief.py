#!/usr/bin/env python3
"""One short line per JSON line of bench_moe / torch_moe.py output: bench, shape, variant,
milliseconds (and TFLOP/s where given), or the mode auto picks; errors verbatim."""
import json
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "error" in r:
                print(f"{r.get('impl', '?')[:5]} {r.get('bench')}: ERROR {r['error']}")
                continue
            if "ms" not in r:  # bench_moe's experts_pick: the mode auto takes
                print(f"{r['impl'][:5]:5} {r['bench']:14} {r['shape']:34} picks {r.get('picks')}")
                continue
            tf = f" {r['tflops']:.0f} TF/s" if r.get("tflops") else ""
            print(f"{r['impl'][:5]:5} {r['bench']:14} {r['shape']:34} {r['variant']:18} "
                  f"{r['ms']:.4f} ms{tf}")
