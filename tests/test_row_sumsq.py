"""Producer statistics: o_proj / down store their rows' 16-column sums of squares, the norm launch after them reads
those instead of its input rows (RMSNormLinearParams.producer_stat, kernels/rmsnorm.py).

Exactness needs two things: the producer's sums are the same bits whatever its tile, warps, split-K or T (checked
against one torch reference), and a norm launch fed them gives each row the same bits whatever T (checked for every
epilogue), so a build with the field on still verifies exactly what it decodes (checked through the engine).
Under the Triton interpreter on CPU; compiled on a GPU.
"""
from __future__ import annotations

import json

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402
from _tiny import prompt, tiny_model  # noqa: E402

import specpilot.kernels as K  # noqa: E402
from specpilot.engines.config import DrafterKind, EngineConfig, KernelBackend  # noqa: E402
from specpilot.engines.runner import ModelRunner, chain_anc  # noqa: E402
from specpilot.kernels import norm_epilogues as E  # noqa: E402
from specpilot.kernels.rmsnorm import rms_norm_ref, row_sumsq_ref  # noqa: E402
from specpilot.kernels.table import check_invariance, table_key  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
BF = torch.bfloat16


def rnd(g, *shape, scale=1.0, dtype=BF):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def test_the_reference_is_a_pairwise_tree_over_16_columns():
    h = torch.tensor([[2.0 ** 24, 0.0, 2.0 ** 12, 2.0 ** 12] + [0.0] * 12 + [3.0] * 16])  # squares 2^48, 0, 2^24, 2^24
    sums = row_sumsq_ref(h)
    assert sums.shape == (1, 2) and sums.dtype == torch.float32
    # adjacent pairs first: 2^24 + 2^24 = 2^25, one fp32 ulp of 2^48, survives; added one by one to 2^48, each 2^24
    # is half an ulp and rounds away (ties to even)
    assert sums[0, 0].item() == 2.0 ** 48 + 2.0 ** 25 and sums[0, 1].item() == 16 * 9.0
    assert torch.tensor(2.0 ** 48) + 2.0 ** 24 + 2.0 ** 24 == 2.0 ** 48


@pytest.mark.parametrize("T,split_k", [(1, 1), (7, 2), (17, 1), (17, 2)])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_a_producer_stores_the_sums_of_what_it_wrote_whatever_its_tile(T, row_tile, split_k):
    g = torch.Generator().manual_seed(T * 5 + split_k)
    K_in, N = 96, 64
    x, W, r = rnd(g, T, K_in), rnd(g, N, K_in, scale=0.1), rnd(g, T, N)
    plain = K.linear(x, W, r, block_k=32, row_tile=row_tile, split_k=split_k)
    want = row_sumsq_ref(plain)
    for block_n in (16, 32, 64):
        for num_warps in (2, 4):
            sums = torch.full((T, N // 16), float("nan"), device=DEV)
            y = K.linear(x, W, r, block_n=block_n, num_warps=num_warps, block_k=32, row_tile=row_tile,
                         split_k=split_k, row_sumsq_out=sums)
            assert torch.equal(y, plain), (block_n, num_warps)
            assert torch.equal(sums, want), (block_n, num_warps)
    # the down projection's form: silu(gate) * up computed in the prologue, no residual
    gate_up = rnd(g, T, 2 * K_in)
    sums = torch.full((T, N // 16), float("nan"), device=DEV)
    y = K.swiglu_linear(gate_up, W, block_n=32, block_k=32, row_tile=row_tile, split_k=split_k, row_sumsq_out=sums)
    assert torch.equal(sums, row_sumsq_ref(y))


def test_split_k_launches_past_64_rows_keep_their_rows_sums():
    """split-K launches a long T in 64-row chunks (gemm.SPLIT_K_ROWS): each chunk's sums land on its own rows, and a
    norm launch chunked the same way reads them there."""
    g = torch.Generator().manual_seed(70)
    T, K_in, N = 70, 64, 32
    x, W, r, nw = rnd(g, T, K_in), rnd(g, N, K_in, scale=0.1), rnd(g, T, N), rnd(g, N)
    sums = torch.full((T, N // 16), float("nan"), device=DEV)
    y = K.linear(x, W, r, block_n=16, block_k=32, split_k=2, row_sumsq_out=sums)
    assert torch.equal(sums, row_sumsq_ref(y))
    Wq = rnd(g, 16, N, scale=0.1)
    kw = {"block_n": 16, "block_k": 16, "split_k": 2, "producer_stat": True}
    whole = K.rmsnorm_linear(y, nw, Wq, 1e-5, row_sumsq=sums, **kw)
    tail = K.rmsnorm_linear(y[64:].contiguous(), nw, Wq, 1e-5, row_sumsq=sums[64:].contiguous(), **kw)
    assert torch.equal(whole[64:], tail)


def test_a_w12_producer_stores_the_same_sums():
    from specpilot.weights.format import encode
    g = torch.Generator().manual_seed(3)
    x, W, r = rnd(g, 5, 64), rnd(g, 48, 64, scale=0.1), rnd(g, 5, 48)
    a, b = (torch.full((5, 3), float("nan"), device=DEV) for _ in range(2))
    y = K.linear(x, W, r, block_n=16, block_k=32, row_sumsq_out=a)
    y12 = K.linear(x, encode(W), r, block_n=16, block_k=32, row_sumsq_out=b)
    assert torch.equal(y, y12) and torch.equal(a, b) and torch.equal(a, row_sumsq_ref(y))
    # and a W12 norm launch fed the sums: the bf16 launch's bits
    Wn, nw = rnd(g, 32, 48, scale=0.1), rnd(g, 48)
    kw = {"block_n": 16, "block_k": 16, "producer_stat": True, "row_sumsq": a}
    assert torch.equal(K.rmsnorm_linear(y, nw, Wn, 1e-5, **kw), K.rmsnorm_linear(y, nw, encode(Wn), 1e-5, **kw))


def one_row_at_a_time(fn, x, sums):
    """fn over each row alone, concatenated: what AR computes for the rows a verify computes at once."""
    return torch.cat([fn(x[i:i + 1], sums[i:i + 1].contiguous()) for i in range(x.shape[0])])


@pytest.mark.parametrize("row_tile", K.ROW_TILES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_a_norm_launch_fed_the_sums_gives_each_row_the_same_bits_whatever_T(row_tile, split_k):
    g = torch.Generator().manual_seed(row_tile + split_k)
    T, K_in, N = 9, 80, 48  # K / 16 = 5 sums a row: padded to 16 in the kernel
    x, nw, W = rnd(g, T, K_in), rnd(g, K_in), rnd(g, N, K_in, scale=0.1)
    sums = row_sumsq_ref(x)
    tile = {"block_k": 32, "row_tile": row_tile, "split_k": split_k, "producer_stat": True}

    def head(rows, s, block_n=16, prenorm=False):
        return K.rmsnorm_linear(rows, nw, W, 1e-5, out_dtype=torch.float32, argmax=True, block_n=block_n,
                                prenorm=prenorm, row_sumsq=s, **tile)

    logits, best = head(x, sums)
    # and at another tile width where that is T-neutral (not at one row a program: tl.sum's tree follows the tile)
    other_n = 16 if row_tile == 1 else 32
    assert torch.equal(logits, one_row_at_a_time(lambda r, s: head(r, s, block_n=other_n)[0], x, sums))
    assert torch.equal(best, logits.argmax(-1))
    assert all(torch.equal(a, b) for a, b in zip(head(x, sums, prenorm=True), (logits, best)))
    # the statistic's order is not the row pass's: within a rounding of the reference
    ref = K.linear(rms_norm_ref(x, nw, 1e-5), W, out_dtype=torch.float32)
    torch.testing.assert_close(logits, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_the_epilogue_launches_fed_the_sums_are_t_invariant(row_tile):
    g = torch.Generator().manual_seed(11 + row_tile)
    T, heads, kv_heads, D, K_in = 6, 4, 2, 16, 64
    x, nw = rnd(g, T, K_in), rnd(g, K_in)
    sums = row_sumsq_ref(x)
    W = rnd(g, (heads + 2 * kv_heads) * D, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(64, D, 10000.0))
    pos = torch.arange(T, device=DEV) * 3
    tile = {"block_n": 16, "block_k": 32, "row_tile": row_tile, "producer_stat": True}

    def qkv(rows, s, at):
        caches = [torch.zeros(kv_heads, 8, D, dtype=BF, device=DEV) for _ in range(2)]
        q = E.rmsnorm_qkv_rope(rows, nw, W, 1e-5, pos[at], at, cos, sin, *caches, heads, kv_heads, row_sumsq=s,
                               **tile)
        return q, caches

    q, caches = qkv(x, sums, torch.arange(T, device=DEV))
    for i in range(T):
        qi, ci = qkv(x[i:i + 1], sums[i:i + 1].contiguous(), torch.tensor([i], device=DEV))
        assert torch.equal(qi[0], q[i]) and all(torch.equal(a[:, i], b[:, i]) for a, b in zip(ci, caches)), i
    Wg = rnd(g, 2 * 24, K_in, scale=0.1)
    act = E.rmsnorm_glu(x, nw, Wg, 1e-5, row_sumsq=sums, **tile)
    assert torch.equal(act, one_row_at_a_time(lambda r, s: E.rmsnorm_glu(r, nw, Wg, 1e-5, row_sumsq=s, **tile),
                                              x, sums))


def test_bad_statistics_are_refused_with_the_reason():
    x = torch.zeros(2, 32, dtype=BF, device=DEV)
    W = torch.zeros(16, 32, dtype=BF, device=DEV)
    sums = torch.zeros(2, 2, device=DEV)
    cases = [({"producer_stat": True}, "needs row_sumsq"), ({"row_sumsq": sums}, "only with producer_stat"),
             ({"producer_stat": True, "row_sumsq": sums[:, :1].contiguous()}, "float32 \\[2, 2\\]"),
             ({"producer_stat": True, "row_sumsq": sums.double()}, "float32"),
             ({"producer_stat": 1, "row_sumsq": sums}, "must be a bool")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.rmsnorm_linear(x, x[0], W, 1e-5, **kw)
    with pytest.raises(ValueError, match="takes no residual"):
        K.rmsnorm_linear(x, x[0], W, 1e-5, x, producer_stat=True, row_sumsq=sums)
    x40 = torch.zeros(2, 40, dtype=BF, device=DEV)
    with pytest.raises(ValueError, match="multiple of 16"):
        K.rmsnorm_linear(x40, x40[0], torch.zeros(16, 40, dtype=BF, device=DEV), 1e-5, producer_stat=True,
                         row_sumsq=sums)
    with pytest.raises(ValueError, match="multiple of 16"):
        K.linear(x, torch.zeros(40, 32, dtype=BF, device=DEV), row_sumsq_out=sums)
    with pytest.raises(ValueError, match="row_sumsq_out"):
        K.linear(x, W, row_sumsq_out=torch.zeros(2, 3, device=DEV))
    assert "producer_stat" not in K.RMSNormLinearParams.T_NEUTRAL  # an order field: one value for every T
    assert "producer_stat" not in K.RMSNormLinearParams.SEARCH_SPACE  # needs the producer: judged on the step


def stat_table(shape, fields=(("producer_stat", True),)) -> tuple[tuple[str, str], ...]:
    on = json.dumps(dict(fields))
    qkv_n = shape.q_dim + 2 * shape.kv_dim
    return ((table_key("qkv", qkv_n, shape.hidden, 1), on),
            (table_key("gate_up", 2 * shape.intermediate, shape.hidden, 1), on),
            (table_key("lm_head", shape.vocab, shape.hidden, 1), on))


@pytest.mark.parametrize("fields", [(("producer_stat", True),), (("producer_stat", True), ("post_scale", True))],
                         ids=["producer_stat", "post_scale"])
def test_a_build_with_producer_statistics_verifies_exactly_what_it_decodes(monkeypatch, fields):
    """The Triton engine with every norm launch on producer statistics (and post_scale: projecting the producer's
    scaled rows): a verified chain's rows equal the rows AR computed one token at a time, bit for bit (argmax,
    top-2 margin, captured features), and the producers did store the sums (every o_proj and down of the forward)."""
    from specpilot.kernels import gemm
    model = tiny_model("gqa", 4).to(DEV)
    table = stat_table(model.shape, fields)
    check_invariance(table)
    stored = []
    real = gemm.linear
    post_scale = dict(fields).get("post_scale", False)

    def counting(*a, **kw):
        stored.append(kw.get("row_sumsq_out") is not None and (kw.get("scaled_out") is not None) == post_scale)
        return real(*a, **kw)

    monkeypatch.setattr(K, "linear", counting)
    c = EngineConfig(dtype="float32", max_seq_len=96, token_tile=8, drafter=DrafterKind.NGRAM,
                     kernel_backend=KernelBackend.TRITON, kernel_table=table)
    p, n = prompt(model.shape.vocab, 7, 4), 6

    def fresh():
        r = ModelRunner(model, c, DEV, block_width=16, topk=2, capture=(0,))
        return r, r.prefill(p)

    r, pre = fresh()
    seq, rows = list(p) + [pre.argmax[0]], []
    for _ in range(n):
        out = r.verify(len(seq) - 1, [seq[-1]], [0], chain_anc(1))
        rows.append((out.argmax[0], out.margin[0], out.features[0].clone()))  # a view of the graph's buffer
        seq.append(out.argmax[0])
    assert stored and all(stored)  # o_proj and down of every layer, every forward
    r, _ = fresh()
    out = r.verify(len(p), seq[len(p):len(p) + n], list(range(n)), chain_anc(n))
    for i, (tok, margin, feat) in enumerate(rows):
        assert out.argmax[i] == tok and torch.equal(out.margin[i], margin), i
        assert torch.equal(out.features[i], feat), i


def test_table_variant_sets_an_order_field_at_every_t_of_the_shape(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend("scripts")
    from table_variant import main
    from specpilot.engines.shapes import LLAMA3_8B
    base = [("qkv@6144x4096@T1", '{"block_n": 64}'), ("qkv@6144x4096@T16", '{"block_n": 32}'),
            ("o_proj@4096x4096@T1", '{"block_n": 32}')]
    (tmp_path / "base.json").write_text(json.dumps(base))
    assert main([str(tmp_path / "v.json"), "--shape", "llama3-8b", "--base", str(tmp_path / "base.json"),
                 "--set", "qkv,lm_head:producer_stat=true"]) == 0
    got = {k: json.loads(v) for k, v in json.loads((tmp_path / "v.json").read_text())}
    assert got["qkv@6144x4096@T1"] == {"block_n": 64, "producer_stat": True}
    assert got["qkv@6144x4096@T16"] == {"block_n": 32, "producer_stat": True}
    assert got[table_key("lm_head", LLAMA3_8B.vocab, LLAMA3_8B.hidden, 1)] == {"producer_stat": True}
    assert got["o_proj@4096x4096@T1"] == {"block_n": 32}
    with pytest.raises(SystemExit):
        main([str(tmp_path / "w.json"), "--set", "qkv:producer_stat"])
