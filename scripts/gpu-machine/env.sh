# shellcheck shell=bash
# Sourced from the repository root by the scripts that run on the GPU machine: the offline
# dependencies (.deps, when present), the environment every device run needs, OUT (the folder
# whose files come back, created), B (the build directory), device_configure, write_results
# and the power sampling helpers.
# One build directory per source tree: worktrees sharing a warm machine must not share a
# CMake cache (a stale one fails the build, or runs another tree's binaries).
B=${MOE_BUILD_DIR:-/tmp/build-device-$(basename "$PWD")}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 # NVLink multicast stays off on shared machines
[ -f .deps/unpack.sh ] && source .deps/unpack.sh >/dev/null
# The bundled cmocka .pc names -I/usr/include and -L/usr/lib, which .deps/unpack.sh does not
# repoint: let the compiler and linker find the unpacked copies.
_deps=${MOE_DEPS_PREFIX:-/opt/libmoe-deps}/usr
if [ -d "$_deps/include" ]; then
  export CPATH="$_deps/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$_deps/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
# device_configure [cmake -D options...]: the Release CUDA build every device script uses, for
# the project's default architectures unless $MOE_CUDA_ARCH names others (90: the sm_90 image
# alone, e.g. to test the kernels' non-sm_90a forms on the H200)
device_configure() {
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON \
    ${MOE_CUDA_ARCH:+-DCMAKE_CUDA_ARCHITECTURES=$MOE_CUDA_ARCH} "$@"
}
# power_sampling_start <label> ... power_sampling_stop: the SM clock, power, temperature and
# throttle reasons every 25 ms into $OUT/power.csv under "== <label>" (bench/power_summary.py
# summarises it)
POWER_FIELDS=timestamp,clocks.sm,power.draw.instant,power.draw.average,temperature.gpu,clocks_event_reasons.active
power_sampling_start() {
  echo "== $1" >>"$OUT/power.csv"
  nvidia-smi --query-gpu=$POWER_FIELDS --format=csv,noheader -lms 25 >>"$OUT/power.csv" &
  POWER_SAMPLER=$!
  sleep 0.3
}
power_sampling_stop() {
  sleep 0.3
  kill "$POWER_SAMPLER"
  wait "$POWER_SAMPLER" 2>/dev/null
}
# write_results [bench/write_results.py options] FILE...: a call's JSON lines as
# $OUT/results/<benchmark>.md, with this machine's date, GPU, CUDA and driver versions and the
# commit ($MOE_COMMIT, else git's; "-dirty" marks uncommitted changes)
write_results() {
  local commit gpu ngpu driver cuda
  commit=${MOE_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  [ "${ngpu:-0}" -gt 1 ] && gpu="$ngpu x $gpu"
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  cuda=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  python3 bench/write_results.py --out "$OUT/results" --commit "$commit" --date "$(date -u +%F)" \
    ${gpu:+--gpu "$gpu"} --software "CUDA ${cuda:-?}, driver ${driver:-?}" "$@"
}
