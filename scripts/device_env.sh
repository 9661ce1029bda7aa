# Sourced from the repository root by the scripts that run on the GPU machine: the offline
# dependencies (.deps, when present), the environment every device run needs, OUT (the folder
# whose files come back, created), B (the build directory) and device_configure.
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
# device_configure [cmake -D options...]: the Release sm_90 CUDA build every device script uses
device_configure() {
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DMOE_CUDA=ON "$@"
}
