"""W12 lossless weights: the format on every bf16 bit pattern and edge tensors, the pack/verify/load layout and CLI,
the decode-in-matmul kernels (bit-identical to the bf16 kernels on the decoded weights, batch-invariant), the
fused forward with weight_format=W12, and (slow) every tensor of SmolLM2-135M and Llama-3-8B-shape tensors.

Without CUDA the kernels run under the Triton interpreter (tests/conftest.py).
"""
from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402

import specpilot.kernels as K  # noqa: E402


from specpilot.engines.config import WeightFormat  # noqa: E402
from specpilot.engines.fused import fused_forward, rope_tables_for  # noqa: E402
from specpilot.engines.loader import save_model  # noqa: E402
from specpilot.weights import (ESCAPE, W12Error, W12Tensor, W12Weights, bitwise_equal,  # noqa: E402
                               concat_rows, decode, encode, load_w12, pack_model, verify)
from specpilot.weights.cli import main as cli_main  # noqa: E402
from specpilot.weights.model import W12Layer  # noqa: E402

from _tiny import tiny_model  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def all_bf16_patterns() -> torch.Tensor:
    """The 65536 bf16 values in bit order: ±0, subnormals, normals, ±inf and every NaN payload."""
    b = torch.arange(65536, dtype=torch.int32)
    return (b - ((b >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def from_bits(*bits: int) -> torch.Tensor:
    return torch.tensor([b - 65536 if b >= 32768 else b for b in bits], dtype=torch.int16).view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bitwise_equal(a, b)


# ---------------------------------------------------------------- the format

@pytest.mark.parametrize("shape", [(256, 256), (257, 255), (65536, 1), (65536,), (16, 64, 64)])
def test_every_bf16_bit_pattern_round_trips(shape):
    n = 1
    for s in shape:
        n *= s
    src = all_bf16_patterns()
    t = src[torch.randperm(65536, generator=torch.Generator().manual_seed(n))][:n].reshape(shape)
    w = encode(t)
    assert same_bits(decode(w), t)
    if n == 65536:  # each exponent appears 256 times: 15 get codes, 241 * 256 elements escape
        assert w.stats.escapes == 65536 - 15 * 256


@pytest.mark.parametrize("case", ["zeros", "neg_zeros", "subnormals", "infinities", "nan_payloads", "scalar", "one"])
def test_edge_value_tensors(case):
    if case in ("zeros", "neg_zeros"):
        t = torch.zeros(7, 9, dtype=torch.bfloat16) * (-1.0 if case == "neg_zeros" else 1.0)
    elif case == "subnormals":
        t = from_bits(*range(1, 128), *range(0x8001, 0x8080)).reshape(2, 127)
    elif case == "infinities":
        t = from_bits(0x7F80, 0xFF80, 0x3F80, 0x0000, 0x8000, 0x7F80).reshape(3, 2)
    elif case == "nan_payloads":
        t = from_bits(*range(0x7F81, 0x8000), *range(0xFF81, 0x10000)).reshape(2, 127)
        assert torch.isnan(t).all()
    elif case == "scalar":
        t = torch.tensor(-3.5e-39, dtype=torch.bfloat16)
    else:
        t = from_bits(0xFFFF)
    w = encode(t)
    d = decode(w)
    assert d.shape == t.shape and same_bits(d, t)
    if case == "neg_zeros":
        assert (d.view(torch.int16) == -32768).all(), "-0 must stay -0"


def test_all_escape_tensor_is_exact_and_costs_a_byte_more():
    t = (torch.randn(33, 70, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    w = encode(t, exponents=range(200, 215))  # no weight of std 0.02 has these exponents
    st = w.stats
    assert st.escapes == t.numel() and st.escape_rate == 1.0
    assert same_bits(decode(w), t)
    assert st.stored_bytes == 33 * 70 + 33 * 35 + 33 * 70 + 16 + 4  # lo + codes + one escape byte each + table
    assert st.kernel_bytes == st.stored_bytes + 4 * 33 + 4 * 34
    assert abs(st.bytes_per_weight - 2.5) < 0.01


def test_table_holds_the_15_most_frequent_exponents_and_encoding_is_deterministic():
    # exponent e (value 2^(e-127)) appears e - 99 times for e in 100..119: the top 15 are 119 down to 105
    vals = [2.0 ** (e - 127) for e in range(100, 120) for _ in range(e - 99)]
    t = torch.tensor(vals, dtype=torch.bfloat16)[torch.randperm(len(vals), generator=torch.Generator().manual_seed(2))]
    w = encode(t.reshape(1, -1))
    assert w.tables[0, :ESCAPE].tolist() == list(range(119, 104, -1))
    assert w.stats.escapes == sum(e - 99 for e in range(100, 105))
    w2 = encode(t.reshape(1, -1))
    assert all(torch.equal(a, b) for a, b in zip(w.components().values(), w2.components().values()))
    ties = encode(torch.tensor([2.0 ** k for k in range(-20, 0)], dtype=torch.bfloat16))
    assert ties.tables[0, :ESCAPE].tolist() == list(range(107, 122)), "equal counts: the lower exponents win"


def test_random_llama_like_tensor_is_about_12_bits():
    t = (torch.randn(512, 4096, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    w = encode(t)
    assert same_bits(decode(w), t)
    st = w.stats
    assert st.escape_rate < 1e-3 and 1.5 <= st.bytes_per_weight < 1.501
    assert st.stored_bytes == 512 * 4096 * 3 // 2 + st.escapes + 20


@pytest.mark.parametrize("group_rows", [1, 3, 64, 1000])
def test_row_groups_and_concat_rows_keep_every_table(group_rows):
    g = torch.Generator().manual_seed(4)
    a = (torch.randn(70, 37, generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(9, 37, generator=g) * 300).to(torch.bfloat16)  # other exponents: its own table
    wa, wb = encode(a, group_rows=group_rows), encode(b)
    assert wa.tables.shape[0] == -(-70 // group_rows)
    assert same_bits(decode(wa), a)
    cat = concat_rows([wa, wb, wa])
    assert same_bits(decode(cat), torch.cat([a, b, a]))
    assert cat.stats.escapes == 2 * wa.stats.escapes + wb.stats.escapes
    with pytest.raises(W12Error, match="one width"):
        concat_rows([wa, encode(a[:, :36])])


def test_malformed_inputs_and_components_are_refused():
    with pytest.raises(W12Error, match="bf16"):
        encode(torch.zeros(3, 4))
    with pytest.raises(W12Error, match="empty"):
        encode(torch.zeros(0, 4, dtype=torch.bfloat16))
    with pytest.raises(W12Error, match="group_rows"):
        encode(torch.zeros(3, 4, dtype=torch.bfloat16), group_rows=0)
    with pytest.raises(W12Error, match="15 distinct"):
        encode(torch.zeros(3, 4, dtype=torch.bfloat16), exponents=[1] * 15)
    t = all_bf16_patterns()[::9][:255 * 7].reshape(7, 255)  # many exponents: escapes in every row
    parts = encode(t).components()
    bad = dict(parts, escapes=parts["escapes"][:-1])
    with pytest.raises(W12Error, match="escapes"):
        W12Tensor.from_components(t.shape, bad)
    codes = parts["codes"].clone()
    codes[0, -1] |= 0x10
    with pytest.raises(W12Error, match="pad nibble"):
        W12Tensor.from_components(t.shape, dict(parts, codes=codes))
    with pytest.raises(W12Error, match="group_ends"):
        W12Tensor.from_components(t.shape, dict(parts, group_ends=torch.tensor([6], dtype=torch.int32)))
    with pytest.raises(W12Error, match="lo must be"):
        W12Tensor.from_components((7, 254), parts)


# ---------------------------------------------------------------- pack, load, verify, CLI

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(tiny_model("gqa", seed=5, dtype=torch.bfloat16), tmp_path_factory.mktemp("m") / "tiny")


def test_pack_load_verify_round_trip(model_dir, tmp_path):
    out = tmp_path / "packed"
    m = pack_model(model_dir, out, shard_bytes=40_000)  # small shards: several files
    assert len(m.files) > 1 and (out / "config.json").is_file()
    report = verify(out, model_dir)
    assert report.ok and len(report.rows) == len(m.tensors) and report.totals.numel == m.totals.numel
    from safetensors.torch import load_file

    src = load_file(str(model_dir / "model.safetensors"))
    loaded = load_w12(out)
    assert set(loaded) == set(src)
    assert all(same_bits(decode(loaded[k]), v) for k, v in src.items())


def test_pack_from_a_llama_model_and_fused_layout(tmp_path):
    model = tiny_model("mha_tied", seed=6, dtype=torch.bfloat16)
    pack_model(model, tmp_path / "p")
    assert verify(tmp_path / "p", model).ok
    save_model(model, tmp_path / "hf")
    pack_model(tmp_path / "hf", tmp_path / "hfp")
    sh = model.shape
    fused = W12Weights.from_tensors(load_w12(tmp_path / "hfp"), sh.layers, sh.tie_embeddings)
    fused.check_against(model)  # q|k|v and gate|up joined from the HF names decode to the model's fused weights
    with pytest.raises(W12Error, match="bf16"):
        pack_model(tiny_model("mqa"), tmp_path / "fp32")


def test_kernel_layouts_keep_bf16_where_the_layout_reads_more():
    """A tensor with escapes in most (row, block) cells (as SmolLM2's embedding) would read more than bf16 in the oct
    layout: the kernels get its bf16 decode; plain weights get the layout."""
    from specpilot.weights.oct import OctLayout
    g = torch.Generator().manual_seed(3)
    plain = (torch.randn(8, 512, generator=g) * 0.02).to(torch.bfloat16)
    wild = all_bf16_patterns()[torch.randperm(65536, generator=g)[:8 * 512]].reshape(8, 512)
    lay = W12Weights((), encode(plain)).kernel_layouts()
    assert isinstance(lay.head, OctLayout) and lay.head.kernel_bytes < 2 * plain.numel()
    lay = W12Weights((), encode(wild)).kernel_layouts()
    assert isinstance(lay.head, torch.Tensor) and same_bits(lay.head, wild)
    assert lay.bytes_per_weight() == 2.0  # what the cost model counts for the build: the bf16 the kernels read
    mixed = W12Weights((W12Layer(*(encode(plain) for _ in range(4))),), encode(wild)).kernel_layouts()
    oct_bytes = 4 * mixed.layers[0].qkv.kernel_bytes
    assert mixed.bytes_per_weight() == pytest.approx((oct_bytes + 2 * wild.numel()) / (5 * plain.numel()))
    assert 1.5 < oct_bytes / (4 * plain.numel()) < 1.6


def test_corruption_is_caught_on_load_and_by_verify(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "packed"
    m = pack_model(model_dir, out)
    shard = out / m.files[0][0]
    arrays = load_file(str(shard))
    arrays["model.layers.1.mlp.down_proj.weight:lo"][3, 5] ^= 1  # one mantissa bit of one weight
    save_file(arrays, str(shard))
    with pytest.raises(W12Error, match="down_proj.*sha256"):
        load_w12(out)
    report = verify(out, model_dir)
    assert not report.ok and report.bad_files == (m.files[0][0],)
    assert [r.name for r in report.rows if not r.ok] == ["model.layers.1.mlp.down_proj.weight"]
    assert cli_main(["weights", "verify", str(out), "--against", str(model_dir)]) == 1


def test_cli_pack_and_verify(model_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["weights", "pack", str(model_dir), "--out", str(out), "--group-rows", "32"]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight" in text and "overall (" in text and "x fewer bytes" in text
    assert cli_main(["weights", "verify", str(out), "--against", str(model_dir)]) == 0
    assert "every tensor decodes bit for bit" in capsys.readouterr().out
    assert cli_main(["weights", "verify", str(model_dir), "--against", str(model_dir)]) == 2
    assert "not a W12 pack" in capsys.readouterr().err


# ---------------------------------------------------------------- kernels: bit-identical to the bf16 kernels

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def assert_same(a, b) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)), "outputs differ in bits"


def weights(kind: str, N: int, Kd: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(N, Kd, generator=g) * Kd ** -0.5).to(torch.bfloat16)
    if kind == "edge":  # zeros, ±0, subnormals and tiny values escape; a few ±inf make inf/NaN output columns
        flat = W.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)
        flat[idx[:40]] = 0.0
        flat[idx[40:60]] = -0.0
        flat[idx[60:90]] = from_bits(*range(1, 31))
        flat[idx[90:92]] = from_bits(0x7F80, 0xFF80)
    return W.to(DEV)


# natural (the tensor's own table: rare escapes), escape-heavy (the two most frequent exponents left out of the
# table: about half the weights escape, interleaved with coded ones), all-escape (a table the tensor never uses) and
# inf_first (code 0 means exponent 255: the K tail past the last weight, which loads code 0, must still be +0.0)
TABLES = {"natural": None, "heavy": "drop2", "all": list(range(200, 215)), "inf_first": "inf_first"}


def encode_as(W: torch.Tensor, table: str) -> W12Tensor:
    spec = TABLES[table]
    if spec == "drop2":
        spec = encode(W).tables[0, 2:ESCAPE].tolist() + [253, 254]
    elif spec == "inf_first":
        spec = [255] + encode(W).tables[0, :ESCAPE - 1].tolist()
    return encode(W, exponents=spec)


@pytest.mark.parametrize("T", [1, 5, 16, 40])
@pytest.mark.parametrize("N,Kd,table,extras", [(64, 128, "natural", ""), (97, 256, "heavy", "res+bias"),
                                               (50, 200, "all", "fp32out"), (33, 130, "inf_first", "res")])
def test_w12_linear_equals_linear_on_decoded(T, N, Kd, table, extras):
    g = torch.Generator().manual_seed(T * 1000 + N)
    W = weights("plain", N, Kd, seed=N)
    Q = encode_as(W, table)
    assert table != "heavy" or 0.3 < Q.stats.escape_rate < 0.8
    x = torch.randn(T, Kd, generator=g).to(torch.bfloat16).to(DEV)
    out_dtype = torch.float32 if extras == "fp32out" else torch.bfloat16
    res = torch.randn(T, N, generator=g).to(out_dtype).to(DEV) if "res" in extras else None
    bias = torch.randn(N, generator=g).to(torch.bfloat16).to(DEV) if "bias" in extras else None
    assert_same(K.linear(x, Q, res, bias=bias, out_dtype=out_dtype),
                K.linear(x, decode(Q), res, bias=bias, out_dtype=out_dtype))


@pytest.mark.parametrize("T", [1, 5, 16, 40])
@pytest.mark.parametrize("N,Kd,table,extras", [(64, 128, "natural", "res"), (97, 192, "heavy", "bias+fp32out"),
                                               (40, 136, "all", ""), (24, 72, "inf_first", "")])
def test_w12_rmsnorm_linear_equals_rmsnorm_linear_on_decoded(T, N, Kd, table, extras):
    g = torch.Generator().manual_seed(T * 100 + N)
    Q = encode_as(weights("plain", N, Kd, seed=N + 1), table)
    x = torch.randn(T, Kd, generator=g).to(torch.bfloat16).to(DEV)
    nw = (1 + 0.2 * torch.randn(Kd, generator=g)).to(torch.bfloat16).to(DEV)
    res = torch.randn(T, Kd, generator=g).to(torch.bfloat16).to(DEV) if "res" in extras else None
    bias = torch.randn(N, generator=g).to(torch.bfloat16).to(DEV) if "bias" in extras else None
    out_dtype = torch.float32 if "fp32out" in extras else None
    assert_same(K.rmsnorm_linear(x, nw, Q, 1e-5, res, bias=bias, out_dtype=out_dtype),
                K.rmsnorm_linear(x, nw, decode(Q), 1e-5, res, bias=bias, out_dtype=out_dtype))


@pytest.mark.parametrize("row_tile", [16])
@pytest.mark.parametrize("T", [1, 5, 17])
def test_every_projection_launch_takes_w12_with_the_same_bits(T, row_tile):
    """One kernel body for both formats: the fused QKV + rotary + cache write, norm + gate_up + SwiGLU, the LM
    head's argmax epilogue and the SwiGLU-prologue GEMM give on W12 weights the bits they give on decode(W), and so
    do the norm launches with the norm as a launch of its own (prenorm)."""
    from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
    g = torch.Generator().manual_seed(T * 10 + row_tile)
    heads, kv_heads, D, Kd, I = 2, 1, 16, 96, 40
    x = torch.randn(T, Kd, generator=g).to(torch.bfloat16).to(DEV)
    nw = (1 + 0.2 * torch.randn(Kd, generator=g)).to(torch.bfloat16).to(DEV)
    q_qkv, q_gu, q_head, q_down = (encode_as(weights("plain", n, k, seed=n), table) for n, k, table in
                                   (((heads + 2 * kv_heads) * D, Kd, "heavy"), (2 * I, Kd, "heavy"), (77, Kd, "heavy"),
                                    (Kd, I, "heavy")))  # about half the weights escape: both row sets' bookkeeping
    assert all(0.3 < q.stats.escape_rate < 0.8 for q in (q_qkv, q_gu, q_head, q_down))
    cos, sin = (t.to(DEV) for t in K.rope_tables(64, D, 10000.0))
    pos = torch.arange(3, 3 + T, device=DEV)
    outs = []
    packed, plain = (q_qkv, q_gu, q_head, q_down), tuple(map(decode, (q_qkv, q_gu, q_head, q_down)))
    for (w_qkv, w_gu, w_head, w_down), prenorm in ((plain, False), (packed, False), (packed, True)):
        kc, vc = (torch.zeros(kv_heads, 64, D, dtype=torch.bfloat16, device=DEV) for _ in "kv")
        p = {"row_tile": row_tile, "prenorm": prenorm}
        q = rmsnorm_qkv_rope(x, nw, w_qkv, 1e-5, pos, pos, cos, sin, kc, vc, heads, kv_heads, **p)
        act = rmsnorm_glu(x, nw, w_gu, 1e-5, **p)
        logits, best = K.rmsnorm_linear(x, nw, w_head, 1e-5, out_dtype=torch.float32, argmax=True, **p)
        gate_up = torch.cat([act, act], dim=1)
        down = K.swiglu_linear(gate_up, w_down, row_tile=row_tile)
        outs.append((q, kc, vc, act, logits, best, down))
    for bf16_out, *w12_outs in zip(*outs):
        for w12_out in w12_outs:
            assert_same(w12_out, bf16_out)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 * inf
def test_edge_value_weights_give_the_same_bits_including_inf_and_nan_outputs():
    W = weights("edge", 48, 160, seed=7)
    Q = encode(W)
    assert int((Q.escapes == 255).sum()) == 2 and same_bits(decode(Q), W), "the two infinities escape"
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEV)
    y = K.linear(x, Q, out_dtype=torch.float32)
    assert not torch.isfinite(y).all(), "the ±inf weights should reach the output"
    assert_same(y, K.linear(x, decode(Q), out_dtype=torch.float32))
    nw = torch.ones(160, dtype=torch.bfloat16, device=DEV)
    assert_same(K.rmsnorm_linear(x, nw, Q, 1e-6), K.rmsnorm_linear(x, nw, decode(Q), 1e-6))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("table", ["natural", "heavy"])
def test_w12_kernels_are_batch_invariant(table):
    g = torch.Generator().manual_seed(9)
    Kd, N = 256, 80
    Q = encode_as(weights("edge", N, Kd, seed=10), table)
    nw = (1 + 0.2 * torch.randn(Kd, generator=g)).to(torch.bfloat16).to(DEV)
    row = torch.randn(Kd, generator=g).to(torch.bfloat16).to(DEV)
    calls = {"linear": lambda x: K.linear(x, Q),
             "rmsnorm_linear": lambda x: K.rmsnorm_linear(x, nw, Q, 1e-5, out_dtype=torch.float32)}
    for name, fn in calls.items():
        alone = fn(row[None])[0]
        for T, p in ((5, 3), (16, 15), (40, 21)):
            x = (torch.randn(T, Kd, generator=g) * 4).to(torch.bfloat16).to(DEV)
            x[p] = row
            assert torch.equal(_bits(fn(x)[p]), _bits(alone)), f"{name}: row {p} differs among T={T} rows"


@pytest.mark.parametrize("Kd,split_k,block_k", [(1024, 2, 128), (1024, 4, 128), (1536, 2, 256)])
def test_w12_split_k_equals_bf16_split_k(Kd, split_k, block_k):
    """Split-K runs start at any 256-block: each cell's escapes are found from the cell, not by walking K."""
    g = torch.Generator().manual_seed(Kd + split_k)
    W = weights("plain", 40, Kd, seed=12)
    W[3, 300:310] = 1e-30  # a cell with ten escapes, in the second run
    Q = encode(W)
    x = torch.randn(5, Kd, generator=g).to(torch.bfloat16).to(DEV)
    nw = (1 + 0.2 * torch.randn(Kd, generator=g)).to(torch.bfloat16).to(DEV)
    p = {"split_k": split_k, "block_k": block_k}
    assert_same(K.linear(x, Q, **p), K.linear(x, decode(Q), **p))
    assert_same(K.rmsnorm_linear(x, nw, Q, 1e-5, **p), K.rmsnorm_linear(x, nw, decode(Q), 1e-5, **p))


def test_w12_wrapper_errors():
    Q = encode(weights("plain", 16, 64, seed=11))
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="bfloat16"):
        K.linear(x.float(), Q)
    with pytest.raises(ValueError, match=r"\[N, 32\]"):
        K.linear(x[:, :32].contiguous(), Q)
    with pytest.raises(ValueError, match="residual"):
        K.linear(x, Q, torch.zeros(2, 15, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="eps"):
        K.rmsnorm_linear(x, x[0], Q, 0.0)
    with pytest.raises(ValueError, match="block_n"):
        K.linear(x, Q, block_n=24)
    with pytest.raises(ValueError, match="row_tile=16"):
        K.linear(x, Q, row_tile=1)
    Q576 = encode(weights("plain", 16, 576, seed=11))
    x576 = torch.zeros(2, 576, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="whole 256-element blocks"):  # 5 chunks of 128 in 2 runs: 384 a run
        K.linear(x576, Q576, split_k=2)
    with pytest.raises(ValueError, match="whole 256-element blocks"):
        K.rmsnorm_linear(x576, x576[0], Q576, 1e-5, split_k=2)


def test_bench_w12_refuses_cpu():
    from specpilot.kernels.w12_tile import bench_w12

    with pytest.raises(RuntimeError, match="CUDA GPU|TRITON_INTERPRET"):
        bench_w12(((64, 64),), (1,), device="cpu")


def test_w12_default_launches_fit_shared_memory_and_pipeline():
    """W12 default tiles stop at 64 columns and pipeline two blocks ahead up to 64 columns, one beyond (what the
    H200 measurements chose; deeper is the tuner's), a GLU's two row sets inside the shared-memory budget."""
    from specpilot.kernels.gemm import W12_STAGES, W12_WIDE_STAGES, default_block_n, default_num_stages
    from specpilot.kernels.norm_gemm import norm_launch_shape
    from specpilot.kernels.w12_tile import OCT_ROW_BLOCK_BYTES

    assert default_block_n(128256, 1, w12=True) == 64 and default_block_n(128256, 1) == 128
    assert default_block_n(4096, 1, w12=True) == 32  # still one wave of programs
    assert default_num_stages(64, 2, w12=True) == default_num_stages(32, 2, w12=True) == W12_STAGES == 3
    assert default_num_stages(128, 2, w12=True) == W12_WIDE_STAGES == 2
    assert default_num_stages(64, 2, most=2, w12=True) == 2  # a caller's ceiling holds
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    bn, stages, _ = norm_launch_shape(x, 14336, None, None, 128, pair=True, w12=True)
    assert bn == 64 and stages == 2 and stages * 2 * bn * OCT_ROW_BLOCK_BYTES <= 200 * 1024


# ---------------------------------------------------------------- the fused forward with weight_format=W12

def _forward(model, tables, T: int, seed: int = 0):
    sh = model.shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, sh.vocab, (T,), generator=g).to(DEV)
    pos = torch.arange(T, device=DEV)
    kv = torch.zeros(2, sh.layers, sh.kv_heads, 64, sh.head_dim, dtype=torch.bfloat16, device=DEV)
    anc = torch.tril(torch.ones(T, T, dtype=torch.bool, device=DEV))
    return fused_forward(model, tables, ids, pos, pos, torch.zeros(1, dtype=torch.long, device=DEV), anc,
                         kv[0], kv[1], capture=(0,))


@pytest.mark.parametrize("shape", ["gqa", "mha_tied"])
def test_fused_forward_w12_is_bit_identical_to_native(shape, tmp_path):
    model = tiny_model(shape, seed=12, dtype=torch.bfloat16).to(DEV)
    native = rope_tables_for(model, 64, DEV)
    assert native.w12 is None
    w12 = rope_tables_for(model, 64, DEV, WeightFormat.W12)
    save_model(model, tmp_path / "hf")
    pack_model(tmp_path / "hf", tmp_path / "p")
    sh = model.shape
    from_pack = rope_tables_for(model, 64, DEV, WeightFormat.W12,
                                w12=W12Weights.from_tensors(load_w12(tmp_path / "p"), sh.layers, sh.tie_embeddings))
    want_logits, want_argmax, want_cap = _forward(model, native, 7)
    for tables in (w12, from_pack):
        logits, argmax, cap = _forward(model, tables, 7)
        assert_same(logits, want_logits)
        assert_same(argmax, want_argmax)
        assert_same(cap[0], want_cap[0])


def test_w12_tables_refuse_non_bf16_and_mismatched_weights():
    with pytest.raises(ValueError, match="bf16"):
        rope_tables_for(tiny_model("gqa"), 64, "cpu", WeightFormat.W12)
    model = tiny_model("gqa", seed=13, dtype=torch.bfloat16)
    packed = W12Weights.from_model(model)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    with pytest.raises(W12Error, match="layers.1.mlp.down_proj"):
        rope_tables_for(model, 64, "cpu", WeightFormat.W12, w12=packed)
    with pytest.raises(ValueError, match="weight_format=native"):
        rope_tables_for(model, 64, "cpu", WeightFormat.NATIVE, w12=packed)


# ---------------------------------------------------------------- acceptance (slow): real and 8B-shape tensors

@pytest.mark.slow
def test_smollm2_every_tensor_round_trips(tmp_path):
    from specpilot.engines.loader import load_model
    from specpilot.testbed import fetch_smollm2
    from specpilot.weights.pack import format_stats_table

    src = fetch_smollm2()
    m = pack_model(src, tmp_path / "w12")
    report = verify(tmp_path / "w12", src)
    print("\n" + format_stats_table([(r.name, r.shape, r.stats, "exact" if r.ok else r.reason) for r in report.rows]))
    assert report.ok and len(report.rows) == len(m.tensors) == 272
    tot = m.totals
    assert tot.numel == 134_515_008 and tot.escape_rate < 1e-3 and tot.bytes_per_weight < 1.501
    # the engine's fused layout from the pack decodes to the loaded model's weights, as does encoding the model
    model = load_model(src, torch.bfloat16, "cpu")
    sh = model.shape
    W12Weights.from_tensors(load_w12(tmp_path / "w12"), sh.layers, sh.tie_embeddings).check_against(model)
    assert W12Weights.from_model(model).stats.numel == sum(p.numel() for n, p in model.named_parameters()
                                                           if "proj" in n) + model.embed_tokens.weight.numel()


LLAMA3_8B_TENSORS = {"q_proj/o_proj": (4096, 4096), "gate_proj/up_proj": (14336, 4096), "down_proj": (4096, 14336),
                     "lm_head": (128256, 4096)}


@pytest.mark.slow
def test_llama3_8b_shape_random_tensors_round_trip():
    """randn * 0.02 in bf16 at every Llama-3-8B projection shape, the full 128256 x 4096 LM head included."""
    from specpilot.weights.pack import format_stats_table

    rows = []
    for i, (name, shape) in enumerate(LLAMA3_8B_TENSORS.items()):
        t = (torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 0.02).to(torch.bfloat16)
        w = encode(t)
        assert same_bits(decode(w), t), name
        rows.append((name, shape, w.stats, "exact"))
        assert w.stats.escape_rate < 1e-3 and w.stats.bytes_per_weight < 1.501
        del t, w
    print("\n" + format_stats_table(rows))
