#!/usr/bin/env bash
# Install the build tree into a temporary prefix, then build the consumer against it twice:
# through find_package(libmoe) and through pkg-config. Usage: check_install.sh BUILD_DIR SRC_DIR
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > /dev/null
libdir=$(ls -d "$tmp"/prefix/lib*/ | head -n1)
cmake -S "$src/tests/install/consumer" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$tmp/prefix" > /dev/null
cmake --build "$tmp/cmake-build" > /dev/null
LD_LIBRARY_PATH="$libdir" "$tmp/cmake-build/consumer"
PKG_CONFIG_PATH="$libdir/pkgconfig" cc -o "$tmp/pc-consumer" "$src/tests/install/consumer/main.c" \
  $(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs libmoe)
LD_LIBRARY_PATH="$libdir" "$tmp/pc-consumer"
# the SONAME carries major.minor, and only moe_* symbols are exported
soname=$(objdump -p "$libdir/libmoe.so" | awk '/SONAME/ {print $2}')
[ "$soname" = "libmoe.so.0.1" ] || { echo "unexpected SONAME $soname"; exit 1; }
if nm -D --defined-only "$libdir/libmoe.so" | awk 'NF==3 {print $3}' | grep -v '^moe_' | grep -v '^LIBMOE_'; then
  echo "symbols outside the moe_ namespace are exported"; exit 1
fi
echo "install check passed"
