"""The side stream's L2 prefetch (kernels/l2_prefetch.py, LinearParams.side_prefetch_lines): argument checks, and a
build with it gives the bits of a build without it (AR rows == verified chain rows, and == the plain build's), with
one prefetch per layer of each projection that asks, of that projection's weight. Under the Triton interpreter on CPU
(the prefetch is then a no-op: the test checks what the forward asks for); compiled, with the real side stream
forked into the captured graphs, on a GPU. The PTX is checked in tests/test_kernel_codegen.py.
"""
from __future__ import annotations

import json

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402
from _tiny import prompt, tiny_model  # noqa: E402

from specpilot.engines.config import DrafterKind, EngineConfig, KernelBackend, WeightFormat  # noqa: E402
from specpilot.engines.runner import ModelRunner, chain_anc  # noqa: E402
from specpilot.kernels import l2_prefetch as l2p  # noqa: E402
from specpilot.kernels.gemm import LinearParams  # noqa: E402
from specpilot.kernels.table import check_invariance, table_key  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("w, lines, match", [
    (torch.zeros(4, 64, dtype=torch.bfloat16), 3, "power of two"),
    (torch.zeros(4, 64, dtype=torch.bfloat16), 0, "lines=0"),
    (torch.zeros(4, 64, dtype=torch.bfloat16), 2048, "lines=2048"),
    (torch.zeros(4, 64, 2, dtype=torch.bfloat16), 4, "shape"),
    (torch.zeros(64, 4, dtype=torch.bfloat16).t(), 4, "contiguous"),
    ("w", 4, "torch.Tensor"),
])
def test_bad_arguments_are_refused_with_the_reason(w, lines, match):
    with pytest.raises(ValueError, match=match):
        l2p.l2_prefetch(w, lines)


def test_a_prefetch_changes_nothing_and_counts_distinct_lines():
    w = torch.arange(8 * 96, dtype=torch.float32).reshape(8, 96).to(torch.bfloat16).to(DEV)
    before = w.clone()
    l2p.l2_prefetch(w, 4)
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(w, before)
    assert l2p.prefetch_bytes(w, 1) == 8 * 128
    assert l2p.prefetch_bytes(w, 64) == 8 * 2 * 128  # a 192-byte row spans two lines


def test_the_field_is_a_step_setting_every_t_may_choose():
    with pytest.raises(ValueError, match="side_prefetch_lines"):
        LinearParams(side_prefetch_lines=-1)
    assert "side_prefetch_lines" not in LinearParams(side_prefetch_lines=32).as_kwargs()
    check_invariance(((table_key("o_proj", 64, 64, 1), json.dumps({"side_prefetch_lines": 32})),
                      (table_key("o_proj", 64, 64, 16), json.dumps({}))))  # T-neutral: T may differ


def side_table(shape, lines):
    on = json.dumps({"side_prefetch_lines": lines})
    return ((table_key("o_proj", shape.hidden, shape.q_dim, 1), on),
            (table_key("down", shape.hidden, shape.intermediate, 1), on))


def test_a_build_with_side_prefetches_decodes_the_same_bits(monkeypatch):
    """AR rows one token at a time, then the same chain verified at once, with o_proj and down prefetched from the
    side stream: equal to each other and to a build without the prefetches (argmax, top-2 margin, features)."""
    from specpilot.engines import fused
    model = tiny_model("gqa", 4).to(DEV)
    asked = []
    real = l2p.l2_prefetch

    def recording(w, lines):
        asked.append((w.data_ptr(), lines))
        return real(w, lines)

    monkeypatch.setattr(l2p, "l2_prefetch", recording)
    p, n = prompt(model.shape.vocab, 7, 4), 6

    def rows(table):
        c = EngineConfig(dtype="float32", max_seq_len=96, token_tile=8, drafter=DrafterKind.NGRAM,
                         kernel_backend=KernelBackend.TRITON, kernel_table=table)
        fresh = lambda: ModelRunner(model, c, DEV, block_width=16, topk=2, capture=(0,))  # noqa: E731
        r = fresh()
        seq, ar = list(p) + [r.prefill(p).argmax[0]], []
        for _ in range(n):
            out = r.verify(len(seq) - 1, [seq[-1]], [0], chain_anc(1))
            ar.append((out.argmax[0], out.margin[0].clone(), out.features[0].clone()))
            seq.append(out.argmax[0])
        r = fresh()
        r.prefill(p)
        out = r.verify(len(p), seq[len(p):len(p) + n], list(range(n)), chain_anc(n))
        chain = [(out.argmax[i], out.margin[i].clone(), out.features[i].clone()) for i in range(n)]
        return ar, chain

    plain_ar, plain_chain = rows(())
    assert not asked
    side_ar, side_chain = rows(side_table(model.shape, 8))
    weights = {w.data_ptr() for layer in model.layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)}
    assert asked and {ptr for ptr, _ in asked} == weights and {lines for _, lines in asked} == {8}
    assert fused._SIDE_STREAMS if CUDA else not fused._SIDE_STREAMS
    for got in (side_ar, side_chain, plain_chain):
        for (tok, margin, feat), (tok2, margin2, feat2) in zip(plain_ar, got):
            assert tok == tok2 and torch.equal(margin, margin2) and torch.equal(feat, feat2)


def test_w12_weights_refuse_the_field():
    model = tiny_model("gqa", 4).to(torch.bfloat16)
    c = EngineConfig(dtype="bfloat16", max_seq_len=64, token_tile=8, drafter=DrafterKind.NGRAM,
                     kernel_backend=KernelBackend.TRITON, weight_format=WeightFormat.W12,
                     kernel_table=side_table(model.shape, 4))
    with pytest.raises(ValueError, match="side_prefetch_lines reads bf16"):
        r = ModelRunner(model, c, torch.device("cpu"), block_width=16, topk=2)
        r.prefill(prompt(model.shape.vocab, 5, 1))
