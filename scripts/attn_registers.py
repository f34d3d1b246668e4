"""Registers and global loads of the attention split kernel, chain (no block_slots) vs position-ordered (block_slots),
cross-compiled for sm_90 on the CPU (no GPU needed; Triton ships ptxas).

python3 scripts/attn_registers.py
Uses tests/test_kernel_codegen.py's compile helper and SmolLM2's launch (H 9, G 3, D 64, BLOCK_M 16, BLOCK_N 64,
SPLIT 64, PDL on) at num_stages 2 (the default) and 1 (T-neutral: the same dots), so the numbers are those of the
code the codegen test checks (notes/h200.md, session 36).
"""
import collections
import re
from pathlib import Path

# the codegen test's compile helpers (build, SINGLE, COMMON, ptxas_sass, sa), without its printing part
_src = (Path(__file__).resolve().parents[1] / "tests" / "test_kernel_codegen.py").read_text()
_ns: dict = {}
exec(_src.split("COMPILE = r'''", 1)[1].split("'''", 1)[0].split("print(json.dumps(")[0], _ns)
build, sa, SINGLE, COMMON, ptxas_sass = (_ns[n] for n in ("build", "sa", "SINGLE", "COMMON", "ptxas_sass"))

print("| block_slots | num_stages | registers | SASS lines | global loads |\n|---|---|---|---|---|")
for slots, stages in ((False, 2), (False, 1), (True, 2), (True, 1)):
    k = build(sa._attn_split_kernel, SINGLE, {**COMMON, "BASE_IS_PTR": True, "HAS_SLOTS": slots, "TILES": 1,
                                              "PDL": 1}, 4, True, num_stages=stages)
    log, sass = ptxas_sass(k.asm["ptx"])
    loads = collections.Counter(re.findall(r"\b(LDG\S*|LDGSTS\S*)", sass))
    regs = re.findall(r"Used (\d+) registers", log)[0]
    print(f"| {slots} | {stages} | {regs} | {len(sass.splitlines())} | {dict(sorted(loads.items()))} |")
