#!/usr/bin/env bash
# The Python package and libmoe.torch on the GPU machine, in one call of about 4 to 6 minutes:
#   build        libmoe with CUDA and bench_moe (scripts/gpu-machine/env.sh's configure, tests
#                and examples off), and bench/python/step_bench.c against the built libmoe.so
#   torch_check  tests/python/torch_check.py: MoELayer against a plain PyTorch layer (bf16
#                bounds of the CUDA tests), zero-copy parameters, PyTorch's current stream,
#                slots, the array-interface and DLPack paths, two small models that train
#   bench        step_bench (the layer step from C), `bench_moe layer` (expert GEMM mode auto),
#                then bench/python/torch_bench.py: the same step through the wrapper and
#                PyTorch's eager layer (bench/torch_moe.py) in the same call
# Shorter phases for a short call (with build, which then builds libmoe and step_bench alone
# unless bench is named too):
#   quick        (after compile) step_bench and torch_bench.py --quick --c-loop at issue 42's three shapes: the
#                overhead figures against the C step in the same process, and the host time
#                split into C calls, the wrapper's Python and PyTorch's autograd
#   compile      torch_check.py --only compile: torch.compile(fullgraph=True) of a 4-layer model
#                against eager (with the fairness checks: routing, eager against eager,
#                aot_eager, the dense floor) and mode="reduce-overhead"; then the same compile
#                check on the host backend (f32, aot_eager)
# Writes $OUT/ffi.jsonl (every JSON line), $OUT/ffi.log (build and stderr), $OUT/ffi.md (the
# results file for bench/results/ffi.md); prints the JSON lines. Exit status 1 when a build or
# a check failed.
# Usage (repository root, .deps carried as scripts/gpu-machine/README.md says):
#   MOE_COMMIT=<commit> bash tests/python/device_check.sh [build quick compile torch_check bench]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
export PYTHONUNBUFFERED=1
phases=${*:-build torch_check bench}
has() { [[ " $phases " == *" $1 "* ]]; }
log=$OUT/ffi.log json=$OUT/ffi.jsonl
: > "$log"
: > "$json"
status=0
mark() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$log"; }
# run NAME SECONDS CMD...: JSON lines to stdout and ffi.jsonl, stderr to ffi.log
run() {
  local name=$1 limit=$2
  shift 2
  mark "$name"
  timeout "$limit" "$@" 2>> "$log" | tee -a "$json"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { mark "$name: exit status $rc"; status=1; }
}

if has build; then
  mark build
  targets=moe
  has bench && targets="moe bench_moe"
  # shellcheck disable=SC2086
  if ! { device_configure -DMOE_BUILD_TESTS=OFF -DMOE_BUILD_EXAMPLES=OFF &&
    cmake --build "$B" -j16 --target $targets; } >> "$log" 2>&1; then
    echo "BUILD FAILED"
    tail -40 "$log"
    exit 1
  fi
  cuda=$(dirname "$(dirname "$(command -v nvcc)")")
  for out in "$B/step_bench" "$B/libstep_bench.so"; do  # the program, and its loop for Python
    shared=$([[ $out == *.so ]] && echo "-shared -fPIC")
    # shellcheck disable=SC2086
    cc -O2 -Wall -Wextra $shared -I include -I "$cuda/include" bench/python/step_bench.c \
      -o "$out" -L "$B" -lmoe -L "$cuda/lib64" -lcudart -lm -Wl,-rpath,"$B" \
      -Wl,-rpath,"$cuda/lib64" >> "$log" 2>&1 ||
      { mark "$(basename "$out"): build failed"; status=1; }
  done
fi
export MOE_LIBRARY=$B/libmoe.so PYTHONPATH=$PWD/python
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)" \
  2>&1 | tee -a "$log"

if has compile; then
  run torch_check_compile 180 python3 tests/python/torch_check.py --only compile
  run torch_check_compile_host 90 python3 tests/python/torch_check.py --host --only compile
fi

if has quick; then
  run step_bench 60 "$B/step_bench" 512 256 512 16 2 2048 1024 1408 64 2 16384 4096 1408 64 2
  run torch_bench 150 python3 bench/python/torch_bench.py --quick --c-loop "$B/libstep_bench.so" \
    "$OUT/ffi.md" "$json"
fi

if has torch_check; then
  run torch_check 240 python3 tests/python/torch_check.py
fi

if has bench; then
  shapes="512 256 512 16 2  2048 1024 1408 64 2  16384 4096 1408 64 2  16384 2048 8192 8 2
          32768 4096 14336 8 2"
  # shellcheck disable=SC2086
  run step_bench 180 "$B/step_bench" $shapes
  run bench_moe 180 env MOE_CUDA_EXPERT_GEMM=auto "$B/bench/bench_moe" layer
  run torch_bench 300 python3 bench/python/torch_bench.py --c-loop "$B/libstep_bench.so" \
    "$OUT/ffi.md" "$json"
fi
# the digest: one line per check and per overhead figure (the JSON lines above may scroll away)
python3 - "$json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("check") in ("torch.compile", "reduce-overhead"):
        print("ok  " if r["ok"] else "FAIL", json.dumps(r))
    elif "check" in r and r["check"] != "summary":
        print("ok  " if r["ok"] else "FAIL", r["check"], r.get("error", ""))
    elif r.get("bench") == "ffi_host_split":
        print(f"host {r['shape']} {r['variant']}: {r['host_us_per_step']} us/step, "
              f"{r['c_calls_us']} in C, {r['python_us']} in the wrapper's Python, "
              f"{r.get('torch_us', '-')} in PyTorch outside it")
    elif r.get("bench") == "ffi_overhead":
        print("overhead", json.dumps(r))
    elif "error" in r:
        print("ERROR", r)
PY
mark "done, exit status $status"
exit $status
