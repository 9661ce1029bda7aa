#!/usr/bin/env bash
# Build the libmoe Python wheel with libmoe.so inside, offline, from Debian's python3-build,
# python3-wheel and python3-setuptools (scripts/setup-deps.sh --tests installs them):
#   scripts/python-wheel.sh [LIBRARY [OUT_DIR]]
# LIBRARY: a built libmoe.so (default build/libmoe.so); OUT_DIR: where the wheel goes (default
# dist/). The library is copied next to the package's modules under its SONAME, where
# libmoe/_native.py looks first after MOE_LIBRARY, with $ORIGIN put before its RUNPATH (so it
# carries no build-tree path of its own, and finds libraries placed beside it). Its other
# dependencies (libcurl, libcjson, liburing, libxxhash, Open MPI, CUDA's runtime for a CUDA
# build) stay the system's. The wheel is tagged py3-none-<platform>. Prints the wheel's path.
# PYTHON picks the interpreter that builds; by default the first of python3 and Debian's
# /usr/bin/python3 that has the three modules.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
lib=$(realpath "${1:-$here/build/libmoe.so}")
out=$(mkdir -p "${2:-dist}" && realpath "${2:-dist}")
[ -f "$lib" ] || { echo "python-wheel.sh: no library at $lib (build libmoe first)" >&2; exit 1; }
python=
for candidate in ${PYTHON:-python3 /usr/bin/python3}; do
  if "$candidate" -c "import build, setuptools, wheel" 2> /dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "python-wheel.sh: ${PYTHON:-python3} lacks build, setuptools or wheel" \
    "(scripts/setup-deps.sh --tests installs python3-build, python3-setuptools, python3-wheel)" >&2
  exit 1
fi
soname=$(patchelf --print-soname "$lib")
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# a copy of the package, so the source tree gets neither the library nor build leftovers
cp -r "$here/python/pyproject.toml" "$here/python/setup.py" "$here/python/libmoe" "$stage/"
rm -rf "$stage/libmoe/__pycache__"
cp "$lib" "$stage/libmoe/$soname"
runpath=$(patchelf --print-rpath "$stage/libmoe/$soname")
patchelf --set-rpath "\$ORIGIN${runpath:+:$runpath}" "$stage/libmoe/$soname"
"$python" -m build --wheel --no-isolation --outdir "$stage/dist" "$stage" > "$stage/build.log" 2>&1 ||
  { cat "$stage/build.log" >&2; exit 1; }
wheel=$(ls "$stage"/dist/libmoe-*.whl)
mv "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
