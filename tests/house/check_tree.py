#!/usr/bin/env python3
"""Keeps the tree honest about itself (run by CTest as test_house_tree):

1. docs/architecture.md's module table names every folder of code under src/ and kernels/, and
   the consumers tools/elastic/ and bench/; CMakeLists.txt's module loop names exactly the
   src/ folders with a sources.cmake.
2. The table's "uses" column is the real dependency graph: module M (a folder of src/, kernels/,
   tools/elastic/ or bench/) uses N when a file of M includes one of N's headers (quoted, or a
   public <moe/...> header N implements) or calls a function N's headers declare. Every such
   use must be in M's row, every listed use must be real, and the graph must have no circle;
   nor may a module's files use each other in a circle (a .c with its header is one file).
3. Only the CUDA backend and the NCCL communicator see CUDA, only comm/ sees MPI and NCCL
   (through any chain of the tree's includes).
4. Includes are relative to the include roots (src/, kernels/), never "../".
5. tests/ mirrors src/: every src/ module has its tests in tests/<module>/, and every folder
   of tests/ is a module's or tests a named part of the tree outside src/.
6. No doc, comment or result cites a development session ("session 19", "the ninth session",
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
    m = re.fullmatch(r"`(?:src/)?([a-z_]+(?:/[a-z_]+)?)/`", cells[0])
    if not m or m.group(1) == "include/moe":
        continue
    uses = set(re.findall(r"[a-z_]+", cells[-1])) if cells[-1] not in ("—", "-") else set()
    modules[m.group(1)] = uses

code_ext = (".c", ".h", ".cu", ".cuh", ".cpp")
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
# The library's module list in CMakeLists.txt (ordered: it is also the link order of their
# libraries) names exactly the src/ folders that list sources, and each has a table row.
cmake_text = open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read()
listed = re.search(r"foreach\(_module ([a-z_ ]+)\)\s*\n\s*"
                   r"include\(src/\$\{_module\}/sources.cmake", cmake_text)
with_sources = {d for d in os.listdir(os.path.join(root, "src"))
                if os.path.isfile(os.path.join(root, "src", d, "sources.cmake"))}
if not listed:
    problems.append("CMakeLists.txt's module loop (foreach(_module ...)) was not found")
else:
    in_cmake = listed.group(1).split()
    for d in sorted(with_sources - set(in_cmake)):
        problems.append(f"src/{d}/sources.cmake is not in CMakeLists.txt's module loop")
    for d in sorted(set(in_cmake) - with_sources):
        problems.append(f"CMakeLists.txt's module loop names {d}, which has no "
                        f"src/{d}/sources.cmake")
    for d in in_cmake:
        if d not in modules:
            problems.append(f"CMakeLists.txt builds the module {d}, which docs/architecture.md's "
                            "table lacks")
for consumer in ("tools/elastic", "bench"):
    if consumer not in modules:
        problems.append(f"docs/architecture.md's module table has no row for `{consumer}/`")

# ---- the real dependencies: includes (quoted and <moe/...>) and calls ----------------------
# A public header belongs to the module that implements it (<moe/moe.h> is only the umbrella).
public_owner = {"core.h": "core", "layer.h": "layer", "optim.h": "optim", "mesh.h": "mesh",
                "pipeline.h": "pipeline", "ckpt.h": "ckpt", "train_state.h": "ckpt",
                "elastic.h": "elastic"}


def module_of(rel):
    parts = rel.split("/")
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[:2] == ["include", "moe"]:
        return public_owner.get(parts[2])
    if parts[0] == "tools" and len(parts) > 2:
        return "tools/" + parts[1]
    if parts[0] == "bench":
        return "bench"
    return None  # tests/support (the benchmarks' helpers), the umbrella header


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', text)


sources = {}
for top in ("src", "kernels", "include", "tools", "bench", os.path.join("tests", "support")):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in files:
            if f.endswith(code_ext):
                rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                sources[rel] = open(os.path.join(root, rel), encoding="utf-8",
                                    errors="replace").read()

include_re = re.compile(r'^\s*#\s*include\s+(?:"([^"]+)"|<(moe/[^>]+)>)', re.M)
search_roots = ("src", "kernels", "bench", "tests/support", "tools/elastic")
# Functions a module's headers declare (or define inline), by name.
decl_re = re.compile(r"^(?!typedef|return|else|#)[A-Za-z_][\w \t\*]*?[\s\*]([a-z_][a-z0-9_]*)\s*\(",
                     re.M)
owner_of_fn = {}
for rel, text in sources.items():
    mod = module_of(rel)
    if mod is None or not rel.endswith((".h", ".cuh")):
        continue
    for name in decl_re.findall(strip_comments(text)):
        if not name.endswith("_t"):
            owner_of_fn.setdefault(name, mod)
call_re = re.compile(r"\b([a-z_][a-z0-9_]*)\s*\(")



def resolve(rel, quoted, public):
    """The file of the tree an include of `rel` names, or None (a system header)."""
    cands = ["include/" + public] if public else \
        [os.path.normpath(os.path.join(os.path.dirname(rel), quoted))] + \
        [r + "/" + quoted for r in search_roots]
    return next((c for c in cands if c in sources), None)


real = {}  # (user, used) -> an example: "file includes x" / "file calls f"
for rel, text in sorted(sources.items()):
    mod = module_of(rel)
    if mod is None:
        continue
    for quoted, public in include_re.findall(text):
        target = resolve(rel, quoted, public)
        used = module_of(target) if target else None
        if used and used != mod:
            real.setdefault((mod, used), f"{rel} includes {quoted or '<' + public + '>'}")
    for name in call_re.findall(strip_comments(text)):
        used = owner_of_fn.get(name)
        if used and used != mod:
            real.setdefault((mod, used), f"{rel} calls {name}()")

# Includes name a header from an include root (include/, src/, kernels/, or the including
# file's own folder), never by climbing out of it with "../".
included_from = dict(sources)
for top in ("tests", "examples"):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        if "node_modules" in dirpath:
            continue
        for f in files:
            if f.endswith(code_ext):
                rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                included_from.setdefault(rel, open(os.path.join(root, rel), encoding="utf-8",
                                                   errors="replace").read())
for rel, text in sorted(included_from.items()):
    for quoted, _ in include_re.findall(text):
        if quoted.startswith("../"):
            problems.append(f'{rel} includes "{quoted}": name it from an include root '
                            f'(src/ or kernels/), not relative to the file')

for (mod, used), example in sorted(real.items()):
    if mod in modules and used not in modules[mod]:
        problems.append(f"{mod}/ uses {used}/ ({example}), which docs/architecture.md's "
                        f"table does not list")
for mod, uses in sorted(modules.items()):
    for used in sorted(uses):
        if (mod, used) not in real:
            problems.append(f"docs/architecture.md says {mod}/ uses {used}/, but no file of "
                            f"{mod}/ includes or calls it")


# No arrow running back up: the table's "uses" graph has no cycle.
def find_cycle(graph):
    state = {}
    for start in sorted(graph):
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif nxt in graph and state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt in graph and nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


cycle = find_cycle(modules)
if cycle:
    problems.append("docs/architecture.md's modules use each other in a circle: " +
                    " -> ".join(cycle))

# ---- who sees CUDA, NCCL and MPI ----------------------------------------------------------
# DESIGN.md: only the CUDA backend (and the NCCL communicator) sees CUDA types, only comm/
# calls MPI or NCCL. A file sees a library when it includes the library's header, itself or
# through the tree's headers it includes.
system_re = re.compile(r'^\s*#\s*include\s+<([^>]+)>', re.M)
libraries = {  # library -> (its headers, the src/ files and folders that may see it)
    "CUDA": (re.compile(r"cuda[\w.]*\.h|cublas\w*\.h|nccl\.h"),
             ("src/backend/cuda/", "src/comm/nccl.c")),
    "NCCL": (re.compile(r"nccl\.h"), ("src/comm/nccl.c",)),
    "MPI": (re.compile(r"mpi\.h"), ("src/comm/",)),
}
_seen = {}


def seen_headers(rel, stack=()):
    """The system headers `rel` includes, itself or through the tree's headers."""
    if rel not in _seen:
        found = set(system_re.findall(strip_comments(sources[rel])))
        for quoted, public in include_re.findall(sources[rel]):
            target = resolve(rel, quoted, public)
            if target and target not in stack:
                found |= seen_headers(target, stack + (rel,))
        _seen[rel] = found
    return _seen[rel]


def library_problems(rel, headers):
    found = []
    for lib, (pattern, allowed) in libraries.items():
        hit = sorted(h for h in headers if pattern.fullmatch(h))
        if hit and not rel.startswith(allowed):
            found.append(f"{rel} sees {lib} (<{hit[0]}>), which only "
                         f"{', '.join(allowed)} may (DESIGN.md section 2)")
    return found


# The check's own test, so it cannot silently pass everything.
if (len(library_problems("src/layer/x.c", {"cuda_runtime.h", "mpi.h", "stdio.h"})) != 2 or
        library_problems("src/comm/nccl.c", {"cuda_runtime.h", "nccl.h", "mpi.h"})):
    problems.append("check_tree.py's library check misjudges its sample")
for rel in sorted(r for r in sources if r.startswith("src/")):
    problems += library_problems(rel, seen_headers(rel))

# ---- no circle among a module's files ------------------------------------------------------
# Inside a module, the files read top-down too: no two files (a .c with its same-named header
# counts as one) include or call each other round a loop. File A uses file B when A includes
# B's header or calls a function that B alone defines (not static).
def_re = re.compile(r"^(?!static\b|typedef\b|return\b|else\b|extern\s+\"\"\s*\{)"
                    r"(?:[A-Za-z_][\w\"]*[ \t\*]+)+\**([a-z_][a-z0-9_]*)\s*\([^;{}]*?\)\s*\{", re.M)


# a prototype at file scope declares, it calls nothing
proto_re = re.compile(r"^(?![\s#]|typedef\b|return\b)[^;{}()]*\b[a-z_][a-z0-9_]*\s*\([^;{}]*\)"
                      r"[^;{}()]*(?:\(\([^;{}]*\)\))?\s*;", re.M)


def unit_of(rel):
    return os.path.splitext(rel)[0]


def file_graph(texts, module_of_file, resolve_include):
    """texts: file -> its text. Returns {unit: {used unit: "how"}} within each module."""
    definers = {}
    for rel, text in texts.items():
        for name in def_re.findall(strip_comments(text)):
            definers.setdefault(name, set()).add(unit_of(rel))
    graph = {}
    for rel, text in sorted(texts.items()):
        unit, mod = unit_of(rel), module_of_file(rel)
        if mod is None:
            continue
        edges = graph.setdefault(unit, {})
        for quoted, public in include_re.findall(text):
            target = resolve_include(rel, quoted, public)
            if target and unit_of(target) != unit and module_of_file(target) == mod:
                edges.setdefault(unit_of(target), f"includes {quoted}")
        for name in call_re.findall(proto_re.sub("", strip_comments(text))):
            owners = definers.get(name, ())
            if len(owners) == 1:
                (owner,) = owners
                if owner != unit and module_of_file(owner + ".c") == mod:
                    edges.setdefault(owner, f"calls {name}()")
    return graph


def file_cycle_problems(graph):
    """One problem per circle, each circle's files left out of the search for the next."""
    found, g = [], {u: set(e) for u, e in graph.items()}
    while True:
        cyc = find_cycle(g)
        if not cyc:
            return found
        ties = ", ".join(f"{a} {graph[a][b]}" for a, b in zip(cyc, cyc[1:]))
        found.append(f"files use each other in a circle: {' -> '.join(cyc)} ({ties}): move "
                     "what they share into a file below both")
        for u in cyc:
            g.pop(u, None)


# The check's own test, so it cannot silently pass everything.
# a -> b -> c -> a is the one circle: e.h only declares f_f (a prototype calls nothing), and
# d.c's call crosses into another module.
_files = {"src/m/a.c": '#include "b.h"\nint a_f(void)\n{\n    return b_f();\n}\n',
          "src/m/b.h": "int b_f(void);\n",
          "src/m/e.h": "int f_f(void)\n    __attribute__((pure));\n",
          "src/m/f.c": '#include "e.h"\nint f_f(void)\n{\n    return 0;\n}\n',
          "src/m/b.c": "int b_f(void)\n{\n    return c_f();\n}\n",
          "src/m/c.c": "static int c_g(void) { return 0; }\nint c_f(void)\n{\n    return a_f();\n}\n",
          "src/n/d.c": "int d_f(void)\n{\n    return a_f();\n}\n"}
_found = file_cycle_problems(file_graph(
    _files, lambda r: r.split("/")[1],
    lambda rel, q, p: os.path.join(os.path.dirname(rel), q) if not p else None))
if len(_found) != 1 or "src/m/a -> src/m/b -> src/m/c -> src/m/a" not in _found[0]:
    problems.append(f"check_tree.py's file circle check misjudges its sample: {_found}")
# Circles left standing, each with what would open it; a listed circle that is gone fails too,
# so the list only shrinks.
known_circles = set()  # pairs of units, e.g. ("src/m/a", "src/m/b"), each with a comment
circles = file_cycle_problems(file_graph(
    {r: t for r, t in sources.items() if not r.startswith("include/")}, module_of, resolve))
for known in sorted(known_circles):
    listed = [c for c in circles if " -> ".join(known + known[:1]) in c]
    if not listed:
        problems.append(f"check_tree.py's known_circles lists {' <-> '.join(known)}, which is "
                        "no longer a circle: take it off the list")
    circles = [c for c in circles if c not in listed]
problems += circles

# ---- tests/ mirrors src/ -----------------------------------------------------------------
# A module's tests sit in tests/<module>/: every folder of src/ that lists sources has its test
# folder, and every folder of tests/ is a module's, or tests a part of the tree outside src/
# named here (the kernels run under the CUDA backend's tests, the launcher under elastic's).
tests_outside_src = {
    "abi": "include/moe",          # the public ABI against its baseline
    "docs": "docs",                # the README's and docs' commands, run as printed
    "house": "docs/architecture.md",  # the tree's own rules
    "install": "cmake",            # the installed package, used by consumers
    "python": "python/libmoe",     # the Python package
    "support": "tests/support/test_support.h",  # helpers every test links, no tests
    "trainer": "examples/trainer",  # the bundled trainer
}
tested_with = {"kernels": "backend", "tools/elastic": "elastic"}


def mirror_problems(src_modules, test_dirs, area_loop):
    """src_modules: the src/ folders with sources; test_dirs: tests/ folder -> its file names;
    area_loop: the folders tests/CMakeLists.txt includes, in order."""
    found = []
    for m in sorted(src_modules):
        files = test_dirs.get(m)
        if files is None:
            found.append(f"src/{m}/ has no test folder tests/{m}/")
        elif not any(f.startswith("test_") for f in files):
            found.append(f"tests/{m}/ holds no test_* file")
    for d in sorted(test_dirs):
        if d not in src_modules and d not in tests_outside_src:
            found.append(f"tests/{d}/ belongs to no module: src/{d}/ does not exist (move its "
                         "tests to their module's folder, or name what it tests in "
                         "check_tree.py's tests_outside_src)")
        if "tests.cmake" in test_dirs[d] and d not in area_loop:
            found.append(f"tests/{d}/tests.cmake is not in tests/CMakeLists.txt's area loop")
    for d in area_loop:
        if "tests.cmake" not in test_dirs.get(d, ()):
            found.append(f"tests/CMakeLists.txt's area loop names {d}, which has no "
                         f"tests/{d}/tests.cmake")
    return found


# The check's own test, so it cannot silently pass everything.
_sample = mirror_problems({"core", "mesh"}, {"core": ["tests.cmake", "test_a.c"],
                                            "moe": ["tests.cmake", "test_b.c"],
                                            "backend": ["tests.cmake", "helper.c"]},
                          ["core", "moe", "gone"])
if len(_sample) != 5:
    problems.append(f"check_tree.py's mirror check misjudges its sample: {_sample}")
for part, folder in tested_with.items():
    if part not in modules or folder not in with_sources:
        problems.append(f"check_tree.py's tested_with maps {part} to tests/{folder}/: not a module "
                        "of the table and src/")
for outside in tests_outside_src.values():
    if not os.path.exists(os.path.join(root, outside)):
        problems.append(f"check_tree.py's tests_outside_src names {outside}, which does not exist")
tests_text = open(os.path.join(root, "tests", "CMakeLists.txt"), encoding="utf-8").read()
area_loop = re.search(r"foreach\(_area ([a-z_\s]+)\)", tests_text)
if not area_loop:
    problems.append("tests/CMakeLists.txt's area loop (foreach(_area ...)) was not found")
test_dirs = {d: os.listdir(os.path.join(root, "tests", d))
             for d in os.listdir(os.path.join(root, "tests"))
             if os.path.isdir(os.path.join(root, "tests", d)) and d != "__pycache__"}
problems += mirror_problems(with_sources, test_dirs,
                            area_loop.group(1).split() if area_loop else [])

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
