"""Hybrid recurrent targets (Qwen3-Next layout): AR == transformers' greedy generate; chain and tree speculative
== AR token for token; rollback is bit-exact; transformers' cache crop does not roll GDN state back; the Triton
tree scan == its torch reference (TRITON_INTERPRET=1 on CPU); the state-traffic cost helper.

Tiny random Qwen3NextForCausalLM models (float32, CPU) are saved with save_pretrained and loaded by our loader.
"""
from __future__ import annotations


import pytest
import torch

# The GDN scan's kernel tests run compiled where a GPU is, else under the interpreter (tests/conftest.py).
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

from specpilot.kernels import gdn as gdn_kernels  # noqa: E402

from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig  # noqa: E402
from specpilot.engines.drafters.base import DraftTree  # noqa: E402
from specpilot.engines.engine import greedy_accept  # noqa: E402
from specpilot.engines.hybrid import (QWEN3_NEXT_80B, BlockSchedule, GdnBackend, HybridConfig,  # noqa: E402
                                      HybridRunner, HybridShape, best_chain, build_hybrid_engine,
                                      hybrid_knob_schema, load_hybrid_model)
from specpilot.engines.hybrid.cost import (block_parents, example_tree, state_cost_table,  # noqa: E402
                                           verify_state_traffic)
from specpilot.engines.hybrid.state import dfs_order, parents_from_anc  # noqa: E402
from specpilot.engines.loader import ModelLoadError  # noqa: E402
from specpilot.engines.layout import tree_anc  # noqa: E402
from specpilot.engines.runner import chain_anc  # noqa: E402
from specpilot.engines.shapes import UnsupportedModelError  # noqa: E402

NO_EOS: frozenset[int] = frozenset()
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12, moe_intermediate_size=24,
            shared_expert_intermediate_size=32, max_position_embeddings=512)
CONFIGS = {
    # MoE everywhere, 2 value heads per key head, K=4, attention every 2nd layer
    "moe_gqa": dict(num_hidden_layers=4, full_attention_interval=2, linear_conv_kernel_dim=4, linear_num_key_heads=2,
                    linear_num_value_heads=4, num_experts=6, num_experts_per_tok=2),
    # dense first layer, K=3, one value head per key head, tied embeddings, unnormalised top-k, half rotary
    "mixed_tied": dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
                       mlp_only_layers=[0], linear_conv_kernel_dim=3, linear_num_key_heads=2, linear_num_value_heads=2,
                       num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_model(name: str, seed: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**BASE, **CONFIGS[name])).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # std-0.02 weights repeat one token forever: larger weights give varied greedy text
        for n, p in model.named_parameters():
            if n.endswith(("A_log", "dt_bias")):
                continue
            scale = 0.1 if "norm" in n else (1.0 if "embed" in n else 0.3)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


_MODELS: dict = {}


def models(name: str, seed: int, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory), cached per module."""
    if (name, seed) not in _MODELS:
        hf = hf_model(name, seed)
        path = tmp_path_factory.mktemp(f"{name}-{seed}")
        hf.save_pretrained(path)
        _MODELS[name, seed] = hf, load_hybrid_model(path, torch.float32, "cpu"), path
    return _MODELS[name, seed][:2]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "max_seq_len": 160, "token_tile": 8, "cuda_graphs": False, **kw})


def ar(model, p, n, hybrid=HybridConfig(), **kw):
    return build_hybrid_engine(cfg(drafter=DrafterKind.NONE, **kw), hybrid, model, NO_EOS, "cpu").generate(p, n).tokens


class OracleDrafter:
    """Proposes the known continuation, as a chain or as a tree with decoys (a decoy before the right token, with a
    child of its own, on even depths; after it on odd depths), optionally wrong from depth `corrupt_from`."""

    def __init__(self, prompt_len: int, ref: list[int], k: int = 5, tree: bool = False,
                 corrupt_from: int | None = None):
        self.prompt_len, self.ref, self.k, self.tree, self.corrupt_from = prompt_len, ref, k, tree, corrupt_from

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        done = len(context) - self.prompt_len
        want = self.ref[done:done + min(self.k, max_depth)]
        v = BASE["vocab_size"]
        bad = self.corrupt_from
        toks = [(t + 1) % v if bad is not None and d >= bad else t for d, t in enumerate(want)]
        if not self.tree:
            return DraftTree.chain(toks)
        return decoy_tree(toks, max_depth)


def decoy_tree(toks: list[int], max_depth: int) -> DraftTree:
    v = BASE["vocab_size"]
    tokens, parents, prev = [], [], -1
    for d, t in enumerate(toks):
        if d % 2 == 0:
            tokens += [(t + 3) % v, t]
            parents += [prev, prev]
            decoy, right = len(tokens) - 2, len(tokens) - 1
            if d + 2 <= max_depth:
                tokens.append((t + 5) % v)
                parents.append(decoy)
        else:
            tokens += [t, (t + 3) % v]
            parents += [prev, prev]
            right = len(tokens) - 2
        prev = right
    return DraftTree(tokens, parents, [1.0] * len(tokens))


# ---- transformers parity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,seed", [("moe_gqa", 0), ("moe_gqa", 1), ("mixed_tied", 0), ("mixed_tied", 1)])
def test_ar_matches_transformers_greedy_generate(name, seed, tmp_path_factory):
    hf, ours = models(name, seed, tmp_path_factory)
    p = prompt(18, seed)
    n = 32
    ref = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(p):].tolist()
    assert len(set(ref)) > 6, "degenerate test model: output must vary"
    assert ar(ours, p, n) == ref
    assert ar(ours, p, n, batch_invariant=False) == ref  # fastest shapes: same tokens here, exactness not claimed


def test_transformers_cache_crop_does_not_roll_back_gdn_state(tmp_path_factory):
    """transformers' rollback after a rejected draft (activate_past_recording + crop) restores the conv rows but not
    the recurrent state, and says so (is_croppable is False). Our runner commits the right state (checked against
    transformers' own prefill of the accepted tokens)."""
    hf, ours = models("moe_gqa", 0, tmp_path_factory)
    p = prompt(12, 5)
    gdn = hf.config.layer_types.index("linear_attention")
    with torch.no_grad():
        out = hf(torch.tensor([p]), use_cache=True)
        cache, pending = out.past_key_values, int(out.logits[0, -1].argmax())
        cache.activate_past_recording()
        hf(torch.tensor([[pending, 7, 8]]), past_key_values=cache, use_cache=True)  # pending token + 2 drafts
        cache.crop(-2)  # reject both drafts
        truth = hf(torch.tensor([p + [pending]]), use_cache=True).past_key_values
    assert cache.get_seq_length() == len(p) + 1 and not cache.is_croppable
    layer, ref = cache.layers[gdn], truth.layers[gdn]
    torch.testing.assert_close(layer.conv_states[0], ref.conv_states[0], atol=1e-5, rtol=1e-5)  # rolled back
    assert (layer.recurrent_states[0] - ref.recurrent_states[0]).abs().max() > 1e-2  # still holds the drafts
    runner = HybridRunner(ours, cfg(drafter=DrafterKind.NONE), HybridConfig(), "cpu", block_width=8)
    with pytest.raises(ValueError, match="empty prompt"):
        runner.prefill([])
    with pytest.raises(ValueError, match="does not fit max_seq_len"):
        runner.prefill([5] * runner.cfg.max_seq_len)
    assert runner.prefill(p).argmax == [pending]
    runner.verify(len(p), [pending, 7, 8], [0, 1, 2], chain_anc(3))
    runner.compact(len(p), [0])
    torch.testing.assert_close(runner.rec.state[0], ref.recurrent_states[0][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(runner.rec.conv[0], ref.conv_states[0][0, :, 1:].t(), atol=1e-6, rtol=1e-5)


# ---- losslessness ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,seed", [("moe_gqa", s) for s in range(10)] + [("mixed_tied", s) for s in range(6)])
def test_chain_and_tree_speculative_equal_ar(name, seed, tmp_path_factory):
    _, model = models(name, seed % 3, tmp_path_factory)
    p = prompt(14, 50 + seed)
    n = 36
    ref = ar(model, p, n)
    spec = cfg(drafter=DrafterKind.NGRAM, draft_len=5)
    runs = {
        "chain": (OracleDrafter(len(p), ref), HybridConfig(), None),
        "chain_partial_s3": (OracleDrafter(len(p), ref, corrupt_from=2), HybridConfig(state_checkpoint_spacing=3),
                             None),
        "tree_dfs": (OracleDrafter(len(p), ref, tree=True), HybridConfig(), 13),
        "tree_dfs_s4": (OracleDrafter(len(p), ref, tree=True), HybridConfig(state_checkpoint_spacing=4), 13),
        "tree_drafter_order_s2": (OracleDrafter(len(p), ref, tree=True, corrupt_from=3),
                                  HybridConfig(dfs_order=False, state_checkpoint_spacing=2), 13),
        "tree_as_chain_s4": (OracleDrafter(len(p), ref, tree=True), HybridConfig(verify_tree=False,
                                                                                 state_checkpoint_spacing=4), 13),
        "ngram": (None, HybridConfig(state_checkpoint_spacing=2), None),
    }
    for label, (drafter, hybrid, nodes) in runs.items():
        engine = build_hybrid_engine(spec, hybrid, model, NO_EOS, "cpu", drafter=drafter, max_draft_nodes=nodes)
        r = engine.generate(p, n)
        assert r.tokens == ref, label
        if label.startswith(("chain", "tree")):
            assert max(s.committed for s in r.steps) >= 3, label  # drafts were accepted: a real test of rollback
        if label.startswith("tree") and "chain" not in label:
            assert max(s.verify_tokens for s in r.steps) > 8, label  # blocks span two forward chunks


def test_eos_and_max_tokens_inside_an_accepted_block(tmp_path_factory):
    _, model = models("moe_gqa", 1, tmp_path_factory)
    p = prompt(10, 9)
    free = ar(model, p, 40)
    j = next(i for i in range(6, 40) if free[i] not in free[:i])
    eos = frozenset({free[j]})
    spec = cfg(drafter=DrafterKind.NGRAM, draft_len=5)
    r = build_hybrid_engine(spec, HybridConfig(), model, eos, "cpu", drafter=OracleDrafter(len(p), free, tree=True),
                            max_draft_nodes=13).generate(p, 40)
    assert r.tokens == free[:j + 1] and r.stop_reason == "eos"
    for n in (1, 2, 7, 11):
        r = build_hybrid_engine(spec, HybridConfig(), model, NO_EOS, "cpu",
                                drafter=OracleDrafter(len(p), free)).generate(p, n)
        assert r.tokens == free[:n] and r.stop_reason == "max_tokens"


def _block(root: int, right: list[int], accept: int, tree: bool) -> tuple[list[int], list[int]]:
    """Block (root + drafts) whose first `accept` drafts are right, as a chain or a decoy tree."""
    v = BASE["vocab_size"]
    toks = [t if d < accept else (t + 1) % v for d, t in enumerate(right)]
    t = decoy_tree(toks, len(toks)) if tree else DraftTree.chain(toks)
    return [root] + t.tokens, [-1] + [q + 1 for q in t.parents]


@pytest.mark.parametrize("spacing,tree,dfs", [(1, False, True), (3, False, True), (1, True, True), (2, True, False),
                                              (4, True, True)])
def test_rollback_after_partial_acceptance_is_bit_exact(spacing, tree, dfs, tmp_path_factory):
    """After each partially accepted block the recurrent state, conv rows and KV equal those of AR decoding of the
    same tokens, bit for bit (float32)."""
    _, model = models("moe_gqa", 0, tmp_path_factory)
    p = prompt(11, 3)
    c = cfg(drafter=DrafterKind.NONE)
    ar_run = HybridRunner(model, c, HybridConfig(), "cpu", block_width=16)
    toks, snaps = ar_run.prefill(p).argmax, []
    for _ in range(26):
        base = len(p) + len(toks) - 1
        out = ar_run.verify(base, [toks[-1]], [0], chain_anc(1))
        ar_run.compact(base, [0])
        snaps.append((ar_run.rec.state.clone(), ar_run.rec.conv.clone(), ar_run.kv[..., :base + 1, :].clone()))
        toks.append(out.argmax[0])
    spec = HybridRunner(model, c, HybridConfig(state_checkpoint_spacing=spacing, dfs_order=dfs), "cpu",
                        block_width=16)
    spec.prefill(p)
    done = 0  # toks[done] is the pending root
    for accept in (0, 3, 1, 4, 2, 0, 4):
        base = len(p) + done
        block, parents = _block(toks[done], toks[done + 1:done + 5], accept, tree)
        depths = [0] * len(parents)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
        out = spec.verify(base, block, depths, tree_anc(parents))
        acc = greedy_accept(block, parents, out.argmax)
        assert len(acc.path) - 1 == accept and acc.tokens[-1] == toks[done + accept + 1]
        spec.compact(base, acc.path)
        state, conv, kv = snaps[done + accept]
        assert torch.equal(spec.rec.state, state) and torch.equal(spec.rec.conv, conv), (accept, done)
        assert torch.equal(spec.kv[..., :base + accept + 1, :], kv)
        done += accept + 1  # the bonus token is the next root


# ---- schedule, drafter adapter, config, loader -----------------------------------------------------------------
def test_schedule_stores_branch_points_and_checkpoints():
    parents = [-1, 0, 0, 2, 1]  # 0 -> {1, 2}; 2 -> 3; 1 -> 4
    assert BlockSchedule.build(parents, chunk=8, spacing=1).store == (0, 1, 2, 3, 4)
    s = BlockSchedule.build(parents, chunk=8, spacing=3)  # depth-2 rows (3, 4) + resumed parents 0 (of 2), 1 (of 4)
    assert s.store == (0, 1, -1, 2, 3) and s.resumes() == 3
    assert s.replay(2) == (0, [2]) and s.replay(3) == (2, [])
    assert BlockSchedule.build([-1, 0, 1, 2, 3], chunk=2, spacing=8).store == (-1, 0, -1, 1, -1)  # chunk starts 2, 4
    assert BlockSchedule.build([-1, 0, 1], chunk=8, spacing=8, keep=(2,)).replay(1) == (-1, [0, 1])
    w = s.conv_windows(3, 6)  # K=3: [committed 0, 1 ; rows at 2 + i]
    assert w.tolist() == [[0, 1], [1, 2], [1, 2], [2, 4], [2, 3], [0, 1]]  # last row: padding
    assert s.conv_after(3, 3).tolist() == [4, 5]  # row 3's window was (row 0, row 2): keep row 2, add row 3
    assert s.hold == (False, False, False, True, True) and s.resume == (True, False, True, False, True)
    assert dfs_order(parents) == [0, 1, 4, 2, 3]
    assert dfs_order([-1, 0, 1, 0]) == [0, 3, 1, 2]  # the leaf child first, then the inner one
    leaves_first = BlockSchedule.build([-1, 0, 0, 2], chunk=8, spacing=8)
    assert leaves_first.resumes() == 1 and leaves_first.stored == 0  # the leaf leaves row 0's state on chip
    assert parents_from_anc(tree_anc(parents)) == parents
    with pytest.raises(ValueError, match="parents must precede"):
        BlockSchedule.build([-1, 2, 0], chunk=8, spacing=1)


def test_best_chain_and_truncation():
    t = DraftTree([5, 6, 7, 8], [-1, -1, 1, 2], [0.9, 0.5, 0.45, 0.4])
    assert best_chain(t).tokens == [5]
    t = DraftTree([5, 6, 7, 8], [-1, -1, 1, 2], [0.5, 0.5, 0.5, 0.5])
    c = best_chain(t)
    assert c.tokens == [6, 7, 8] and c.parents == [-1, 0, 1]


def test_hybrid_config_knobs():
    assert HybridConfig(gdn_backend="triton").gdn_backend is GdnBackend.TRITON
    for bad in (dict(state_checkpoint_spacing=0), dict(state_checkpoint_spacing=2.0), dict(verify_tree=1),
                dict(gdn_backend="cuda")):
        with pytest.raises(ConfigError):
            HybridConfig(**bad)
    names = {k["name"] for k in hybrid_knob_schema()}
    assert names == {"verify_tree", "state_checkpoint_spacing", "dfs_order", "gdn_backend"}
    assert HybridConfig().to_dict()["gdn_backend"] == "reference"


def test_80b_constants_match_transformers_defaults():
    from transformers import Qwen3NextConfig
    d = HybridShape.from_hf_config(Qwen3NextConfig().to_dict())
    for f in ("vocab", "hidden", "layer_kinds", "sparse_layers", "heads", "kv_heads", "head_dim", "rotary_dim",
              "lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim", "conv_kernel", "experts", "experts_per_tok",
              "moe_intermediate", "shared_intermediate"):
        assert getattr(d, f) == getattr(QWEN3_NEXT_80B, f), f
    assert len(QWEN3_NEXT_80B.gdn_layers) == 36 and QWEN3_NEXT_80B.state_elems * 4 == 2 * 2 ** 20


def test_loader_errors(tmp_path, tmp_path_factory):
    models("mixed_tied", 0, tmp_path_factory)
    src = _MODELS["mixed_tied", 0][2]
    import json
    from safetensors.torch import load_file, save_file
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.experts.4.up_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="experts.4.up_proj"):
        load_hybrid_model(tmp_path, torch.float32, "cpu")
    cfg_json = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg_json, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="qwen3_next"):
        load_hybrid_model(tmp_path, torch.float32, "cpu")


# ---- Triton tree scan -----------------------------------------------------------------------------------------
def _scan_inputs(gen, t, hk, hv, dk, dv, device=torch.device("cpu")):
    def norm(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    return tuple(x.to(device) for x in (
        norm(torch.randn(t, hk, dk, generator=gen)) * dk ** -0.5, norm(torch.randn(t, hk, dk, generator=gen)),
        torch.randn(t, hv, dv, generator=gen), -torch.rand(t, hv, generator=gen) * 2,
        torch.rand(t, hv, generator=gen), torch.randn(hv, dk, dv, generator=gen)))


def _run_chunks(fn, sched, inputs, nodes, chunk):
    q, k, v, g, beta, s0 = inputs
    par, store = torch.tensor(sched.parents, device=q.device), torch.tensor(sched.store, device=q.device)
    hold = torch.tensor(sched.hold, dtype=torch.long, device=q.device)
    outs = [fn(q[s:s + chunk], k[s:s + chunk], v[s:s + chunk], g[s:s + chunk], beta[s:s + chunk],
               par[s:s + chunk], hold[s:s + chunk], store, s0, nodes, offset=s) for s in range(0, sched.rows, chunk)]
    return torch.cat(outs)


@pytest.mark.parametrize("hk,hv,dk,dv,block_v", [(2, 4, 8, 12, 16), (1, 1, 16, 40, 16), (2, 2, 32, 16, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_tree_scan_matches_reference(hk, hv, dk, dv, block_v, seed):
    gen = torch.Generator().manual_seed(seed)
    t, chunk = 11, 4
    parents = [-1] + [int(torch.randint(-1 if i > 3 else 0, i, (1,), generator=gen)) for i in range(1, t)]
    if seed:  # depth-first, leaves first: held leaves let siblings continue from the on-chip state
        order = dfs_order(parents)
        row_of = {n: r for r, n in enumerate(order)}
        parents = [row_of[parents[n]] if parents[n] >= 0 else -1 for n in order]
    sched = BlockSchedule.build(parents, chunk=chunk, spacing=2)
    assert any(sched.hold[i] and not sched.resume[i] for i in range(t)) or not seed
    inputs = _scan_inputs(gen, t, hk, hv, dk, dv, DEV)
    n_ref, n_tri = (torch.full((sched.stored, hv, dk, dv), 7.0, device=DEV) for _ in range(2))
    o_ref = _run_chunks(gdn_kernels.tree_gdn_ref, sched, inputs, n_ref, chunk)
    o_tri = _run_chunks(lambda *a, offset: gdn_kernels.tree_gdn(*a, offset=offset, block_v=block_v), sched, inputs,
                        n_tri, chunk)
    torch.testing.assert_close(o_tri, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(n_tri, n_ref, atol=2e-5, rtol=1e-4)
    # chain special case == one state carried through every row (transformers' recurrent loop)
    chain = BlockSchedule.build(list(range(-1, t - 1)), chunk=t, spacing=t, keep=(t - 1,))
    last = torch.zeros(1, hv, dk, dv, device=DEV)
    o_chain = _run_chunks(gdn_kernels.tree_gdn, chain, inputs, last, t)
    q, k, v, g, beta, state = inputs
    for i in range(t):
        state, o = gdn_kernels.gdn_step_ref(state, q[i].repeat_interleave(hv // hk, 0),
                                            k[i].repeat_interleave(hv // hk, 0), v[i], g[i], beta[i])
        torch.testing.assert_close(o_chain[i], o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(last[0], state, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", ["tree_gdn", "tree_gdn_ref"])
def test_replay_from_checkpoint_is_bit_exact(fn):
    """A node's state replayed from a stored ancestor equals the one the scan stored, bit for bit (same backend)."""
    scan = getattr(gdn_kernels, fn)
    gen = torch.Generator().manual_seed(4)
    t, hk, hv, dk, dv = 7, 2, 4, 8, 12
    q, k, v, g, beta, s0 = _scan_inputs(gen, t, hk, hv, dk, dv, DEV)
    everything = torch.zeros(t, hv, dk, dv, device=DEV)
    no_hold = torch.zeros(t, dtype=torch.long, device=DEV)
    scan(q, k, v, g, beta, torch.arange(-1, t - 1, device=DEV), no_hold, torch.arange(t, device=DEV), s0, everything)
    for start, end in ((1, 6), (0, 3), (4, 5)):
        rows = slice(start + 1, end + 1)
        m = end - start
        out = torch.zeros(1, hv, dk, dv, device=DEV)
        store = torch.full((m,), -1, device=DEV)
        store[-1] = 0
        scan(k[rows].contiguous(), k[rows].contiguous(), v[rows].contiguous(), g[rows].contiguous(),
             beta[rows].contiguous(), torch.arange(-1, m - 1, device=DEV), no_hold[:m], store,
             everything[start].contiguous(), out)
        assert torch.equal(out[0], everything[end]), (start, end)


def test_triton_wrapper_and_reference_reject_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, s0 = _scan_inputs(gen, 3, 2, 4, 8, 12)
    nodes, par, store = torch.zeros(3, 4, 8, 12), torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 2])
    hold = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="q must have dtype"):
        gdn_kernels.tree_gdn(q.double(), k, v, g, beta, par, hold, store, s0, nodes)
    with pytest.raises(ValueError, match="v must be contiguous"):
        gdn_kernels.tree_gdn(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), g, beta, par, hold, store, s0,
                             nodes)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn_kernels.tree_gdn(q, k, v[:, :3].contiguous(), g[:, :3].contiguous(), beta[:, :3].contiguous(), par,
                             hold, store, s0[:3].contiguous(), nodes[:, :3].contiguous())
    with pytest.raises(ValueError, match="hold must have shape"):
        gdn_kernels.tree_gdn(q, k, v, g, beta, par, hold[:2], store, s0, nodes)
    with pytest.raises(ValueError, match="store has 2 entries"):
        gdn_kernels.tree_gdn(q, k, v, g, beta, par, hold, store[:2], s0, nodes)
    with pytest.raises(ValueError, match="not stored"):  # row 2 resumes from row 0, which is not stored
        gdn_kernels.tree_gdn_ref(q, k, v, g, beta, par, hold, torch.tensor([-1, 0, 1]), s0, nodes)


@pytest.mark.interpreter
def test_engine_on_triton_scan_equals_reference_ar(tmp_path_factory):
    _, model = models("moe_gqa", 1, tmp_path_factory)
    p = prompt(9, 21)
    n = 14
    ref = ar(model, p, n)
    triton = HybridConfig(gdn_backend=GdnBackend.TRITON)
    assert ar(model, p, n, hybrid=triton) == ref
    spec = cfg(drafter=DrafterKind.NGRAM, draft_len=4)
    for hybrid in (triton, HybridConfig(gdn_backend=GdnBackend.TRITON, state_checkpoint_spacing=3)):
        e = build_hybrid_engine(spec, hybrid, model, NO_EOS, "cpu", max_draft_nodes=10,
                                drafter=OracleDrafter(len(p), ref, k=4, tree=True))
        r = e.generate(p, n)
        assert r.tokens == ref and max(s.committed for s in r.steps) >= 3


# ---- cost helper ----------------------------------------------------------------------------------------------
def test_state_traffic_for_80b_layer_shapes():
    sh = QWEN3_NEXT_80B
    state, conv, layers = 2 * 2 ** 20, 3 * 8192 * 2, 36
    chain = BlockSchedule.build(block_parents(list(range(-1, 15))), chunk=32, spacing=1)  # root + 16 drafts
    c = verify_state_traffic(sh, chain, commit_row=5)
    row_in = 4 * (16 * 128 + 32 * 130) + 8192 * 2
    assert c.floor == layers * 2 * (state + conv)
    assert c.read == layers * (state + conv + state + conv)  # one resume (row 0), the checkpoint copy, conv rows
    assert c.written == layers * (17 * state + 17 * row_in + state + conv)
    sparse = verify_state_traffic(sh, BlockSchedule.build(chain.parents, chunk=32, spacing=16), commit_row=5)
    assert sparse.total < c.total and sparse.over_floor < 2.5
    table = {(r["block"], r["order"], r["spacing"]): r for r in state_cost_table()}
    assert table["tree", "dfs", 1]["worst_bytes"] < table["tree", "drafter", 1]["worst_bytes"]
    assert table["chain", "drafter", 16]["worst_bytes"] < table["chain", "drafter", 1]["worst_bytes"]
    assert all(r["worst_bytes"] >= r["floor_bytes"] for r in table.values())
    # depth-first with leaves first, the example tree (a main path plus leaf alternatives) resumes once, like a chain
    assert table["tree", "dfs", 16]["resumes"] == 1 and table["tree", "drafter", 16]["resumes"] > 8
    assert table["tree", "dfs", 16]["worst_bytes"] <= table["chain", "drafter", 16]["worst_bytes"]
    assert example_tree(6, 3) == [-1, -1, 0, 0, 2, 2]
