"""The persistent decode step (kernels/step_kernel.py) gives the launches' bits: logits, argmax, KV cache and
residual stream equal fused_forward's for AR steps, chain verifies and position-ordered (tree) blocks, on tiny
random Llamas in bf16 and fp32. Without CUDA the interpreter runs it one stage per launch (the same bodies); on
CUDA one grid-synchronised launch (scripts/gpu_step_kernel.py measures it on the H200)."""
from __future__ import annotations

import pytest
import torch

from specpilot.engines.fused import fused_forward, persistent_forward, rope_tables_for, stack_weights
from specpilot.engines.llama import ancestor_slots
from specpilot.kernels.step_kernel import StackedLlama, persistent_step

from _tiny import tiny_model

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROGRAMS = 3 if DEV.type == "cpu" else 32  # fewer programs than most stages' items: each walks several


def _setup(shape: str, dtype: torch.dtype, seed: int):
    model = tiny_model(shape, seed=seed, dtype=dtype).to(DEV)
    tables = rope_tables_for(model, 128, DEV, persistent=True)
    sh = model.shape
    kv = torch.zeros(2, sh.layers, sh.kv_heads, 96, sh.head_dim, dtype=dtype, device=DEV)
    return model, tables, kv


def _both(model, tables, kv, ids, pos, slots, base, anc, block_slots=None):
    """(launches' (logits, argmax), persistent's (logits, argmax)), each from its own copy of the cache; the
    caches must end equal too."""
    kv_a, kv_b = kv.clone(), kv.clone()
    b = torch.tensor([base], device=DEV)
    cap = (0, model.shape.layers - 1)  # a block drafter's target features: these layers' outputs
    logits, argmax, feats = fused_forward(model, tables, ids, pos, slots, b, anc, kv_a[0], kv_a[1], capture=cap,
                                          block_slots=block_slots)
    want = logits, argmax
    *got, got_feats = persistent_forward(model, tables, ids, pos, slots, b, anc, kv_b, PROGRAMS, capture=cap,
                                         block_slots=block_slots)
    _same(got_feats, torch.cat(feats, dim=-1))
    assert torch.equal(kv_a.view(torch.uint8) if kv.dtype == torch.bfloat16 else kv_a, kv_b.view(torch.uint8)
                       if kv.dtype == torch.bfloat16 else kv_b), "KV cache writes differ"
    return want, got, kv_a


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a, b.view(torch.int32)
                       if b.dtype == torch.float32 else b)


@pytest.mark.parametrize("shape,dtype", [("gqa", torch.bfloat16), ("mha_tied", torch.float32)])
def test_persistent_step_matches_launches_for_prefill_ar_and_chain(shape, dtype):
    model, tables, kv = _setup(shape, dtype, seed=21)
    g = torch.Generator().manual_seed(5)
    sh = model.shape
    # a 7-token prefill, then an AR step at base 7, then a 4-token chain verify at base 8
    for base, T in ((0, 7), (7, 1), (8, 4)):
        ids = torch.randint(0, sh.vocab, (T,), generator=g).to(DEV)
        pos = torch.arange(base, base + T, device=DEV)
        anc = torch.tril(torch.ones(T, T, dtype=torch.bool, device=DEV))
        (wl, wa), (gl, ga), kv = _both(model, tables, kv, ids, pos, pos, base, anc)
        _same(gl, wl)
        _same(ga, wa)


def test_persistent_step_matches_launches_for_a_position_ordered_tree():
    model, tables, kv = _setup("gqa", torch.bfloat16, seed=22)
    sh = model.shape
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, sh.vocab, (9,), generator=g).to(DEV)
    pos = torch.arange(9, device=DEV)
    (_, _), (_, _), kv = _both(model, tables, kv, ids, pos, pos, 0, torch.tril(torch.ones(9, 9, dtype=torch.bool,
                                                                                            device=DEV)))
    # a tree: root 0, children 1 and 2 of 0, child 3 of 1 (ancestor-or-self rows)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=DEV)
    depth = torch.tensor([0, 1, 1, 2], device=DEV)
    ids = torch.randint(0, sh.vocab, (4,), generator=g).to(DEV)
    base = torch.tensor(9, device=DEV)
    slots = torch.arange(9, 13, device=DEV)
    (wl, wa), (gl, ga), _ = _both(model, tables, kv, ids, 9 + depth, slots, 9, anc, ancestor_slots(base, anc))
    _same(gl, wl)
    _same(ga, wa)


def test_stack_weights_repoints_the_model_and_checks_shapes():
    model = tiny_model("gqa", seed=23)
    before = model.layers[1].mlp.down_proj.weight.detach().clone()
    st = stack_weights(model)
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == st.down[1].data_ptr()  # one copy, shared
    assert torch.equal(st.down[1], before)
    with pytest.raises(ValueError, match="heads"):
        StackedLlama(**{**st.__dict__, "heads": 3})
    with pytest.raises(ValueError, match="gate_up"):
        StackedLlama(**{**st.__dict__, "gate_up": st.gate_up[:, :-1]})


def test_persistent_step_refuses_bad_launch_orders():
    model, tables, kv = _setup("gqa", torch.float32, seed=24)
    x = torch.zeros(1, model.shape.hidden, device=DEV)
    one = torch.zeros(1, dtype=torch.long, device=DEV)
    good_k = dict.fromkeys(("qkv", "o_proj", "gate_up", "down", "lm_head"), 128)
    good_n = dict.fromkeys(good_k, 16)
    args = (x, tables.stacked, kv[0], kv[1], tables.cos, tables.sin, one, one, one,
            torch.ones(1, 1, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="block_k"):
        persistent_step(*args, block_k={**good_k, "down": 100}, block_n=good_n,
                        attention={"block_n": 64, "split_keys": 64}, programs=2)
    with pytest.raises(ValueError, match="split_keys"):
        persistent_step(*args, block_k=good_k, block_n=good_n, attention={"block_n": 64, "split_keys": 96},
                        programs=2)
    split = rope_tables_for(model, 128, DEV, persistent=True,
                            kernel_table=(("down@64x128@T1", '{"split_k": 2}'),))
    with pytest.raises(ValueError, match="split-K"):
        persistent_forward(model, split, one, one, one, one, torch.ones(1, 1, dtype=torch.bool, device=DEV), kv, 2)


def test_engine_with_the_persistent_step_generates_the_launches_tokens():
    """AR and n-gram speculative generations through step_kernel=persistent equal the launches' AR, token for
    token (verify blocks of several tokens run through the persistent step too)."""
    from specpilot.engines.build import build_engine
    from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig

    from _tiny import prompt
    model = tiny_model("gqa", seed=25).to(DEV)
    p = prompt(model.shape.vocab, 10, 7) * 3  # repeats: the n-gram drafter gets accepted blocks

    def run(drafter, step_kernel):
        c = EngineConfig(dtype="float32", max_seq_len=160, drafter=drafter, kernel_backend="triton",
                         step_kernel=step_kernel)
        return build_engine(c, model, frozenset(), DEV.type).generate(p, 24)
    want = run(DrafterKind.NONE, "launches").tokens
    assert run(DrafterKind.NONE, "persistent").tokens == want
    spec = run(DrafterKind.NGRAM, "persistent")
    assert spec.tokens == want
    assert max(s.verify_tokens for s in spec.steps) > 1, "no verify block longer than one token ran"
    with pytest.raises(ConfigError, match="persistent"):
        EngineConfig(step_kernel="persistent")  # the torch backend
