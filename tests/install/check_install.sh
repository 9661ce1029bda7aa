#!/usr/bin/env bash
# Install the build tree into a temporary prefix, then build programs against it as users do:
#  - the consumer through find_package(libmoe) and through pkg-config, shared library;
#  - the README's example program (extracted from README.md), through pkg-config;
#  - the consumer linked statically: find_package(libmoe COMPONENTS static) -> libmoe::moe_static,
#    pkg-config --static libmoe-static beside the shared library, and pkg-config --static
#    libmoe on a prefix that holds the static library alone;
#  - the installed tools moe_train and moe_elastic (--help);
# and check the SONAME and that only moe_* symbols are exported.
# Usage: check_install.sh BUILD_DIR SRC_DIR
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > /dev/null
libdir=$(ls -d "$tmp"/prefix/lib*/ | head -n1)
libdir=${libdir%/}
pc() { PKG_CONFIG_PATH="$1/pkgconfig" pkg-config "${@:2}"; }
# a statically linked program must not load libmoe.so
no_shared_libmoe() {
  if readelf -d "$1" | grep -q 'NEEDED.*libmoe'; then
    echo "$1 needs libmoe.so although it was linked statically"; exit 1
  fi
}

cmake -S "$src/tests/install/consumer" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$tmp/prefix" > /dev/null
cmake --build "$tmp/cmake-build" > /dev/null
LD_LIBRARY_PATH="$libdir" "$tmp/cmake-build/consumer"
cc -o "$tmp/pc-consumer" "$src/tests/install/consumer/main.c" $(pc "$libdir" --cflags --libs libmoe)
LD_LIBRARY_PATH="$libdir" "$tmp/pc-consumer"

# The README's example: the C block after the readme-example marker, built as the README says.
awk '/<!-- readme-example/ {m = 1; next} m && /^```c$/ {c = 1; next} c && /^```$/ {exit}
     c {print}' "$src/README.md" > "$tmp/example.c"
[ -s "$tmp/example.c" ] || { echo "no example program found in README.md"; exit 1; }
cc -Wall -Wextra -Werror -o "$tmp/readme-example" "$tmp/example.c" $(pc "$libdir" --cflags --libs libmoe)
LD_LIBRARY_PATH="$libdir" "$tmp/readme-example"

cmake -S "$src/tests/install/consumer" -B "$tmp/cmake-static" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DMOE_CONSUMER_STATIC=ON > /dev/null
cmake --build "$tmp/cmake-static" > /dev/null
no_shared_libmoe "$tmp/cmake-static/consumer"
"$tmp/cmake-static/consumer"
# beside the shared library: libmoe-static.pc names the archive itself
cc -o "$tmp/pc-static-beside" "$src/tests/install/consumer/main.c" \
  $(pc "$libdir" --static --cflags --libs libmoe-static)
no_shared_libmoe "$tmp/pc-static-beside"
"$tmp/pc-static-beside"
# a static-only install: the same prefix without the shared library
cp -a "$tmp/prefix" "$tmp/static-prefix"
static_libdir="$tmp/static-prefix/${libdir#"$tmp/prefix/"}"
rm -f "$static_libdir"/libmoe.so*
cc -o "$tmp/pc-static-consumer" "$src/tests/install/consumer/main.c" \
  $(pc "$static_libdir" --static --cflags --libs libmoe)
no_shared_libmoe "$tmp/pc-static-consumer"
"$tmp/pc-static-consumer"

# the tools: the trainer (found its libmoe.so through its RPATH) and the elastic launcher
if [ -f "$build/examples/moe_train" ]; then
  "$tmp/prefix/bin/moe_train" --help | grep -q "usage:" || { echo "installed moe_train --help failed"; exit 1; }
  "$tmp/prefix/bin/moe_elastic" --help | grep -q -- "--slots" || { echo "installed moe_elastic --help failed"; exit 1; }
fi

# the SONAME carries major.minor, and only moe_* symbols are exported
soname=$(objdump -p "$libdir/libmoe.so" | awk '/SONAME/ {print $2}')
[ "$soname" = "libmoe.so.0.2" ] || { echo "unexpected SONAME $soname"; exit 1; }
if nm -D --defined-only "$libdir/libmoe.so" | awk 'NF==3 {print $3}' | grep -v '^moe_' | grep -v '^LIBMOE_'; then
  echo "symbols outside the moe_ namespace are exported"; exit 1
fi
echo "install check passed"
