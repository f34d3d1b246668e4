"""Kernels that must give the same bits must compile their dots identically for the GPU.

The single-request and paged attention split kernels (batched output == single-request output), and the W12
GEMMs against the bf16 ones (12-bit weights == bf16 weights). Same statements are not enough: Triton picks each
dot's operand layout from heuristics over the whole kernel. An 8-bit load feeding a dot operand (the ancestor
mask, the W12 bytes) made it take kWidth=4 operands, another K order inside the MMA, and on an H200 rows parted
by an ulp (attention) and the W12 GEMM from the bf16 one at T=16. This cross-compiles the kernels for sm_90 on
the CPU (Triton ships ptxas) and compares every dot's operand and result types, layout aliases resolved. No GPU
needed; runs in a subprocess because the test session runs Triton under the interpreter (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import re
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
from specpilot.engines.batch import ngram_drafting as bn
from specpilot.kernels import gemm, norm_gemm
from specpilot.engines import device_drafters as dd
from specpilot.engines import loop_kernels as lk
from specpilot.engines import tree_grow as tg
from specpilot.engines import tree_move as tm
from specpilot.engines.drafters import block_fused as bf
from specpilot.kernels import embed
from specpilot.kernels import topk
from specpilot.kernels.sass import ptxas_sass, sass_opcodes

P = "*bf16"
COMMON = {"H": 9, "G": 3, "D": 64, "DOT_PREC": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "SPLIT": 64}
SINGLE = {"q_ptr": P, "k_ptr": P, "v_ptr": P, "anc_ptr": "*u8", "base_ptr": "*i32", "ws_m_ptr": "*fp32",
          "ws_l_ptr": "*fp32", "ws_o_ptr": "*fp32", "bslot_ptr": "*i64", "T": "i32", "base_val": "i32", "S": "i32",
          "A": "i32", "P_CTX": "i32", "P_BLK": "i32", "N_BLK": "i32", "qk_scale": "fp32", "window": "i32"}
PAGED = {"q_ptr": P, "k_ptr": P, "v_ptr": P, "pt_ptr": "*i64", "tile_req_ptr": "*i64", "tile_row_ptr": "*i64",
         "qstart_ptr": "*i64", "qlen_ptr": "*i64", "kvlen_ptr": "*i64", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32",
         "ws_o_ptr": "*fp32", "NTOK": "i32", "S": "i32", "P": "i32", "qk_scale": "fp32"}


def build(fn, sig, consts, num_warps=4, pdl=False, maxnreg=None, num_stages=2):
    # a direct compile takes no parameter defaults: PDL (kernels/pdl.py) and split-K off unless given
    defaults = (("PDL", 0), ("PF_LINES", 16), ("SPLIT_K", 1), ("STAT_UNROLL", 8), ("ACT_PREFETCH", 2),
                ("EARLY_RES", 1), ("W_PRELOAD", 0), ("K_LOOP", 1), ("NORM", True), ("ROW_SUMSQ", 0), ("STAT_SEGS", 0),
                ("SCALED", 0), ("WINDOWED", False), ("TOPK", 0), ("QK_NORM", False), ("CONSECUTIVE", False))
    consts = {**{k: v for k, v in defaults if k in fn.arg_names}, **consts}
    # what a launch specialises on: 16-byte aligned pointers and int arguments divisible by 16 (but those it is told
    # not to); without them loads are not vectorised and no K loop is pipelined, which is not the code that runs
    keep = set(getattr(fn, "do_not_specialize", ())) | {fn.arg_names[i] for i in getattr(fn, "do_not_specialize", ())
                                                        if isinstance(i, int)}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or (t == "i32" and a not in keep)}
    sig = {**sig, **{k: "constexpr" for k in consts}}
    # a parameter left out compiles as None, silently (a missing NORM once dropped the norm statistic)
    missing = [a for a in fn.arg_names if a not in sig]
    assert not missing, (fn.__name__, missing)
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": False,
                                   "launch_pdl": pdl, **({} if maxnreg is None else {"maxnreg": maxnreg})})


def dots(fn, sig, consts, num_warps=4, pdl=False, num_stages=2):
    ir = build(fn, sig, consts, num_warps, pdl, num_stages=num_stages).asm["ttgir"]
    alias = dict(re.findall(r"^(#\w+) = (.*)$", ir, flags=re.M))
    out = []
    for line in ir.splitlines():
        if "tt.dot " in line or "ttng.warp_group_dot " in line:
            types = line.split(" : ", 1)[1].split(" loc(")[0]
            out.append(re.sub(r"#\w+", lambda m: alias.get(m.group(0), m.group(0)), types))
    return out


W12 = {"words_ptr": "*i32", "codes_ptr": "*i32", "base_ptr": "*i32", "fcell_ptr": "*i32", "fat_ptr": "*i32",
       "Kp": "i32"}  # a W12 W's oct arrays (kernels/w12_tile.py); a bf16 W passes w_ptr in each
TILE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
SPLIT = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}  # split-K partials and arrival counters (gemm.split_k_combine)
LINEAR = {"x_ptr": P, "w_ptr": P, **W12, "b_ptr": P, "r_ptr": P, "y_ptr": P, **SPLIT, "ss_ptr": "*fp32", "sw_ptr": P,
          "g_ptr": P, "T": "i32",
          "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_x": "i32"}
NORM = {"x_ptr": P, "r_ptr": P, "nw_ptr": P, "w_ptr": P, **W12, "b_ptr": P, "y_ptr": P, "h_ptr": P,
        "pmax_ptr": "*fp32", "pidx_ptr": "*i32", "tk_ptr": "*i64", "ts_ptr": "*fp32", **SPLIT, "ss_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64",
        "cos_ptr": "*fp32",
        "sin_ptr": "*fp32", "kc_ptr": P, "vc_ptr": P, "S": "i32", "max_pos": "i32", "T": "i32", "N": "i32", "K": "i32",
        "K_SPLIT": "i32", "eps": "fp32"}
FLAGS = {"HAS_BIAS": False, "HAS_RES": True}
PDL_KERNELS = [("linear", gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False,
                                                         **TILE}, 4),
               ("norm_linear_epi1", norm_gemm._rmsnorm_linear_kernel, NORM,
                {**FLAGS, "HAS_RES": False, "DOT_PREC": "tf32", "W12": False, "STORE_Y": True, "ARGMAX": False,
                 "EPI": 1, "H": 9, "KVH": 3, "HALF": 32, **TILE}, 8)]
PDL_OPS = ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "prefetch.global.L2")


def trigger_after_mma(ptx):
    lines = ptx.splitlines()
    trigger = [i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l]
    mma = [i for i, l in enumerate(lines) if "mma.sync" in l]
    assert len(trigger) == 1 and mma, (len(trigger), len(mma))
    return {"before_first": trigger[0] < mma[0], "after_last": trigger[0] > mma[-1]}


def loads_and_waits(fn, sig, consts, num_warps):
    """Compiled for sm_90 at all (it loads), and a kernel with a PDL parameter under PDL (the device loop's glue
    and the drafter's small launches overlap their neighbours as the fused kernels do): it waits."""
    pdl = "PDL" in fn.arg_names
    ptx = build(fn, sig, {"PDL": 1, **consts} if pdl else consts, num_warps, pdl=pdl).asm["ptx"]
    return "ld.global" in ptx and (not pdl or consts.get("PDL") == 0 or "griddepcontrol.wait" in ptx)


def assembled(fn, sig, consts, num_warps):
    """(ptxas -v log, SASS) of the kernel, assembled for sm_90a by the ptxas Triton ships."""
    return ptxas_sass(build(fn, sig, consts, num_warps).asm["ptx"])


def spill_bytes(fn, sig, consts, num_warps):
    """Bytes a thread spills."""
    log, _ = assembled(fn, sig, consts, num_warps)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


NORM_EPI0 = {**FLAGS, "HAS_RES": False, "DOT_PREC": "tf32", "W12": False, "STORE_Y": True, "ARGMAX": False, "EPI": 0,
             "H": 9, "KVH": 3, "HALF": 32, **TILE}

W12_SASS = assembled(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": True,
                                                   **TILE}, 4)[1]
print(json.dumps({
    **{f"single_chain{'' if tiles == 1 else f'_tiles{tiles}'}": dots(
        sa._attn_split_kernel, SINGLE, {**COMMON, "BASE_IS_PTR": True, "HAS_SLOTS": False, "TILES": tiles})
       for tiles in (1, 4)},
    **{f"single_slots{'' if stages == 2 else f'_stages{stages}'}": dots(
        sa._attn_split_kernel, SINGLE, {**COMMON, "BASE_IS_PTR": True, "HAS_SLOTS": True, "TILES": 1},
        num_stages=stages) for stages in (2, 1)},
    # the block drafter's context window (drafter_window): masks and a later first key block, the same dots
    "single_chain_windowed": dots(sa._attn_split_kernel, SINGLE, {**COMMON, "BASE_IS_PTR": True, "HAS_SLOTS": False,
                                                                  "TILES": 1, "WINDOWED": True}),
    **{f"single_{kind}_row_tile32": dots(sa._attn_split_kernel, SINGLE, {**COMMON, "BLOCK_M": 32, "BASE_IS_PTR": True,
                                                                       "HAS_SLOTS": kind == "slots", "TILES": 1})
       for kind in ("chain", "slots")},
    "paged": dots(pa._paged_split_kernel, PAGED, {**COMMON, "SPLITS_PER_PROGRAM": 4}),
    "paged_row_tile": dots(pa._paged_split_kernel, PAGED, {**COMMON, "BLOCK_M": pa.ROW_TILE, "SPLITS_PER_PROGRAM": 4}),
    **{f"{'w12_' if w12 else ''}linear": dots(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32",
                                                                          "W12": w12, **TILE})
       for w12 in (False, True)},
    # o_proj / down with the whole W tile loaded before the wait (gemm.preload_chunks): the same dots
    "preload_linear": dots(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False,
                                                         **TILE, "BLOCK_N": 16, "W_PRELOAD": 5, "K_LOOP": 0}),
    "linear_n16": dots(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False,
                                                     **TILE, "BLOCK_N": 16}),
    # a large tile's first chunk preloaded, the K loop over the rest: one unrolled dot, then the loop's
    "head_preload_linear": dots(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32",
                                                              "W12": False, **TILE, "W_PRELOAD": 1}),
    **{f"{'w12_' if w12 else ''}norm_linear{f'_epi{epi}' if epi else ''}": dots(
        norm_gemm._rmsnorm_linear_kernel, NORM, {**FLAGS, "HAS_RES": epi == 0, "DOT_PREC": "tf32", "W12": w12,
                                                 "STORE_Y": True, "ARGMAX": False, "EPI": epi, "H": 9, "KVH": 3,
                                                 "HALF": 32, **TILE}, num_warps=8)
       for w12 in (False, True) for epi in (0, 1, 2)},  # gate_up's GLU and qkv's rotary epilogues
    # prenorm (rmsnorm.rms_norm_rows launched first): the projection alone, x fed to the dot unchanged
    "prenorm_linear": dots(norm_gemm._rmsnorm_linear_kernel, NORM, {
        **FLAGS, "HAS_RES": False, "DOT_PREC": "tf32", "W12": False, "STORE_Y": True, "ARGMAX": False, "EPI": 0,
        "H": 9, "KVH": 3, "HALF": 32, **TILE, "NORM": False}, num_warps=8),
    # producer statistics (rmsnorm.py): the producer's segment sums add no dot, the consumer one 16-lane sum
    "sumsq_linear": dots(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False,
                                                       **TILE, "ROW_SUMSQ": 1}),
    # the projections in 32-row tiles (tile_rows): the 16-row kernels' dots on twice the rows
    "rows32": {name: dots(fn, sig, {**consts, "BLOCK_M": 32}, nw) for name, fn, sig, consts, nw in (
        ("linear", gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False, **TILE},
         4),
        *((f"norm_linear_epi{epi}", norm_gemm._rmsnorm_linear_kernel, NORM, {**NORM_EPI0, "HAS_RES": epi == 0,
                                                                             "EPI": epi}, 8) for epi in (0, 1, 2)),
        ("stat_in_norm_linear", norm_gemm._rmsnorm_linear_kernel, NORM, {**NORM_EPI0, "STAT_SEGS": 256}, 8))},
    "stat_in_norm_linear": dots(norm_gemm._rmsnorm_linear_kernel, NORM, {
        **FLAGS, "HAS_RES": False, "DOT_PREC": "tf32", "W12": False, "STORE_Y": True, "ARGMAX": False, "EPI": 0,
        "H": 9, "KVH": 3, "HALF": 32, **TILE, "STAT_SEGS": 256}, num_warps=8),
    # Llama-3-8B's 256 segment sums a row: no more spills than the row pass (a first version spilled 22 KB a thread)
    "stat_in_spills": [spill_bytes(norm_gemm._rmsnorm_linear_kernel, NORM, {**NORM_EPI0, **extra}, 8)
                       for extra in ({}, {"STAT_SEGS": 256})],
    # the producer's squares stay FMULs: an FMA contracted into the segment tree would round them another way, in
    # some compiled variants only (the attention kernels' 1-ulp story, _common.NO_FP_FUSION)
    # the W12 linear assembled by ptxas (the decode's inline PTX included): its SASS opcodes, counted
    "w12_sass_ops": sass_opcodes(W12_SASS),
    # shared memory of the W12 linear and GLU at 2 and 4 stages: the pipeliner's buffers for the blocks in flight
    "w12_smem": {name: [build(fn, sig, {**consts, "W12": True}, nw, num_stages=ns).metadata.shared for ns in (2, 4)]
                 for name, fn, sig, consts, nw in (
                     ("linear", gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", **TILE}, 4),
                     ("glu", norm_gemm._rmsnorm_linear_kernel, NORM, {**NORM_EPI0, "HAS_RES": False, "EPI": 1}, 4))},
    # a max_registers launch (ptxas maxnreg) of the W12 linear: the registers ptxas then gives a thread
    "w12_registers": {str(cap): int(re.search(r"Used (\d+) registers", ptxas_sass(build(
        gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": True, **TILE}, 4,
        maxnreg=cap).asm["ptx"])[0]).group(1)) for cap in (None, 168, 128)},
    # byte permutes that pack two 16-bit halves into one register (an operand repacked after the decode)
    "w12_repacks": len(re.findall(r"PRMT R\d+, R\d+(?:\.reuse)?, 0x(?:5410|7632)", W12_SASS)),
    "sumsq_ffma": [assembled(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": swiglu, "DOT_PREC": "tf32",
                                                           "W12": False, **TILE, "BLOCK_M": bm, "BLOCK_N": bn,
                                                           "ROW_SUMSQ": 1}, nw)[1].count("FFMA")
                   for bm, bn, nw, swiglu in ((16, 16, 2, False), (16, 128, 8, True), (1, 64, 4, False),
                                              (1, 128, 8, True))],
    # asynchronous copies to shared memory (the pipelined K loop's loads) in the projections: x and W in `linear`
    # and a prenorm projection; W alone where x is normalised in registers on its way to the dot
    "cp_async": {name: len(re.findall(r"cp\.async\.c[ag]\.shared", build(fn, sig, consts, nw).asm["ptx"]))
                 for name, fn, sig, consts, nw in (
                     ("linear", gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False,
                                                              **TILE}, 4),
                     ("norm_linear", norm_gemm._rmsnorm_linear_kernel, NORM, NORM_EPI0, 8),
                     ("prenorm_linear", norm_gemm._rmsnorm_linear_kernel, NORM, {**NORM_EPI0, "NORM": False}, 8),
                     ("post_scale_linear", norm_gemm._rmsnorm_linear_kernel, NORM,
                      {**NORM_EPI0, "NORM": False, "STAT_SEGS": 256}, 8))},
    # post_scale (producer statistics, the producer's scaled rows projected as they are): the projection's dot, the
    # 16-lane sum of the producer's segment sums; the producer that stores those rows: linear's dots
    "post_scale_norm_linear": dots(norm_gemm._rmsnorm_linear_kernel, NORM, {**NORM_EPI0, "NORM": False,
                                                                             "STAT_SEGS": 256}, num_warps=8),
    "scaled_linear": dots(gemm._linear_kernel, LINEAR, {**FLAGS, "SWIGLU": False, "DOT_PREC": "tf32", "W12": False,
                                                        **TILE, "ROW_SUMSQ": 1, "SCALED": 1}),
    # programmatic dependent launch (kernels/pdl.py): the same dots, plus the wait and the weight prefetch
    **{f"pdl{mode}_{name}": dots(fn, sig, {**consts, "PDL": mode, "PF_LINES": 16}, nw, pdl=True)
       for mode in (1, 2) for name, fn, sig, consts, nw in PDL_KERNELS},
    # split-K (gemm.split_k_combine): the same dots over fewer chunks, then the partials added in split order
    **{f"split4_{name}": dots(fn, sig, {**consts, "SPLIT_K": 4}, nw) for name, fn, sig, consts, nw in PDL_KERNELS},
    "pdl_ptx": {f"{name}_{mode}": [op in build(fn, sig, {**consts, "PDL": mode, "PF_LINES": 16}, nw, pdl=mode > 0).asm["ptx"]
                                   for op in PDL_OPS]
                for mode in (0, 1, 2) for name, fn, sig, consts, nw in PDL_KERNELS},
    # where the trigger sits: after the wait, before any MMA (mode 1), or after the K loop's last MMA (mode 2)
    "pdl_trigger_after_mma": {f"{name}_{mode}": trigger_after_mma(build(fn, sig, {**consts, "PDL": mode}, nw,
                                                                        pdl=True).asm["ptx"])
                              for mode in (1, 2) for name, fn, sig, consts, nw in PDL_KERNELS},
    # the paged attention kernels under PDL: the same dots, the wait (nothing to prefetch: no weights)
    "pdl1_paged": dots(pa._paged_split_kernel, PAGED, {**COMMON, "SPLITS_PER_PROGRAM": 4, "PDL": 1}, pdl=True),
    "pdl_ptx_paged": {f"{name}_{mode}": [op in build(fn, sig, {**consts, "PDL": mode}, 4, pdl=mode > 0).asm["ptx"]
                                         for op in PDL_OPS]
                      for mode in (0, 1, 2) for name, fn, sig, consts in (
                          ("split", pa._paged_split_kernel, PAGED, {**COMMON, "SPLITS_PER_PROGRAM": 4}),
                          ("combine", pa._paged_combine_kernel,
                           {"ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_o_ptr": "*fp32", "o_ptr": P,
                            "tok_kvlen_ptr": "*i64", "NTOK": "i32"}, {"H": 9, "D": 64, "SPLIT": 64, "GROUP": 64}))},
    # the device loop's kernels: compiled for the GPU at all (the interpreter accepts what sm_90 code generation
    # refuses, e.g. a constexpr reassigned in a static_range body), under PDL where they take it
    "sm90": {name: loads_and_waits(fn, sig, consts, nw) for name, fn, sig, consts, nw in (
        ("ngram_lookup", dd._ngram_kernel, {"tok_ptr": "*i64", "state_ptr": "*i64", "draft_ptr": "*i64",
                                            "proposed_ptr": "*i64", "gate_tok_ptr": "*i64", "gate_prob_ptr": "*fp32",
                                            "doubt": "fp32"},
         {"NMAX": 3, "NMIN": 1, "K": 15, "KP": 16, "BLOCK": 1024, "GATE_K": 2, "GKP": 2, "PERIODIC": True}, 4),
        ("batch_ngram_lookup", bn._batch_ngram_kernel, {"tok_ptr": "*i64", "row_stride": "i32", "pos_ptr": "*i64",
                                                        "draft_ptr": "*i64", "proposed_ptr": "*i64", "first_ptr": "*i64"},
         {"NMAX": 4, "NMIN": 1, "K": 32, "KP": 32, "BLOCK": 1024}, 4),
        ("norm_linear_topk", norm_gemm._rmsnorm_linear_kernel, {**NORM, "y_ptr": "*fp32"},
         {**NORM_EPI0, "STORE_Y": False, "TOPK": 8}, 4),
        *((f"embedding_pdl{pdl}", embed._embedding_kernel, {"ids_ptr": "*i64", "w_ptr": P, "out_ptr": P, "V": "i32"},
           {"H": 576, "BLOCK": 1024, "PDL": pdl}, 4) for pdl in (0, 1)),
        *((name, bf._qk_norm_rope_kernel, {"x_ptr": P, "row_stride": "i32", "pos_ptr": "*i64", "slot_ptr": "*i64",
                                           "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qn_ptr": P, "kn_ptr": P,
                                           "eps": "fp32", "q_ptr": P, "k_ptr": P, "v_ptr": P, "S": "i32",
                                           "layer_stride": "i64"},
           {"H": h, "KVH": 3, "HALF": 32, "QK_NORM": True, "CONSECUTIVE": consecutive, "LAYERS": layers}, 1)
          for name, h, consecutive, layers in (("qk_norm_rope", 9, False, 1), ("qk_norm_rope_consecutive", 9, True, 1),
                                               ("kv_norm_rope_layers", 0, False, 2))),
        ("topk_chunk", topk._topk_chunk_kernel, {"x_ptr": "*fp32", "keys_ptr": "*i64", "m_ptr": "*fp32",
                                                 "s_ptr": "*fp32", "V": "i32", "G": "i32"},
         {"KP": 8, "BLOCK": 1024}, 4),
        *((f"topk_merge{'_mapped' if mapped else ''}", topk._topk_merge_kernel,
           {"keys_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32", "map_ptr": "*i64", "tok_ptr": "*i64",
            "prob_ptr": "*fp32", "V": "i32", "G": "i32", "K": "i32"},
           {"KP": 8, "GP": 64, "MAPPED": mapped}, 4) for mapped in (False, True)),
        # a 32-row tree in one warp, a 128-row one over a lookup 127 deep in loop_kernels.ASSEMBLE_WIDE_WARPS
        *((name, lk._assemble_kernel, {n: "*i64" for n in ("tok_ptr", "lead_ptr", "lead_n_ptr", "state_ptr",
                                                           "src_ptr", "rpos_ptr", "rslot_ptr", "rbs_ptr",
                                                           "out_tok_ptr", "ids_ptr", "pos_ptr", "slot_ptr",
                                                           "bs_ptr")}
           | {"prob_ptr": "*fp32", "out_prob_ptr": "*fp32"},
           {"D": d, "K": 4, "N": w - 1, "W": w, "A": w, "HAS_LEAD": True, "HAS_BS": True,
            "DP": triton.next_power_of_2(d), "KP": 4, "NP": w, "WP": w, "AP": w}, nw)
          for name, d, w, nw in (("assemble", 15, 32, 1), ("assemble_128", 127, 128, lk.ASSEMBLE_WIDE_WARPS))),
        ("chain_commit", lk._chain_commit_kernel, {n: "*i64" for n in ("argmax_ptr", "ids_ptr", "proposed_ptr",
                                                                      "state_ptr", "seq_ptr", "path_ptr",
                                                                      "acc_ptr", "stop_ptr", "ctl_ptr")},
         {"R": 16, "RP": 16, "HAS_SEQ": True, "HAS_STOP": True, "E": 2, "EP": 2}, 1),
        ("tree_commit", lk._tree_commit_kernel, {n: "*i64" for n in ("argmax_ptr", "ids_ptr", "par_ptr", "depth_ptr",
                                                                    "state_ptr", "seq_ptr", "path_ptr", "tok_ptr",
                                                                    "acc_ptr", "next_ptr", "stop_ptr",
                                                                    "ctl_ptr")} | {"anc_ptr": "*u8"},
         {"R": 32, "RP": 32, "DR": 9, "DRP": 16, "HAS_SEQ": True, "HAS_STOP": True, "E": 2, "EP": 2}, 1),
        # 64 rows over the block's 15 depths, and 128 over a lookup 127 deep (a second ancestor word)
        *((name, tg._grow_tree_kernel, {n: "*i64" for n in ("tok_ptr", "lead_ptr", "lead_n_ptr", "src_ptr",
                                                           "par_ptr", "depth_ptr", "pos_ptr", "bs_ptr", "rbits_ptr")}
           | {"prob_ptr": "*fp32", "tanc_ptr": "*u8", "anc_ptr": "*i1", "lat_ptr": "*fp64", "doubt": "fp32"},
           {"D": d, "K": 8, "WIDTH": 8, "BITS": 3, "R": r, "W": r, "HAS_LEAD": True, "HAS_BS": True,
            "DP": triton.next_power_of_2(d), "KP": 8, "RP": r, "WP": r, "CB": 16, "DEPTH_SHIFT": tg.DEPTH_SHIFT,
            "ROW_BITS": tg.ROW_BITS, "RANKED": 15, "HI": r > 64, "GATE_K": 2, "GKP": 2}, 1)
          for name, d, r in (("grow_tree", 15, 64), ("grow_tree_128", 127, 128))),
        ("tree_move", tm._tree_move_kernel, {"kv_ptr": P, "path_ptr": "*i64", "acc_ptr": "*i64", "next_ptr": "*i64",
                                             "state_ptr": "*i64", "f_ptr": P, "fout_ptr": P, "S": "i32", "F": "i32",
                                             "H": "i32", "LAYER_STRIDE": "i32", "kv2_ptr": P, "S2": "i32"},
         {"ROWSETS": 180, "ROWSETS2": 12, "DR": 16, "DRP": 16, "D": 64, "HAS_F": True, "BLOCK_F": 256}, 1))},
}))

'''


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no CUDA code generation here
        return False
    return True


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[str]]:
    if not _nvidia_backend():
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_single_and_paged_split_kernels_compile_the_same_dots(compiled):
    # three dots per key block: q @ K^T, p @ V, p @ ones (the row sums)
    assert len(compiled["paged"]) == 3, compiled["paged"]
    assert compiled["single_chain"] == compiled["paged"]
    assert compiled["single_slots"] == compiled["paged"]
    assert compiled["single_chain_windowed"] == compiled["single_chain"]
    # num_stages is T-neutral (AttentionParams): one stage (99 registers a thread with block_slots, 168 at two;
    # scripts/attn_registers.py) runs the same dots
    assert compiled["single_slots_stages1"] == compiled["paged"]
    assert compiled["single_chain_tiles4"] == compiled["single_chain"] * 4  # row tiles in turn: the same dots
    # the batched engine's 32-row tiles: the same MMA v2 dots (layout, instruction shape, warps), twice the rows
    assert compiled["paged_row_tile"] == [d.replace("tensor<16x", "tensor<32x") for d in compiled["paged"]]
    # single-request attention in 32-row tiles (AttentionParams.tile_rows): the same, so 16 and 32 give the same bits
    for kind in ("chain", "slots"):
        assert compiled[f"single_{kind}_row_tile32"] == compiled["paged_row_tile"], kind


def any_k(dot: str) -> str:
    """A projection dot's types with its K width left out: W12 runs eight 32-wide dots where bf16 runs one per chunk."""
    return re.sub(r"tensor<(16x)?(32|128)(x64)?xbf16", lambda m: f"tensor<{m.group(1) or ''}K{m.group(3) or ''}xbf16",
                  dot)


def spread(dot: str) -> str:
    """A dot's types with the warps' spread over the tile left out (num_warps and tile rows move it; each element's
    chain stays one warp's MMA in K order)."""
    return re.sub(r"warpsPerCTA = \[\d+, \d+\]", "warpsPerCTA", dot)


def test_w12_decode_assembles(compiled):
    """ptxas takes the decode's inline PTX (w12_tile.OCT_ASM; tests/test_oct_asm.py checks what it computes): the
    W12 linear assembles for sm_90a with its byte permutes and MMAs. (ptxas re-optimises the PTX: an 8- and a
    7-instruction spelling of the pair decode gave the same SASS opcode counts, session 29.) Each asm output is a
    lane pair's bf16x2, the MMA operand register as it stands: no permute repacks halves (before session 30: 64 a
    block, one an operand register)."""
    ops = compiled["w12_sass_ops"]
    assert ops.get("PRMT", 0) >= 2 * 16 * 4 and ops.get("HMMA", 0) > 0, ops
    assert compiled["w12_repacks"] == 0


def test_w12_loops_pipeline_as_deep_as_their_stages(compiled):
    """num_stages - 1 blocks of the W12 arrays in flight: the shared memory grows with the stages. (Until session 30
    the high nibbles' address came from a load in the same iteration and Triton's pipeliner halved the distance:
    one block ahead, ~41 KiB, at 2, 3 or 4 stages alike; w12_tile.oct_cell carries it from the iteration before.)"""
    for name, (two, four) in compiled["w12_smem"].items():
        assert four >= 2.5 * two, (name, two, four)


def test_max_registers_caps_what_ptxas_allocates(compiled):
    """LinearParams/RMSNormLinearParams.max_registers reaches ptxas as maxnreg (the launches pass it: test_kernels.py):
    each cap holds, and uncapped the W12 linear takes more than the tighter one."""
    regs = compiled["w12_registers"]
    assert regs["168"] <= 168 and regs["128"] <= 128 and regs["None"] > 128, regs


def test_w12_gemms_compile_the_dots_of_the_bf16_ones(compiled):
    assert len(compiled["linear"]) == 1 and "kWidth = 2" in compiled["linear"][0]
    # the same MMA (operand layouts, kWidth, accumulator) over 32-wide K slices: per 16-wide K step the same rounding;
    # eight in the whole-block loop, eight in the tail block
    assert len(compiled["w12_linear"]) == 16 and "tensor<16x32xbf16" in compiled["w12_linear"][0]
    assert {any_k(d) for d in compiled["w12_linear"]} == {any_k(compiled["linear"][0])}
    # preloaded (gemm.preload_chunks): the same MMA per chunk, unrolled; only the warps' spread over the tile may
    # differ, as with num_warps (T-neutral: each element's chain is one warp's, in K order)
    assert len(compiled["linear_n16"]) == 1
    assert [spread(d) for d in compiled["preload_linear"]] == [spread(compiled["linear_n16"][0])] * 5
    assert [spread(d) for d in compiled["head_preload_linear"]] == [spread(compiled["linear"][0])] * 2
    # the norm statistic's fp32 dot, then the projection
    assert len(compiled["norm_linear"]) == 2, compiled["norm_linear"]
    # gate_up's GLU: gate and up rows, two projection dots a chunk; QKV's rotary: one (the partners share the tile)
    assert compiled["norm_linear_epi1"] == [compiled["norm_linear"][0]] + [compiled["norm_linear"][1]] * 2
    assert compiled["norm_linear_epi2"] == compiled["norm_linear"]
    for name, per_block in (("norm_linear", 16), ("norm_linear_epi1", 32), ("norm_linear_epi2", 16)):
        stat, *proj = compiled[f"w12_{name}"]
        assert stat == compiled[name][0] and len(proj) == per_block, name
        assert {any_k(d) for d in proj} == {any_k(compiled[name][1])}, name
    assert compiled["prenorm_linear"] == compiled["norm_linear"][1:]
    assert compiled["sumsq_linear"] == compiled["linear"]
    # the producer's segment sums, 16 lanes a row, by an fp32 dot with ones; then the projection
    assert len(compiled["stat_in_norm_linear"]) == 2 and "tensor<16x16xf32" in compiled["stat_in_norm_linear"][0]
    assert compiled["stat_in_norm_linear"][1:] == compiled["norm_linear"][1:]
    rows_pass, from_sums = compiled["stat_in_spills"]
    assert from_sums <= rows_pass, compiled["stat_in_spills"]
    assert compiled["sumsq_ffma"] == [0, 0, 0, 0]


def test_32_row_projection_tiles_compile_the_16_row_dots(compiled):
    """tile_rows=32 (LinearParams, RMSNormLinearParams; T-neutral): the same MMA v2 dots (instruction, operand
    layouts, kWidth) on two 16-row slabs, so a row's bits are the 16-row tile's; only the warps' spread over the
    tile may differ, as with num_warps."""
    rows16 = lambda dots: [spread(d.replace("tensor<32x", "tensor<16x")) for d in dots]  # noqa: E731
    r32 = compiled["rows32"]
    assert rows16(r32["linear"]) == rows16(compiled["linear"])
    for epi in (0, 1, 2):
        assert rows16(r32[f"norm_linear_epi{epi}"]) == rows16(compiled[f"norm_linear{f'_epi{epi}' if epi else ''}"]), epi
    assert rows16(r32["stat_in_norm_linear"]) == rows16(compiled["stat_in_norm_linear"])
    assert all("tensor<32x" in d for d in r32["linear"]), r32["linear"]  # (not silently compiled at 16 rows)


def test_pdl_variants_compile_the_same_dots_and_wait_for_the_predecessor(compiled):
    for mode in (1, 2):
        assert compiled[f"pdl{mode}_linear"] == compiled["linear"]
        assert compiled[f"pdl{mode}_norm_linear_epi1"] == compiled["norm_linear_epi1"]
    for name in ("linear", "norm_linear_epi1"):
        for mode in (1, 2):  # wait, trigger, weight prefetch
            assert compiled["pdl_ptx"][f"{name}_{mode}"] == [True, True, True], (name, mode)
        assert compiled["pdl_ptx"][f"{name}_0"] == [False, False, False], name
        # WAIT_THEN_TRIGGER lets the successor launch before the first dot, ..._AT_END only after the K loop's last
        assert compiled["pdl_trigger_after_mma"][f"{name}_1"] == {"before_first": True, "after_last": False}, name
        assert compiled["pdl_trigger_after_mma"][f"{name}_2"] == {"before_first": False, "after_last": True}, name


def test_paged_attention_under_pdl_compiles_the_same_dots_and_waits(compiled):
    assert compiled["pdl1_paged"] == compiled["paged"]
    for name in ("split", "combine"):
        for mode in (1, 2):
            assert compiled["pdl_ptx_paged"][f"{name}_{mode}"][:2] == [True, True], (name, mode)  # wait, trigger
        assert compiled["pdl_ptx_paged"][f"{name}_0"] == [False, False, False], name


def test_split_k_variants_compile_the_dots_of_the_unsplit_kernels(compiled):
    assert compiled["split4_linear"] == compiled["linear"]
    assert compiled["split4_norm_linear_epi1"] == compiled["norm_linear_epi1"]


def test_projection_k_loops_load_through_the_pipeline(compiled):
    # compiled with the launch's specialisations (build): without 16-byte alignment no load is pipelined at all
    c = compiled["cp_async"]
    assert c["linear"] > 0 and c["prenorm_linear"] > 0 and c["norm_linear"] > 0, c
    assert c["norm_linear"] < c["prenorm_linear"], c  # the normed operand comes through registers
    assert c["post_scale_linear"] == c["prenorm_linear"], c  # post_scale: x through the pipeline as in prenorm


def test_post_scale_compiles_the_projection_dots(compiled):
    assert compiled["scaled_linear"] == compiled["linear"]
    dots = compiled["post_scale_norm_linear"]
    assert len(dots) == 2 and "tensor<16x16xf32" in dots[0] and dots[1:] == compiled["norm_linear"][1:], dots


def test_device_loop_kernels_compile_for_sm90(compiled):
    assert compiled["sm90"] == {"ngram_lookup": True, "batch_ngram_lookup": True, "qk_norm_rope": True,
                                "topk_chunk": True, "topk_merge": True, "topk_merge_mapped": True, "assemble": True,
                                "assemble_128": True, "chain_commit": True, "tree_commit": True, "grow_tree": True,
                                "grow_tree_128": True, "tree_move": True, "qk_norm_rope_consecutive": True,
                                "kv_norm_rope_layers": True, "embedding_pdl0": True, "embedding_pdl1": True,
                                "norm_linear_topk": True}
