"""The ctypes mirrors in python/libmoe/_structs.py have the C layout: a C program built here
from include/moe prints sizeof and offsetof of every mirrored struct and field, which must equal
ctypes' sizeof and offsets (a header change without its mirror fails here).

Needs a C compiler: $CC, else cc (the build's compiler is passed by CTest).
"""
import ctypes as C
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from libmoe import _structs as S

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def c_program():
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <moe/moe.h>",
             "int main(void) {", '  printf("{");']
    first = True
    for cname, mirror in S.C_NAMES.items():
        sep = "" if first else ","
        first = False
        lines.append(f'  printf("{sep}\\"{cname}\\": [%zu", sizeof({cname}));')
        for field, _ in mirror._fields_:
            lines.append(f'  printf(", %zu", offsetof({cname}, {field}));')
        lines.append('  printf("]");')
    lines += ['  printf("}\\n");', "  return 0;", "}"]
    return "\n".join(lines)


class LayoutTest(unittest.TestCase):
    def test_mirrors_match_the_headers(self):
        cc = os.environ.get("CC") or shutil.which("cc")
        if not cc:
            self.skipTest("no C compiler")
        with tempfile.TemporaryDirectory() as tmp:
            src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
            with open(src, "w") as f:
                f.write(c_program())
            subprocess.run([cc, "-std=c11", "-I", os.path.join(ROOT, "include"), src, "-o", exe],
                           check=True)
            layout = json.loads(subprocess.run([exe], check=True, capture_output=True,
                                               text=True).stdout)
        for cname, mirror in S.C_NAMES.items():
            size, *offsets = layout[cname]
            self.assertEqual(C.sizeof(mirror), size, f"sizeof({cname})")
            for (field, _), off in zip(mirror._fields_, offsets):
                self.assertEqual(getattr(mirror, field).offset, off, f"{cname}.{field}")


if __name__ == "__main__":
    sys.exit(unittest.main())
