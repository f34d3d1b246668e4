"""Top-k tokens and their softmax probabilities of each logits row, in two launches.

torch.topk over a 49k vocabulary runs a multi-block radix select (about 20 launches on an H200, ~55 us for 16
rows) and logsumexp two reductions more: most of a block drafter's step beyond its GEMMs (session 11). Here one
launch gives each (row, chunk of BLOCK logits) its chunk's top KP and the chunk's max and sum of exp, and one
more merges a row's chunks. Values and indices travel together as one int64 key (the float's order-preserving
int32 above, the complement of the index below), so one integer top-k sorts both and ties go to the lower index.
Drafting only: what a drafter proposes is verified, so these probabilities need not be bit-equal to torch's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import check_int, check_launchable, check_tensor, next_pow2
from .pdl import pdl_launch, release_successor, wait_for_predecessor

BLOCK = 1024  # logits per program of the first launch (fewer for a smaller vocabulary)
MAX_K = 64


@triton.jit
def logit_key(x, idx, V):
    b = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0 (a tie, as in torch.topk)
    s = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # the float's order as a signed int (finite values)
    return (s.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64)


@triton.jit
def rank_rows(x, idx, ok, V, KP: tl.constexpr):
    """Each row of a chunk x [R, C] of logits (column idx, -inf where not ok): its max, sum of exp and top KP keys
    ([R], [R], [R, KP]): what a merge needs of the chunk. Shared by the chunk launch and an LM head's epilogue."""
    m = tl.max(x, axis=1)
    m_safe = tl.where(m > float("-inf"), m, 0.0)  # a chunk of -inf logits only: sum 0, not exp(NaN)
    keys = tl.where(ok, logit_key(x, idx, V), -9223372036854775807 - 1)  # past the row: below every key
    return m, tl.sum(tl.exp(x - m_safe[:, None]), axis=1), tl.topk(keys, KP)


@triton.jit
def _topk_chunk_kernel(x_ptr, keys_ptr, m_ptr, s_ptr, V, G, KP: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the logits are the head's
    row, g = tl.program_id(0), tl.program_id(1)
    idx = g * BLOCK + tl.arange(0, BLOCK)[None, :]  # one row of BLOCK logits
    ok = idx < V
    m, s, top = rank_rows(tl.load(x_ptr + row.to(tl.int64) * V + idx, mask=ok, other=float("-inf")), idx, ok, V, KP)
    part = row * G + g + tl.zeros([1], tl.int32)
    tl.store(m_ptr + part, m)
    tl.store(s_ptr + part, s)
    tl.store(keys_ptr + part[:, None] * KP + tl.arange(0, KP)[None, :], top)
    release_successor(PDL)


@triton.jit
def _topk_merge_kernel(keys_ptr, m_ptr, s_ptr, map_ptr, tok_ptr, prob_ptr, V, G, K, KP: tl.constexpr,
                       GP: tl.constexpr, MAPPED: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the chunks are the chunk launch's (or the head epilogue's)
    row = tl.program_id(0)
    j = tl.arange(0, GP * KP)
    keys = tl.load(keys_ptr + row * G * KP + j, mask=j < G * KP, other=-9223372036854775807 - 1)
    top = tl.topk(keys, KP)
    g = tl.arange(0, GP)
    m = tl.load(m_ptr + row * G + g, mask=g < G, other=float("-inf"))
    s = tl.load(s_ptr + row * G + g, mask=g < G, other=0.0)
    big = tl.max(m, 0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), 0))
    hi = top >> 32
    s32 = hi.to(tl.int32)
    value = tl.where(s32 >= 0, s32, s32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    token = V - 1 - (top - (hi << 32))
    k = tl.arange(0, KP)
    if MAPPED:  # column -> token id (a head restricted to some vocabulary rows)
        token = tl.load(map_ptr + token, mask=k < K, other=0)
    tl.store(tok_ptr + row * K + k, token, mask=k < K)
    tl.store(prob_ptr + row * K + k, tl.exp(value - lse), mask=k < K)
    release_successor(PDL)


class TopkPartials(NamedTuple):
    """Each (row, chunk of logits)'s top KP keys (logit_key) [R, G, KP] int64, max and sum of exp [R, G] float32,
    over V logits a row: what _topk_chunk_kernel writes, or an LM head's epilogue (norm_gemm.rmsnorm_linear(...,
    topk=KP)) with its column tiles as the chunks."""
    keys: torch.Tensor
    m: torch.Tensor
    s: torch.Tensor
    V: int


def merge_topk(parts: TopkPartials, k: int, token_map: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's chunks merged: (top-k token ids [R, k] int64, best first; their softmax probabilities [R, k])."""
    keys, m, s, V = parts
    check_tensor("keys", keys, (None, None, None), torch.int64)
    R, G, kp = keys.shape
    check_int("k", k, 1, min(kp, MAX_K))
    for name, t in (("m", m), ("s", s)):
        check_tensor(name, t, (R, G), torch.float32, keys.device)
    if token_map is not None:
        check_tensor("token_map", token_map, (V,), torch.int64, keys.device)
    tokens = torch.empty(R, k, dtype=torch.int64, device=keys.device)
    probs = torch.empty(R, k, dtype=torch.float32, device=keys.device)
    _topk_merge_kernel[(R,)](keys, m, s, tokens if token_map is None else token_map, tokens, probs, V, G, k, KP=kp,
                             GP=next_pow2(G, 2), MAPPED=token_map is not None, num_warps=4,
                             **pdl_launch(keys.device))
    return tokens, probs


def topk_probs(logits: torch.Tensor, k: int, token_map: torch.Tensor | None = None, *, block: int = BLOCK
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] float32 -> (top-k token ids [R, k] int64, best first; their softmax probabilities [R, k]).
    token_map [V] int64: column j holds the logit of token token_map[j] (returned ids are mapped; ties go to the
    lower column, so an ascending map keeps torch's order). block: logits a first-launch program sorts (a power of
    two >= 16): smaller chunks, more programs; the same tokens, probabilities summed in another order."""
    check_tensor("logits", logits, (None, None), torch.float32)
    R, V = logits.shape
    check_int("k", k, 1, min(V, MAX_K))
    check_chunk(block)
    if token_map is not None:
        check_tensor("token_map", token_map, (V,), torch.int64, logits.device)
    check_launchable(_topk_chunk_kernel, logits.device)
    kp, block = next_pow2(k, 2), min(block, next_pow2(V, 16))  # tl.topk needs k >= 2
    G = triton.cdiv(V, block)
    keys = torch.empty(R, G, kp, dtype=torch.int64, device=logits.device)
    m, s = (torch.empty(R, G, dtype=torch.float32, device=logits.device) for _ in range(2))
    _topk_chunk_kernel[(R, G)](logits, keys, m, s, V, G, KP=kp, BLOCK=block, num_warps=4,
                               **pdl_launch(logits.device))
    return merge_topk(TopkPartials(keys, m, s, V), k, token_map)


def check_chunk(block: int) -> None:
    check_int("block", block, 16, 1 << 16)
    if block & (block - 1):
        raise ValueError(f"block={block}: must be a power of two")


def topk_probs_ref(logits: torch.Tensor, k: int, token_map: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_probs in plain torch (ties in torch.topk's order)."""
    top = torch.topk(logits, k, dim=-1)
    tokens = top.indices if token_map is None else token_map[top.indices]
    return tokens, torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
