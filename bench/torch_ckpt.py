#!/usr/bin/env python3
"""PyTorch's checkpoint saves of the state ckpt_bench saves, for the same-run comparison.

The state: --tensors bf16 tensors of --gib GiB in all on the GPU (as ckpt_bench makes it).
Each method saves it into --dir, one warm-up save, then --runs timed saves, medians over them:
  torch.save       torch.save of the state dict into one file, then fsync of the file and
                   its directory (stall = durable: the call blocks until the data is written)
  dcp.save         torch.distributed.checkpoint.save (FileSystemWriter, which fsyncs its
                   files), blocking like torch.save
  dcp.async_save   torch.distributed.checkpoint.async_save: stall = the time until it returns
                   (the state staged to host memory), durable = until its future completes
DCP runs in a process group of one (gloo). Prints one JSON line per save and one summary line
per method; a method that fails prints {"error": ...} and the others still run.
Usage: torch_ckpt.py [--gib 8] [--tensors 32] [--runs 5] [--dir /tmp] [--methods a,b]
(--methods: a comma-separated subset of torch.save, dcp.save, dcp.async_save; default all)
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(state, where):
    path = os.path.join(where, "state.pt")
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_path(path)
    fsync_path(where)
    t = time.perf_counter() - t0
    return t, t


def save_dcp(state, where):
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(where))
    t = time.perf_counter() - t0
    return t, t


def save_dcp_async(state, where):
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(where))
    stall = time.perf_counter() - t0
    fut.result()
    return stall, time.perf_counter() - t0


METHODS = {"torch.save": save_torch, "dcp.save": save_dcp, "dcp.async_save": save_dcp_async}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    impl = f"torch {torch.__version__}"
    total = int(args.gib * 2**30) // args.tensors // 2 * 2 * args.tensors
    n = total // args.tensors // 2
    state = {f"layer{i:03d}.weight": torch.randn(n, dtype=torch.bfloat16, device="cuda")
             for i in range(args.tensors)}
    torch.cuda.synchronize()
    init_file = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{init_file.name}", rank=0,
                            world_size=1)
    base = tempfile.mkdtemp(prefix="torch-ckpt-bench-", dir=args.dir)
    try:
        for name in methods:
            fn = METHODS[name]
            stalls, durables = [], []
            try:
                for run in range(-1, args.runs):
                    where = os.path.join(base, f"run{run + 1}")
                    os.makedirs(where)
                    stall, durable = fn(state, where)
                    shutil.rmtree(where)
                    if run < 0:
                        continue
                    stalls.append(stall)
                    durables.append(durable)
                    print(json.dumps({"bench": "torch_ckpt", "impl": impl, "method": name,
                                      "run": run, "bytes": total, "stall_s": round(stall, 4),
                                      "durable_s": round(durable, 4)}), flush=True)
                print(json.dumps({"bench": "torch_ckpt_summary", "impl": impl, "method": name,
                                  "runs": args.runs, "bytes": total, "dir": args.dir,
                                  "stall_median_s": round(statistics.median(stalls), 4),
                                  "durable_median_s": round(statistics.median(durables), 4)}),
                      flush=True)
            except Exception as e:  # report the method's failure, run the others
                print(json.dumps({"bench": "torch_ckpt", "impl": impl, "method": name,
                                  "error": f"{type(e).__name__}: {e}"}), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()
        os.unlink(init_file.name)


if __name__ == "__main__":
    main()
