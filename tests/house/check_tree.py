#!/usr/bin/env python3
"""Keeps the tree honest about itself (run by CTest as test_house_tree):

1. docs/architecture.md's module table names every folder of code under src/ and kernels/.
2. Every #include that crosses modules follows the table: module M includes module N only when
   N is in M's "uses" column (so the layering the doc describes is the one the code has).
3. No doc, comment or result cites a development session ("session 19", "the ninth session",
   "call 7", "run 12"): they describe the code as it is, and git history keeps the past.

Usage: check_tree.py SOURCE_DIR. Exits 1 listing every violation.
"""
import os
import re
import subprocess
import sys

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
problems = []

# ---- the module table ---------------------------------------------------------------------
arch_path = os.path.join(root, "docs", "architecture.md")
arch = open(arch_path, encoding="utf-8").read()
modules = {}  # name -> set of modules it may use
for line in arch.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or not line.lstrip().startswith("|"):
        continue
    m = re.fullmatch(r"`(?:src/)?([a-z_]+)/`", cells[0])
    if not m:
        continue
    uses = set(re.findall(r"[a-z_]+", cells[-1])) if cells[-1] not in ("—", "-") else set()
    modules[m.group(1)] = uses

code_ext = (".c", ".h", ".cu", ".cuh")
code_dirs = set()
for top in ("src", "kernels"):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        if any(f.endswith(code_ext) for f in files):
            code_dirs.add(os.path.relpath(dirpath, root))
for d in sorted(code_dirs):
    if f"`{d}/`" not in arch and f"`{d}`" not in arch:
        problems.append(f"docs/architecture.md does not name the folder `{d}/`")
for d in sorted(code_dirs):
    parts = d.split(os.sep)
    name = parts[0] if parts[0] == "kernels" else parts[1]
    if name not in modules:
        problems.append(f"docs/architecture.md's module table has no row for `{d}/`")


def module_of(path):
    rel = os.path.relpath(path, root).split(os.sep)
    if rel[0] == "kernels":
        return "kernels"
    if rel[0] == "src" and len(rel) > 2:
        return rel[1]
    return None


include_re = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
for d in sorted(code_dirs):
    for f in sorted(os.listdir(os.path.join(root, d))):
        if not f.endswith(code_ext):
            continue
        path = os.path.join(root, d, f)
        src_mod = module_of(path)
        text = open(path, encoding="utf-8", errors="replace").read()
        for inc in include_re.findall(text):
            cands = [os.path.join(root, d, inc), os.path.join(root, "src", inc),
                     os.path.join(root, "kernels", inc)]
            target = next((os.path.normpath(c) for c in cands if os.path.exists(c)), None)
            if target is None:
                continue
            dst_mod = module_of(target)
            if dst_mod is None or dst_mod == src_mod:
                continue
            if dst_mod not in modules.get(src_mod, set()):
                problems.append(f"{os.path.relpath(path, root)} includes {inc} ({dst_mod}/), "
                                f"which docs/architecture.md does not let {src_mod}/ use")

# ---- no development diary ----------------------------------------------------------------
ordinals = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
            "twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
            "nineteenth|twentieth|\\d+(?:st|nd|rd|th)")
# "run 7," / "(runs 1 and 7)" cite a run; "runs 4 ranks" or "runs 32/LANES tokens" do not
diary = re.compile(r"(?i:\bsessions?[ _-]?\d+|\b(?:" + ordinals + r")[ -]session\b|"
                   r"(?<![-\w])calls? \d+\b)|"
                   r"(?<![-\w])runs? \d+(?:\s*(?:-|–|and|,)\s*\d+)*(?=\s*[),.;:]|\s*$)|"
                   r"-run\d+\b")
# The pattern's own test, so the check cannot silently pass everything.
for sample, cites in [("see run 7, and", True), ("(runs 1 and 7)", True), ("session 19", True),
                      ("the ninth session", True), ("in call 7 the", True),
                      ("results/h200-run12/x", True), ("runs 4 ranks", False),
                      ("each warp runs 32/LANES tokens", False), ("--runs 5", False),
                      ("AWS session token", False), ("every call", False)]:
    if bool(diary.search(sample)) != cites:
        problems.append(f"check_tree.py's diary pattern misjudges {sample!r}")
text_ext = (".c", ".h", ".cu", ".cuh", ".md", ".py", ".sh", ".cmake", ".txt", ".in", ".map",
            ".json", ".jsonl", ".csv")
this_file = os.path.relpath(os.path.abspath(__file__), root)
try:
    tracked = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True,
                             check=True).stdout.split("\n")
except (OSError, subprocess.CalledProcessError):  # a source tree without git
    tracked = [os.path.relpath(os.path.join(dp, f), root)
               for dp, dns, fs in os.walk(root)
               for f in fs if not any(p.startswith(("build", ".git", "node_modules"))
                                      for p in os.path.relpath(dp, root).split(os.sep))]
for rel in sorted(t for t in tracked if t):
    if rel == this_file or "node_modules" in rel or rel.endswith("package-lock.json"):
        continue
    if not (rel.endswith(text_ext) or os.path.basename(rel) == "CMakeLists.txt"):
        continue
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        continue
    for n, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
        m = diary.search(line)
        if m:
            problems.append(f"{rel}:{n}: cites development history ({m.group(0)!r}): "
                            "describe the code as it is")

for p in problems:
    print(p)
print(f"check_tree: {len(problems)} problem(s) in {len(code_dirs)} code folders, "
      f"{len(modules)} modules in the table")
sys.exit(1 if problems else 0)
