"""Batched speculative decoding (specpilot.engines.batch): lossless per request, paged attention, mechanisms.

Every request served by the batched engine (joining and leaving at different steps, ragged acceptance, EOS and
token limits inside a verify block, chunked prefill, CUDA-graph buckets emulated on CPU) must equal its
single-request AR output from SpecEngine with kernel_backend=triton. Without CUDA the Triton kernels run
under the interpreter (tests/conftest.py turns it on), on
micro Llama models (one or two layers) so the whole file stays within a few minutes on two cores.
"""
from __future__ import annotations

import functools
import gc
import importlib
import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402

from specpilot.engines.batch import (BatchConfig, BatchEngine, BatchRunner, CostCurve,  # noqa: E402
                                     DraftLength, RequestSpec, StepClock, VerifyBudget, batch_knob_schema,
                                     block_width, build_batch_engine)
from specpilot.engines.batch.config import ALL_MECHANISMS  # noqa: E402
from specpilot.engines.batch.cost import profile_tokens  # noqa: E402
from specpilot.engines.batch.drafting import NgramChainDrafter  # noqa: E402
from specpilot.engines.batch.mechanisms import (AcceptanceEstimate, allocate_verify_budget,  # noqa: E402
                                                expected_tokens, goodput_draft_len)
from specpilot.engines.batch.model import attention_params, batch_forward  # noqa: E402
from specpilot.engines.batch.paged_attn import (ROW_TILE, PagedMeta, max_tiles, paged_attention,  # noqa: E402
                                                paged_attention_ref, tile_map, tiles_for)
from specpilot.engines.batch.paged_cache import CacheShape, OutOfPages, PagedKVCache  # noqa: E402
from specpilot.engines.batch.runner import StepEntry  # noqa: E402
from specpilot.engines.batch.scheduler import Request, RequestState, Scheduler, StopReason  # noqa: E402
from specpilot.engines.build import build_engine  # noqa: E402
from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig  # noqa: E402
from specpilot.engines.drafters.ngram import NgramDrafter  # noqa: E402
from specpilot.engines.fused import fused_forward, rope_tables_for  # noqa: E402
from specpilot.engines.loader import random_model  # noqa: E402
from specpilot.engines.shapes import LlamaShape  # noqa: E402
from specpilot.kernels.attn import AttentionParams, attention  # noqa: E402

MICRO = {  # group sizes 2, 3 and 1 (MHA, two layers, tied head)
    "g2": LlamaShape(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=16, intermediate=64, rms_eps=1e-5,
                     rope_theta=10000.0, tie_embeddings=False),
    "g3": LlamaShape(vocab=48, hidden=32, layers=1, heads=3, kv_heads=1, head_dim=16, intermediate=64, rms_eps=1e-6,
                     rope_theta=500.0, tie_embeddings=False),
    "mha": LlamaShape(vocab=56, hidden=32, layers=2, heads=2, kv_heads=2, head_dim=16, intermediate=48, rms_eps=1e-5,
                      rope_theta=10000.0, tie_embeddings=True),
}
MAX_SEQ = 320
NO_EOS: frozenset[int] = frozenset()


@functools.lru_cache(maxsize=None)
def micro(shape: str, seed: int):
    m = random_model(MICRO[shape], torch.float32, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # larger weights than the default init: sharp, input-dependent greedy outputs
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 0.35))
    return m


def ecfg(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "max_seq_len": MAX_SEQ, "kernel_backend": "triton",
                           "cuda_graphs": False, "drafter": DrafterKind.NONE, **kw})


@functools.lru_cache(maxsize=None)
def single_ar(shape: str, seed: int, prompt: tuple[int, ...], n: int) -> list[int]:
    """The reference: SpecEngine (the existing single-request engine), AR, Triton kernels, no EOS."""
    return build_engine(ecfg(), micro(shape, seed), NO_EOS, "cpu").generate(list(prompt), n).tokens


def expected(ref: list[int], max_new: int, eos: frozenset[int]) -> list[int]:
    """AR with an EOS set / a token limit is AR without them, cut at the first EOS (inclusive) and the limit:
    the engine only stops earlier, every token before the stop is the same argmax."""
    out = ref[:max_new]
    return next((out[:i + 1] for i, t in enumerate(out) if t in eos), out)


class Oracle:
    """Drafts a request's true continuation, wrong from a random depth on: ragged acceptance, every length."""

    def __init__(self, ref: list[int], prompt_len: int, vocab: int, seed: int):
        self.ref, self.n0, self.vocab, self.rng = ref, prompt_len, vocab, random.Random(seed)

    def _guess(self, done: int, k: int) -> list[int]:
        want = self.ref[done:done + k]
        cut = self.rng.choice([0, 1, 2, len(want), len(want), len(want)])
        return [t if i < cut else (t + 1) % self.vocab for i, t in enumerate(want)]

    def propose(self, seq: list[int], k: int) -> list[int]:
        return self._guess(len(seq) - self.n0, k)

    def propose_ahead(self, seq: list[int], draft: list[int], k: int) -> list[int]:
        return self._guess(len(seq) + len(draft) - self.n0, k + 1)


def scenario(shape: str, seed: int):
    """Four requests: different prompt lengths (one in two prefill chunks), limits (one of 1 token), arrival
    steps; an EOS token from inside request 0's output."""
    vocab = MICRO[shape].vocab
    rng = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(3, vocab, (n,), generator=rng).tolist()) for n in (5, 13, 24, 9)]
    max_new, arrive = (10, 4, 10, 1), (0, 0, 1, 4)
    refs = [single_ar(shape, seed, p, n) for p, n in zip(prompts, max_new)]
    assert len(set(refs[0])) > 4, "degenerate micro model: its output must vary"
    eos = frozenset({refs[0][6]})
    specs = [RequestSpec(f"r{i}", p, n, float(a)) for i, (p, n, a) in enumerate(zip(prompts, max_new, arrive))]
    want = {s.id: expected(r, s.max_new_tokens, eos) for s, r in zip(specs, refs)}
    return specs, refs, eos, want


@pytest.mark.interpreter
def test_w12_weights_give_the_batched_engine_the_native_bits():
    """weight_format=w12 in the batch regime: the batched forward is the fused one, reading the projections in W12
    (exact), so batched AR and speculative outputs are the native bf16 engine's, token for token."""
    import copy
    model = copy.deepcopy(micro("g2", 0)).to(torch.bfloat16)
    specs, _, eos, _ = scenario("g2", 0)
    batch = BatchConfig(max_batch=2, prefill_chunk=16)
    bf16 = {"dtype": "bfloat16"}
    want = {r.id: r.tokens for r in build_batch_engine(model, ecfg(**bf16), batch, eos, "cpu").run(specs).requests}
    assert len({t for ts in want.values() for t in ts}) > 4, "degenerate model: its output must vary"
    for cfg in (ecfg(**bf16, weight_format="w12"), ecfg(**bf16, weight_format="w12", drafter="ngram", draft_len=4)):
        engine = build_batch_engine(model, cfg, batch, eos, "cpu")
        assert engine.runner.tables.w12 is not None
        assert {r.id: r.tokens for r in engine.run(specs).requests} == want, cfg.drafter


def oracle_factory(specs, refs, vocab):
    by_id = {s.id: (r, len(s.prompt), i) for i, (s, r) in enumerate(zip(specs, refs))}
    return lambda req: Oracle(by_id[req.id][0], by_id[req.id][1], vocab, 7 + by_id[req.id][2])


CURVE = ((1, 0.2), (8, 0.22), (16, 0.3), (64, 1.0))  # seconds: the interpreter's scale


# ---- paged attention ------------------------------------------------------------------------------------
def paged_case(dtype, page=32):
    torch.manual_seed(0)
    KVH, H, D, npages = 2, 6, 16, 18
    kc, vc = (torch.randn(KVH, npages * page, D).to(dtype) for _ in range(2))
    # (kv_len, q_len): AR, a chain block, a prefill chunk, a whole prompt, a block over more splits than one
    # program reduces (SPLITS_PER_PROGRAM)
    reqs = [(70, 1), (40, 5), (100, 30), (3, 3), (170, 2)]
    perm = torch.randperm(npages)  # pages scattered over the cache
    pt, used = torch.full((len(reqs), 6), -1, dtype=torch.int64), 0
    for i, (kv, _) in enumerate(reqs):
        n = -(-kv // page)
        pt[i, :n] = perm[used:used + n]
        used += n
    q_len = torch.tensor([r[1] for r in reqs])
    kv_len = torch.tensor([r[0] for r in reqs])
    q_start = torch.cumsum(q_len, 0) - q_len
    ntok = int(q_len.sum()) + 3  # three padding tokens
    tok_kv = torch.zeros(ntok, dtype=torch.int64)
    tok_kv[:ntok - 3] = torch.repeat_interleave(kv_len, q_len)
    t_req, t_row = tile_map(q_len.numpy(), H // KVH, max_tiles(ntok, H // KVH, len(reqs)))
    meta = PagedMeta(pt, q_start, q_len, kv_len, torch.from_numpy(t_req), torch.from_numpy(t_row), tok_kv)
    return torch.randn(ntok, H, D).to(dtype), kc, vc, meta, reqs


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_equals_single_request_kernel_and_reference(dtype):
    """Each request's rows equal kernels.attn.attention on a contiguous copy of its keys, bit for bit (splits of
    32 keys in blocks of 16: several splits per request), and the fp32 reference up to rounding."""
    params = AttentionParams(block_n=16, split_keys=32)
    q, kc, vc, meta, reqs = paged_case(dtype)
    out = paged_attention(q, kc, vc, meta, params=params)
    ref = paged_attention_ref(q, kc, vc, meta, page=32)
    assert (out.float() - ref.float()).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))  # padding tokens
    for i, (kv, ql) in enumerate(reqs):
        keys = torch.arange(kv)
        slots = meta.page_table[i, keys // 32] * 32 + keys % 32
        kcc, vcc = (torch.zeros(kc.shape[0], 192, kc.shape[2], dtype=dtype) for _ in range(2))
        kcc[:, :kv], vcc[:, :kv] = kc[:, slots], vc[:, slots]
        qs = int(meta.q_start[i])
        chain = torch.tril(torch.ones(ql, ql, dtype=torch.bool))
        single = attention(q[qs:qs + ql].contiguous(), kcc, vcc, kv - ql, chain, block_n=16, split_keys=32)
        assert torch.equal(single, out[qs:qs + ql]), f"request {i}"


def test_paged_attention_checks_its_inputs():
    q, kc, vc, meta, _ = paged_case(torch.float32)
    p = AttentionParams(block_n=16, split_keys=32)
    with pytest.raises(ValueError, match="q must have dtype|q must have shape"):
        paged_attention(q.to(torch.int32), kc, vc, meta, params=p)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention(q, kc, vc.to(torch.bfloat16), meta, params=p)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, meta, params=p)
    with pytest.raises(ValueError, match="whole number of pages"):
        paged_attention(q, kc[:, :40].contiguous(), vc[:, :40].contiguous(), meta, params=p)
    with pytest.raises(ValueError, match="meta.q_len"):
        paged_attention(q, kc, vc, PagedMeta(**{**meta.__dict__, "q_len": meta.q_len[:2]}), params=p)
    with pytest.raises(ValueError, match="meta.tok_kv_len"):
        paged_attention(q, kc, vc, PagedMeta(**{**meta.__dict__, "tok_kv_len": meta.tok_kv_len[:-1]}), params=p)
    with pytest.raises(ValueError, match="meta.page_table"):
        paged_attention(q, kc, vc, PagedMeta(**{**meta.__dict__, "page_table": meta.page_table.int()}), params=p)


def test_tile_map():
    req, row = tile_map(np.array([3, 0, 12, 1]), 3, 8)  # rows 9, 0, 36, 3 -> tiles of 32 rows: 1, 0, 2, 1
    assert ROW_TILE == 32 and req.tolist() == [0, 2, 2, 3, -1, -1, -1, -1] and row.tolist()[:4] == [0, 0, 32, 0]
    with pytest.raises(ValueError, match="do not fit"):
        tile_map(np.array([40]), 2, 2)  # 80 rows: 3 tiles


@pytest.mark.interpreter
def test_batch_forward_is_fused_forward_per_row():
    """One request's rows through batch_forward (paged, scattered pages, next to another request's rows)
    equal fused_forward on the contiguous cache: logits and KV, bit for bit."""
    model = micro("g2", 0)
    sh = model.shape
    tables = rope_tables_for(model, MAX_SEQ, "cpu")
    page = attention_params(model, tables).split_keys
    ids = torch.randint(0, sh.vocab, (12,), generator=torch.Generator().manual_seed(3))
    kv_single = torch.zeros(2, sh.layers, sh.kv_heads, 8 * page, sh.head_dim)
    kv_paged = torch.zeros_like(kv_single)
    pages = torch.tensor([[3, 1, 0, 2], [5, 4, 6, 7]])  # request 0's pages, scattered; request 1's
    for lo, hi in ((0, 9), (9, 12)):  # a prompt chunk, then a 3-token verify block
        pos = torch.arange(lo, hi)
        chain = torch.tril(torch.ones(hi - lo, hi - lo, dtype=torch.bool))
        ref, _, _ = fused_forward(model, tables, ids[lo:hi], pos, pos, torch.tensor([lo]), chain, kv_single[0],
                                  kv_single[1])
        n = hi - lo
        both = torch.cat([ids[lo:hi], ids[:2]])  # request 1: two tokens at positions 0, 1 (its own pages)
        positions = torch.cat([pos, torch.arange(2)])
        slots = torch.cat([pages[0, pos // page] * page + pos % page, pages[1, 0] * page + torch.arange(2)])
        t_req, t_row = tile_map(np.array([n, 2]), 2, 8)
        meta = PagedMeta(pages, torch.tensor([0, n]), torch.tensor([n, 2]), torch.tensor([hi, 2]),
                         torch.from_numpy(t_req), torch.from_numpy(t_row), torch.tensor([hi] * n + [2, 2]))
        logits, argmax, _ = batch_forward(model, tables, both, positions, slots, meta, kv_paged[0], kv_paged[1], page,
                                       want_logits=True)
        assert torch.equal(logits[:n], ref) and torch.equal(argmax[:n], ref.argmax(-1))
    logical = pages[0, torch.arange(12) // page] * page + torch.arange(12) % page
    assert torch.equal(kv_paged[..., logical, :], kv_single[..., :12, :])


# ---- configuration, cache, scheduler --------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("max_batch", 0), ("max_batch", 2.5), ("prefill_chunk", 8), ("graph_max_tokens", 40), ("num_pages", -1),
    ("draft_length", "longest"), ("max_draft_len", 0), ("max_draft_len", 64), ("verify_budget", "on"),
    ("verify_budget_max", -1), ("overlap_draft", 1), ("device_draft", "yes"), ("extrapolate", 1), ("accept_decay", 1.0),
    ("accept_prior", 0.0),
    ("cost_curve", ((8, 1.0),)), ("cost_curve", ((8, 1.0), (4, 2.0))), ("cost_curve", ((1, 1.0), (2, 0.0))),
    ("cost_curve", (("a", 1),))])
def test_batch_config_rejects(field, value):
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        BatchConfig(**{field: value})


def test_batch_config_knobs():
    c = BatchConfig(draft_length="goodput", verify_budget="cost_curve", cost_curve=[[1, 0.5], [16, 0.6]])
    assert c.draft_length is DraftLength.GOODPUT and c.verify_budget is VerifyBudget.COST_CURVE
    assert c.cost_curve == ((1, 0.5), (16, 0.6)) and c.needs_cost_curve
    assert BatchConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c and c.digest() != BatchConfig().digest()
    assert BatchConfig().mechanisms == () and not BatchConfig().needs_cost_curve
    assert BatchConfig.with_mechanisms("all").mechanisms == ("goodput_draft", "verify_budget", "device_draft",
                                                             "extrapolate")
    assert BatchConfig.with_mechanisms("overlap_draft", max_batch=3).mechanisms == ("overlap_draft",)
    with pytest.raises(ConfigError, match="turn one off"):
        BatchConfig(overlap_draft=True, device_draft=True)
    with pytest.raises(ConfigError, match="unknown mechanism"):
        BatchConfig.with_mechanisms("faster")
    with pytest.raises(ConfigError, match="unknown BatchConfig field"):
        BatchConfig().replace(batch=3)
    schema = {row["name"]: row for row in batch_knob_schema()}
    assert schema["draft_length"]["choices"] == ["fixed", "goodput"] and schema["max_batch"]["default"] == 24
    assert block_width(ecfg(), c) == 1 and block_width(ecfg(drafter="ngram"), c) == 17
    assert block_width(ecfg(drafter="ngram", draft_len=3), BatchConfig()) == 4


def test_paged_cache_pages():
    cache = PagedKVCache(CacheShape(1, 1, 16, num_pages=4, page=8), torch.float32, "cpu")
    a = cache.allocate(17)  # 3 pages
    assert a == [0, 1, 2] and cache.free_pages == 1 and cache.can_hold(8) and not cache.can_hold(9)
    with pytest.raises(OutOfPages):
        cache.allocate(9)
    cache.release(a)
    with pytest.raises(ValueError, match="already free"):
        cache.release([0])
    assert cache.free_pages == 4 and cache.kv.shape == (2, 1, 1, 32, 16)


def test_scheduler_admission_prefill_chunks_and_release():
    cache = PagedKVCache(CacheShape(1, 1, 16, num_pages=6, page=8), torch.float32, "cpu")
    s = Scheduler(BatchConfig(max_batch=2, prefill_chunk=16), cache, max_seq_len=64, rows=3)
    big, small, tiny = Request("big", [1] * 30, 10), Request("small", [1] * 4, 4), Request("tiny", [1] * 2, 2)
    for r in (big, small, tiny):
        s.add(r)
    assert s.admit() == [big, small]  # rows for two (max_batch); big holds 5 of 6 pages (38 positions)
    assert (big.row, small.row, cache.free_pages) == (0, 1, 0)  # small: 7 positions, one page
    plan = s.plan()  # 16 prompt tokens per step, oldest first
    assert [(r.id, a, b) for r, a, b in plan.prefill] == [("big", 0, 16)] and plan.decode == []
    big.prefilled = 16
    assert [(r.id, a, b) for r, a, b in s.plan().prefill] == [("big", 16, 30), ("small", 0, 2)]
    big.state = RequestState.DECODE
    s.finish(small, StopReason.EOS, now=3.0)
    assert small.state is RequestState.FINISHED and small.finish_s == 3.0 and cache.free_pages == 1
    assert s.admit() == [tiny] and tiny.row == 1  # the freed row and page go to the next request
    assert s.plan().decode == [big]
    with pytest.raises(ValueError, match="already scheduled"):
        s.add(tiny)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        s.add(Request("long", [1] * 60, 4))
    with pytest.raises(ValueError, match="more KV pages than the whole cache"):
        Scheduler(BatchConfig(max_batch=1), cache, 128, rows=1).add(Request("huge", [1] * 60, 4))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("z", [1], 0)
    with pytest.raises(ValueError, match="runner"):
        Scheduler(BatchConfig(max_batch=4), cache, 64, rows=3)


def test_fifo_admission_does_not_let_small_requests_overtake():
    cache = PagedKVCache(CacheShape(1, 1, 16, num_pages=3, page=8), torch.float32, "cpu")
    s = Scheduler(BatchConfig(max_batch=3), cache, max_seq_len=64, rows=3)
    first, big, small = Request("a", [1] * 10, 4), Request("b", [1] * 10, 7), Request("c", [1], 2)
    for r in (first, big, small):
        s.add(r)
    assert s.admit() == [first]  # 13 positions: 2 pages; b needs 2 more, c would fit but waits its turn
    s.finish(first, StopReason.MAX_TOKENS)
    assert s.admit() == [big, small]


# ---- mechanisms -----------------------------------------------------------------------------------------
def test_acceptance_estimate_and_goodput_draft_length():
    e = AcceptanceEstimate(prior=0.5, decay=0.5)
    assert e.alpha == 0.5
    e.update(4, 4)  # all accepted: 4 successes, no failure
    assert e.alpha == pytest.approx(4.5 / 5)
    e.update(0, 0)  # nothing drafted: no evidence, the old evidence fades toward the prior
    assert e.alpha == pytest.approx((2 + 0.5) / (2 + 1))
    e.update(4, 0)  # rejected at once
    assert e.alpha == pytest.approx((1 + 0.5) / (1 + 1 + 1))
    low = AcceptanceEstimate(prior=0.5, decay=0.5)
    for _ in range(4):
        low.update(4, 0)
    starved = low.alpha
    for _ in range(6):  # cut to no draft step after step: it recovers toward the prior, so it drafts again
        low.update(0, 0)
    assert starved < 0.2 and low.alpha > 0.45
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert goodput_draft_len(0.95, 16, 1.0, 0.0) == 16  # free verify tokens: draft as deep as allowed
    assert goodput_draft_len(0.95, 16, 1.0, 0.01) > goodput_draft_len(0.6, 16, 1.0, 0.01) > 0
    assert goodput_draft_len(0.05, 16, 1.0, 0.5) == 0  # poor acceptance, costly tokens: do not draft
    assert goodput_draft_len(0.9, 0, 1.0, 0.0) == 0
    # A larger batch shrinks each request's fixed share: the same alpha drafts shorter (batch-size aware).
    assert goodput_draft_len(0.8, 16, 1.0 / 24, 0.01) < goodput_draft_len(0.8, 16, 1.0, 0.01)


def test_verify_budget_goes_to_likeliest_slots():
    flat = CostCurve(((1, 1.0), (512, 1.0)))
    assert allocate_verify_budget([0.9, 0.1], [4, 4], 2, flat, 0.0) == [4, 4]  # free tokens: verify all
    assert allocate_verify_budget([0.9, 0.1], [4, 4], 2, flat, 0.0, cap=5) == [4, 1]  # best slots first
    steep = CostCurve(((1, 1.0), (2, 2.0)))  # every token costs a whole forward
    assert allocate_verify_budget([0.9, 0.3], [4, 4], 2, steep, 0.0) == [0, 0]
    mid = CostCurve(((2, 1.0), (10, 1.4)))  # 0.05 per token: worth it only for likely slots
    keep = allocate_verify_budget([0.95, 0.2, 0.6], [5, 5, 5], 3, mid, 0.0)
    assert keep[0] == 5 and keep[1] <= 1 and keep[0] >= keep[2] >= keep[1]
    assert allocate_verify_budget([0.5], [0], 1, mid, 0.0) == [0] and allocate_verify_budget([], [], 0, mid, 0.0) == []


def test_max_tiles_bounds_every_split_of_a_step():
    """tile_map fits in max_tiles for any split of a step's tokens over its requests, and a small token bucket
    needs few tiles however many request rows the runner has (the graph's attention grid)."""
    rng = random.Random(0)
    for _ in range(300):
        group, rows = rng.choice([1, 3, 4, 8]), rng.randrange(1, 30)
        n_req = rng.randrange(1, rows + 1)
        q_len = np.zeros(rows, dtype=np.int64)
        q_len[rng.sample(range(rows), n_req)] = [rng.randrange(1, 40) for _ in range(n_req)]
        bound = max_tiles(int(q_len.sum()), group, rows)
        req, _ = tile_map(q_len, group, bound)  # raises if the tiles do not fit
        assert (req >= 0).sum() == sum(-(-int(q) * group // ROW_TILE) for q in q_len) == tiles_for(q_len, group)
    assert max_tiles(1, 3, 24) == 2 and max_tiles(8, 3, 24) == 1 + 8 and max_tiles(96, 3, 24) == 9 + 24


def test_cost_curve():
    c = CostCurve(((1, 1.0), (16, 1.0), (32, 2.0)))
    assert c.at(8) == 1.0 and c.at(24) == 1.5 and c.at(48) == 3.0  # extended with the last slope
    assert c.slope(20) == pytest.approx(1 / 16) and c.slope(1) == 0.0
    assert list(c.at([1, 32])) == [1.0, 2.0]
    with pytest.raises(ValueError):
        CostCurve(((4, 1.0), (2, 1.0)))
    assert profile_tokens(24, 6) == [1, 16, 32, 64, 128, 144] and profile_tokens(1, 1) == [1, 2]
    # one number takes a plain-float path: the same bits as the array path (np.interp), knots and extension too
    h200 = CostCurve(((1, 0.00127), (16, 0.00132), (32, 0.00146), (64, 0.00163), (128, 0.00192), (408, 0.00432)))
    rng = random.Random(0)
    xs = [0, 0.5, 1, 1.5, 16, 16.25, 31.999, 32, 100, 128, 407, 408, 409.5, 2000]
    xs += [rng.uniform(0, 600) for _ in range(500)]
    for curve in (c, h200):
        assert [curve.at(x) for x in xs] == curve.at(np.array(xs)).tolist()
        assert all(isinstance(curve.at(x), float) for x in (3, 3.5))


def test_ngram_chain_drafter_equals_ngram_drafter():
    rng = random.Random(0)
    for trial in range(30):
        seq = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        k, nmax = rng.randrange(1, 8), rng.randrange(1, 5)
        a, b = NgramDrafter(k, nmax), NgramChainDrafter(k, nmax)
        for grow in range(3):  # incremental indexing, as the sequence grows
            assert b.propose(seq, k) == a.propose(seq, k).tokens, (trial, grow)
            seq = seq + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
    d = NgramChainDrafter(4, 3)
    seq = [1, 2, 3, 4, 5, 1, 2]
    assert d.propose(seq, 4) == [3, 4, 5, 1]
    assert d.propose_ahead(seq, [3, 4], 3) == [5, 1, 2, 3]  # after 1 2 3 4: a guess of the bonus (5), then more
    assert d.propose_ahead(seq, [9], 3) == []  # no earlier occurrence of ... 2 9


# ---- the batched engine: lossless ---------------------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.parametrize("shape,seed", [("g2", 0), ("g3", 1), ("mha", 2)])
def test_batched_outputs_equal_single_request_ar(shape, seed):
    """Requests join (arrival steps 0, 0, 1, 4; two rows, so the third waits for one to leave), prefill in
    chunks next to decoding requests, stop at an EOS or a limit inside a verify block (one after its first
    token); drafts are ragged. AR batched, stock speculative, and every mechanism on: all equal single AR."""
    specs, refs, eos, want = scenario(shape, seed)
    model, vocab = micro(shape, seed), MICRO[shape].vocab
    stock = BatchConfig(max_batch=2, prefill_chunk=16)
    ar = build_batch_engine(model, ecfg(), stock, eos, "cpu").run(specs, StepClock())
    assert {r.id: r.tokens for r in ar.requests} == want
    assert {r.id: r.stop_reason for r in ar.requests}["r3"] in ("max_tokens", "eos")
    factory = oracle_factory(specs, refs, vocab)  # host drafters: every host-side mechanism
    for batch in (stock, BatchConfig.with_mechanisms("goodput_draft", "verify_budget", "overlap_draft", max_batch=2,
                                                     prefill_chunk=16, max_draft_len=6, cost_curve=CURVE)):
        res = build_batch_engine(model, ecfg(drafter="ngram", draft_len=4), batch, eos, "cpu",
                                 drafter_factory=factory).run(specs, StepClock())
        assert {r.id: r.tokens for r in res.requests} == want, batch.mechanisms
        drafted, accepted = sum(r.drafted for r in res.requests), sum(r.accepted for r in res.requests)
        assert 0 < accepted < drafted, "acceptance must be ragged"
        assert len(res.steps) < len(ar.steps)
        if batch.overlap_draft:
            assert res.ahead_tried > 0


@pytest.mark.interpreter
def test_eos_stop_matches_single_engine_directly():
    """The EOS cut that `expected` derives, checked once against SpecEngine run with that EOS."""
    specs, refs, eos, want = scenario("g2", 0)
    direct = build_engine(ecfg(), micro("g2", 0), eos, "cpu").generate(list(specs[0].prompt), specs[0].max_new_tokens)
    assert direct.tokens == want["r0"] and direct.stop_reason == "eos"


@pytest.mark.interpreter
def test_graph_buckets_emulated_on_cpu_equal_single_ar():
    """The CUDA-graph path's buckets, padding, static buffers and replays (emulated: no CUDA here), mixed with
    eager steps larger than the largest bucket, still give every request its single AR output."""
    specs, refs, eos, want = scenario("g2", 0)
    batch = BatchConfig(max_batch=3, prefill_chunk=16, graph_max_tokens=16)
    engine = build_batch_engine(micro("g2", 0), ecfg(drafter="ngram", draft_len=4), batch, eos, "cpu",
                                emulate_graphs=True, drafter_factory=oracle_factory(specs, refs, 64))
    res = engine.run(specs, StepClock())
    assert {r.id: r.tokens for r in res.requests} == want
    assert set(engine.runner._graphs) and max(s.tokens for s in res.steps) > 16  # graphs and eager steps both ran


# ---- the batched block drafter -------------------------------------------------------------------------------
def block_model(shape: str, seed: int, block_size: int = 5):
    """A random block drafter for a micro target, with weights large enough for sharp, context-dependent tops."""
    from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
    return BlockDrafterModel(BlockDrafterConfig.for_target(MICRO[shape], layers=2, block_size=block_size)).init_weights(
        seed, std=0.3)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape,window", [("mha", 0), ("g3", 0), ("g3", 9)])  # key-head groups of 1 and 3 query heads
def test_batch_block_drafter_chains_equal_the_single_request_drafter(shape, window):
    """Three requests' contexts (different lengths) in one cache, with a rejected draft's junk written past one
    request's pending position and padding tokens: each row's batched top-1 chain equals BlockTreeDrafter's (the
    single-request engine's drafter) over that request's context alone (window: both with that context window)."""
    from specpilot.engines.batch.block_drafting import BatchBlockDrafter
    from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape
    target, drafter = micro(shape, 0), block_model(shape, 1)
    feat = drafter.config.feature_dim
    g = torch.Generator().manual_seed(2)
    batched = BatchBlockDrafter(drafter, target, rows=4, capacity=64, device="cpu", window=window)
    lengths, rows = (7, 30, 12), (2, 0, 3)
    contexts = [torch.randn(n, feat, generator=g) for n in lengths]
    junk = torch.randn(3, feat, generator=g)
    f = torch.cat([contexts[0], contexts[1], junk, contexts[2], torch.randn(2, feat, generator=g)])
    r = torch.tensor([2] * 7 + [0] * 30 + [2] * 3 + [3] * 12 + [-1, -1])
    pos = torch.cat([torch.arange(7), torch.arange(30), torch.arange(7, 10), torch.arange(12), torch.zeros(2)]).long()
    batched.observe(f[:20], None, r[:20], pos[:20])  # in two steps, as the engine observes them
    batched.observe(f[20:], None, r[20:], pos[20:])
    pending = [5, 9, 11]
    chains = batched.draft(list(rows), pending, list(lengths))
    shape = TreeShape(tree=False, block_size=5, budget=4, width=1, depth=4)
    for ctx, tok, chain in zip(contexts, pending, chains):
        single = BlockTreeDrafter(drafter, target, shape, 64, "cpu", window=window)
        single.observe(0, ctx)
        tokens, _ = single.candidates([1] * ctx.shape[0] + [tok], 4)
        assert chain == [t[0] for t in tokens]
    assert len(set(map(tuple, chains))) > 1, "degenerate drafter: the chains must depend on the context"
    if window:  # the window shows: the 30-token context drafts otherwise without it
        plain = BatchBlockDrafter(drafter, target, rows=4, capacity=64, device="cpu")
        plain.keys, plain.values = batched.keys, batched.values
        assert plain.draft([0], [9], [30]) != [chains[1]]
    fused = BatchBlockDrafter(drafter, target, rows=4, capacity=64, device="cpu", triton_head=True, window=window)
    fused.keys, fused.values = batched.keys, batched.values
    assert fused.draft(list(rows), pending, list(lengths)) == chains  # the engine's norm + head + argmax kernel
    with pytest.raises(ValueError, match="features"):
        batched.observe(f[:, :-1], None, r, pos)
    with pytest.raises(ValueError, match="positions"):
        batched.draft([0], [1], [65])
    with pytest.raises(ValueError, match="rows"):
        batched.draft([4], [1], [3])


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["block", "lookup_goodput"])
def test_block_drafter_batched_outputs_equal_single_request_ar(mode):
    """The batched engine drafting with the block drafter (fed and run inside the step's own forward, graph
    buckets emulated) alone at its block depth, or led by prompt lookup with goodput draft lengths: every request's
    output equals its single-request AR output, and the block proposed the drafts."""
    specs, refs, eos, want = scenario("mha", 0)
    cfg = ecfg(drafter="block", block_size=5, ngram_prefix=mode != "block")
    batch = BatchConfig(max_batch=3, prefill_chunk=16, graph_max_tokens=16,
                        **({"draft_length": "goodput", "max_draft_len": 6, "cost_curve": CURVE}
                           if mode != "block" else {}))
    engine = build_batch_engine(micro("mha", 0), cfg, batch, eos, "cpu", emulate_graphs=True,
                                block_drafter=block_model("mha", 1))
    calls = []
    plan_drafts = engine._draft

    def recorded(decode, prefill_tokens):  # each request's chain from its last step, as the step reads it
        calls.extend((list(r.seq), list(r.block)) for r in decode if r.block)
        return plan_drafts(decode, prefill_tokens)

    engine._draft = recorded
    res = engine.run(specs, StepClock())
    assert {r.id: r.tokens for r in res.requests} == want
    assert sum(r.drafted for r in res.requests) > 0 and calls
    assert any(k[1] for k in engine.runner._graphs)  # the drafting variant of the graphs ran
    # Each chain equals a fresh drafter's from one prefill of the request's committed sequence: the engine observed
    # every committed token's features at its position, and what it wrote past the pending one stayed hidden.
    from specpilot.engines.batch import BatchBlockDrafter
    for seq, chain in calls:
        fresh = BatchBlockDrafter(block_model("mha", 1), engine.runner.model, 1, MAX_SEQ, "cpu")
        runner = BatchRunner(engine.runner.model, cfg, BatchConfig(max_batch=1, prefill_chunk=64), "cpu",
                             max_block=5, drafters=[fresh])
        runner.bind(0, list(range(runner.pages_per_request)))
        out = runner.launch([StepEntry(0, seq[:-1], 0, last_only=True)], draft=True).result()
        assert out[0, 1] == seq[-1] and out[0, 1 + runner.W:].tolist() == chain  # drafted in the prefill's forward
        assert fresh.draft([0], [seq[-1]], [len(seq) - 1]) == [chain]


@pytest.mark.interpreter
def test_block_drafter_batching_rejects_what_it_cannot_serve():
    from specpilot.engines.batch import BatchBlockDrafter
    model, drafter = micro("mha", 0), block_model("mha", 1)
    with pytest.raises(ConfigError, match="needs the drafter"):
        build_batch_engine(model, ecfg(drafter="block", block_size=5), BatchConfig(max_batch=2), NO_EOS, "cpu")
    with pytest.raises(ConfigError, match="overlap_draft"):
        build_batch_engine(model, ecfg(drafter="block", block_size=5), BatchConfig(max_batch=2, overlap_draft=True),
                           NO_EOS, "cpu", block_drafter=drafter)
    with pytest.raises(ConfigError, match="trained block size"):
        build_batch_engine(model, ecfg(drafter="block", block_size=8), BatchConfig(max_batch=2), NO_EOS, "cpu",
                           block_drafter=drafter)
    with pytest.raises(ConfigError, match="single regime only"):
        build_batch_engine(model, ecfg(drafter="block", block_size=5, ngram_prefix=True, lookup_agree_topk=2),
                           BatchConfig(max_batch=2), NO_EOS, "cpu", block_drafter=drafter)
    with pytest.raises(ConfigError, match="device_overlap .* single regime only"):
        build_batch_engine(model, ecfg(drafter="block", block_size=5, device_overlap=True), BatchConfig(max_batch=2),
                           NO_EOS, "cpu", block_drafter=drafter)
    with pytest.raises(ConfigError, match="not built with this block drafter"):
        runner = BatchRunner(model, ecfg(drafter="block", block_size=5), BatchConfig(max_batch=2), "cpu", max_block=5)
        BatchEngine(runner, ecfg(drafter="block", block_size=5), BatchConfig(max_batch=2), NO_EOS,
                    block_drafter=BatchBlockDrafter(drafter, model, 2, MAX_SEQ, "cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        BatchBlockDrafter(block_model("g2", 1), model, 2, MAX_SEQ, "cpu")
    with pytest.raises(ValueError, match="names the runner's one drafter; it has 0"):
        BatchRunner(model, ecfg(), BatchConfig(max_batch=2), "cpu", max_block=1).launch(
            [StepEntry(0, [1], 0)], draft=True)
    with pytest.raises(ValueError, match="was not built with"):
        BatchRunner(model, ecfg(), BatchConfig(max_batch=2), "cpu", max_block=1).launch(
            [StepEntry(0, [1], 0)], draft=BatchBlockDrafter(drafter, model, 2, MAX_SEQ, "cpu"))
    with pytest.raises(ValueError, match="rows"):
        BatchRunner(model, ecfg(), BatchConfig(max_batch=2), "cpu", max_block=1,
                    drafters=[BatchBlockDrafter(drafter, model, 3, MAX_SEQ, "cpu")])


@pytest.mark.interpreter
def test_engine_rejects_what_it_cannot_serve():
    model = micro("g2", 0)
    with pytest.raises(ConfigError, match="kernel_backend=triton"):
        build_batch_engine(model, ecfg(kernel_backend="torch"), BatchConfig(), NO_EOS, "cpu")
    with pytest.raises(ConfigError, match="chain"):
        build_batch_engine(model, ecfg(drafter="ngram", verify="tree"), BatchConfig(), NO_EOS, "cpu")
    with pytest.raises(ConfigError, match="not batched"):
        build_batch_engine(model, ecfg(drafter="draft_model"), BatchConfig(), NO_EOS, "cpu")
    runner = BatchRunner(model, ecfg(), BatchConfig(max_batch=2), "cpu", max_block=3)
    with pytest.raises(ConfigError, match="block width"):
        BatchEngine(runner, ecfg(drafter="ngram", draft_len=5), BatchConfig(max_batch=2), NO_EOS)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        BatchEngine(runner, ecfg(), BatchConfig(max_batch=2), NO_EOS).run([RequestSpec("x", (1,) * 300, 30)])


# ---- all five benchmarks, bench, GPU script -----------------------------------------------------------------
def fold(ids, vocab: int) -> tuple[int, ...]:
    """Real token ids mapped into a micro vocabulary (the prompts' structure and lengths stay)."""
    return tuple(i % vocab for i in ids)


def test_five_benchmarks_prompts_lossless_with_every_mechanism():
    """The first validate prompt of each benchmark (SmolLM2's chat template and tokenizer; ids folded into the
    micro model's vocabulary), served together by the n-gram drafter with every mechanism on; the longest
    (mt_bench) runs past a KV page boundary (of the page size the engine's attention sets). Every output
    equals single-request AR."""
    from specpilot.engines.loader import load_tokenizer
    from specpilot.testbed import fetch_smollm2
    from specpilot.workload import ALL_BENCHMARKS, WorkloadSpec, apply_chat_template
    tok = load_tokenizer(fetch_smollm2())
    wl = WorkloadSpec(benchmarks=tuple(b.value for b in ALL_BENCHMARKS), prompts_per_benchmark=1, max_new_tokens=1)
    prompts = {p.benchmark.value: fold(apply_chat_template(tok, p.text), 64) for p in wl.select().validate}
    assert len(prompts) == 5
    longest = max(prompts, key=lambda b: len(prompts[b]))
    page = attention_params(micro("g2", 0), rope_tables_for(micro("g2", 0), MAX_SEQ, "cpu")).split_keys
    specs = [RequestSpec(b, p, max(6, page + 2 - len(p)) if b == longest else 6) for b, p in prompts.items()]
    want = {s.id: single_ar("g2", 0, s.prompt, s.max_new_tokens) for s in specs}
    batch = BatchConfig.with_mechanisms("all", max_batch=5, prefill_chunk=256, max_draft_len=6, cost_curve=CURVE)
    res = build_batch_engine(micro("g2", 0), ecfg(drafter="ngram"), batch, NO_EOS, "cpu").run(specs)
    assert {r.id: r.tokens for r in res.requests} == want
    assert max(len(s.prompt) + s.max_new_tokens - 1 for s in specs) > page


@pytest.mark.interpreter
def test_concurrency_bench_reports_and_catches_mismatches():
    from specpilot.bench.batched import (Arrival, format_concurrency_report, run_concurrency_bench,
                                         standard_variants)
    model = micro("g2", 0)
    rng = torch.Generator().manual_seed(1)
    phrase = torch.randint(3, 64, (5,), generator=rng).tolist()
    prompts = [(f"p{i}", phrase * 2 + torch.randint(3, 64, (3,), generator=rng).tolist()) for i in range(2)]
    reference = {k: single_ar("g2", 0, tuple(p), 5) for k, p in prompts}
    reference["p1"] = reference["p1"][:-1] + [reference["p1"][-1] + 1]  # a wrong reference must be caught
    variants = standard_variants(ecfg(), ecfg(drafter="ngram"), ["all"])
    assert [v.label for v in variants] == ["ar", "stock", "all"]
    report = run_concurrency_bench(model, NO_EOS, prompts, 5, [2], [Arrival.ALL, Arrival.POISSON], variants, "cpu",
                                   rate=20.0, cost_curve=CostCurve(CURVE), reference=reference)
    rows = {(r.arrival, r.variant): r for r in report.rows}
    assert set(rows) == {(a, v) for a in ("all", "poisson") for v in ("ar", "stock", "all")}
    for r in report.rows:
        assert r.requests == 2 and r.new_tokens == 10 and r.throughput > 0 and r.tpot_p50_ms > 0
        assert r.mismatches == ["p1#0"] and not r.matches_ar  # every variant equals AR, not the bad reference
    assert rows[("all", "ar")].speedup_vs_ar == 1.0 and rows[("all", "all")].speedup_vs_stock > 0
    assert rows[("poisson", "ar")].rate == 20.0 and not report.all_match()
    text = format_concurrency_report(report)
    assert "| 2 | poisson | all |" in text and "MISMATCH" in text
    assert json.loads(json.dumps(report.to_dict()))["rows"][0]["variant"] == "ar"


@pytest.mark.interpreter
def test_concurrency_bench_measures_its_cost_curve_at_the_runs_context():
    from specpilot.bench.batched import Arrival, run_concurrency_bench, standard_variants, typical_context
    assert typical_context([("a", [1] * 10), ("b", [1] * 21)], 100) == 16 + 50
    prompts = [(f"p{i}", list(range(3 + i, 16 + i))) for i in range(2)]  # 13 tokens each
    said: list[str] = []
    variants = standard_variants(ecfg(), ecfg(drafter="ngram"), ["goodput_draft"], BatchConfig(max_draft_len=2))
    report = run_concurrency_bench(micro("g2", 0), NO_EOS, prompts, 6, [2], [Arrival.ALL], variants, "cpu",
                                   progress=said.append, cost_repeats=1)
    assert any(m.startswith("cost curve at 16 keys a row: ") for m in said), said
    tokens = [n for n, _ in report.cost_curve]
    assert tokens[0] == 1 and tokens == sorted(set(tokens)) and all(s > 0 for _, s in report.cost_curve)
    assert report.all_match()


def test_standard_variants_share_the_base_batch_config():
    from specpilot.bench.batched import standard_variants
    base = BatchConfig(max_batch=3, max_draft_len=7, graph_max_tokens=64)
    variants = standard_variants(ecfg(), ecfg(drafter="ngram"), ["goodput_draft", "all"], base)
    assert [v.label for v in variants] == ["ar", "stock", "goodput_draft", "all"]
    assert all(v.batch.max_draft_len == 7 and v.batch.graph_max_tokens == 64 for v in variants)
    assert [v.batch.mechanisms for v in variants] == [(), (), ("goodput_draft",), ALL_MECHANISMS]
    combo = standard_variants(ecfg(), ecfg(drafter="ngram"), ["goodput_draft+overlap_draft"], base)[-1]
    assert combo.label == "goodput_draft+overlap_draft" and combo.batch.mechanisms == ("goodput_draft", "overlap_draft")
    with pytest.raises(ConfigError, match="unknown mechanism"):
        standard_variants(ecfg(), ecfg(drafter="ngram"), ["bogus"], base)
    with pytest.raises(ValueError, match="stock must have every mechanism off"):
        standard_variants(ecfg(), ecfg(drafter="ngram"), ["all"], BatchConfig(overlap_draft=True))


def test_bench_cli_concurrency(monkeypatch, tmp_path, capsys):
    """`specpilot bench --concurrency`: the deployment's real workload prompts, a micro target in place of
    SmolLM2 (the session is replaced; everything after it is the real path)."""
    import specpilot.bench.cli as bench_cli

    class MicroSession:
        def __init__(self, deployment, device=None):
            self.deployment, self.device, self.target, self.eos = deployment, "cpu", micro("g2", 0), NO_EOS

        def tokenize(self, prompts):
            return [SimpleNamespace(key=p.key, ids=fold([ord(c) for c in p.text[:20]], 64)) for p in prompts]

    monkeypatch.setattr(bench_cli, "DeploymentSession", MicroSession)
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps([list(p) for p in CURVE]))
    rc = bench_cli.main(["bench", "--deployment", "smollm2-135m-cpu", "--benchmarks", "gsm8k",
                         "--prompts-per-benchmark", "2", "--max-new-tokens", "3", "--concurrency", "2", "--arrival",
                         "all", "--mechanisms", "verify_budget", "--cost-curve", str(curve), "--json", "--out",
                         str(tmp_path), "--batch", '{"verify_budget_max": 2}'])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["all_match_ar"] and [r["variant"] for r in out["rows"]] == ["ar", "stock", "verify_budget"]
    assert json.loads((tmp_path / "bench_concurrency.json").read_text())["cost_curve"] == [list(p) for p in CURVE]
    assert all(r["step_ms"] > 0 and r["forward_tokens"] >= 1 for r in out["rows"])
    for bad in ('{"bogus": 1}', '{"max_draft_len": 0}', '{"accept_decay": "0.5"}', "[1]", "{"):
        with pytest.raises(SystemExit):
            bench_cli.main(["bench", "--deployment", "smollm2-135m-cpu", "--concurrency", "2", "--batch", bad])
        assert "--batch" in capsys.readouterr().err


@pytest.mark.interpreter
def test_gpu_batch_bench_script_runs_tiny(tmp_path, capsys):
    """scripts/gpu_batch_bench.py's whole logic at tiny scale on CPU (--tiny), so its first GPU run cannot
    trip on it: references, shared runner, measured cost curve, variants, checks, JSON, table."""
    path = Path(__file__).parents[1] / "scripts" / "gpu_batch_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_batch_bench", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from specpilot.drafting.checkpoint import WeightStorage, save_drafter
    from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
    drafter = BlockDrafterModel(BlockDrafterConfig.for_target(script.MICRO, layers=1, block_size=4)).init_weights(0)
    save_drafter(drafter, tmp_path / "drafter", script.micro_model(0), storage=WeightStorage.FP32)
    out = tmp_path / "bench.json"
    assert script.main(["--tiny", str(out), "--arrival", "all", "--mechanisms", "goodput_draft,all",
                        "--max-new-tokens", "5", "--engine", '{"max_seq_len": 256}',
                        "--drafter", str(tmp_path / "drafter")]) == 0
    data = json.loads(out.read_text())
    assert data["summary"][0]["all_equal_single_ar"] and len(data["report"]["cost_curve"]) >= 2
    assert set(data["summary"][0]["vs_ar"]) == {"stock", "goodput_draft", "all", "block", "block+lookup",
                                                "block+lookup+goodput", "block+lookup+goodput+budget"}
    assert "| conc | arrival | AR tok/s |" in capsys.readouterr().out.strip().splitlines()[-3]
    from specpilot.engines.loader import load_tokenizer
    from specpilot.testbed import fetch_smollm2
    prompts = script.benchmark_prompts(load_tokenizer(fetch_smollm2()), 1)  # the real-model path's prompts
    assert [k.split("/")[0] for k, _ in prompts] == ["gsm8k", "humaneval", "math500", "mbpp", "mt_bench"]


def test_host_cost_harness_replays_known_outputs_through_the_engine(capsys):
    """scripts/host_batch_cost.py: the real BatchEngine loop over a runner that answers from known sequences. The
    script asserts every request committed exactly its sequence, for AR, stock and every mechanism: hundreds of
    ragged steps of the engine's commit/cut logic against a known answer, with no forward in the way."""
    path = Path(__file__).parents[1] / "scripts" / "host_batch_cost.py"
    spec = importlib.util.spec_from_file_location("host_batch_cost", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--synthetic", "6x200", "--requests", "9", "--concurrency", "4", "--oracle"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "variant" not in line]
    tok_step = {r.split("|")[1].strip(): float(r.split("|")[3]) for r in rows}
    predicted = {r.split("|")[1].strip(): float(r.split("|")[7]) for r in rows}  # equal host cost per step
    assert set(tok_step) == {"ar", "stock", "goodput_draft", "verify_budget", "overlap_draft", "device_draft",
                             "extrapolate", "all", "all, host drafting", "goodput_draft+verify_budget",
                             "oracle-cut lookup"}
    # the lookup on the device proposes what the host's does: the same steps, tokens and forwards as stock
    assert tok_step["device_draft"] == tok_step["stock"] and predicted["device_draft"] == predicted["stock"]
    assert 1.0 <= tok_step["ar"] < 1.1 and tok_step["stock"] > 1.5  # (prefill commits one token with no decode row)
    assert tok_step["goodput_draft"] > tok_step["stock"]
    # the bound: the lookup's proposals cut to what is accepted commit the most a step and waste no verify token
    assert tok_step["oracle-cut lookup"] >= max(tok_step.values())
    assert predicted["oracle-cut lookup"] >= max(predicted.values()) and predicted["stock"] > predicted["ar"]


@pytest.mark.interpreter
def test_batch_engine_serves_with_the_collector_off_and_restores_it():
    specs, refs, eos, want = scenario("g2", 0)
    engine = build_batch_engine(micro("g2", 0), ecfg(), BatchConfig(max_batch=2, prefill_chunk=16), eos, "cpu")
    seen = []
    step = engine.step
    engine.step = lambda clock: (seen.append(gc.isenabled()), step(clock))[1]
    assert gc.isenabled()
    engine.run(specs, StepClock())
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        engine.run(specs, StepClock())
        assert not gc.isenabled()  # a caller's choice stands
    finally:
        gc.enable()
