"""The device loop's glue kernels (engines.loop_kernels, tree_move; interpreted here) equal their torch references on
hand-built edge cases and random drafts, write what the references write, and refuse bad inputs."""
from __future__ import annotations

import pytest
import torch

from specpilot.engines.layout import draft_layout
from specpilot.engines.llama import ancestor_slots
from specpilot.engines.loop_kernels import (LoopStop, assemble, assemble_ref, chain_commit, chain_commit_ref,
                                            tree_commit, tree_commit_ref)

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run interpreted (tests/conftest.py)


def on_dev(*ts):
    return [None if t is None else t.to(DEV) for t in ts]


def _assemble_inputs(g, depth, k, n_nodes, width, lead_depth, vocab=9):
    tokens = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(depth)])  # distinct per depth
    probs = torch.rand(depth, k, generator=g)
    lead = torch.randint(0, vocab, (depth,), generator=g)
    node_src = torch.randint(0, depth * k, (n_nodes,), generator=g)
    rel_positions = torch.randint(0, 40, (width,), generator=g)
    rel_slots = torch.randint(0, 40, (width,), generator=g)
    state = torch.tensor([int(torch.randint(0, vocab, (1,), generator=g)), int(torch.randint(0, 50, (1,),
                                                                                                generator=g))])
    lead_args = (None, None) if lead_depth is None else (lead, torch.tensor([lead_depth]))
    return on_dev(tokens, probs, *lead_args, state, node_src, rel_positions, rel_slots)


def _block_layout(parents):
    """The layout of a block whose row i hangs off row parents[i] (parents[0] = -1: the root)."""
    return draft_layout(tuple(p - 1 for p in parents[1:]))


def _equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        assert g is None or (g.dtype == w.dtype and torch.equal(g, w.reshape(g.shape))), (g, w)


@pytest.mark.parametrize("depth,k,n_nodes,width", [(3, 1, 3, 4), (5, 4, 15, 16), (7, 3, 9, 16), (16, 8, 31, 32)])
@pytest.mark.parametrize("lead_depth", [None, 0, 2, 99])
def test_assemble_equals_its_reference(depth, k, n_nodes, width, lead_depth):
    g = torch.Generator().manual_seed(depth * 100 + k * 10 + (lead_depth or 0))
    for trial in range(3):
        args = _assemble_inputs(g, depth, k, n_nodes, width, lead_depth, vocab=max(9, k + 1))
        _equal(assemble(*args), assemble_ref(*args))
        # with a static tree's relative block slots: base added where a row has an ancestor at that depth
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, width)]
        anc = torch.from_numpy(_block_layout(parents).anc.copy())
        rel = ancestor_slots(torch.tensor(0), anc)
        got, want = assemble(*args, rel.to(DEV)), assemble_ref(*args, rel.to(DEV))
        _equal(got, want)
        assert torch.equal(got[5].cpu(), ancestor_slots(args[4][1].cpu(), anc))  # what the runner would derive


def test_assemble_leads_each_depth_and_gathers_the_led_nodes():
    tokens = torch.tensor([[7, 5, 9], [7, 8, 9], [5, 7, 9], [7, 9, 5], [4, 6, 2]])  # lead duplicate at 1, none, 0, 2
    probs = torch.tensor([[0.5, 0.3, 0.1], [0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.4, 0.3, 0.2], [0.7, 0.1, 0.05]])
    lead, n_lead = torch.tensor([5, 5, 5, 5, 3]), torch.tensor([4])  # the last depth is past the lookup's match
    state = torch.tensor([11, 20])
    node_src = torch.tensor([0, 1, 3, 4, 13, 14])  # (depth, rank) (0,0) (0,1) (1,0) (1,1) (4,1) (4,2)
    rel = torch.arange(8)
    for fn in (assemble, assemble_ref):
        tok, prob, ids, pos, slots, block_slots = fn(*on_dev(tokens, probs, lead, n_lead, state, node_src, rel,
                                                             rel * 2))
        assert block_slots is None
        assert tok.tolist() == [[5, 7, 9], [5, 7, 8], [5, 7, 9], [5, 7, 9], [4, 6, 2]]
        assert prob[1].tolist() == pytest.approx([1.0, 0.5, 0.3]) and prob[4].tolist() == probs[4].tolist()
        assert ids.tolist() == [11, 5, 7, 5, 7, 6, 2, 0]
        assert pos.tolist() == list(range(20, 28)) and slots.tolist() == list(range(20, 36, 2))


@pytest.mark.parametrize("argmax,ids,proposed,accepted", [
    ([5, 6, 7, 8], [1, 5, 6, 7], 3, 3),  # every draft right
    ([5, 6, 7, 8], [1, 5, 6, 7], 2, 2),  # right past what was proposed (filler): capped
    ([5, 6, 7, 8], [1, 4, 6, 7], 3, 0),  # the first wrong: later matches do not count
    ([5, 6, 7, 8], [1, 5, 0, 7], 3, 1),
    ([5], [1], 0, 0),  # a chain of the root only
])
def test_chain_commit_hand_built(argmax, ids, proposed, accepted):
    for fn in (chain_commit, chain_commit_ref):
        state, seq = on_dev(torch.tensor([1, 10]), torch.full((20,), -1))
        path, acc = fn(*on_dev(torch.tensor(argmax), torch.tensor(ids + [0, 0]), torch.tensor(proposed)), state, seq)
        assert int(acc) == accepted and path.tolist() == argmax
        assert state.tolist() == [argmax[accepted], 10 + accepted + 1]
        assert seq[11:11 + len(argmax)].tolist() == argmax and (seq[:11] == -1).all()
        assert (seq[11 + len(argmax):] == -1).all()


def test_chain_commit_equals_its_reference_on_random_chains():
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        rows = int(torch.randint(1, 17, (1,), generator=g))
        argmax = torch.randint(0, 3, (rows,), generator=g)  # 3 tokens: long accepted runs happen
        ids = torch.cat([torch.tensor([9]), torch.randint(0, 3, (rows + 2,), generator=g)])
        proposed = torch.randint(0, rows, (1,), generator=g)
        base = int(torch.randint(0, 30, (1,), generator=g))
        got, want = [], []
        for fn, out in ((chain_commit, got), (chain_commit_ref, want)):
            state, seq = on_dev(torch.tensor([9, base]), torch.zeros(64, dtype=torch.long))
            path, acc = fn(*on_dev(argmax, ids, proposed), state, seq if trial % 2 else None)
            out += [path, acc.reshape(()), state, seq]
        _equal(got, want)


@pytest.mark.parametrize("eos, left, live, want", [
    # argmax [5, 6, 7, 8], drafts [5, 6, 9]: accepted 2, committed tokens 5, 6, 7 (ctl: left, ran, live)
    ([], 10, 1, [7, 1, 1]),  # no EOS, 7 tokens still to go
    ([7], 10, 1, [7, 1, 0]),  # the bonus token is an EOS: stop
    ([5, 99], 10, 1, [7, 1, 0]),  # the first committed token is one of the EOS set
    ([8], 10, 1, [7, 1, 1]),  # EOS past the accepted path: not committed, no stop
    ([], 3, 1, [0, 1, 0]),  # exactly at the token limit
    ([], 2, 1, [-1, 1, 0]),  # past it (the host cuts the tokens; the request stops either way)
    ([7], 10, 0, [10, 0, 0]),  # a step run after the stop (no conditional node): counts nothing, changes nothing
])
def test_commits_track_the_stop_rule(eos, left, live, want):
    for fn in (chain_commit, chain_commit_ref):
        state, ctl = on_dev(torch.tensor([1, 10]), torch.tensor([left, 0, live]))
        ids = on_dev(torch.tensor(eos or [-1]))[0]
        fn(*on_dev(torch.tensor([5, 6, 7, 8]), torch.tensor([1, 5, 6, 9]), torch.tensor(3)), state, None,
           LoopStop(ids, ctl))
        assert ctl.tolist() == want, fn.__name__
    parents, anc, depths, depth_rows = _tree([-1, 0, 0, 1, 2, 2, 5])
    argmax = torch.tensor([10, 11, 20, 12, 21, 22, 23])
    for fn in (tree_commit, tree_commit_ref):  # accepted path 0 -> 2 -> 5 -> 6: tokens 20, 22, 23 and bonus 0's 10
        for eos, stops in (([22], True), ([21], False), ([10], True), ([12], False)):
            state, ctl = on_dev(torch.tensor([10, 30]), torch.tensor([50, 4, 1]))
            fn(*on_dev(argmax, torch.tensor([0, 9, 10, 0, 0, 20, 22]), parents, anc, depths), state, depth_rows,
               None, LoopStop(*on_dev(torch.tensor(eos)), ctl))
            assert ctl.tolist() == [46, 5, int(not stops)], (fn.__name__, eos)


def test_commits_track_the_stop_rule_like_their_references_on_random_chains():
    g = torch.Generator().manual_seed(4)
    for trial in range(30):
        rows = int(torch.randint(1, 17, (1,), generator=g))
        argmax = torch.randint(0, 4, (rows,), generator=g)
        ids = torch.cat([torch.tensor([9]), torch.randint(0, 4, (rows + 2,), generator=g)])
        proposed = torch.randint(0, rows, (1,), generator=g)
        eos = torch.randint(0, 6, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
        ctl0 = torch.tensor([int(torch.randint(1, 12, (1,), generator=g)), trial, int(trial % 5 > 0)])
        got = []
        for fn in (chain_commit, chain_commit_ref):
            state, ctl = on_dev(torch.tensor([9, 3]), ctl0.clone())
            fn(*on_dev(argmax, ids, proposed), state, None, LoopStop(*on_dev(eos), ctl))
            got.append(ctl.tolist())
        assert got[0] == got[1], trial


def test_bad_inputs_are_refused():
    t, p, state, src, rel = on_dev(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2),
                                   torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.arange(4))
    with pytest.raises(ValueError, match="come together"):
        assemble(t, p, torch.zeros(2, dtype=torch.long, device=DEV), None, state, src, rel, rel)
    with pytest.raises(ValueError, match="probs must have dtype"):
        assemble(t, p.double(), None, None, state, src, rel, rel)
    with pytest.raises(ValueError, match="do not fit"):
        assemble(t, p, None, None, state, torch.zeros(4, dtype=torch.long, device=DEV), rel, rel)
    with pytest.raises(ValueError, match="argmax must have dtype"):
        chain_commit(*on_dev(torch.zeros(3, dtype=torch.int32), rel, torch.tensor(1)), state)
    with pytest.raises(ValueError, match="proposed must hold one"):
        chain_commit(*on_dev(torch.zeros(3, dtype=torch.long), rel, torch.tensor([1, 2])), state)
    with pytest.raises(ValueError, match="stop ctl must have shape"):
        chain_commit(*on_dev(torch.zeros(3, dtype=torch.long), rel, torch.tensor(1)), state, None,
                     LoopStop(*on_dev(torch.tensor([2]), torch.zeros(2, dtype=torch.long))))
    with pytest.raises(ValueError, match="at least one"):
        chain_commit(*on_dev(torch.zeros(3, dtype=torch.long), rel, torch.tensor(1)), state, None,
                     LoopStop(*on_dev(torch.zeros(0, dtype=torch.long), torch.zeros(3, dtype=torch.long))))


def _tree(parents):
    lay = _block_layout(parents)
    return (torch.tensor(lay.parents), torch.from_numpy(lay.anc.astype("uint8")), torch.tensor(lay.depths),
            lay.max_depth + 1)


def test_tree_commit_hand_built():
    """Root 0; 1 and 2 children of 0; 3 child of 1; 4 and 5 children of 2; 6 child of 5."""
    parents, anc, depths, depth_rows = _tree([-1, 0, 0, 1, 2, 2, 5])
    argmax = torch.tensor([10, 11, 20, 12, 21, 22, 23])  # the target's token after each node
    cases = [  # ids (the block), accepted, path rows
        ([0, 10, 9, 11, 20, 20, 22], 2, [0, 1, 3, 0]),  # 1 and 3 right; 2 wrong, so its subtree (4, 5, 6) too
        ([0, 9, 10, 0, 20, 0, 0], 2, [0, 2, 4, 0]),  # 1 wrong; 2 right, then 4
        ([0, 9, 10, 0, 0, 20, 22], 3, [0, 2, 5, 6]),  # the deepest path: 2, 5, 6
        ([0, 9, 8, 0, 20, 20, 22], 0, [0, 0, 0, 0]),  # no depth-1 node right: the bonus only
    ]
    for ids, acc, rows in cases:
        for fn in (tree_commit, tree_commit_ref):
            state, seq = on_dev(torch.tensor([10, 30]), torch.full((40,), -1))
            path, tokens, accepted, nxt = fn(*on_dev(argmax, torch.tensor(ids), parents, anc, depths), state,
                                             depth_rows, seq)
            assert int(accepted) == acc and path.tolist() == rows, (fn.__name__, ids)
            assert tokens.tolist() == argmax[rows].tolist()
            assert nxt.tolist() == [int(argmax[rows[acc]]), 30 + acc + 1] and state.tolist() == [10, 30]
            assert seq[31:31 + depth_rows].tolist() == argmax[rows].tolist() and (seq[:31] == -1).all()


def test_tree_commit_equals_its_reference_on_random_trees():
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        rows = int(torch.randint(2, 33, (1,), generator=g))
        parents, anc, depths, depth_rows = _tree([-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=g))
                                                         for i in range(1, rows)])
        argmax = torch.randint(0, 3, (rows,), generator=g)
        ids = torch.cat([torch.tensor([7]), torch.randint(0, 3, (rows + 1,), generator=g)])
        got, want = [], []
        for fn, out in ((tree_commit, got), (tree_commit_ref, want)):
            state, seq = on_dev(torch.tensor([7, 5]), torch.zeros(48, dtype=torch.long))
            res = fn(*on_dev(argmax, ids, parents, anc, depths), state, depth_rows, seq if trial % 2 else None)
            out += [*res, state, seq]
        _equal(got, want)


def test_tree_move_moves_the_path_in_place_gathering_before_it_writes():
    """The accepted path's rows move to base.., entries past the accepted depth take the root's row; a row one depth
    reads is one another depth writes (path 0, 2, 5 with depth 2's destination row 2 = depth 1's source), so every
    row is read before any is written; features come back in depth order (rows [T, F], or the runner's layer-major
    [layers, T, H] as rows of the layers side by side); state becomes the next state."""
    from specpilot.engines.tree_move import tree_move, tree_move_ref

    g = torch.Generator().manual_seed(0)
    for path_rows, accepted, dtype in (([0, 2, 5, 0, 0], 2, torch.bfloat16), ([0, 1, 2, 3, 4], 4, torch.float32),
                                       ([0, 3, 4, 7, 0], 3, torch.float32), ([0, 0, 0], 0, torch.bfloat16)):
        kv = torch.randn(2, 3, 2, 40, 16, generator=g).to(dtype)
        features = torch.randn(8, 300, generator=g).to(dtype)  # 300 columns: two chunks, the second partial
        stacked = torch.randn(3, 8, 100, generator=g).to(dtype)  # 3 layers of 100: chunks straddle layers
        base = 11
        path = torch.tensor(path_rows)
        next_state = torch.tensor([7, base + accepted + 1])
        want_kv, want_state = kv.clone(), torch.tensor([5, base])
        want_kv[:, :, :, base:base + len(path_rows)] = kv[:, :, :, [base + r for r in path_rows]]
        for move in (tree_move_ref, tree_move):
            k, st = on_dev(kv.clone(), torch.tensor([5, base]))
            got = move(k, *on_dev(path, torch.tensor(accepted), next_state), st, *on_dev(features))
            assert torch.equal(k.cpu(), want_kv) and st.tolist() == next_state.tolist(), (move.__name__, path_rows)
            assert torch.equal(got.cpu(), features[path]), move.__name__
            got = move(k, *on_dev(path, torch.tensor(accepted), next_state), st, *on_dev(stacked))
            assert torch.equal(got.cpu(), torch.cat(list(stacked[:, path]), dim=-1)), move.__name__
            assert move(k, *on_dev(path, torch.tensor(accepted), next_state), st) is None
        # the block drafter's cache [layers, k/v, kv heads, slots, D] (its own slot count) moves along the same path
        cache = torch.randn(2, 2, 3, 30, 16, generator=g).to(dtype)
        want_cache = cache.clone()
        want_cache[..., base:base + len(path_rows), :] = cache[..., [base + r for r in path_rows], :]
        for move in (tree_move_ref, tree_move):
            k, st, c = on_dev(kv.clone(), torch.tensor([5, base]), cache.clone())
            assert move(k, *on_dev(path, torch.tensor(accepted), next_state), st, drafter_cache=c) is None
            assert torch.equal(k.cpu(), want_kv) and torch.equal(c.cpu(), want_cache), (move.__name__, path_rows)
    with pytest.raises(ValueError, match="features has 2 rows"):
        tree_move_ref(kv, path, torch.tensor(0), next_state, want_state, features[:2])
    with pytest.raises(ValueError, match="accepted must have shape"):
        tree_move_ref(kv, path, torch.tensor([0]), next_state, want_state)
    with pytest.raises(ValueError, match="drafter_cache must have shape"):
        tree_move_ref(kv, path, torch.tensor(0), next_state, want_state, drafter_cache=torch.zeros(2, 3, 40, 8))
