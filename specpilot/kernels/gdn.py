"""Tree-structured gated delta rule (Gated DeltaNet, as in Qwen3-Next) over T verify nodes, with its torch reference.

Each node i of a draft block has a parent; its recurrent state is the gated delta update of its parent's state:
    S_i = S_p * exp(g_i);   S_i += k_i (x) (beta_i * (v_i - S_i^T k_i));   o_i = S_i^T q_i
with S [heads, d_k, d_v] in fp32, q already l2-normalised and scaled by d_k^-0.5 (as transformers does before its
recurrent rule). Parent -1 is the committed state `state0`. A chain is the special case parents[i] = i - 1.

States follow parent pointers instead of being copied per node: the scan walks the nodes in order and keeps one
state on chip, owned by the last node that kept it. A node whose parent owns the on-chip state continues from
it; any other node *resumes* from memory: from `state0` (parent -1) or from its parent's stored checkpoint
`nodes[store[parent]]`. A *held* node (hold[i] != 0, e.g. a leaf) leaves its parent's state on chip, so its
siblings continue from registers too: a tree ordered depth-first with leaf children first resumes no more often
than a chain. Only nodes with store[i] >= 0 are written out; the caller stores every node some other node
resumes from (see specpilot.engines.hybrid.state.BlockSchedule). A launch may cover a slice of the block
(`offset` = the global index of its first node, which always resumes); `parents` and `hold` hold the launch's
nodes, `store` is indexed by global node.

Exactness: a node's arithmetic does not depend on T, offset, the other nodes, or on whether its parent's state
came from registers or from memory (fp32 stored, an exact round trip), so a node computed inside a tree, in a
chain, alone (autoregressive decoding) or replayed from a checkpoint gets the same bits under one backend.
`block_v` and `num_warps` may change the order of the d_k reduction: fix them per model, never per call.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import LaunchParams, check_int, check_launchable, check_out, check_tensor, next_pow2


@dataclasses.dataclass(frozen=True)
class GdnParams(LaunchParams):
    """block_v: value columns per program; sets the reduction layout, so it is per model, not per call."""

    block_v: int = 32
    num_warps: int = 4
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"block_v": (16, 32, 64), "num_warps": (2, 4, 8)}


@triton.jit(do_not_specialize=["T", "offset"])
def _tree_gdn_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, hold_ptr, store_ptr, state0_ptr, nodes_ptr,
                     o_ptr, T, offset, HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    hk = h // (HV // HK)  # value head h reads key head h // group (transformers' repeat_interleave)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    m2 = mk[:, None] & mv[None, :]
    st = h * DK * DV + rk[:, None] * DV + rv[None, :]  # offsets inside one [HV, DK, DV] state
    S = tl.zeros([BK, BV], dtype=tl.float32)
    owner = offset * 0 - 2  # node whose state is on chip (-1: state0, -2: none yet)
    for i in range(T):
        node = offset + i
        p = tl.load(parents_ptr + i).to(tl.int32)
        resume = p != owner
        slot = tl.load(store_ptr + tl.maximum(p, 0))
        from0 = tl.load(state0_ptr + st, mask=m2 & resume & (p < 0), other=0.0)
        fromslot = tl.load(nodes_ptr + tl.maximum(slot, 0).to(tl.int64) * (HV * DK * DV) + st,
                           mask=m2 & resume & (p >= 0), other=0.0)
        S = tl.where(resume, tl.where(p < 0, from0, fromslot), S)  # the parent's state
        kt = tl.load(k_ptr + (i * HK + hk) * DK + rk, mask=mk, other=0.0)
        qt = tl.load(q_ptr + (i * HK + hk) * DK + rk, mask=mk, other=0.0)
        vt = tl.load(v_ptr + (i * HV + h) * DV + rv, mask=mv, other=0.0)
        gt = tl.load(g_ptr + i * HV + h)
        bt = tl.load(beta_ptr + i * HV + h)
        N = S * tl.exp(gt)
        kv_mem = tl.sum(N * kt[:, None], axis=0)
        delta = (vt - kv_mem) * bt
        N = N + kt[:, None] * delta[None, :]
        o = tl.sum(N * qt[:, None], axis=0)
        tl.store(o_ptr + (i * HV + h) * DV + rv, o, mask=mv)
        mine = tl.load(store_ptr + node)
        tl.store(nodes_ptr + tl.maximum(mine, 0).to(tl.int64) * (HV * DK * DV) + st, N, mask=m2 & (mine >= 0))
        held = tl.load(hold_ptr + i) != 0
        S = tl.where(held, S, N)
        owner = tl.where(held, p, node)


def gdn_step_ref(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One node, all heads: state [HV, DK, DV]; q, k [HV, DK]; v [HV, DV]; g, beta [HV]. Same ops, same order as
    transformers' torch_recurrent_gated_delta_rule. Returns (new state, o [HV, DV])."""
    state = state * g.exp()[:, None, None]
    kv_mem = (state * k[:, :, None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, (state * q[:, :, None]).sum(dim=-2)


def tree_gdn_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 parents: torch.Tensor, hold: torch.Tensor, store: torch.Tensor, state0: torch.Tensor,
                 nodes: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Plain torch, same contract as `tree_gdn` (CPU path of the engine). Writes nodes[store[i]]; returns o."""
    T = q.shape[0]
    group = v.shape[1] // k.shape[1]
    qh, kh = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    par, held, slots = parents.tolist(), hold.tolist(), store.tolist()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    state, owner = state0, -2
    for i in range(T):
        node, p = offset + i, par[i]
        if p != owner:
            if p >= 0 and slots[p] < 0:
                raise ValueError(f"node {node} resumes from parent {p}, whose state is not stored")
            state = state0 if p < 0 else nodes[slots[p]]
        new, o[i] = gdn_step_ref(state, qh[i], kh[i], v[i], g[i], beta[i])
        if slots[node] >= 0:
            nodes[slots[node]].copy_(new)
        if held[i]:
            owner = p
        else:
            state, owner = new, node
    return o


def tree_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             parents: torch.Tensor, hold: torch.Tensor, store: torch.Tensor, state0: torch.Tensor,
             nodes: torch.Tensor, offset: int = 0, *, out: torch.Tensor | None = None, block_v: int = 32,
             num_warps: int = 4) -> torch.Tensor:
    """o [T, HV, DV] fp32 for q, k [T, HK, DK], v [T, HV, DV], g, beta [T, HV] (all fp32, contiguous).

    parents [T] (global node indices, -1 = state0), hold [T] (nonzero: keep the parent's state on chip after the
    node) and store [N] (slot per global node, -1 = not stored) are int32/int64 on the same device; state0
    [HV, DK, DV] and nodes [slots, HV, DK, DV] are fp32. The caller guarantees every resumed parent is stored
    (the reference raises otherwise; the kernel cannot check).
    """
    params = GdnParams(block_v=block_v, num_warps=num_warps)
    f32 = torch.float32
    check_tensor("k", k, (None, None, None), f32)
    dev = k.device
    T, HK, DK = k.shape
    if T < 1:
        raise ValueError("k must hold at least one node")
    check_tensor("q", q, (T, HK, DK), f32, dev)
    check_tensor("v", v, (T, None, None), f32, dev)
    HV, DV = v.shape[1], v.shape[2]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    check_tensor("g", g, (T, HV), f32, dev)
    check_tensor("beta", beta, (T, HV), f32, dev)
    check_tensor("parents", parents, (T,), (torch.int32, torch.int64), dev)
    check_tensor("hold", hold, (T,), (torch.int32, torch.int64), dev)
    check_tensor("store", store, (None,), (torch.int32, torch.int64), dev)
    offset = check_int("offset", offset, 0)
    if store.shape[0] < offset + T:
        raise ValueError(f"store has {store.shape[0]} entries but the launch covers nodes {offset}..{offset + T - 1}")
    check_tensor("state0", state0, (HV, DK, DV), f32, dev)
    check_tensor("nodes", nodes, (None, HV, DK, DV), f32, dev)
    check_launchable(_tree_gdn_kernel, dev)
    out = check_out("out", out, (T, HV, DV), f32, dev)
    grid = (HV, triton.cdiv(DV, params.block_v))
    _tree_gdn_kernel[grid](q, k, v, g, beta, parents, hold, store, state0, nodes, out, T, offset, HV=HV, HK=HK, DK=DK,
                           DV=DV, BK=next_pow2(DK), BV=params.block_v, num_warps=params.num_warps)
    return out
