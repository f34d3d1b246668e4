"""sm_90 machine code of a compiled kernel, on any machine: Triton ships ptxas and cuobjdump. Used by the codegen
tests (tests/test_kernel_codegen.py) and the kernel experiments in scripts/ to read what a change compiles to."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def ptxas_sass(ptx: str, arch: str = "sm_90a") -> tuple[str, str]:
    """(ptxas -v log, SASS listing) of a PTX module, assembled by the ptxas Triton ships."""
    import triton

    nv = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        log = subprocess.run([f"{nv}/ptxas", f"-arch={arch}", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([f"{nv}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True,
                              check=True).stdout
    return log, sass


def sass_opcodes(sass: str) -> dict[str, int]:
    """Opcode -> how many times it appears in a SASS listing (predicates and modifiers dropped)."""
    ops: dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", sass):
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return ops
