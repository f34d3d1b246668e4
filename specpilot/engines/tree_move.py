"""A tree step's accepted path moved into place, in one launch (the device loop's tree steps).

After a tree verify the accepted path's keys/values sit at the block rows of its nodes; AR would have put them at
slots base, base + 1, ..: they move there (entries past the accepted depth get the root's row: harmless, the next
step overwrites them), the drafter gets the path's target features in depth order, and the loop's state becomes the
commit's next state. In torch that was seven launches a step (two index adds, a gather, an index_put, the
features' gather, the drafter's positions, the state copy), ~1.2 us each inside the step's graph; here one grid of
programs, one per (key/value, layer, kv head) row set plus the features' column chunks.

It launches in plain stream order, unlike the loop's other glue: with PDL (a wait, then the trigger) the 16-row
tree step took 0.7966 against 0.7819 ms on an H100 (session 51, `gpu_block_drafter_step.py --pdl-off-too`), while
PDL on the other glue launches was worth ~0.4%.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.kernels._common import check_launchable, check_tensor

FEATURE_BLOCK = 256  # feature columns a program gathers


def _check_move(kv, path, accepted, next_state, state, features, drafter_cache=None):
    check_tensor("kv", kv, (None, None, None, None, None))
    dev = kv.device
    if drafter_cache is not None:
        check_tensor("drafter_cache", drafter_cache, (None, None, None, None, kv.shape[-1]), kv.dtype, dev)
        if drafter_cache.shape[-2] < path.shape[0]:
            raise ValueError(f"drafter_cache has {drafter_cache.shape[-2]} slots, the path reaches {path.shape[0]}")
    check_tensor("path", path, (None,), torch.int64, dev)
    check_tensor("accepted", accepted, (), torch.int64, dev)
    check_tensor("next_state", next_state, (2,), torch.int64, dev)
    check_tensor("state", state, (2,), torch.int64, dev)
    if features is not None:
        if features.dim() == 2:  # rows [T, F]: one layer of F columns
            features = features[None]
        check_tensor("features", features, (None, None, None), None, dev)
        if features.shape[1] < path.shape[0]:
            raise ValueError(f"features has {features.shape[1]} rows, the path reaches {path.shape[0]} depths")
    return features


def tree_move_ref(kv, path, accepted, next_state, state, features=None, drafter_cache=None):
    """kv [2, layers, kv heads, slots, head dim]: slots base + e <- base + path[e] for every depth e < len(path)
    (base = next_state[1] - accepted - 1, the step's root slot), gathered before any is written; state <-
    next_state. drafter_cache [a, b, c, slots, head dim] (the block drafter's, slot = position): its rows move the
    same way. features: rows [T, F] or layer-major [layers, T, H] (the runner's step); returns the path's rows
    [len(path), F or layers * H], each its layers side by side (None without features)."""
    features = _check_move(kv, path, accepted, next_state, state, features, drafter_cache)
    base = next_state[1] - accepted - 1
    to = base + torch.arange(path.shape[0], device=kv.device)
    for cache in (kv,) if drafter_cache is None else (kv, drafter_cache):
        cache[:, :, :, to] = cache[:, :, :, base + path]
    state.copy_(next_state)
    return None if features is None else features[:, path].transpose(0, 1).reshape(path.shape[0], -1)


@triton.jit
def _tree_move_kernel(kv_ptr, path_ptr, acc_ptr, next_ptr, state_ptr, f_ptr, fout_ptr, S, F, H, LAYER_STRIDE,
                      kv2_ptr, S2, ROWSETS: tl.constexpr, ROWSETS2: tl.constexpr, DR: tl.constexpr,
                      DRP: tl.constexpr, D: tl.constexpr, HAS_F: tl.constexpr, BLOCK_F: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.arange(0, DRP)
    ok = e < DR
    path = tl.load(path_ptr + e, mask=ok, other=0)
    if pid < ROWSETS + ROWSETS2:  # one (key/value, layer, kv head) of either cache: its DR rows of D
        base = tl.load(next_ptr + 1) - tl.load(acc_ptr) - 1  # not state[1]: program 0 rewrites state
        d = tl.arange(0, D)[None, :]
        if pid < ROWSETS:
            rows = kv_ptr + pid.to(tl.int64) * S * D
        else:  # the drafter's cache (its own slot count)
            rows = kv2_ptr + (pid - ROWSETS).to(tl.int64) * S2 * D
        moved = tl.load(rows + (base + path)[:, None] * D + d, mask=ok[:, None])
        tl.debug_barrier()  # a row one depth reads may be one another depth writes: every load first
        tl.store(rows + (base + e)[:, None] * D + d, moved, mask=ok[:, None])
    elif HAS_F:
        c = (pid - ROWSETS - ROWSETS2) * BLOCK_F + tl.arange(0, BLOCK_F)[None, :]
        cols = c < F
        layer = c // H  # output column c is layer c // H's column c % H
        src = f_ptr + layer.to(tl.int64) * LAYER_STRIDE + path[:, None] * H + (c - layer * H)
        tl.store(fout_ptr + e[:, None] * F + c, tl.load(src, mask=ok[:, None] & cols), mask=ok[:, None] & cols)
    if pid == 0:
        i = tl.arange(0, 2)
        tl.store(state_ptr + i, tl.load(next_ptr + i))


def tree_move(kv, path, accepted, next_state, state, features=None, drafter_cache=None):
    """tree_move_ref's writes and result in one launch."""
    features = _check_move(kv, path, accepted, next_state, state, features, drafter_cache)
    check_launchable(_tree_move_kernel, kv.device)
    two, layers, heads, slots, dim = kv.shape
    if dim != triton.next_power_of_2(dim):
        raise ValueError(f"head dim {dim}: the kernel moves power-of-two rows")
    rowsets, depth_rows = two * layers * heads, path.shape[0]
    rowsets2 = 0 if drafter_cache is None else drafter_cache[..., 0, 0].numel()
    h = 1 if features is None else features.shape[2]
    n_f = 0 if features is None else features.shape[0] * h
    out = None if features is None else torch.empty(depth_rows, n_f, dtype=features.dtype, device=kv.device)
    _tree_move_kernel[(rowsets + rowsets2 + triton.cdiv(n_f, FEATURE_BLOCK),)](
        kv, path, accepted, next_state, state, kv if features is None else features, kv if out is None else out,
        slots, max(n_f, 1), h, 0 if features is None else features.stride(0),
        kv if drafter_cache is None else drafter_cache, 1 if drafter_cache is None else drafter_cache.shape[-2],
        ROWSETS=rowsets, ROWSETS2=rowsets2, DR=depth_rows,
        DRP=triton.next_power_of_2(depth_rows), D=dim, HAS_F=features is not None, BLOCK_F=FEATURE_BLOCK, num_warps=1)
    return out
