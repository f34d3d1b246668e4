"""Tree verification is BIT-exact versus AR (torch backend), not only token-exact.

A tree node at depth d sits at slot base + i (i != d once decoy siblings come first), while AR puts the same
token at slot base + d. Each query reads its keys in position order (position_slots), so the committed path's
KV, hidden states, logits and margins equal AR's bit for bit, and compaction leaves AR's exact cache behind.
Both backends: the torch path (per-row gathered keys) and the Triton one (the attention kernel's block_slots),
the latter under the Triton interpreter without CUDA (tests/conftest.py).
"""
from __future__ import annotations

import random

import numpy as np
import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402
from _tiny import prompt, tiny_model  # noqa: E402

import specpilot.kernels as K  # noqa: E402
from specpilot.engines.config import DrafterKind, EngineConfig, KernelBackend  # noqa: E402
from specpilot.engines.engine import greedy_accept  # noqa: E402
from specpilot.engines.llama import ancestor_slots, position_slots  # noqa: E402
from specpilot.engines.layout import tree_anc  # noqa: E402
from specpilot.engines.runner import ModelRunner, chain_anc  # noqa: E402


TOPK = 4
CAPTURE = (0,)


def runner_for(model, tile: int, backend: KernelBackend = KernelBackend.TORCH, ordered: bool = True,
               block_width: int = 32) -> ModelRunner:
    c = EngineConfig(dtype="float32", max_seq_len=160, token_tile=tile, drafter=DrafterKind.NGRAM,
                     kernel_backend=backend, position_ordered_attention=ordered)
    # the Triton kernels compiled where there is a GPU; the torch path stays on the CPU (cuBLAS picks its reduction
    # by the token count: not bit-exact across T on a GPU)
    dev = "cuda" if CUDA and backend is KernelBackend.TRITON else "cpu"
    return ModelRunner(model.to(dev), c, dev, block_width=block_width, topk=TOPK, capture=CAPTURE)


def row(out, i: int):
    """Everything a step exposes about row i: greedy token, margin, top-k tokens/probs, layer-0 features (a copy:
    with CUDA graphs a step's features are a view of its output buffer, which the next step overwrites)."""
    return out.argmax[i], out.margin[i], out.topk_tokens[i], out.topk_probs[i], out.features[i].clone()


def assert_rows_equal(a, b, where) -> None:
    assert a[0] == b[0] and a[2] == b[2], where
    assert torch.equal(a[1], b[1]), (where, "margin", (a[1] - b[1]).item())
    assert a[3] == b[3], (where, "top-k probs")
    assert torch.equal(a[4], b[4]), (where, "features")


def ar_reference(model, p: list[int], n: int, tile: int, backend: KernelBackend, ordered: bool = True):
    """AR through the runner: rows[k] = the outputs after token k of the sequence p + generated (k >= len(p)-1)."""
    r = runner_for(model, tile, backend, ordered)
    pre = r.prefill(p)
    seq, rows = list(p) + [pre.argmax[0]], {len(p) - 1: row(pre, 0)}
    while len(seq) < len(p) + n:
        base = len(seq) - 1
        out = r.verify(base, [seq[-1]], [0], chain_anc(1))
        rows[base] = row(out, 0)
        seq.append(out.argmax[0])
    return seq, rows, r


def decoy_tree(ref: list[int], depth: int, vocab: int) -> tuple[list[int], list[int]]:
    """Per depth a wrong sibling first, then the right token (children of the right one): node i != depth."""
    tokens, parents, prev = [], [], 0
    for t in ref[:depth]:
        tokens += [(t + 3) % vocab, t]
        parents += [prev, prev]
        prev = len(tokens)  # block index of the right token (the root is block index 0)
    return tokens, parents


@pytest.mark.parametrize("shape,seed,tile,backend,n", [
    ("gqa", 0, 8, KernelBackend.TORCH, 40), ("mha_tied", 1, 16, KernelBackend.TORCH, 40),
    ("mqa", 2, 16, KernelBackend.TORCH, 40), ("mha_tied", 0, 8, KernelBackend.TORCH, 40),
    ("gqa", 1, 8, KernelBackend.TRITON, 12), ("mha_tied", 2, 8, KernelBackend.TRITON, 12)])
def test_tree_verify_is_bit_exact_vs_ar(shape, seed, tile, backend, n):
    check_tree_against_ar(shape, seed, tile, backend, n, ordered=True)


def test_slot_ordered_sdpa_is_not_bit_exact_for_trees():
    """Why the knob exists: with one SDPA over slots, tree nodes' keys sit at other slots than AR's, the sums
    group differently, and the bits differ (tokens agree here, but a near-tie could flip)."""
    with pytest.raises(AssertionError):
        check_tree_against_ar("gqa", 0, 8, KernelBackend.TORCH, 40, ordered=False)


def check_tree_against_ar(shape, seed, tile, backend, n, ordered):
    model = tiny_model(shape, seed)
    vocab = model.shape.vocab
    p = prompt(vocab, 13, seed)
    seq, ar_rows, ar = ar_reference(model, p, n + 1, tile, backend, ordered)  # + 1: AR's row at the last position too
    r = runner_for(model, tile, backend, ordered)
    pre = r.prefill(p)
    assert_rows_equal(row(pre, 0), ar_rows[len(p) - 1], "prefill")
    got, k, checked = list(p) + [pre.argmax[0]], 5, 0
    while len(got) < len(p) + n:
        base = len(got) - 1
        depth = min(k, len(p) + n - len(got) - 1)
        ref_next = seq[len(got):len(got) + depth]
        tokens, parents = decoy_tree(ref_next, depth, vocab)
        block, parents = [got[-1]] + tokens, [-1] + parents
        depths = [0] * len(block)
        for j in range(1, len(block)):
            depths[j] = depths[parents[j]] + 1
        out = r.verify(base, block, depths, tree_anc(parents))
        acc = greedy_accept(block, parents, out.argmax)
        assert len(acc.path) == depth + 1  # the oracle's right tokens are all accepted
        assert any(node != d for d, node in enumerate(acc.path)) or depth == 0
        for d, node in enumerate(acc.path):
            assert_rows_equal(row(out, node), ar_rows[base + d], (base, d, node))
            checked += 1
        r.compact(base, acc.path)
        got += acc.tokens
        k = 7 - k  # alternate depths 5 and 2
    assert got == seq[:len(p) + n]
    committed = len(p) + n - 1  # AR never computed the KV of the last generated token
    assert torch.equal(r.kv[:, :, :, :committed], ar.kv[:, :, :, :committed])
    assert checked >= n - 1


def test_a_block_past_the_last_power_of_two_below_block_width_fits():
    """Tree budgets give block widths such as 48, and a 39-node tree pads to the 64-token bucket, which the runner
    must hold (an H200 bench stopped there: 'anc must have shape [64, 64], got [64, 48]'); its rows stay AR's."""
    model = tiny_model("gqa", 0)
    vocab, depth = model.shape.vocab, 19
    p = prompt(vocab, 13, 0)
    seq, ar_rows, _ = ar_reference(model, p, depth + 2, 8, KernelBackend.TRITON)  # tile: unused by the fused path
    r = runner_for(model, 8, KernelBackend.TRITON, block_width=48)
    assert r.block_width == 64
    pre = r.prefill(p)
    base = len(p)
    tokens, parents = decoy_tree(seq[base + 1:base + 1 + depth], depth, vocab)
    block, parents = [pre.argmax[0]] + tokens, [-1] + parents
    depths = [0] * len(block)
    for j in range(1, len(block)):
        depths[j] = depths[parents[j]] + 1
    out = r.verify(base, block, depths, tree_anc(parents))
    acc = greedy_accept(block, parents, out.argmax)
    assert len(block) == 39 and len(acc.path) == depth + 1
    for d, node in enumerate(acc.path):
        assert_rows_equal(row(out, node), ar_rows[base + d], (d, node))


def test_position_slots_matches_python_definition():
    rng = random.Random(0)
    for trial in range(20):
        n = rng.randrange(1, 12)
        parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        width, base, S = 16, rng.randrange(0, 9), 40
        anc = np.eye(width, width, dtype=bool)[:n]
        anc[:, :n] = tree_anc(parents)
        slot_of, mask = position_slots(torch.tensor(base), torch.from_numpy(anc), S)
        for i in range(n):
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()  # ancestor at depth e = path[e]
            want = list(range(S))
            for e, j in enumerate(path):
                want[base + e] = base + j
            assert slot_of[i].tolist() == want, (parents, i)
            assert mask[i].tolist() == [s < base + depth[i] + 1 for s in range(S)]


def test_verify_rejects_blocks_whose_parents_follow_children():
    r = runner_for(tiny_model("gqa", 0), 8)
    r.prefill([5, 6, 7])
    bad = np.array([[1, 0, 0], [1, 1, 1], [1, 0, 1]], dtype=bool)  # node 1's parent is node 2
    with pytest.raises(ValueError, match="parents precede"):
        r.verify(2, [7, 8, 9], [0, 2, 1], bad)
    with pytest.raises(ValueError, match="depths"):
        r.verify(2, [7, 8, 9], [0, 1, 2], tree_anc([-1, 0, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH", [(4, 2), (3, 3), (20, 1)])  # G = 20 > BLOCK_M: two programs per token
def test_attention_block_slots_matches_ref_and_reads_keys_in_position_order(dtype, H, KVH):
    g = torch.Generator().manual_seed(H * 10 + KVH)
    dev = "cuda" if CUDA else "cpu"  # the compiled kernel on a GPU, the interpreter on CPU
    T, D, S, base = 9, 16, 90, 41
    parents = [-1, 0, 0, 2, 2, 4, 3, 5, 1]
    anc = torch.from_numpy(tree_anc(parents)).to(dev)
    q = torch.randn(T, H, D, generator=g).to(dev, dtype)
    kc, vc = (torch.randn(KVH, S, D, generator=g).to(dev, dtype) for _ in range(2))
    bs = ancestor_slots(torch.tensor(base, device=dev), anc)
    o = K.attention(q, kc, vc, base, anc, block_slots=bs, block_n=16, split_keys=32)
    ref = K.attention_ref(q, kc, vc, base, anc, block_slots=bs)
    err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2)
    # Same visible key set as the anc mask: agrees with the slot-order reference too.
    assert ((o.double() - K.attention_ref(q, kc, vc, base, anc).double()).norm() / ref.double().norm()) <= \
        (1e-5 if dtype == torch.float32 else 1e-2)
    # Node 7 (path 0, 2, 4, 5, 7) equals, bit for bit, an AR query at base + 4 over a cache with the path moved
    # into position order: the same keys at the same positions in the same blocks.
    path = [0, 2, 4, 5, 7]
    kc2, vc2 = kc.clone(), vc.clone()
    for d, node in enumerate(path):
        kc2[:, base + d], vc2[:, base + d] = kc[:, base + node], vc[:, base + node]
    one = torch.ones(1, 1, dtype=torch.bool, device=dev)
    ar = K.attention(q[7:8], kc2, vc2, base + 4, one,
                     block_slots=ancestor_slots(torch.tensor(base + 4, device=dev), one),
                     block_n=16, split_keys=32)
    assert torch.equal(ar[0], o[7])
    for tiles in (2, 4):  # row tiles run in turn by one program: the same bits, spare tiles past the tokens idle
        assert torch.equal(K.attention(q, kc, vc, base, anc, block_slots=bs, block_n=16, split_keys=32,
                                       tiles_per_program=tiles), o)
    # 32-row tiles: context splits tile (token, head) rows two slabs at a time, splits at base a token a tile
    assert torch.equal(K.attention(q, kc, vc, base, anc, block_slots=bs, block_n=16, split_keys=32, tile_rows=32), o)
    with pytest.raises(ValueError, match="block_slots"):
        K.attention(q, kc, vc, base, anc, block_slots=bs.int(), block_n=16, split_keys=32)


@pytest.mark.parametrize("base", [3, 13, 16, 30])  # the block inside one 16-key split, across two, across three
def test_attention_block_slots_covers_every_split_the_block_reaches(base):
    """A 20-node tree at 16-key splits reaches up to three splits past the context's: each is run by the per-token
    section of the grid whatever base is (an int, or a tensor as in CUDA graphs, the grid then spans the cache)."""
    g = torch.Generator().manual_seed(base)
    dev = "cuda" if CUDA else "cpu"
    T, H, KVH, D, S = 20, 4, 2, 16, 64
    rng = random.Random(base)
    parents = [-1] + [rng.randrange(i) for i in range(1, T)]
    anc = torch.from_numpy(tree_anc(parents)).to(dev)
    q = torch.randn(T, H, D, generator=g).to(dev)
    kc, vc = (torch.randn(KVH, S, D, generator=g).to(dev) for _ in range(2))
    bs = ancestor_slots(torch.tensor(base, device=dev), anc)
    o = K.attention(q, kc, vc, base, anc, block_slots=bs, block_n=16, split_keys=16)
    ref = K.attention_ref(q, kc, vc, base, anc, block_slots=bs)
    assert ((o.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-5
    t_base = torch.tensor([base], dtype=torch.int32, device=dev)
    for kw in ({}, {"tiles_per_program": 4}, {"tile_rows": 32}):  # the same bits however the rows are tiled
        assert torch.equal(K.attention(q, kc, vc, t_base, anc, block_slots=bs, block_n=16, split_keys=16, **kw), o)


@pytest.mark.parametrize("T,base", [(14, 5), (40, 20), (3, 30)])
def test_a_chain_reads_the_same_bits_in_slot_order(T, base):
    """A chain at slots base.. (row i at position base + i): keys in slot order through anc are the keys in position
    order through block_slots, in the same splits, so the bits are the same (the device loop's switched chain runs
    without block slots: EngineConfig.deep_tree_chain). A tree's are not (the mutation: a random tree differs)."""
    g = torch.Generator().manual_seed(T + base)
    dev = "cuda" if CUDA else "cpu"
    H, KVH, D, S = 9, 3, 16, 96
    q = torch.randn(T, H, D, generator=g).to(dev)
    kc, vc = (torch.randn(KVH, S, D, generator=g).to(dev) for _ in range(2))
    anc = torch.from_numpy(tree_anc(list(range(-1, T - 1)))).to(dev)
    bs = ancestor_slots(torch.tensor(base, device=dev), anc)
    t_base = torch.tensor([base], dtype=torch.int32, device=dev)
    for rows in (16, 32):
        kw = dict(block_n=16, split_keys=16, tile_rows=rows)
        o = K.attention(q, kc, vc, t_base, anc, **kw)
        assert torch.equal(K.attention(q, kc, vc, t_base, anc, block_slots=bs, **kw), o), rows
    rng = random.Random(T)
    tree = torch.from_numpy(tree_anc([-1] + [rng.randrange(i) for i in range(1, T)])).to(dev)
    if T > 3:
        tree_bs = ancestor_slots(torch.tensor(base, device=dev), tree)
        assert not torch.equal(K.attention(q, kc, vc, t_base, tree, block_slots=tree_bs, block_n=16, split_keys=16),
                               K.attention(q, kc, vc, t_base, tree, block_n=16, split_keys=16))


