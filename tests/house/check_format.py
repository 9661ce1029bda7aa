#!/usr/bin/env python3
"""Every tracked C and CUDA file is formatted as .clang-format says: clang-format --dry-run
--Werror over the files git tracks, with the files that differ named. Exits 77 (skip) when
clang-format is missing or is not version 14, the version the tree's layout was written for
(other versions lay the same options out differently)."""
import re
import shutil
import subprocess
import sys

root = sys.argv[1]
exe = shutil.which("clang-format")
if not exe:
    print("skipped: no clang-format")
    sys.exit(77)
version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
m = re.search(r"version (\d+)", version)
if not m or m.group(1) != "14":
    print(f"skipped: clang-format {m.group(1) if m else '?'} (the layout is clang-format 14's)")
    sys.exit(77)
files = subprocess.run(["git", "-C", root, "ls-files", "*.c", "*.h", "*.cu", "*.cuh"],
                       capture_output=True, text=True, check=True).stdout.split()
bad = [f for f in files
       if subprocess.run([exe, "--dry-run", "--Werror", f], cwd=root,
                         capture_output=True).returncode != 0]
for f in bad:
    print(f"not formatted: {f} (clang-format -i {f})")
print(f"{len(files) - len(bad)} of {len(files)} files formatted")
sys.exit(1 if bad else 0)
