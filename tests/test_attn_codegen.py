"""The single-request and paged attention split kernels must compile their dots identically for the GPU.

Batched output equals single-request output only if every row of the paged kernel gets the bits the
single-request kernel gives it. Same statements are not enough: Triton picks each dot's operand layout from
heuristics over the whole kernel (an 8-bit mask load once made the p @ V dot of one kernel take kWidth=4
operands, a different K order inside the MMA, and rows parted by an ulp on an H200). This cross-compiles the
kernels for sm_90 on the CPU (Triton ships ptxas) and compares every dot's operand and result types, with the
layout aliases resolved. No GPU needed; runs in a subprocess because other test modules switch Triton to the
interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMPILE = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specpilot.kernels import attn as sa
from specpilot.engines.batch import paged_attn as pa

P = "*bf16"
COMMON = {"H": 9, "G": 3, "D": 64, "DOT_PREC": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "SPLIT": 64}
SINGLE = {"q_ptr": P, "k_ptr": P, "v_ptr": P, "anc_ptr": "*u8", "base_ptr": "*i32", "ws_m_ptr": "*fp32",
          "ws_l_ptr": "*fp32", "ws_o_ptr": "*fp32", "bslot_ptr": "*i64", "T": "i32", "base_val": "i32", "S": "i32",
          "A": "i32", "qk_scale": "fp32"}
PAGED = {"q_ptr": P, "k_ptr": P, "v_ptr": P, "pt_ptr": "*i64", "tile_req_ptr": "*i64", "tile_row_ptr": "*i64",
         "qstart_ptr": "*i64", "qlen_ptr": "*i64", "kvlen_ptr": "*i64", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32",
         "ws_o_ptr": "*fp32", "NTOK": "i32", "S": "i32", "P": "i32", "qk_scale": "fp32"}


def dots(fn, sig, consts):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False})
    ir = k.asm["ttgir"]
    alias = dict(re.findall(r"^(#\w+) = (.*)$", ir, flags=re.M))
    out = []
    for line in ir.splitlines():
        if "tt.dot " in line or "ttng.warp_group_dot " in line:
            types = line.split(" : ", 1)[1].split(" loc(")[0]
            out.append(re.sub(r"#\w+", lambda m: alias.get(m.group(0), m.group(0)), types))
    return out


print(json.dumps({
    "single_chain": dots(sa._attn_split_kernel, SINGLE, {**COMMON, "BASE_IS_PTR": True, "HAS_SLOTS": False}),
    "single_slots": dots(sa._attn_split_kernel, SINGLE, {**COMMON, "BASE_IS_PTR": True, "HAS_SLOTS": True}),
    "paged": dots(pa._paged_split_kernel, PAGED, {**COMMON, "SPLITS_PER_PROGRAM": 4}),
}))
'''


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no CUDA code generation here
        return False
    return True


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton build has no NVIDIA backend")
def test_single_and_paged_split_kernels_compile_the_same_dots():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # three dots per key block: q @ K^T, p @ V, p @ ones (the row sums)
    assert len(got["paged"]) == 3, got["paged"]
    assert got["single_chain"] == got["paged"]
    assert got["single_slots"] == got["paged"]
