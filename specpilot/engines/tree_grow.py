"""The device loop's tree block, and the per-step best-first tree grown on the device (EngineConfig.device_tree).

A device loop step reads its tree from device tensors (TreeBlock): which candidate each draft node is, parents,
ancestors, depths, the verify's positions and mask. A calibrated tree fills them once (a static shape); with
`per_step`, grow_tree rewrites them every step from the step's own candidates, inside the step's CUDA graph: the
host loop's best-first tree (costmodel.acceptance.best_first_tree over the first `width` ranks a depth, zero
probabilities ruled out), without a host round trip. On the H200 (SmolLM2, 16 rows led by lookup, session 36)
the grown tree accepted 5.23 tokens a step against the calibrated static one's 4.72.

The kernel runs best_first_tree's heap as a frontier of at most budget + 1 entries in one program: each of the
budget pops takes the frontier's best key (score, then depth, then the ranks in lexicographic order, packed as one
integer: the heap's own order), puts its next sibling in its place and its first child in a new entry. Scores are
float64 products in the host's order, so the tree is the host's exactly, ties included. Where fewer nodes exist
than the budget (few nonzero candidates), the rows left are dead: depth 0, their own only ancestor, never deeper
than the root, so never accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from specpilot.engines.config import MAX_GROWN_NODES
from specpilot.engines.device_drafters import gate_leads
from specpilot.engines.drafters.ngram_prefix import LeadGate
from specpilot.engines.llama import ancestor_slots
from specpilot.engines.loop_kernels import _led_source, check_candidates, lead_rows
from specpilot.kernels._common import check_launchable, check_tensor
from specpilot.kernels.pdl import pdl_launch, release_successor, wait_for_predecessor

# Rows a grown tree may have: ancestor sets are two int64 bit masks a row in the kernel (the second one only in
# trees of more than 64 rows: a constexpr branch, so smaller trees compile as before).
MAX_GROWN_ROWS = MAX_GROWN_NODES + 1
# The kernel's frontier keys: depth << DEPTH_SHIFT | the ranks' digits << ROW_BITS | the parent's row (so ranked
# depths x bits a rank <= DEPTH_SHIFT - ROW_BITS; depths up to 2**(63 - DEPTH_SHIFT) - 2).
DEPTH_SHIFT = 55
ROW_BITS = 7
assert MAX_GROWN_ROWS <= 1 << ROW_BITS


@dataclass(frozen=True)
class TreeBlock:
    """A verify block's tree as the device loop's step reads it. rows = draft nodes + 1 (the root at row 0),
    width = the verify block's rows (pad rows past `rows` see themselves at their own position)."""
    node_src: torch.Tensor  # [nodes] int64: node i's candidate as a flat index depth * K + rank (row i + 1)
    parents: torch.Tensor  # [rows] int64: each row's parent row, -1 for the root (and dead rows)
    tree_anc: torch.Tensor  # [rows, rows] uint8: ancestors-or-self
    depths: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [width] int64: position - base (a row's depth; pad rows their row)
    anc: torch.Tensor  # [width, width] bool: the verify's mask (ancestors-or-self; pad rows themselves)
    block_slots: torch.Tensor | None  # [width, width] int64: row's ancestor at depth e (its row), -1 past its depth

    @property
    def rows(self) -> int:
        return self.parents.shape[0]

    @classmethod
    def build(cls, node_src, parents, depths, anc, width: int, block_slots: bool, device) -> "TreeBlock":
        """From host arrays: node_src [nodes], parents / depths [rows], anc [rows, rows] ancestors-or-self."""
        rows = len(parents)
        as_long = lambda a: torch.as_tensor(a, dtype=torch.long).to(device)  # noqa: E731
        tree_anc = torch.from_numpy(np.array(anc, dtype=bool))  # a copy: layouts' arrays are read-only
        mask = torch.eye(width, dtype=torch.bool)
        mask[:rows, :rows] = tree_anc
        positions = torch.arange(width)
        positions[:rows] = torch.as_tensor(depths)
        rel_slots = ancestor_slots(torch.tensor(0), mask).to(device) if block_slots else None
        return cls(as_long(node_src), as_long(parents), tree_anc.to(torch.uint8).to(device), as_long(depths),
                   positions.to(device), mask.to(device), rel_slots)

    @classmethod
    def dead(cls, nodes: int, width: int, block_slots: bool, device) -> "TreeBlock":
        """Every draft row dead (grow_tree's starting point)."""
        rows = nodes + 1
        return cls.build([0] * nodes, [-1] * rows, [0] * rows, np.eye(rows, dtype=bool), width, block_slots,
                         device)


def _check_grow(tokens, probs, lead, lead_depths, width, block, ranked, gate=None):
    dev, (depth, k) = check_candidates(tokens, probs, lead, lead_depths), tokens.shape
    if gate is not None and (lead is None or not isinstance(gate, LeadGate)):
        raise ValueError("a gate is a LeadGate, for a lead")
    rows, w = block.rows, block.positions.shape[0]
    if not 2 <= rows <= min(w, MAX_GROWN_ROWS):
        raise ValueError(f"a grown tree has 1..{MAX_GROWN_NODES} nodes in a block of >= rows, got {rows - 1} "
                         f"nodes, {w} block rows")
    for name, t, shape, dt in (("node_src", block.node_src, (rows - 1,), torch.int64),
                               ("parents", block.parents, (rows,), torch.int64),
                               ("tree_anc", block.tree_anc, (rows, rows), torch.uint8),
                               ("depths", block.depths, (rows,), torch.int64),
                               ("anc", block.anc, (w, w), torch.bool)):
        check_tensor(name, t, shape, dt, dev)
    if block.block_slots is not None:
        check_tensor("block_slots", block.block_slots, (w, w), torch.int64, dev)
    if not 1 <= width <= k or min(depth, ranked) * _code_bits(width) > DEPTH_SHIFT - ROW_BITS:
        raise ValueError(f"width={width}: must be in 1..{k} (the candidates a depth), with ranked depths x bits a "
                         f"rank <= {DEPTH_SHIFT - ROW_BITS}")
    if not 1 <= ranked or depth >= (1 << (63 - DEPTH_SHIFT)) - 1:
        raise ValueError(f"ranked={ranked} must be >= 1 and depth={depth} < {(1 << (63 - DEPTH_SHIFT)) - 1}")
    return min(depth, ranked)


def _code_bits(width: int) -> int:
    return max(1, (width - 1).bit_length())


def grow_tree_ref(tokens, probs, lead, lead_depths, width: int, block: TreeBlock, ranked: int | None = None,
                  gate: LeadGate | None = None) -> None:
    """Rewrites `block` with the best-first tree of block.rows - 1 nodes over the step's candidates tokens / probs
    [depth, K] (best first; led by `lead` at depths below lead_depths when given, as assemble leads them), at most
    `width` ranks a depth. Depths past the first `ranked` (default: all) hold one candidate at most (prompt lookup's
    match running past the block drafter's depth): their rank, always 0, takes no digit in the tie order. gate: the
    lookup's LeadGate, not yet applied (EngineConfig.lookup_overlap): lead_depths becomes 0 in place where it refuses
    the lead, given the depth-1 candidates (what the gated lookup proposes; assemble reads it after). The kernel's
    frontier in torch ops (no host sync)."""
    ranked = _check_grow(tokens, probs, lead, lead_depths, width, block, ranked or tokens.shape[0], gate)
    dev, (depth, k), rows = tokens.device, tokens.shape, block.rows
    if gate is not None:
        gate.gate_on_device(lead_depths, lead[0], tokens[0], probs[0])
    if lead is not None:
        _, probs = lead_rows(tokens, probs, lead, torch.arange(depth, device=dev) < lead_depths.reshape(()))
    ranks = torch.arange(k + 1, device=dev)
    padded = torch.full((depth + 1, k + 1), -1.0, dtype=torch.float64, device=dev)  # -1: no candidate
    padded[:depth, :k] = torch.where((ranks[None, :k] < width) & (probs > 0), probs.double(), -1.0)
    bits = _code_bits(width)
    f = torch.arange(rows, device=dev)  # the frontier: one entry a pop at most, plus the first
    zero = torch.zeros(rows, dtype=torch.long, device=dev)
    score = torch.where(f == 0, padded[0, 0], -1.0)  # < 0: no entry
    pscore = torch.where(f == 0, 1.0, 0.0).double()
    fdepth, code, rank, parent = zero + (f == 0).long(), zero.clone(), zero.clone(), zero.clone()
    used = torch.ones((), dtype=torch.long, device=dev)
    node_src, row_par, row_depth = block.node_src.new_zeros(rows - 1), zero - 1, zero.clone()
    anc = torch.eye(rows, dtype=torch.bool, device=dev)
    for i in range(rows - 1):
        best = score.max()
        live = best >= 0
        sel = (score == best) & live
        dmin = torch.where(sel, fdepth, 1 << 30).min()
        sel &= fdepth == dmin
        cmin = torch.where(sel, code, 1 << 62).min()
        sel &= code == cmin
        r, par, ps, slot = ((torch.where(sel, t, 0)).sum() for t in (rank, parent, pscore, f))
        row = i + 1
        node_src[i] = torch.where(live, (dmin - 1) * k + r, 0)
        row_par[row] = torch.where(live, par, -1)
        row_depth[row] = torch.where(live, dmin, 0)
        anc[row] |= anc.index_select(0, par.view(1))[0] & live
        level = dmin.clamp(max=depth)  # the padded row past the last depth, where the frontier is empty
        sib = _at(padded, (level - 1).clamp(min=0) * (k + 1) + r + 1)
        at = f == slot
        score = torch.where(at, torch.where(live & (sib >= 0), ps * sib, -1.0), score)
        rank, code = torch.where(at, r + 1, rank), torch.where(at, cmin + 1, code)
        child = _at(padded, level * (k + 1))
        new = (f == used) & live & (child >= 0)
        score, pscore = torch.where(new, best * child, score), torch.where(new, best, pscore)
        fdepth, rank = torch.where(new, dmin + 1, fdepth), torch.where(new, 0, rank)
        code = torch.where(new, torch.where(dmin < ranked, cmin << bits, cmin), code)
        parent = torch.where(new, row, parent)
        used = used + new.any().long()
    block.node_src.copy_(node_src)
    block.parents.copy_(row_par)
    block.depths.copy_(row_depth)
    block.tree_anc.copy_(anc.to(torch.uint8))
    block.positions[:rows] = row_depth
    block.anc[:rows, :rows] = anc
    if block.block_slots is not None:
        block.block_slots.copy_(ancestor_slots(torch.zeros((), dtype=torch.long, device=dev), block.anc))


def _at(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """t's element at a flat index given as a 0-d tensor (index_select: no host read of the index)."""
    return t.reshape(-1).index_select(0, flat.reshape(1))[0]


@triton.jit
def _lattice(tok_ptr, prob_ptr, lead_ptr, lead_n_ptr, d, j, D: tl.constexpr, K: tl.constexpr, WIDTH: tl.constexpr,
             KP: tl.constexpr, HAS_LEAD: tl.constexpr):
    """The led candidates' probabilities (float64) at depths d and ranks j (broadcastable grids); -1: no candidate
    (past the lattice or the width, or probability 0)."""
    ok = (d < D) & (j < K)
    if HAS_LEAD:
        _, flat = _led_source(tok_ptr, lead_ptr, tl.load(lead_n_ptr), d, j, d < D, K, KP)
        prob = tl.where(flat < 0, 1.0, tl.load(prob_ptr + tl.maximum(flat, 0), mask=ok, other=0.0))
    else:
        prob = tl.load(prob_ptr + d * K + j, mask=ok, other=0.0)
    return tl.where(ok & (j < WIDTH) & (prob > 0), prob.to(tl.float64), -1.0)


@triton.jit
def _frontier_best(score1, key1, score2, key2):
    """The heap's order as one reduction: the higher score, then the lower key (keys are unique among entries)."""
    first = (score1 > score2) | ((score1 == score2) & (key1 < key2))
    return tl.where(first, score1, score2), tl.where(first, key1, key2)


@triton.jit
def _flag(cond):
    """A scalar condition usable with vectors (the interpreter trips on `vector & scalar compare`)."""
    return tl.where(cond, 1, 0) != 0


@triton.jit
def _grow_tree_kernel(tok_ptr, prob_ptr, lead_ptr, lead_n_ptr, src_ptr, par_ptr, tanc_ptr, depth_ptr, pos_ptr,
                      anc_ptr, bs_ptr, lat_ptr, rbits_ptr, doubt, D: tl.constexpr, K: tl.constexpr,
                      WIDTH: tl.constexpr,
                      BITS: tl.constexpr, R: tl.constexpr, W: tl.constexpr, RANKED: tl.constexpr,
                      HAS_LEAD: tl.constexpr, HAS_BS: tl.constexpr, DP: tl.constexpr, KP: tl.constexpr,
                      RP: tl.constexpr, WP: tl.constexpr, CB: tl.constexpr, DEPTH_SHIFT: tl.constexpr,
                      ROW_BITS: tl.constexpr, HI: tl.constexpr, GATE_K: tl.constexpr = 0, GKP: tl.constexpr = 1,
                      PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the candidates are the drafter's, the lead the lookup's
    if GATE_K > 0:  # the lookup's LeadGate on the depth-1 candidates: a refused lead covers no depth (assemble too)
        leads = gate_leads(tl.load(lead_ptr), tok_ptr, prob_ptr, doubt, GATE_K, GKP)
        tl.store(lead_n_ptr, tl.where(leads, tl.load(lead_n_ptr), 0))
        tl.debug_barrier()  # the lattice reads it back
    NO_KEY: tl.constexpr = (1 << 63) - 1
    # Scratch the pops read one element of (an element of a register tensor costs a reduction over it): lat_ptr
    # holds the led lattice [DP, KP] (past RANKED rank 0 alone), then each row's score [RP]; rbits_ptr each row's
    # ancestor bits [RP] (and rows 64.. in [RP] more: HI, trees of more than 64 rows).
    j2 = tl.arange(0, KP)[None, :]
    for c in tl.static_range(0, DP, CB):
        d2 = c + tl.arange(0, CB)[:, None]
        lat = _lattice(tok_ptr, prob_ptr, lead_ptr, lead_n_ptr, d2, j2, D, K, WIDTH, KP, HAS_LEAD)
        tl.store(lat_ptr + d2 * KP + j2, tl.where((d2 < RANKED) | (j2 == 0), lat, -1.0), mask=d2 < DP)
    ROWS: tl.constexpr = DP * KP
    tl.store(lat_ptr + ROWS, 1.0)  # the root: score 1, ancestor bit 0
    tl.store(rbits_ptr, tl.full([], 1, tl.int64))
    if HI:
        tl.store(rbits_ptr + RP, tl.full([], 0, tl.int64))
    tl.debug_barrier()
    # The frontier: R entries (each pop adds one at most). An entry's key is depth << DEPTH_SHIFT | its ranks as
    # base-2^BITS digits << ROW_BITS | its parent's row; (score, key) is the heap's order (the ranks' digits make
    # the key unique, so the parent's row below them changes no comparison). No entry: score -1, key NO_KEY.
    f = tl.arange(0, RP)
    first = tl.load(lat_ptr)
    score = tl.where(f == 0, first, -1.0)
    dkey = tl.where((f == 0) & _flag(first >= 0.0), 1 << DEPTH_SHIFT, NO_KEY).to(tl.int64)
    used = 1
    f64 = f.to(tl.int64)
    anc_bits = tl.where(f < 64, tl.full([RP], 1, tl.int64) << (f64 & 63), 0)  # dead rows: themselves
    anc_hi = tl.where(f >= 64, tl.full([RP], 1, tl.int64) << (f64 & 63), 0)
    node_src = tl.zeros([RP], dtype=tl.int64)  # node i at entry i
    row_par = tl.full([RP], -1, tl.int64)  # dead rows: no parent, depth 0
    row_depth = tl.zeros([RP], dtype=tl.int64)
    for i in range(R - 1):
        best, dk = tl.reduce((score, dkey), 0, _frontier_best)
        live = _flag(dk < NO_KEY)
        sel = (dkey == dk) & live
        prow = dk & ((1 << ROW_BITS) - 1)
        depth = (dk >> DEPTH_SHIFT).to(tl.int32)  # all ones when the frontier is empty: no candidate there
        code = (dk >> ROW_BITS) & ((1 << (DEPTH_SHIFT - ROW_BITS)) - 1)
        r = tl.where(depth <= RANKED, code & ((1 << BITS) - 1), 0).to(tl.int32)  # past RANKED: rank 0, no digit
        ps = tl.load(lat_ptr + ROWS + prow, mask=live, other=0.0)
        pb = tl.load(rbits_ptr + prow, mask=live, other=0)
        sib = tl.load(lat_ptr + (depth - 1) * KP + r + 1, mask=live & (r + 1 < KP), other=-1.0)
        child = tl.load(lat_ptr + depth * KP, mask=live & (depth < D), other=-1.0)  # none past the last depth
        one = tl.full([], 1, tl.int64)
        row = one * 0 + i + 1  # (the interpreter's loop index is an int)
        row_bit = tl.where(row < 64, one << (row & 63), 0)
        node_src = tl.where((f == i) & live, ((depth - 1) * K + r).to(tl.int64), node_src)
        at_row = (f == i + 1) & live
        anc_bits = tl.where(at_row, pb | row_bit, anc_bits)
        row_par = tl.where(at_row, prow, row_par)
        row_depth = tl.where(at_row, depth.to(tl.int64), row_depth)
        tl.store(lat_ptr + ROWS + row, best, mask=live)
        tl.store(rbits_ptr + row, pb | row_bit, mask=live)
        if HI:
            pb_hi = tl.load(rbits_ptr + RP + prow, mask=live, other=0)
            row_bit_hi = tl.where(row >= 64, one << (row & 63), 0)
            anc_hi = tl.where(at_row, pb_hi | row_bit_hi, anc_hi)
            tl.store(rbits_ptr + RP + row, pb_hi | row_bit_hi, mask=live)
        has_sib = _flag(sib >= 0.0)
        score = tl.where(sel, tl.where(has_sib, ps * sib, -1.0), score)
        dkey = tl.where(sel, tl.where(has_sib, dk + (1 << ROW_BITS), NO_KEY), dkey)
        has_child = _flag(child >= 0.0) & live
        new = (f == used) & has_child
        score = tl.where(new, best * child, score)
        digits = tl.where(depth < RANKED, code << BITS, code)
        dkey = tl.where(new, ((depth + 1).to(tl.int64) << DEPTH_SHIFT) | (digits << ROW_BITS) | row, dkey)
        used = used + tl.where(has_child, 1, 0)
        tl.debug_barrier()  # this row's score and bits before a later pop reads them as a parent's
    # The rows' ancestor masks and (HAS_BS) their ancestors' slots by depth, CB columns a turn of a loop that is not
    # unrolled: the unrolled [RP, CB] int64 tiles of every turn spilled 22 KB a thread at 128 rows (ptxas).
    r_ok = f < R
    tl.store(src_ptr + f, node_src, mask=f < R - 1)
    tl.store(par_ptr + f, row_par, mask=r_ok)
    tl.store(depth_ptr + f, row_depth, mask=r_ok)
    tl.store(pos_ptr + f, row_depth, mask=r_ok)
    tl.debug_barrier()  # the depths, read back a column at a time below
    ri = f[:, None]
    for c in range(0, RP, CB):
        rj = c + tl.arange(0, CB)[None, :]
        word = anc_bits[:, None]
        if HI:
            word = tl.where(rj >= 64, anc_hi[:, None], word)
        is_anc = ((word >> (rj.to(tl.int64) & 63)) & 1) != 0
        ok = (ri < R) & (rj < R)
        tl.store(tanc_ptr + ri * R + rj, is_anc.to(tl.uint8), mask=ok)
        tl.store(anc_ptr + ri * W + rj, is_anc, mask=ok)
        if HAS_BS:  # row i's ancestor at depth e is the one ancestor of that depth
            col_depth = tl.load(depth_ptr + rj, mask=rj < R, other=0)
            tl.store(bs_ptr + ri * W + col_depth, rj.to(tl.int64), mask=ok & is_anc)
    if HAS_BS:  # entries past a row's depth are -1
        for c in range(0, WP, CB):
            e = c + tl.arange(0, CB)[None, :]
            tl.store(bs_ptr + ri * W + e, tl.full([RP, CB], -1, tl.int64),
                     mask=(ri < R) & (e < W) & (e > row_depth[:, None]))
    release_successor(PDL)


def grow_tree(tokens, probs, lead, lead_depths, width: int, block: TreeBlock, ranked: int | None = None,
              gate: LeadGate | None = None) -> None:
    """grow_tree_ref's writes in one launch (one program)."""
    ranked = _check_grow(tokens, probs, lead, lead_depths, width, block, ranked or tokens.shape[0], gate)
    dev, (depth, k), rows, w = tokens.device, tokens.shape, block.rows, block.positions.shape[0]
    check_launchable(_grow_tree_kernel, dev)
    p2 = triton.next_power_of_2
    has_bs = block.block_slots is not None
    # Scratch: the lattice and the rows' scores (float64), the rows' ancestor words (int64).
    dp, kp, rp = p2(depth), p2(k), p2(rows)
    lattice = torch.empty(dp * kp + rp, dtype=torch.float64, device=dev)
    row_bits = torch.empty(2 * rp, dtype=torch.int64, device=dev)
    gate_k = 0 if gate is None else min(gate.agree_topk, k)
    _grow_tree_kernel[(1,)](tokens, probs, tokens if lead is None else lead,
                            block.depths if lead_depths is None else lead_depths, block.node_src, block.parents,
                            block.tree_anc, block.depths, block.positions, block.anc,
                            block.block_slots if has_bs else block.depths, lattice, row_bits,
                            0.0 if gate is None else gate.doubt_prob, D=depth, K=k,
                            WIDTH=width, BITS=_code_bits(width), R=rows, W=w, RANKED=ranked,
                            HAS_LEAD=lead is not None, HAS_BS=has_bs, DP=dp, KP=kp, RP=rp, WP=p2(w),
                            CB=min(16, rp), DEPTH_SHIFT=DEPTH_SHIFT, ROW_BITS=ROW_BITS, HI=rp > 64,
                            GATE_K=gate_k, GKP=triton.next_power_of_2(max(gate_k, 1)), num_warps=1,
                            **pdl_launch(dev))
