#!/usr/bin/env bash
# Compare a library's public ABI with the committed baseline (libabigail's abidw / abidiff).
#
# The ABI is what the public headers declare and the library exports: functions, and the
# structs, enums and typedefs they reach (abidw --headers-dir, so internal symbols and types
# never count and the CUDA and host-only builds have the same ABI). It needs the library's
# DWARF (CMakeLists.txt builds the C objects with -g).
#   pass: identical, or only additions (new functions, new enumerators, members appended to
#         the structs growable.suppr lists);
#   fail: anything else, unless the SONAME changed, which says the release is incompatible:
#         then the baseline must be re-recorded in the same change (it must carry the new
#         SONAME) and the check compares against it.
# Usage: check_abi.sh LIBRARY HEADERS_DIR BASELINE [--update]
#   --update writes LIBRARY's ABI to BASELINE (a new SONAME, or recording the first one).
set -euo pipefail
lib=$1 headers=$2 baseline=$3 mode=${4:-check}
here=$(cd "$(dirname "$0")" && pwd)
for tool in abidw abidiff; do
  command -v $tool > /dev/null ||
    { echo "$tool not found (Debian package abigail-tools)"; exit 77; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# paths inside the dump are made relative to the source tree (one level above HEADERS_DIR's
# include/), so the baseline does not depend on where the tree was built
src=$(cd "$headers/../.." && pwd)
abidw --headers-dir "$headers" --exported-interfaces-only --drop-private-types --no-show-locs \
  --no-corpus-path --no-comp-dir-path --no-elf-needed --out-file "$tmp/current.abi" "$lib"
sed -i "s|path='$src/|path='|g" "$tmp/current.abi"
grep -q "<function-decl" "$tmp/current.abi" ||
  { echo "$lib has no DWARF for its public functions: build its C objects with -g"; exit 1; }
soname() { sed -n "s/.*<abi-corpus [^>]*soname='\([^']*\)'.*/\1/p" "$1" | head -n1; }

if [ "$mode" = --update ]; then
  cp "$tmp/current.abi" "$baseline"
  symbols=$(grep -c '<elf-symbol ' "$baseline")
  echo "recorded the ABI of $(soname "$baseline") ($symbols symbols) in $baseline"
  exit 0
fi
[ -f "$baseline" ] ||
  { echo "no baseline $baseline: record one with $0 $lib $headers $baseline --update"; exit 1; }
now=$(soname "$tmp/current.abi") then=$(soname "$baseline")
if [ "$now" != "$then" ]; then
  echo "the SONAME is $now, the baseline records $then: a new SONAME re-records the baseline in the"
  echo "same change: $0 $lib $headers $baseline --update"
  exit 1
fi

set +e
abidiff --suppressions "$here/growable.suppr" --no-show-locs "$baseline" "$tmp/current.abi" \
  > "$tmp/report"
rc=$?
set -e
if [ $rc -eq 0 ]; then
  echo "ABI of $now: identical to the baseline"
  exit 0
fi
cat "$tmp/report"
if (( rc & 3 )); then
  echo "abidiff failed (exit status $rc)"
  exit 1
fi
# ABIDIFF_ABI_CHANGE (4) alone: compatible only when nothing was removed or changed
changed=$(grep -E "^ *(Functions|Variables) changes summary" "$tmp/report" |
  sed -E 's/.*summary: ([0-9]+) Removed, ([0-9]+) Changed.*/\1 \2/' |
  awk '{s += $1 + $2} END {print s + 0}')
if (( rc & 8 )) || [ "$changed" -ne 0 ]; then
  echo "incompatible ABI change against the baseline of $now: keep the old interface (add a new"
  echo "function or struct instead; docs/api-stability.md), or bump the SONAME (MOE_VERSION_MINOR"
  echo "while the major is 0) and re-record: $0 $lib $headers $baseline --update"
  exit 1
fi
echo "ABI of $now: compatible additions to the baseline"
