"""The device loop's glue around the target's forward, as one-program kernels (engines.device_loop): a step's draft
block assembled from the drafter's candidates (and, for position-ordered attention, its ancestor slots), and a
chain's or a static tree's outcome committed.

In torch each side was ~15 small launches a step (gather, cat, compare, cumprod, index_select, the lookup's
sort/gather/cat/where, the tree's ancestor matmul/argmax/scatter, llama.ancestor_slots' ~8, state updates): ~33 a
chain + lookup step at ~1.5 us each inside the loop's CUDA graph (`scripts/gpu_block_drafter_step.py`, section
loop_kernels). The work is integer selection (and copies of probabilities), so the kernels equal their torch
references exactly; the device loop runs the references on CPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specpilot.kernels._common import check_launchable, check_tensor
from specpilot.kernels.pdl import pdl_launch, release_successor, wait_for_predecessor


def lead_rows(tokens: torch.Tensor, probs: torch.Tensor, lead: torch.Tensor, use: torch.Tensor):
    """NgramPrefixDrafter's lead_with at the depths where `use`: lead [depth] first (probability 1), the candidates
    tokens/probs [depth, k] after it in their order, a duplicate of it dropped (a stable sort moves it last), k
    kept."""
    order = torch.sort((tokens == lead[:, None]).to(torch.int32), dim=1, stable=True).indices
    led_tokens = torch.cat([lead[:, None], tokens.gather(1, order)[:, :-1]], 1)
    led_probs = torch.cat([torch.ones_like(probs[:, :1]), probs.gather(1, order)[:, :-1]], 1)
    return torch.where(use[:, None], led_tokens, tokens), torch.where(use[:, None], led_probs, probs)


def check_candidates(tokens, probs, lead, lead_depths) -> torch.device:
    """A step's drafted candidates tokens / probs [depth, k] and the lookup's lead [depth] with the depths it covers
    (both or neither); returns their device."""
    check_tensor("tokens", tokens, (None, None), torch.int64)
    dev, (depth, k) = tokens.device, tokens.shape
    check_tensor("probs", probs, (depth, k), torch.float32, dev)
    if (lead is None) != (lead_depths is None):
        raise ValueError("lead and lead_depths come together (a lookup's tokens and how many depths they cover)")
    if lead is not None:
        check_tensor("lead", lead, (depth,), torch.int64, dev)
        _check_count("lead_depths", lead_depths, dev)
    return dev


def _check_assemble(tokens, probs, lead, lead_depths, state, node_src, rel_positions, rel_slots, rel_block_slots):
    dev = check_candidates(tokens, probs, lead, lead_depths)
    check_tensor("state", state, (2,), torch.int64, dev)
    check_tensor("node_src", node_src, (None,), torch.int64, dev)
    check_tensor("rel_positions", rel_positions, (None,), torch.int64, dev)
    check_tensor("rel_slots", rel_slots, rel_positions.shape, torch.int64, dev)
    if node_src.shape[0] + 1 > rel_positions.shape[0]:
        raise ValueError(f"{node_src.shape[0]} draft nodes and the root do not fit a {rel_positions.shape[0]}-row "
                         "block")
    if rel_block_slots is not None:
        check_tensor("rel_block_slots", rel_block_slots, (rel_positions.shape[0], None), torch.int64, dev)


def assemble_ref(tokens, probs, lead, lead_depths, state, node_src, rel_positions, rel_slots, rel_block_slots=None):
    """A step's draft block -> (candidates [depth, k] and their probabilities, led by `lead` at depths below
    lead_depths when given; the block's token ids [W]: the pending token state[0], then node i's candidate
    (flat index node_src[i] into the led candidates), then zeros; its positions and slots: state[1] + rel_*;
    with rel_block_slots [W, A] (a static tree's ancestor slots relative to its base, -1: none), the attention's
    block_slots: state[1] + rel where rel >= 0, else -1 (llama.ancestor_slots of the block, without its ~8
    launches a step), else None)."""
    _check_assemble(tokens, probs, lead, lead_depths, state, node_src, rel_positions, rel_slots, rel_block_slots)
    if lead is not None:
        depths = torch.arange(tokens.shape[0], device=tokens.device)
        tokens, probs = lead_rows(tokens, probs, lead, depths < lead_depths.reshape(()))
    pad = torch.zeros(rel_positions.shape[0] - node_src.shape[0] - 1, dtype=torch.int64, device=tokens.device)
    ids = torch.cat([state[:1], tokens.reshape(-1)[node_src], pad])
    block_slots = None if rel_block_slots is None else torch.where(rel_block_slots >= 0, state[1] + rel_block_slots,
                                                                   -1)
    return tokens, probs, ids, state[1] + rel_positions, state[1] + rel_slots, block_slots


@triton.jit
def _led_source(tok_ptr, lead_ptr, n_lead, d, j, row_ok, K: tl.constexpr, KP: tl.constexpr):
    """(token, flat source index or -1 for the lead itself) of candidate j at depth d after leading: the lead
    first, the others in order without its duplicate. d, j: broadcastable [R, 1] / [R, 1] or [1, KP]."""
    kk = tl.arange(0, KP)[None, :]
    row = tl.load(tok_ptr + d * K + kk, mask=row_ok & (kk < K), other=-1)
    lead = tl.load(lead_ptr + d, mask=row_ok, other=-2)  # token ids are >= 0: -1 and -2 never match
    dup = tl.min(tl.where((kk < K) & (row == lead), kk, K), axis=1)[:, None]  # K: no duplicate
    src = tl.where(j - 1 < dup, j - 1, j)
    use = d < n_lead
    flat = tl.where(use, tl.where(j == 0, -1, d * K + src), d * K + j)
    return tl.where(use & (j == 0), lead, tl.load(tok_ptr + tl.maximum(flat, 0), mask=row_ok & (j < K))), flat


@triton.jit
def _assemble_kernel(tok_ptr, prob_ptr, lead_ptr, lead_n_ptr, state_ptr, src_ptr, rpos_ptr, rslot_ptr, rbs_ptr,
                     out_tok_ptr, out_prob_ptr, ids_ptr, pos_ptr, slot_ptr, bs_ptr,
                     D: tl.constexpr, K: tl.constexpr, N: tl.constexpr, W: tl.constexpr, A: tl.constexpr,
                     HAS_LEAD: tl.constexpr, HAS_BS: tl.constexpr, DP: tl.constexpr, KP: tl.constexpr,
                     NP: tl.constexpr, WP: tl.constexpr, AP: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the candidates and the state are the previous kernels' writes
    d = tl.arange(0, DP)[:, None]
    j = tl.arange(0, KP)[None, :]
    ok = (d < D) & (j < K)
    i = tl.arange(0, NP)
    i_ok = i < N
    src = tl.load(src_ptr + i, mask=i_ok, other=0)
    if HAS_LEAD:
        n_lead = tl.load(lead_n_ptr)
        tok, flat = _led_source(tok_ptr, lead_ptr, n_lead, d, j, d < D, K, KP)
        prob = tl.where(flat < 0, 1.0, tl.load(prob_ptr + tl.maximum(flat, 0), mask=ok, other=0.0))
        node, _ = _led_source(tok_ptr, lead_ptr, n_lead, (src // K)[:, None], (src % K)[:, None], i_ok[:, None],
                              K, KP)
        node = tl.reshape(node, [NP])
    else:
        tok = tl.load(tok_ptr + d * K + j, mask=ok, other=0)
        prob = tl.load(prob_ptr + d * K + j, mask=ok, other=0.0)
        node = tl.load(tok_ptr + src, mask=i_ok, other=0)
    tl.store(out_tok_ptr + d * K + j, tok, mask=ok)
    tl.store(out_prob_ptr + d * K + j, prob, mask=ok)
    w = tl.arange(0, WP)
    w_ok = w < W
    base = tl.load(state_ptr + 1)
    tl.store(ids_ptr + w, tl.where(w == 0, tl.load(state_ptr), 0), mask=w_ok & ((w == 0) | (w > N)))
    tl.store(ids_ptr + 1 + i, node, mask=i_ok)
    tl.store(pos_ptr + w, base + tl.load(rpos_ptr + w, mask=w_ok, other=0), mask=w_ok)
    tl.store(slot_ptr + w, base + tl.load(rslot_ptr + w, mask=w_ok, other=0), mask=w_ok)
    if HAS_BS:
        e = tl.arange(0, AP)[None, :]
        bs_ok = w_ok[:, None] & (e < A)
        rel = tl.load(rbs_ptr + w[:, None] * A + e, mask=bs_ok, other=-1)
        tl.store(bs_ptr + w[:, None] * A + e, tl.where(rel >= 0, base + rel, -1), mask=bs_ok)
    release_successor(PDL)


# Warps of an assemble launch whose block slots pass 64 x 64 (a 128-row tree: 128 KB read and written; one warp took
# 46 of a step's 3095 profiler us, session 47). Its only reduction is an integer min: any warp count, the same bits.
ASSEMBLE_WIDE_WARPS = 4


def assemble(tokens, probs, lead, lead_depths, state, node_src, rel_positions, rel_slots, rel_block_slots=None):
    """assemble_ref's results in one launch."""
    _check_assemble(tokens, probs, lead, lead_depths, state, node_src, rel_positions, rel_slots, rel_block_slots)
    dev, (depth, k), n, w = tokens.device, tokens.shape, node_src.shape[0], rel_positions.shape[0]
    check_launchable(_assemble_kernel, dev)
    out_tok, out_prob = torch.empty_like(tokens), torch.empty_like(probs)
    ids, pos, slots = (torch.empty(w, dtype=torch.int64, device=dev) for _ in range(3))
    has_bs = rel_block_slots is not None
    a = rel_block_slots.shape[1] if has_bs else 1
    block_slots = torch.empty(w, a, dtype=torch.int64, device=dev) if has_bs else None
    p2 = triton.next_power_of_2
    _assemble_kernel[(1,)](tokens, probs, tokens if lead is None else lead,
                           state if lead_depths is None else lead_depths, state, node_src, rel_positions, rel_slots,
                           rel_block_slots if has_bs else ids, out_tok, out_prob, ids, pos, slots,
                           block_slots if has_bs else ids, D=depth, K=k, N=n, W=w, A=a, HAS_LEAD=lead is not None,
                           HAS_BS=has_bs, DP=p2(depth), KP=p2(k), NP=p2(max(n, 1)), WP=p2(w), AP=p2(a),
                           num_warps=ASSEMBLE_WIDE_WARPS if w * a > 64 * 64 else 1, **pdl_launch(dev))
    return out_tok, out_prob, ids, pos, slots, block_slots


class LoopStop(NamedTuple):
    """The host's stop rule, tracked on the device so that a chunk queued behind a stop can be skipped (the
    conditional node of engines.graph_if reads ctl's live): ids [E] int64, the EOS tokens (-1 pads: no token
    matches); ctl [3] int64 (tokens the request may still commit, steps run while live, live 0/1), written by each
    commit. A step commits its path's first accepted + 1 tokens; the request stops after a step that commits an EOS
    or reaches the token limit, as EnginePolicy.commit stops it."""
    ids: torch.Tensor
    ctl: torch.Tensor


def _check_stop(stop: LoopStop | None, dev) -> None:
    if stop is not None:
        check_tensor("stop ids", stop.ids, (None,), torch.int64, dev)
        check_tensor("stop ctl", stop.ctl, (3,), torch.int64, dev)
        if stop.ids.shape[0] < 1:
            raise ValueError("stop ids: at least one entry (pad with -1)")


def stop_update_ref(tokens: torch.Tensor, accepted: torch.Tensor, stop: LoopStop) -> None:
    """The step's committed tokens (tokens[:accepted + 1]) against the stop rule; ctl updated in place."""
    ids, ctl = stop
    committed = torch.arange(tokens.shape[0], device=tokens.device) <= accepted
    hit = (torch.isin(tokens, ids) & committed).any()
    was = ctl[2] != 0
    left = torch.where(was, ctl[0] - accepted - 1, ctl[0])
    ctl.copy_(torch.stack([left, ctl[1] + was.long(), (was & ~hit & (left > 0)).long()]))


@triton.jit
def _stop_update(tokens, idx, accepted, ok, ids_ptr, ctl_ptr, E: tl.constexpr, EP: tl.constexpr):
    """stop_update_ref inside a commit kernel: tokens/idx/ok [N] (path tokens, their depth, valid)."""
    e = tl.arange(0, EP)
    stop_ids = tl.load(ids_ptr + e, mask=e < E, other=-1)
    committed = ok & (idx <= accepted)
    hit = tl.max(tl.where(committed[:, None] & (tokens[:, None] == stop_ids[None, :]), 1, 0))
    left = tl.load(ctl_ptr)
    ran = tl.load(ctl_ptr + 1)
    was = tl.load(ctl_ptr + 2) != 0
    new_left = tl.where(was, left - accepted - 1, left)
    tl.debug_barrier()  # every thread has read ctl before any writes it
    tl.store(ctl_ptr, new_left)
    tl.store(ctl_ptr + 1, ran + was.to(tl.int64))
    tl.store(ctl_ptr + 2, (was & (hit == 0) & (new_left > 0)).to(tl.int64))


def _check_count(name, t, dev):
    """A one-element int64 count on the device (a 0-d or [1] tensor)."""
    check_tensor(name, t, None, torch.int64, dev)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one count, got shape {list(t.shape)}")


def _check_outcome(argmax, ids, state, sequence, stop) -> tuple[torch.device, int]:
    """What both commits read: argmax [R] of a block whose ids hold at least R rows, the state, the sequence copy,
    the stop rule."""
    check_tensor("argmax", argmax, (None,), torch.int64)
    dev, rows = argmax.device, argmax.shape[0]
    check_tensor("ids", ids, (None,), torch.int64, dev)
    if ids.shape[0] < rows:
        raise ValueError(f"ids has {ids.shape[0]} rows, the block's argmax {rows}")
    check_tensor("state", state, (2,), torch.int64, dev)
    if sequence is not None:
        check_tensor("sequence", sequence, (None,), torch.int64, dev)
    _check_stop(stop, dev)
    return dev, rows


def _check_commit(argmax, ids, proposed, state, sequence, stop):
    dev, _ = _check_outcome(argmax, ids, state, sequence, stop)
    _check_count("proposed", proposed, dev)


def chain_commit_ref(argmax, ids, proposed, state, sequence=None, stop=None):
    """A chain step's outcome: argmax [R] of the block ids[:R] (root, then R - 1 draft tokens). Accepted = the
    leading drafts equal to the argmax at their parent, at most `proposed`; path tokens = argmax [R] (commit the
    first accepted + 1: the drafts, then the bonus). state = (pending, base) becomes (bonus, base + accepted + 1);
    sequence (a lookup's copy of the sequence by position), when given, gets the path tokens at base + 1...; stop
    (LoopStop), when given, is updated. Returns (path tokens [R], accepted 0-d)."""
    _check_commit(argmax, ids, proposed, state, sequence, stop)
    rows = argmax.shape[0]
    matched = ids[1:rows] == argmax[:rows - 1]
    accepted = torch.minimum(matched.long().cumprod(0).sum(), proposed.reshape(()))
    path = argmax.clone()
    base = state[1].clone()
    if sequence is not None:
        sequence.index_copy_(0, base + 1 + torch.arange(rows, device=argmax.device), path)
    state.copy_(torch.cat([torch.index_select(path, 0, accepted.view(1)), (base + accepted + 1).view(1)]))
    if stop is not None:
        stop_update_ref(path, accepted, stop)
    return path, accepted


@triton.jit
def _chain_commit_kernel(argmax_ptr, ids_ptr, proposed_ptr, state_ptr, seq_ptr, path_ptr, acc_ptr, stop_ptr, ctl_ptr,
                         R: tl.constexpr, RP: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_STOP: tl.constexpr,
                         E: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the argmax is the target's
    i = tl.arange(0, RP)
    ok = i < R
    am = tl.load(argmax_ptr + i, mask=ok, other=0)
    draft = i >= 1
    parent = tl.load(argmax_ptr + i - 1, mask=ok & draft, other=-1)
    node = tl.load(ids_ptr + i, mask=ok & draft, other=-2)
    first_miss = tl.min(tl.where(ok & draft & (node != parent), i, R), axis=0)
    accepted = tl.minimum(first_miss.to(tl.int64) - 1, tl.load(proposed_ptr))
    base = tl.load(state_ptr + 1)
    bonus = tl.sum(tl.where(i == accepted, am, 0), axis=0)
    tl.store(path_ptr + i, am, mask=ok)
    tl.store(acc_ptr, accepted)
    if HAS_SEQ:
        tl.store(seq_ptr + base + 1 + i, am, mask=ok)
    tl.debug_barrier()  # every thread has read the old state before any writes the new one
    tl.store(state_ptr, bonus)
    tl.store(state_ptr + 1, base + accepted + 1)
    if HAS_STOP:
        _stop_update(am, i, accepted, ok, stop_ptr, ctl_ptr, E, EP)
    release_successor(PDL)


def _stop_args(stop, fallback) -> dict:
    """A commit kernel's stop arguments (pointers and constexprs; `fallback` stands in for absent pointers)."""
    if stop is None:
        return {"stop_ptr": fallback, "ctl_ptr": fallback, "HAS_STOP": False, "E": 1, "EP": 1}
    n = stop.ids.shape[0]
    return {"stop_ptr": stop.ids, "ctl_ptr": stop.ctl, "HAS_STOP": True, "E": n, "EP": triton.next_power_of_2(n)}


def chain_commit(argmax, ids, proposed, state, sequence=None, stop=None):
    """chain_commit_ref's results and writes in one launch."""
    _check_commit(argmax, ids, proposed, state, sequence, stop)
    rows = argmax.shape[0]
    check_launchable(_chain_commit_kernel, argmax.device)
    path = torch.empty_like(argmax)
    accepted = torch.empty((), dtype=torch.int64, device=argmax.device)
    _chain_commit_kernel[(1,)](argmax, ids, proposed, state, state if sequence is None else sequence, path,
                               accepted, R=rows, RP=triton.next_power_of_2(rows), HAS_SEQ=sequence is not None,
                               num_warps=1, **_stop_args(stop, state), **pdl_launch(argmax.device))
    return path, accepted


def _check_tree(argmax, ids, parents, anc, depths, state, sequence, depth_rows, stop):
    dev, rows = _check_outcome(argmax, ids, state, sequence, stop)
    check_tensor("parents", parents, (rows,), torch.int64, dev)
    check_tensor("anc", anc, (rows, rows), torch.uint8, dev)
    check_tensor("depths", depths, (rows,), torch.int64, dev)
    if not 1 <= depth_rows <= rows:
        raise ValueError(f"depth_rows={depth_rows} must be in 1..{rows}")


def tree_commit_ref(argmax, ids, parents, anc, depths, state, depth_rows, sequence=None, stop=None):
    """A static tree step's outcome: argmax [R] of the block ids[:R] (root, then draft node i at row i with parent
    parents[i] (-1: the root's), ancestors-or-self anc [R, R] (uint8), depth depths[i]). A node is accepted when
    every node on its path equals the argmax at its parent; the deepest wins (siblings differ; ties: the lowest
    row). Returns (path rows [depth_rows]: the row of its ancestor at each depth, 0 past it; path tokens
    [depth_rows] = argmax at those rows (commit the first accepted + 1); accepted 0-d; the next state (bonus,
    base + accepted + 1)). state itself is left alone (the caller moves the path's keys/values from base first);
    sequence, when given, gets the path tokens at base + 1..; stop (LoopStop), when given, is updated."""
    _check_tree(argmax, ids, parents, anc, depths, state, sequence, depth_rows, stop)
    rows = argmax.shape[0]
    matched = torch.cat([torch.ones(1, dtype=torch.bool, device=argmax.device),
                         ids[1:rows] == argmax[parents[1:].clamp(min=0)]])
    ok = ~((anc != 0) & ~matched[None, :]).any(1)  # no miss among a node's ancestors-or-self
    best = torch.argmax(ok.long() * depths).view(1)  # the first deepest
    accepted = torch.index_select(depths, 0, best)[0]
    on_path = torch.index_select(anc, 0, best)[0] != 0
    d = torch.arange(depth_rows, device=argmax.device)
    rows_at = torch.arange(rows, device=argmax.device)
    path = ((on_path[None, :] & (depths[None, :] == d[:, None])).long() * rows_at[None, :]).sum(1)
    tokens = argmax[path]
    if sequence is not None:
        sequence.index_copy_(0, state[1] + 1 + d, tokens)
    next_state = torch.cat([torch.index_select(tokens, 0, accepted.view(1)), (state[1] + accepted + 1).view(1)])
    if stop is not None:
        stop_update_ref(tokens, accepted, stop)
    return path, tokens, accepted, next_state


@triton.jit
def _tree_commit_kernel(argmax_ptr, ids_ptr, par_ptr, anc_ptr, depth_ptr, state_ptr, seq_ptr, path_ptr, tok_ptr,
                        acc_ptr, next_ptr, stop_ptr, ctl_ptr, R: tl.constexpr, RP: tl.constexpr, DR: tl.constexpr,
                        DRP: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_STOP: tl.constexpr, E: tl.constexpr,
                        EP: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the argmax is the target's, the tree the grow kernel's
    i = tl.arange(0, RP)
    row_ok = i < R
    draft = row_ok & (i >= 1)
    parent = tl.load(par_ptr + i, mask=draft, other=0)
    matched = (i == 0) | (tl.load(ids_ptr + i, mask=draft, other=-1) ==
                          tl.load(argmax_ptr + tl.maximum(parent, 0), mask=draft, other=-2))
    r = i[:, None]
    j = i[None, :]
    anc = tl.load(anc_ptr + r * R + j, mask=(r < R) & (j < R), other=0)
    miss = (anc != 0) & (matched[None, :] == 0)
    ok = row_ok & (tl.max(miss.to(tl.int32), axis=1) == 0)
    depth = tl.load(depth_ptr + i, mask=row_ok, other=0)
    key = tl.where(ok, depth * RP + (RP - 1 - i), -1)  # deepest first, then the lowest row
    best_key = tl.max(key, axis=0)  # the root always qualifies: >= 0
    accepted = best_key // RP
    best = RP - 1 - best_key % RP
    on_path = tl.load(anc_ptr + best * R + i, mask=row_ok, other=0) != 0
    d = tl.arange(0, DRP)
    hit = on_path[None, :] & (depth[None, :] == d[:, None])
    path = tl.sum(tl.where(hit, i[None, :], 0), axis=1).to(tl.int64)  # [DRP]; 0 past the accepted depth
    d_ok = d < DR
    tokens = tl.load(argmax_ptr + path, mask=d_ok, other=0)
    base = tl.load(state_ptr + 1)
    tl.store(path_ptr + d, path, mask=d_ok)
    tl.store(tok_ptr + d, tokens, mask=d_ok)
    tl.store(acc_ptr, accepted.to(tl.int64))
    tl.store(next_ptr, tl.sum(tl.where(d == accepted, tokens, 0), axis=0))
    tl.store(next_ptr + 1, base + accepted + 1)
    if HAS_SEQ:
        tl.store(seq_ptr + base + 1 + d, tokens, mask=d_ok)
    if HAS_STOP:
        _stop_update(tokens, d, accepted.to(tl.int64), d_ok, stop_ptr, ctl_ptr, E, EP)
    release_successor(PDL)


def tree_commit(argmax, ids, parents, anc, depths, state, depth_rows, sequence=None, stop=None):
    """tree_commit_ref's results and writes in one launch."""
    _check_tree(argmax, ids, parents, anc, depths, state, sequence, depth_rows, stop)
    rows, dev = argmax.shape[0], argmax.device
    check_launchable(_tree_commit_kernel, dev)
    path, tokens = (torch.empty(depth_rows, dtype=torch.int64, device=dev) for _ in range(2))
    accepted = torch.empty((), dtype=torch.int64, device=dev)
    next_state = torch.empty(2, dtype=torch.int64, device=dev)
    p2 = triton.next_power_of_2
    _tree_commit_kernel[(1,)](argmax, ids, parents, anc, depths, state, state if sequence is None else sequence,
                              path, tokens, accepted, next_state, R=rows, RP=p2(rows), DR=depth_rows,
                              DRP=p2(depth_rows), HAS_SEQ=sequence is not None, num_warps=1,
                              **_stop_args(stop, state), **pdl_launch(dev))
    return path, tokens, accepted, next_state
