#!/usr/bin/env python3
"""Run the shell commands that README.md, docs/trainer.md and docs/elastic.md show, as printed.

Every code block in those files that holds a command carries a marker on the line before it:

  <!-- docs-run -->                       run it
  <!-- docs-run expect="REGEX" -->        run it; its output must match REGEX (Python re)
  <!-- docs-skip: why -->                 not run here, for the reason given

A block is an indented (4 spaces) or fenced (```) code block. An unmarked block that starts
like a command (bash, python3, mpirun, build/..., cmake, ...) is an error, so a command added
to the docs without a marker fails this test.

The marked blocks run in order (README.md, then docs/trainer.md, then docs/elastic.md) in one
bash session with `set -e` (cd and export carry from block to block, as in a terminal), in a
fresh clone of the committed tree (`git clone` of --src: uncommitted changes are not seen),
with HOME set to an empty folder (a new user's home: `~/.local` installs land there).

Usage: run_doc_commands.py --src REPO --work DIR [--list]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

FILES = ["README.md", "docs/trainer.md", "docs/elastic.md"]
MARKER = re.compile(r'^<!-- docs-(run|skip)(?:\s+expect="(.*)")?(?::\s*(.*?))?\s*-->\s*$')
COMMANDISH = re.compile(r"^(bash|sh|python3?|mpirun|build/|cmake|ctest|cc|pkg-config|export|"
                        r"scripts/|node|\./|moe_|git|sudo|apt)")


def blocks(path):
    """(line number, marker match or None, command text) for each code block of the file."""
    lines = open(path).read().split("\n")
    out, i = [], 0
    while i < len(lines):
        prev = lines[i - 1] if i > 0 else ""
        marker = MARKER.match(prev.strip())
        if lines[i].startswith("```") and not lines[i].startswith("```c"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((i + 1, marker, "\n".join(lines[i + 1:j])))
            i = j + 1
            continue
        if lines[i].startswith("```"):  # a fenced C (or C++) program: not a shell command
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            i = j + 1
            continue
        starts_block = lines[i].startswith("    ") and lines[i].strip() and (
            prev.strip() == "" or marker)
        in_list = prev.lstrip().startswith(("- ", "* ", "| "))
        if starts_block and not in_list:
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            while j > i and not lines[j - 1].strip():
                j -= 1
            out.append((i + 1, marker, "\n".join(l[4:] for l in lines[i:j])))
            i = j
            continue
        i += 1
    return out


def collect(src):
    runs, errors = [], []
    for name in FILES:
        for line, marker, text in blocks(os.path.join(src, name)):
            where = f"{name}:{line}"
            if marker is None:
                if COMMANDISH.match(text.lstrip()):
                    errors.append(f"{where}: a command block without a docs-run or docs-skip "
                                  f"marker: {text.splitlines()[0]!r}")
                continue
            if marker.group(1) == "skip":
                if not marker.group(3):
                    errors.append(f"{where}: docs-skip needs a reason")
                print(f"skip {where}: {marker.group(3)}")
                continue
            runs.append((where, text, marker.group(2)))
    return runs, errors


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--list", action="store_true", help="print the blocks, run nothing")
    a = p.parse_args()
    runs, errors = collect(a.src)
    for e in errors:
        print("FAIL:", e)
    if errors:
        return 1
    if a.list:
        for where, text, expect in runs:
            print(f"run {where}" + (f" (expect {expect!r})" if expect else ""))
            print("    " + text.replace("\n", "\n    "))
        return 0

    shutil.rmtree(a.work, ignore_errors=True)
    clone, home, out = (os.path.join(a.work, d) for d in ("clone", "home", "out"))
    os.makedirs(home)
    os.makedirs(out)
    subprocess.run(["git", "clone", "--quiet", a.src, clone], check=True)
    driver = ["set -e", f"cd {clone}"]
    for i, (where, text, _) in enumerate(runs):
        block = os.path.join(out, f"{i}.sh")
        open(block, "w").write(text + "\n")
        driver += [f"echo {i} > {out}/current", f"echo '=== {where}' >&2",
                   f"source {block} > {out}/{i}.log 2>&1"]
    driver.append(f"echo done > {out}/current")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env["HOME"] = home
    r = subprocess.run(["bash", "-c", "\n".join(driver)], env=env)
    current = open(os.path.join(out, "current")).read().strip()
    failures = 0
    for i, (where, text, expect) in enumerate(runs):
        log_path = os.path.join(out, f"{i}.log")
        if not os.path.exists(log_path):
            break
        log = open(log_path, errors="replace").read()
        failed = current == str(i)
        bad_expect = not failed and expect and not re.search(expect, log)
        status = "FAIL" if failed or bad_expect else "ok"
        print(f"{status} {where}: {text.splitlines()[0]}")
        if failed or bad_expect:
            failures += 1
            why = f"exit status {r.returncode}" if failed else f"output does not match {expect!r}"
            print(f"  {why}; the output's tail:")
            print("    " + "\n    ".join(log.splitlines()[-30:]))
    if current != "done" and r.returncode == 0:
        failures += 1
    print(f"{len(runs)} command blocks, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
