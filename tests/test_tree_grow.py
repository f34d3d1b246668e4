"""The device loop's per-step tree (engines.tree_grow): the kernel (interpreted) and its torch reference grow the host
loop's best-first tree (costmodel.acceptance.best_first_tree) from a step's candidates, node for node, ties, zero
probabilities and a lookup's lead included; rows past the candidates that exist are dead and never accepted."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.costmodel.acceptance import best_first_tree
from specpilot.engines.layout import draft_layout
from specpilot.engines.llama import ancestor_slots
from specpilot.engines.loop_kernels import lead_rows, tree_commit_ref
from specpilot.engines.tree_grow import TreeBlock, grow_tree, grow_tree_ref

FIELDS = ("node_src", "parents", "tree_anc", "depths", "positions", "anc", "block_slots")


def grown(tokens, probs, width, budget, lead=None, lead_depths=None, kernel=False, block_width=None, ranked=None):
    block = TreeBlock.dead(budget, block_width or budget + 1, True, "cpu")
    (grow_tree if kernel else grow_tree_ref)(tokens, probs, lead, lead_depths, width, block, ranked)
    return block


def host_block(tokens, probs, width, budget, lead=None, lead_depths=None, block_width=None) -> TreeBlock:
    """The host loop's tree over the same candidates, as a TreeBlock (dead rows where it has fewer nodes)."""
    if lead is not None:
        use = torch.arange(tokens.shape[0]) < lead_depths.reshape(())
        tokens, probs = lead_rows(tokens, probs, lead, use)
    p = probs.tolist()
    tree = best_first_tree([list(range(min(width, len(r)))) for r in p], [r[:width] for r in p], budget)
    n, k = len(tree.parents), probs.shape[1]
    lay = draft_layout(tuple(tree.parents))
    dead = budget - n
    anc = np.eye(budget + 1, dtype=bool)
    anc[:n + 1, :n + 1] = lay.anc
    src = [(d - 1) * k + r for d, r in zip(tree.depths, tree.tokens)] + [0] * dead
    return TreeBlock.build(src, list(lay.parents) + [-1] * dead, list(lay.depths) + [0] * dead, anc,
                           block_width or budget + 1, True, "cpu")


def candidates(seed: int, depth: int = 5, k: int = 6, vocab: int = 40, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    probs, tokens = (torch.randn(depth, vocab, generator=g) * scale).softmax(-1).topk(k, dim=-1)
    return tokens.contiguous(), probs.contiguous()


def assert_same(a: TreeBlock, b: TreeBlock, what=""):
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), (what, f, getattr(a, f), getattr(b, f))


def test_a_hand_built_tree():
    """Depth 1 rank 0 (0.9), its rank-0 child (0.72), that child's sibling (0.09) before depth 1's rank 1 (0.05)."""
    tokens = torch.tensor([[10, 11, 12], [20, 21, 22]])
    probs = torch.tensor([[0.9, 0.05, 0.01], [0.8, 0.1, 0.0]])
    b = grown(tokens, probs, 2, 3)
    assert b.node_src.tolist() == [0, 3, 4]  # flat depth * K + rank
    assert b.parents.tolist() == [-1, 0, 1, 1] and b.depths.tolist() == [0, 1, 2, 2]
    assert b.positions.tolist() == [0, 1, 2, 2]
    assert b.tree_anc.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    assert b.block_slots.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 3, -1]]
    # budget 4 at width 3: depth 1's rank 1 (0.05) before its rank 2 (0.01); depth 2's rank 2 has probability 0
    b = grown(tokens, probs, 3, 4, block_width=8)
    assert b.node_src.tolist() == [0, 3, 4, 1] and b.parents.tolist() == [-1, 0, 1, 1, 0]
    assert b.anc.shape == (8, 8) and torch.equal(b.anc[5:], torch.eye(8, dtype=torch.bool)[5:])  # pad rows
    assert b.positions.tolist() == [0, 1, 2, 2, 1, 5, 6, 7]


@pytest.mark.interpreter
def test_ties_go_to_the_shallower_node_then_the_lower_ranks():
    tokens = torch.arange(12).reshape(3, 4)
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0]])
    # scores: (0) .5, (1) .5, (0,0) .5, (1,0) .5, (0,0,0) .25, (0,0,1) .125, (0,0,2) .125, (1,0,0) .25 ...
    b = grown(tokens, probs, 4, 7)
    assert b.depths.tolist() == [0, 1, 1, 2, 2, 3, 3, 3]
    assert b.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4, 3]
    assert b.node_src.tolist() == [0, 1, 4, 4, 8, 8, 9]
    assert_same(b, host_block(tokens, probs, 4, 7))
    assert_same(grown(tokens, probs, 4, 7, kernel=True), b)


@pytest.mark.interpreter
def test_rows_past_the_candidates_are_dead_and_never_accepted():
    """One candidate a depth (the others at probability 0): a 3-node chain, then 4 dead rows (depth 0, their own
    only ancestor). Even where a dead row's token equals the argmax at the root, the chain's path wins."""
    tokens = torch.tensor([[5, 6], [7, 8], [9, 1]])
    probs = torch.tensor([[0.7, 0.0], [0.6, 0.0], [0.9, 0.0]])
    for kernel in (False, True):
        b = grown(tokens, probs, 2, 7, kernel=kernel)
        assert b.parents.tolist() == [-1, 0, 1, 2, -1, -1, -1, -1] and b.depths.tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
        assert b.tree_anc[4:].tolist() == torch.eye(8, dtype=torch.uint8)[4:].tolist()
        assert b.block_slots[5].tolist() == [5] + [-1] * 7
    ids = torch.tensor([3, 5, 7, 9, 5, 5, 5, 5])  # dead rows carry node_src 0's token: depth 1's rank 0
    argmax = torch.tensor([5, 7, 2, 0, 0, 0, 0, 0])  # the chain's first two nodes match
    _, tokens_out, accepted, _ = tree_commit_ref(argmax, ids, b.parents, b.tree_anc, b.depths,
                                                 torch.tensor([3, 10]), 4)
    assert accepted.item() == 2 and tokens_out.tolist()[:3] == [5, 7, 2]


@pytest.mark.interpreter
def test_a_lookup_lead_is_the_main_path():
    """Lookup's tokens lead at the depths it covers (probability 1): they are the first nodes, the block's own
    candidates after them (a duplicate of the lead dropped)."""
    tokens, probs = candidates(3, depth=4, k=4)
    lead = torch.tensor([int(tokens[0, 2]), 39, 38, 0])
    n = torch.tensor(3)
    for kernel in (False, True):
        b = grown(tokens, probs, 3, 15, lead, n, kernel=kernel)
        assert b.parents.tolist()[:4] == [-1, 0, 1, 2] and b.node_src.tolist()[:3] == [0, 4, 8]
        assert_same(b, host_block(tokens, probs, 3, 15, lead, n), kernel)


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(12))
def test_random_candidates_grow_the_host_loops_tree(seed):
    depth, k = [(3, 4), (5, 6), (7, 8), (15, 8)][seed % 4]
    width, budget = [(1, 3), (2, 7), (4, 15), (4, 31), (8, 63), (3, 20)][seed % 6]
    width = min(width, k)
    tokens, probs = candidates(seed, depth, k, scale=[1.0, 3.0, 8.0][seed % 3])
    if seed % 3 == 2:
        probs = torch.round(probs * 8) / 8  # many exact ties and zeros
    lead = n = None
    if seed % 2:
        lead, n = torch.randint(0, 40, (depth,), generator=torch.Generator().manual_seed(seed)), torch.tensor(seed % 5)
    rows = budget + 1
    w = 1 << (rows - 1).bit_length()
    want = host_block(tokens, probs, width, budget, lead, n, block_width=w)
    assert_same(grown(tokens, probs, width, budget, lead, n, block_width=w), want, "ref")
    assert_same(grown(tokens, probs, width, budget, lead, n, kernel=True, block_width=w), want, "kernel")
    assert torch.equal(want.block_slots, ancestor_slots(torch.tensor(0), want.anc))


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(10))
def test_a_lookup_running_past_the_blocks_depth_grows_the_host_loops_tree(seed):
    """EngineConfig.lookup_depth: the candidates past the block's `ranked` depths are padding (probability 0), so
    there the lookup's token is the only candidate; its rank takes no digit of the kernel's tie key, which lets 31
    depths at width 8 fit (3 bits a rank for 15 ranked depths). Same tree as the host's, ties included; seeds 8-9:
    a 127-node tree over a lookup 127 deep (rows past 64 in the kernel's second ancestor word)."""
    ranked, k = [(15, 8), (7, 4)][seed % 2]
    depth = [31, 16, 24, 40][seed % 4] if seed < 8 else 127
    width, budget = [(8, 31), (4, 63), (2, 15), (8, 47)][seed % 4] if seed < 8 else (4, 127)
    width = min(width, k)
    tokens, probs = candidates(seed, ranked, k, scale=[1.0, 3.0, 8.0][seed % 3])
    if seed % 3 == 2:
        probs = torch.round(probs * 8) / 8  # ties, and some ranked depths' top-1 at probability 1, as the lead's
    tokens = torch.cat([tokens, torch.zeros(depth - ranked, k, dtype=torch.long)])
    probs = torch.cat([probs, torch.zeros(depth - ranked, k)])
    g = torch.Generator().manual_seed(seed)
    lead = torch.randint(0, 40, (depth,), generator=g)
    lead[:ranked:3] = tokens[:ranked:3, 1]  # the lead duplicates a block candidate at some depths
    n = torch.tensor([depth, ranked + 5, 3, depth - 1][seed % 4] if seed < 8 else [depth, 90][seed % 2])
    w = 1 << budget.bit_length()
    want = host_block(tokens, probs, width, budget, lead, n, block_width=w)
    if seed % 4 != 2 and seed < 8:
        assert int(want.depths.max()) > ranked  # the tree does go past the block's depth
    if seed >= 8:  # live rows in the second word: a bushy tree (seed 8's ties) and one 127 deep (seed 9)
        assert int(want.depths[64:].min()) > 0 and int(want.depths.max()) > (64 if seed == 9 else 0)
    assert_same(grown(tokens, probs, width, budget, lead, n, block_width=w, ranked=ranked), want, "ref")
    assert_same(grown(tokens, probs, width, budget, lead, n, kernel=True, block_width=w, ranked=ranked), want,
                "kernel")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["agrees", "in doubt", "refused", "agrees past k"])
def test_a_gate_in_the_grow_launch_is_the_gated_lookups_tree(case):
    """grow(gate=): the lookup's LeadGate applied where the lead is read (EngineConfig.lookup_overlap): lead_depths
    is gated in place (what the gated lookup proposes: ngram_lookup_ref's rule) and the tree is the one grown from
    the gated count; kernel and reference alike."""
    from specpilot.engines.device_drafters import ngram_lookup_ref
    from specpilot.engines.drafters.ngram_prefix import LeadGate

    tokens, probs = candidates(5, depth=6, k=4, scale=1.0)  # top-1 probabilities well below 0.9
    agree_topk, doubt = {"agrees": (2, 0.0), "in doubt": (1, 0.95), "refused": (2, 0.0),
                         "agrees past k": (9, 0.0)}[case]
    gate = LeadGate(agree_topk, doubt)
    lead = torch.tensor([int(tokens[0, 1 if case != "agrees past k" else 3]), 7, 8, 9, 10, 11])
    if case in ("in doubt", "refused"):
        lead[0] = 39 if 39 not in tokens[0].tolist() else 38
    seq = torch.tensor([1, 2, 3, *lead.tolist(), 1, 2, 3] + [0] * 8)  # a match whose continuation is the lead
    state = torch.tensor([3, 11])
    _, gated = ngram_lookup_ref(seq, state, 2, 3, 6, gate, tokens[0].contiguous(), probs[0].contiguous())
    assert gated.item() == (0 if case == "refused" else 6)
    w = 16
    want = grown(tokens, probs, 3, 15, lead, gated[0], block_width=w)
    for kernel in (False, True):
        n = torch.tensor(6)
        block = TreeBlock.dead(15, w, True, "cpu")
        (grow_tree if kernel else grow_tree_ref)(tokens, probs, lead, n, 3, block, None, gate)
        assert n.item() == gated.item(), kernel
        assert_same(block, want, (case, kernel))
    with pytest.raises(ValueError, match="LeadGate, for a lead"):
        grow_tree_ref(tokens, probs, None, None, 3, TreeBlock.dead(15, w, True, "cpu"), None, gate)


@pytest.mark.interpreter
def test_bad_inputs_are_refused():
    tokens, probs = candidates(0, 3, 4)
    with pytest.raises(ValueError, match="width=5"):
        grown(tokens, probs, 5, 7)
    with pytest.raises(ValueError, match="grown tree has 1..127 nodes"):
        grow_tree_ref(tokens, probs, None, None, 2, TreeBlock.dead(128, 256, False, "cpu"))
    with pytest.raises(ValueError, match="probs must have dtype"):
        grown(tokens, probs.double(), 2, 7)
    with pytest.raises(ValueError, match="lead and lead_depths"):
        grown(tokens, probs, 2, 7, lead=tokens[:, 0].contiguous())
    deep, deep_probs = candidates(0, 31, 8)
    with pytest.raises(ValueError, match="ranked depths x bits"):  # every depth ranked: 31 x 3 bits
        grown(deep, deep_probs, 8, 31)
    # the key's ranks take DEPTH_SHIFT - ROW_BITS = 48 bits: 16 depths of 3-bit ranks fit, 17 do not
    edge, edge_probs = candidates(1, 17, 8)
    with pytest.raises(ValueError, match="ranked depths x bits a rank <= 48"):
        grown(edge, edge_probs, 8, 31)
    assert_same(grown(edge[:16], edge_probs[:16], 8, 31, kernel=True), grown(edge[:16], edge_probs[:16], 8, 31), "16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernel)")
def test_the_compiled_kernel_grows_the_host_loops_tree_on_gpu():
    """On the H200: the kernel compiled for the device (float64 scores, one warp) = the host loop's tree."""
    for seed in range(24):
        depth, k = [(15, 8), (7, 4)][seed % 2]
        width, budget = [(4, 31), (4, 63), (2, 15), (8, 31)][seed % 4]
        width = min(width, k)
        tokens, probs = candidates(seed, depth, k, scale=[1.0, 3.0, 8.0][seed % 3])
        if seed % 3 == 2:
            probs = torch.round(probs * 8) / 8
        lead, n = torch.randint(0, 40, (depth,), generator=torch.Generator().manual_seed(seed)), torch.tensor(seed % 6)
        w = 1 << budget.bit_length()
        want = host_block(tokens, probs, width, budget, lead, n, block_width=w)
        block = TreeBlock.dead(budget, w, True, "cuda")
        grow_tree(tokens.cuda(), probs.cuda(), lead.cuda(), n.cuda(), width, block)
        for f in FIELDS:
            assert torch.equal(getattr(block, f).cpu(), getattr(want, f)), (seed, f)
    for seed in range(12):  # a lookup past the block's 15 ranked depths (lookup_depth), 31 / 63 / 127 deep
        depth, budget = [(31, 31), (63, 63), (127, 127)][seed % 3]
        tokens, probs = candidates(seed, 15, 8, scale=[1.0, 3.0, 8.0][seed % 3])
        tokens = torch.cat([tokens, torch.zeros(depth - 15, 8, dtype=torch.long)])
        probs = torch.cat([probs, torch.zeros(depth - 15, 8)])
        lead, n = torch.randint(0, 40, (depth,), generator=torch.Generator().manual_seed(seed)), torch.tensor(
            [depth, 20, 3, 40][seed % 4])
        w = 1 << budget.bit_length()
        want = host_block(tokens, probs, 8, budget, lead, n, block_width=w)
        block = TreeBlock.dead(budget, w, True, "cuda")
        grow_tree(tokens.cuda(), probs.cuda(), lead.cuda(), n.cuda(), 8, block, 15)
        for f in FIELDS:
            assert torch.equal(getattr(block, f).cpu(), getattr(want, f)), ("deep", seed, f)
    from specpilot.engines.drafters.ngram_prefix import LeadGate
    for seed in range(8):  # the lookup's gate in the launch (lookup_overlap): lead_depths gated in place
        tokens, probs = candidates(seed, 15, 8, scale=1.0)
        lead = torch.randint(0, 40, (15,), generator=torch.Generator().manual_seed(seed))
        lead[0] = tokens[0, seed % 3] if seed % 2 else lead[0]
        gate = LeadGate(2, [0.0, 0.5][seed // 4])
        n_ref, n = torch.tensor(9), torch.tensor(9).cuda()
        want = TreeBlock.dead(15, 16, True, "cpu")
        grow_tree_ref(tokens, probs, lead, n_ref, 4, want, None, gate)
        block = TreeBlock.dead(15, 16, True, "cuda")
        grow_tree(tokens.cuda(), probs.cuda(), lead.cuda(), n, 4, block, None, gate)
        assert n.item() == n_ref.item(), ("gate", seed)
        for f in FIELDS:
            assert torch.equal(getattr(block, f).cpu(), getattr(want, f)), ("gate", seed, f)
