"""Greedy acceptance of a draft tree (a chain is a tree) on the device, without a host sync.

Node 0 is the root (the last committed token, always correct). Node i > 0 with parent p = parents[i] < i is
correct iff draft_tokens[i] == target_argmax[p] and p is correct. The deepest correct node is accepted (ties:
the lowest index); path = its root-to-node indices padded with -1; bonus = target_argmax[accepted node];
accepted_len = the accepted node's depth = the number of accepted draft tokens (0: none).

One program: correctness and depth of all nodes by pointer jumping (log2(BLOCK) rounds of vector gathers through
a small global scratch, with barriers between the writes and the reads), the deepest node by one max over a
(depth, -index) key, then a walk up the accepted path (its length is the accepted depth). The result is
integer and exact, so it is trivially independent of anything but the tree. A node whose parent is out of
range (not in [0, i)) cannot be reported without a host sync: the kernel treats it, and its subtree, as never
correct and reads nothing out of bounds (the reference raises instead).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import LaunchParams, check_launchable, check_out, check_tensor, next_pow2

MAX_NODES = 256


@dataclasses.dataclass(frozen=True)
class AcceptParams(LaunchParams):
    """Integer kernel: every field is T-neutral."""

    num_warps: int = 1
    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("num_warps",)
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"num_warps": (1, 2, 4)}


@triton.jit(do_not_specialize=["T"])
def _greedy_accept_kernel(tgt_ptr, draft_ptr, par_ptr, len_ptr, path_ptr, bonus_ptr, scratch_ptr, T,
                          BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    i = tl.arange(0, BLOCK)
    valid = i < T
    par = tl.load(par_ptr + i, mask=valid, other=-1)
    par_ok = valid & (i > 0) & (par >= 0) & (par < i)
    tgt = tl.load(tgt_ptr + par, mask=par_ok, other=-1)
    drf = tl.load(draft_ptr + i, mask=par_ok, other=-1)
    c = ((i == 0) | (par_ok & (drf == tgt))).to(tl.int32)  # correct, ANDed over ever longer ancestor spans
    jump = tl.where(par_ok, par, 0).to(tl.int32)  # the root (and a bad node) points to the root
    d = par_ok.to(tl.int32)  # distance from the node to `jump`
    for _ in tl.static_range(ROUNDS):
        tl.store(scratch_ptr + i, c)
        tl.store(scratch_ptr + BLOCK + i, d)
        tl.store(scratch_ptr + 2 * BLOCK + i, jump)
        tl.debug_barrier()
        cj = tl.load(scratch_ptr + jump, volatile=True)
        dj = tl.load(scratch_ptr + BLOCK + jump, volatile=True)
        jj = tl.load(scratch_ptr + 2 * BLOCK + jump, volatile=True)
        tl.debug_barrier()
        c = c & cj
        d = d + dj
        jump = jj
    key = tl.where(valid & (c == 1), d * BLOCK + (BLOCK - 1 - i), -1)
    best_key = tl.max(key, axis=0)  # the root is always correct, so best_key >= 0
    depth = best_key // BLOCK
    best = (BLOCK - 1 - best_key % BLOCK).to(tl.int64)
    tl.store(len_ptr, depth.to(tl.int64))
    tl.store(bonus_ptr, tl.load(tgt_ptr + best))
    tl.store(path_ptr + i, tl.full([BLOCK], -1, tl.int64), mask=valid & (i > depth))
    cur = best
    pos = depth
    while pos >= 0:
        tl.store(path_ptr + pos, cur)
        cur = tl.load(par_ptr + cur)
        pos -= 1


def greedy_accept_ref(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor):
    """Plain Python over the tree; returns (accepted_len [1], path [T] padded with -1, bonus [1]), int64."""
    tgt, drf, par = target_argmax.tolist(), draft_tokens.tolist(), parents.tolist()
    T = len(tgt)
    if par[0] != -1 or any(not 0 <= par[i] < i for i in range(1, T)):
        raise ValueError(f"parents must be -1 for the root and in [0, i) for node i, got {par}")
    correct = [True] * T
    depth = [0] * T
    for i in range(1, T):
        depth[i] = depth[par[i]] + 1
        correct[i] = correct[par[i]] and drf[i] == tgt[par[i]]
    best = 0
    for i in range(1, T):
        if correct[i] and depth[i] > depth[best]:
            best = i
    path = []
    node = best
    while node != -1:
        path.append(node)
        node = par[node]
    path = path[::-1] + [-1] * (T - len(path))
    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=target_argmax.device)

    return as_tensor([depth[best]]), as_tensor(path), as_tensor([tgt[best]])


def greedy_accept(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor, *,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, num_warps: int = 1):
    """(accepted_len [1], path [T], bonus [1]) int64 on the inputs' device; inputs int64 [T], 1 <= T <= 256."""
    AcceptParams(num_warps=num_warps)
    check_tensor("target_argmax", target_argmax, (None,), torch.int64)
    T = target_argmax.shape[0]
    if not 1 <= T <= MAX_NODES:
        raise ValueError(f"the tree must have 1..{MAX_NODES} nodes, got {T}")
    dev = target_argmax.device
    check_tensor("draft_tokens", draft_tokens, (T,), torch.int64, dev)
    check_tensor("parents", parents, (T,), torch.int64, dev)
    check_launchable(_greedy_accept_kernel, dev)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise ValueError("out must be a tuple (accepted_len [1], path [T], bonus [1])")
    acc_len = check_out("out[0]", None if out is None else out[0], (1,), torch.int64, dev)
    path = check_out("out[1]", None if out is None else out[1], (T,), torch.int64, dev)
    bonus = check_out("out[2]", None if out is None else out[2], (1,), torch.int64, dev)
    block = next_pow2(T)
    scratch = torch.empty(3 * block, dtype=torch.int32, device=dev)
    _greedy_accept_kernel[(1,)](target_argmax, draft_tokens, parents, acc_len, path, bonus, scratch, T,
                                BLOCK=block, ROUNDS=block.bit_length() - 1, num_warps=num_warps)
    return acc_len, path, bonus
