#!/usr/bin/env bash
# The ABI check's own test: a small library (include/moe/abitest.h) is built in versions that
# change its interface the ways docs/api-stability.md names, and check_abi.sh must pass the
# compatible ones and fail the others against the first version's baseline.
# Usage: check_abi_selftest.sh [CC]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cc=${1:-cc}
command -v abidw > /dev/null || { echo "abidw not found (Debian package abigail-tools)"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# version 1; each case below edits a copy of it with sed
cat > "$tmp/v1.h" <<'H'
#include <stddef.h>
#include <stdint.h>
#define API __attribute__((visibility("default")))
typedef enum moe_color { MOE_RED = 0, MOE_GREEN = 1 } moe_color_t;
typedef struct moe_thing_config {
    size_t struct_size; int32_t width; float rate; } moe_thing_config_t;
typedef struct moe_pipeline_stats {
    size_t struct_size; double seconds; int32_t stages; } moe_pipeline_stats_t;
API moe_thing_config_t moe_thing_config_default(void);
API int moe_thing_run(const moe_thing_config_t *c, moe_color_t color, int32_t n);
API int moe_thing_stats(moe_pipeline_stats_t *s);
API int moe_thing_old(void);
H
cat > "$tmp/lib.c" <<'C'
#include <string.h>
#include <moe/abitest.h>
#ifndef N_T
#define N_T int32_t
#endif
moe_thing_config_t moe_thing_config_default(void)
{
    moe_thing_config_t c;
    memset(&c, 0, sizeof c);
    return c;
}
int moe_thing_run(const moe_thing_config_t *c, moe_color_t color, N_T n)
{
    return (int)c->struct_size + (int)color + (int)n;
}
int moe_thing_stats(moe_pipeline_stats_t *s) { memset(s, 0, s->struct_size); return 0; }
#ifndef DROP_OLD
int moe_thing_old(void) { return 1; }
#endif
#ifdef ADD_NEW
API int moe_thing_new(int x);
int moe_thing_new(int x) { return x; }
#endif
C

build() { # build NAME SONAME [cc flags...]: header $tmp/NAME.h -> $tmp/NAME/libabitest.so
  local name=$1 so=$2
  shift 2
  mkdir -p "$tmp/$name/include/moe"
  cp "$tmp/$name.h" "$tmp/$name/include/moe/abitest.h"
  "$cc" -g -O2 -shared -fPIC -fvisibility=hidden -I "$tmp/$name/include" "$@" \
    -Wl,-soname,$so -o "$tmp/$name/libabitest.so" "$tmp/lib.c"
}
variant() { # variant NAME SED-SCRIPT: a header from v1's
  sed -e "$2" "$tmp/v1.h" > "$tmp/$1.h"
}
fails=0
expect() { # expect pass|fail NAME [SONAME [cc flags...]]
  local want=$1 name=$2 so=${3:-libabitest.so.1}
  shift 3 2> /dev/null || shift $#
  build "$name" "$so" "$@" || { echo "FAILED to build $name"; fails=$((fails + 1)); return; }
  if bash "$here/check_abi.sh" "$tmp/$name/libabitest.so" "$tmp/$name/include/moe" \
    "$tmp/baseline.abi" > "$tmp/$name.log" 2>&1; then got=pass; else got=fail; fi
  if [ $got = "$want" ]; then
    echo "ok   $want: $name"
  else
    echo "FAIL $name: expected $want, got $got"; sed 's/^/     /' "$tmp/$name.log"
    fails=$((fails + 1))
  fi
}

build v1 libabitest.so.1 || exit 1
bash "$here/check_abi.sh" "$tmp/v1/libabitest.so" "$tmp/v1/include/moe" "$tmp/baseline.abi" \
  --update > /dev/null || exit 1

expect pass v1
cp "$tmp/v1.h" "$tmp/added_function.h"
echo 'API int moe_thing_new(int x);' >> "$tmp/added_function.h"
expect pass added_function libabitest.so.1 -DADD_NEW
variant added_enumerator 's/MOE_GREEN = 1 }/MOE_GREEN = 1, MOE_BLUE = 2 }/'
expect pass added_enumerator
variant grown_stats_at_end 's/int32_t stages; }/int32_t stages; int32_t buffers; }/'
expect pass grown_stats_at_end
variant removed_function '/moe_thing_old/d'
expect fail removed_function libabitest.so.1 -DDROP_OLD
variant changed_signature 's/moe_color_t color, int32_t n)/moe_color_t color, int64_t n)/'
expect fail changed_signature libabitest.so.1 -DN_T=int64_t
variant removed_field 's/ int32_t width;//'
expect fail removed_field
variant grown_config 's/float rate; }/float rate; int32_t extra; }/'
expect fail grown_config
variant inserted_in_stats 's/double seconds;/int32_t first; double seconds;/'
expect fail inserted_in_stats
variant renumbered_enumerator 's/MOE_GREEN = 1/MOE_GREEN = 2/'
expect fail renumbered_enumerator
# an incompatible change with a new SONAME fails until the baseline is re-recorded for it,
# then passes
expect fail removed_field libabitest.so.2
bash "$here/check_abi.sh" "$tmp/removed_field/libabitest.so" "$tmp/removed_field/include/moe" \
  "$tmp/baseline.abi" --update > /dev/null
expect pass removed_field libabitest.so.2
echo "$fails case(s) failed"
[ $fails -eq 0 ]
