"""tune_kernels on CPU under the Triton interpreter (allow_cpu: exercises the search, says nothing about speed):
selection order from a hand-built attribution, batch-invariance enforcement, and the table's round trip
through EngineConfig."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import ClassVar

import pytest
import torch

from specpilot.costmodel import Ceilings, attribute, ideal_op_times  # noqa: E402
from specpilot.engines.config import EngineConfig  # noqa: E402
from specpilot.engines.shapes import LlamaShape, OpClass  # noqa: E402
from specpilot.engines.traces import KernelTrace, StepTrace  # noqa: E402
from specpilot.kernels import AttentionParams, LinearParams  # noqa: E402
from specpilot.stages import tune_kernels as tk  # noqa: E402

SHAPE = LlamaShape(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64, rms_eps=1e-5,
                   rope_theta=10000.0, tie_embeddings=False)
TOKENS, CONTEXT = 4, 64
CEILINGS = Ceilings(peak_flops=1e12, peak_bandwidth=1e11)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = tk.TuneBudget(max_kernels=2, max_settings=3, reps=1, context=300, min_gain=1.0, step_gate=False)


def hand_attribution(multiples: dict[OpClass, float]):
    """One kernel trace per op class (recorded op), each `multiples[op]` x its ideal time (1.0 if absent)."""
    ideals = ideal_op_times(SHAPE, TOKENS, CONTEXT, CEILINGS)
    traces = [KernelTrace(f"k_{op.value}", op.value, calls=10, device_s=multiples.get(op, 1.0) * i.ideal_s * 10,
                          steps=10, tokens=TOKENS) for op, i in ideals.items()]
    steps = [StepTrace("r", 0, CONTEXT, 3, 3, 2, 3, 4, 1e-4, 1e-3, [[5], [6], [7]], [[0.9], [0.8], [0.7]], [5, 6, 8, 9])]
    return attribute(steps, traces, SHAPE, CEILINGS, lambda n: 1.0 + 0.1 * n, tokens=TOKENS, context=CONTEXT)


def test_selection_takes_the_largest_excess_time_first_and_maps_ops_to_kernels():
    ideals = ideal_op_times(SHAPE, TOKENS, CONTEXT, CEILINGS)
    # ACCEPT has the largest ratio but a tiny ideal; LM_HEAD's 3x of a large ideal is the most time to win back.
    attr = hand_attribution({OpClass.ACCEPT: 40.0, OpClass.LM_HEAD: 3.0, OpClass.ATTN: 2.0, OpClass.DOWN: 1.5})
    excess = {op: (m - 1.0) * ideals[op].ideal_s for op, m in
              {OpClass.ACCEPT: 40.0, OpClass.LM_HEAD: 3.0, OpClass.ATTN: 2.0, OpClass.DOWN: 1.5}.items()}
    want = [op for op in sorted(excess, key=lambda o: -excess[o])]
    op_kernel = {OpClass.ACCEPT: "greedy_accept", OpClass.LM_HEAD: "lm_head", OpClass.ATTN: "attention",
                 OpClass.DOWN: "down"}
    chosen = tk.select_kernels(attr, max_kernels=4)
    assert [c.kernel for c in chosen] == [op_kernel[op] for op in want]
    assert [c.op for c in chosen] == want and all(c.gap > 1.0 for c in chosen)
    assert tk.select_kernels(hand_attribution({}), max_kernels=4) == ()  # nothing above its ideal: nothing to tune
    norm_only = tk.select_kernels(hand_attribution({OpClass.NORM: 5.0}), max_kernels=4)  # norms run fused in GEMMs
    assert [c.kernel for c in norm_only] == ["qkv", "gate_up"]


def test_projection_specs_launch_the_kernel_variants_the_engine_runs():
    """qkv with the rotary + cache-write epilogue, gate_up with the GLU one and the LM head with the argmax one, as
    engines/fused.py launches them: the tuner once timed the plain store variants, whose best tiles are not those
    of the pair-loading ones."""
    from specpilot.kernels import RMSNormLinearParams
    from specpilot.stages.kernel_specs import BY_NAME
    dev, g, t = torch.device(DEVICE), torch.Generator().manual_seed(0), 2
    n, k = BY_NAME["qkv"].dims(SHAPE)
    q, kc, vc = BY_NAME["qkv"].make(SHAPE, n, k, t, 8, torch.float32, dev, g)(RMSNormLinearParams())
    assert q.shape == (t, SHAPE.heads, SHAPE.head_dim) and kc.shape == vc.shape == (SHAPE.kv_heads, 8 + t, 16)
    n, k = BY_NAME["gate_up"].dims(SHAPE)
    act = BY_NAME["gate_up"].make(SHAPE, n, k, t, 8, torch.float32, dev, g)(RMSNormLinearParams())
    assert act.shape == (t, SHAPE.intermediate)  # silu(gate) * up, not the [t, 2I] projection
    n, k = BY_NAME["lm_head"].dims(SHAPE)
    logits, best = BY_NAME["lm_head"].make(SHAPE, n, k, t, 8, torch.float32, dev, g)(RMSNormLinearParams())
    assert logits.shape == (t, SHAPE.vocab) and torch.equal(best, logits.argmax(-1))  # the argmax epilogue ran


@pytest.mark.parametrize("name", ["qkv", "gate_up", "lm_head", "o_proj", "down"])
def test_w12_projection_specs_launch_w12_weights_with_the_bf16_bits(name):
    """A weight_format=w12 build's projections are timed on W12 weights (the oct layout the engine holds), drawn from
    the same values: every output equals the bf16 weights' bit for bit, whatever the setting."""
    from specpilot.kernels import LinearParams, RMSNormLinearParams
    from specpilot.stages.kernel_specs import BY_NAME, _weights
    from specpilot.weights.oct import OctLayout
    spec, dev = BY_NAME[name], torch.device(DEVICE)
    assert isinstance(_weights(torch.Generator(), torch.bfloat16, dev, 8, 32, w12=True)(), OctLayout)
    n, k = spec.dims(SHAPE)
    p = (RMSNormLinearParams if spec.params is RMSNormLinearParams else LinearParams)(block_n=16, num_warps=4)
    outs = [spec.make(SHAPE, n, k, 2, 8, torch.bfloat16, dev, torch.Generator().manual_seed(3), w12=w12)(p)
            for w12 in (False, True)]
    flat = [[t for t in (o if isinstance(o, tuple) else (o,))] for o in outs]
    assert all(torch.equal(a.view(torch.int8) if a.is_floating_point() else a,
                           b.view(torch.int8) if b.is_floating_point() else b) for a, b in zip(*flat))


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the interpreter path")
def test_w12_builds_are_tuned_on_w12_weights():
    attr = hand_attribution({OpClass.O_PROJ: 4.0})
    with pytest.raises(tk.TuneError, match="bfloat16"):
        tk.tune_kernels(attr, SHAPE, DEVICE, [1], TINY, allow_cpu=True, dtype=torch.float32,
                        weight_format=tk.WeightFormat.W12)
    table = tk.tune_kernels(attr, SHAPE, DEVICE, [1, 4], dataclasses.replace(TINY, max_kernels=1), allow_cpu=True,
                            weight_format=tk.WeightFormat.W12)
    assert [c.kernel for c in table.selected] == ["o_proj"]
    assert {e.tokens for e in table.entries} <= {1, 4} and all(e.kernel == "o_proj" for e in table.entries)


def test_cpu_tuning_is_refused_unless_asked_for():
    with pytest.raises(tk.TuneError, match="allow_cpu"):
        tk.tune_kernels(hand_attribution({OpClass.O_PROJ: 4.0}), SHAPE, "cpu", [1, 4], TINY)


class ParamsClock:
    """A deterministic clock for the tuner: every timed call still runs the real launch (so the T-neutral search's
    bit checks are real), but its time is cost(params, T) of the launch it ran. The interpreter's own timings
    decided which settings won, and a run in a few kept the defaults (a flaky test)."""

    def __init__(self, cost):
        self.cost, self.last = cost, None

    def spec(self, spec):
        def make(shape, n, k, t, *args, **kw):
            run = spec.make(shape, n, k, t, *args, **kw)

            def recorded(p):
                self.last = (p, t)
                return run(p)
            return recorded
        return dataclasses.replace(spec, make=make)

    def timer(self, dev, reps):
        def timed(fn):
            fn()
            return self.cost(*self.last)
        return timed


def launch_cost(p, t: int) -> float:
    """128-key blocks in 256-key splits (reachable on the coordinate search's second sweep: 128-key blocks need
    split_keys >= 128 first) and, at T=4 only, 8 warps; o_proj: 8 warps at every T."""
    if isinstance(p, AttentionParams):
        return 1.0 - 0.3 * (p.block_n == 128) - 0.2 * (p.split_keys == 256) - 0.05 * (t == 4 and p.num_warps == 8)
    return 1.0 - 0.1 * (p.num_warps == 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the interpreter path")
def test_tuned_table_keeps_numerics_fields_per_shape_and_round_trips(tmp_path, monkeypatch):
    attr = hand_attribution({OpClass.ATTN: 6.0, OpClass.O_PROJ: 3.0})
    clock = ParamsClock(launch_cost)
    monkeypatch.setattr(tk, "_timer", clock.timer)
    table = tk.tune_kernels(attr, SHAPE, DEVICE, [1, 4], dataclasses.replace(TINY, max_settings=10), allow_cpu=True,
                            specs=[clock.spec(s) for s in tk.SPECS])
    assert [c.kernel for c in table.selected] == ["attention", "o_proj"]
    by_kernel: dict[str, list[tk.TableEntry]] = {}
    for e in table.entries:
        by_kernel.setdefault(e.kernel, []).append(e)
        assert (e.n, e.k) == tk.BY_NAME[e.kernel].dims(SHAPE) and e.default_ms > 0 and e.tuned_ms > 0
    # block_n / split_keys set the reduction order: one setting for every T of the shape, so an entry for every
    # T, even T=1 where no T-neutral field moved; num_warps is T-neutral: T=4's own
    attn = {e.tokens: e.params for e in by_kernel["attention"]}
    assert sorted(attn) == [1, 4]
    assert {(p["block_n"], p["split_keys"]) for p in attn.values()} == {(128, 256)}
    assert (attn[1]["num_warps"], attn[4]["num_warps"]) == (AttentionParams.num_warps, 8)
    assert {e.tokens: e.params["num_warps"] for e in by_kernel["o_proj"]} == {1: 8, 4: 8}
    cfg = table.apply(EngineConfig())
    assert cfg.kernel_table == tuple(sorted(table.config_pairs()))
    back = EngineConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.digest() == cfg.digest()
    path = tk.write_kernel_table(table, tmp_path / "kernel_table.json")
    assert tk.read_kernel_table(path) == table
    from specpilot.kernels.table import read_pairs  # what the GPU scripts read: a summary.json or a pair list
    pairs = tuple(tuple(p) for p in table.config_pairs())
    (tmp_path / "summary.json").write_text(json.dumps({"kernel_table": pairs}))
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    assert read_pairs(tmp_path / "summary.json") == read_pairs(tmp_path / "pairs.json") == pairs
    for key, text in back.kernel_table:  # what the engine will launch with at each tuned (shape, T)
        kernel, n, k, t = tk.parse_key(key)
        assert tk.launch_params(back.kernel_table, kernel, n, k, t) == json.loads(text)


def test_invariance_is_enforced_on_tables_and_lookups():
    n, k = tk.BY_NAME["attention"].dims(SHAPE)
    ok = ((f"attention@{n}x{k}@T1", json.dumps(dataclasses.asdict(AttentionParams(block_n=32, split_keys=128)))),
          (f"attention@{n}x{k}@T4", json.dumps(dataclasses.asdict(AttentionParams(32, 128, num_warps=8)))))
    tk.check_invariance(ok)
    # a T without an entry takes the nearest tuned T's entry among those with as many 16-row tiles (the smaller on
    # a tie), else the shape's reduction-order fields with default T-neutral ones
    assert tk.launch_params(ok, "attention", n, k, 16) == dataclasses.asdict(AttentionParams(32, 128, num_warps=8))
    assert tk.launch_params(ok, "attention", n, k, 2) == dataclasses.asdict(AttentionParams(block_n=32, split_keys=128))
    assert tk.launch_params(ok, "attention", n, k, 17) == dataclasses.asdict(AttentionParams(block_n=32, split_keys=128))
    one_row = ((f"o_proj@{n}x{k}@T1", json.dumps(dataclasses.asdict(LinearParams(row_tile=1, block_n=64, num_warps=8,
                                                                                 num_stages=3)))),)
    # one row per program: block_n and num_warps shape the sum, so they hold for every T; num_stages, tuned at T=1
    # only, falls back to its default at an untuned T (one row per program: T=2 runs other programs than T=1)
    assert tk.launch_params(one_row, "o_proj", n, k, 2) == dataclasses.asdict(LinearParams(row_tile=1, block_n=64,
                                                                                           num_warps=8))
    assert tk.launch_params(ok, "attention", n + 1, k, 16) is None
    bad = ok + ((f"attention@{n}x{k}@T8", json.dumps(dataclasses.asdict(AttentionParams(block_n=64, split_keys=128)))),)
    with pytest.raises(tk.TuneError, match="batch invariance"):
        tk.check_invariance(bad)
    with pytest.raises(tk.TuneError, match="batch invariance"):
        tk.KernelTable("cpu", "float32", 64, tuple(
            tk.TableEntry("attention", n, k, t, json.loads(p), 1.0, 1.0) for t, (_, p) in zip((1, 4, 8), bad))
        ).apply(EngineConfig())
    linear = dataclasses.asdict(LinearParams(block_n=64, num_warps=2))  # all T-neutral: free per T
    tk.check_invariance((("o_proj@32x32@T1", json.dumps(linear)),
                         ("o_proj@32x32@T4", json.dumps(LinearParams().as_kwargs()))))
    with pytest.raises(ValueError):
        tk.check_invariance((("o_proj@32x32@T1", json.dumps({**linear, "num_warps": 3})),))


@dataclasses.dataclass(frozen=True)
class MislabelledAttention(AttentionParams):
    """Claims split_keys changes no bit: the tuner's bit-identity check must catch it."""

    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("num_warps", "num_stages", "split_keys")
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"split_keys": (64, 128, 512)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the interpreter path")
def test_a_t_neutral_claim_that_changes_bits_is_refused():
    spec = dataclasses.replace(tk.BY_NAME["attention"], params=MislabelledAttention)
    budget = dataclasses.replace(TINY, max_kernels=1, max_settings=3)
    table = tk.tune_kernels(hand_attribution({OpClass.ATTN: 6.0}), SHAPE, DEVICE, [4], budget, allow_cpu=True,
                            specs=(spec,))
    # 128 and 512 split the 300 cached keys differently from the default 64: different rounding, refused
    assert sorted(r.split("{'split_keys': ")[1][:3] for r in table.refused if "output differs" in r) == ["128", "512"]
    assert table.entries == ()


@pytest.mark.interpreter
def test_engine_runs_with_its_kernel_table():
    """The fused forward launches with EngineConfig.kernel_table: an order-setting attention entry and T-neutral
    projection entries keep speculative == AR, and an invalid table is refused when the runner is built."""
    sys.path.insert(0, os.path.dirname(__file__))
    from _tiny import prompt, tiny_model
    from specpilot.engines.build import build_engine
    from specpilot.engines.config import DrafterKind
    from specpilot.kernels.table import KernelTableError, table_key

    model = tiny_model("gqa", 2, dtype=torch.bfloat16)
    sh = model.shape
    table = ((table_key("attention", sh.q_dim, sh.kv_dim, 1), json.dumps(AttentionParams(32, 32).as_kwargs())),
             (table_key("o_proj", sh.hidden, sh.q_dim, 8), json.dumps(LinearParams(block_n=16, num_warps=2).as_kwargs())))
    base = EngineConfig(kernel_backend="triton", cuda_graphs=False, max_seq_len=128, kernel_table=table)
    p = prompt(sh.vocab, 10, 2)
    ar = build_engine(base.replace(drafter=DrafterKind.NONE), model, frozenset(), "cpu").generate(p, 12)
    spec = build_engine(base.replace(drafter=DrafterKind.NGRAM), model, frozenset(), "cpu").generate(p, 12)
    assert spec.tokens == ar.tokens
    bad = ((table_key("attention", sh.q_dim, sh.kv_dim, 1), json.dumps({"block_n": 48})),)
    with pytest.raises(KernelTableError, match="attention"):
        build_engine(base.replace(drafter=DrafterKind.NONE, kernel_table=bad), model, frozenset(), "cpu")


def test_one_row_tiles_make_block_n_and_warps_numerics():
    """With row_tile=1 the K chunk is summed by tl.sum, whose tree follows block_n and num_warps: a table may no
    longer vary them across T (with 16-row tensor-core tiles it may)."""
    from specpilot.kernels.table import InvarianceError, check_invariance

    def pairs(row_tile, **t16):
        one = {"row_tile": row_tile, "block_n": 16, "num_warps": 4}
        return [("o_proj@64x64@T1", json.dumps(one)), ("o_proj@64x64@T16", json.dumps(one | t16))]

    check_invariance(pairs(16, block_n=32, num_warps=8, num_stages=3))
    check_invariance(pairs(1, num_stages=3))
    for change in ({"block_n": 32}, {"num_warps": 8}):
        with pytest.raises(InvarianceError):
            check_invariance(pairs(1, **change))


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the interpreter path")
def test_a_setting_the_device_cannot_launch_is_refused_and_the_search_goes_on():
    """On an H200 an rmsnorm_glu setting asked for 276 KiB of shared memory and Triton raised OutOfResources at
    launch, which ended the whole stage. Such a setting is now one refusal among the others."""
    from triton.runtime.errors import OutOfResources

    real = tk.BY_NAME["o_proj"]

    def make(*args, **kw):
        run = real.make(*args, **kw)

        def launch(p):
            if p.num_stages == 5:
                raise OutOfResources(282624, 232448, "shared memory")
            return run(p)
        return launch

    spec = dataclasses.replace(real, make=make)
    budget = dataclasses.replace(TINY, max_kernels=1, max_settings=64)
    table = tk.tune_kernels(hand_attribution({OpClass.O_PROJ: 6.0}), SHAPE, DEVICE, [4], budget, allow_cpu=True,
                            specs=(spec,))
    assert any("num_stages': 5" in r and "shared memory" in r for r in table.refused)
    assert all(e.params.get("num_stages") != 5 for e in table.entries)


def test_step_gate_keeps_only_kernels_that_make_the_step_faster():
    """Hand-built step times: attention's entries speed the step up, o_proj's slow it (its kernel won alone)."""
    from specpilot.stages.step_gate import gate
    pairs = {"attention": (("attention@32x16@T1", "{}"),), "o_proj": (("o_proj@32x32@T1", "{}"),)}
    cost = {"attention@32x16@T1": -0.10, "o_proj@32x32@T1": +0.02}  # ms each entry adds to a 1 ms step
    measured = []

    def measure(configs):
        measured.append(len(configs))
        return [1.0 * tokens + sum(cost[k] for k, _ in table) for table, tokens in configs]
    kept, dropped, step = gate(pairs, measure, [1, 4], 1.002)
    assert kept == ["attention"]
    assert len(dropped) == 1 and dropped[0].startswith("o_proj:")
    assert step["tokens"] == [1, 4] and step["default_ms"] == [1.0, 4.0]
    assert step["tuned_ms"] == [pytest.approx(0.9), pytest.approx(3.9)]
    assert step["gain"] == pytest.approx(5.0 / 4.8)
    assert measured == [4, 4, 4, 4]  # each kernel with and without, then kept vs untuned in both orders


def test_step_gate_drops_a_table_that_only_gains_by_being_measured_first():
    """Entries that change nothing, timed by a clock where whatever is measured first reads 2% faster: each
    kernel's own judgement (kept measured first) keeps them; the both-orders check of the table drops them all."""
    from specpilot.stages.step_gate import gate
    pairs = {"qkv": (("qkv@32x16@T1", "{}"),), "down": (("down@16x32@T1", "{}"),)}

    def measure(configs):
        first = configs[0][0]
        return [tokens * (0.98 if table == first else 1.0) for table, tokens in configs]
    kept, dropped, step = gate(pairs, measure, [1, 4], 1.002)
    assert kept == [] and dropped[-1].startswith("together (qkv, down)") and len(dropped) == 1
    assert step["gain"] == 1.0 and step["tuned_ms"] == step["default_ms"] == [pytest.approx(0.99), pytest.approx(3.96)]


def test_step_options_are_kept_only_where_the_step_gains_each_on_the_table_so_far():
    from specpilot.kernels.table import with_fields
    from specpilot.stages.step_gate import try_options
    start = (("qkv@32x16@T1", '{"block_n": 16}'),)
    cost = {"producer_stat": -0.05, "prenorm": +0.01}  # ms a field set on any entry adds to a 1 ms step
    seen = []

    def measure(configs):
        seen.append([table for table, _ in configs])
        return [tokens * 1.0 + sum(c for f, c in cost.items() for _, text in table if f in json.loads(text))
                for table, tokens in configs]
    options = [(f, lambda pairs, f=f: with_fields(pairs, "qkv", 32, 16, {f: True}))
               for f in ("producer_stat", "prenorm")]
    pairs, records = try_options(start, options, measure, [1, 4], 1.002)
    assert json.loads(dict(pairs)["qkv@32x16@T1"]) == {"block_n": 16, "producer_stat": True}
    assert [r["kept"] for r in records] == [True, False]
    assert records[0]["gain"] == pytest.approx(5.0 / 4.9) and records[1]["without_ms"] == [0.95, 3.95]
    assert len(seen) == 4  # each option in both orders
    base_of_second = json.loads(dict(seen[2][-1])["qkv@32x16@T1"])  # the second option judged on top of the first
    assert base_of_second == {"block_n": 16, "producer_stat": True}


def test_tuning_runs_the_step_gate_on_a_real_engine():
    """The gate times the whole step of a Triton-backend engine (here on CPU: the path runs, timings mean
    nothing) and records its times in the table; then the step options (producer statistics, then post_scale on
    top) on that engine, each kept at a minimum gain of 0."""
    attr = hand_attribution({OpClass.ATTN: 6.0, OpClass.O_PROJ: 3.0})
    budget = dataclasses.replace(TINY, step_gate=True, min_step_gain=0.0)  # keep every kernel: nothing is faster
    table = tk.tune_kernels(attr, SHAPE, DEVICE, [1, 4], budget, allow_cpu=True)
    assert table.step["tokens"] == [1, 4] and all(v > 0 for v in table.step["tuned_ms"] + table.step["default_ms"])
    tuned = {e.kernel for e in table.entries if e.tuned_ms is not None}
    assert tuned <= {"attention", "o_proj"} and tuned
    options = table.step["options"]
    assert [o["option"] for o in options] == ["producer_stat", "post_scale"]
    assert all(o["kept"] and all(v > 0 for v in o["with_ms"]) for o in options)
    made = {e.kernel: e for e in table.entries if e.tuned_ms is None}
    assert set(made) == {"qkv", "gate_up", "lm_head"}
    assert all(e.params["producer_stat"] and e.params["post_scale"] for e in made.values())
    assert tk.KernelTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    tk.check_invariance(table.config_pairs())


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the interpreter path")
def test_the_step_gate_of_a_w12_build_times_w12_engines(monkeypatch):
    """A W12 build's table is judged on the W12 step: every engine the gate builds reads W12 weights, one set of
    kernel layouts shared by all of them (until session 31 the gate timed bf16 weights whatever the build)."""
    from specpilot.stages import step_gate

    built = []

    class Recorded(step_gate.ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(step_gate, "ModelRunner", Recorded)
    budget = dataclasses.replace(TINY, max_kernels=1, step_gate=True, step_options=False, min_step_gain=0.0)
    table = tk.tune_kernels(hand_attribution({OpClass.O_PROJ: 4.0}), SHAPE, DEVICE, [1], budget, allow_cpu=True,
                            weight_format=tk.WeightFormat.W12)
    assert table.step["tokens"] == [1] and built
    assert {r.cfg.weight_format for r in built} == {tk.WeightFormat.W12}
    assert len({id(r.fused.w12) for r in built}) == 1 and built[0].fused.w12 is not None
    built.clear()
    step_gate.step_timer(SHAPE, torch.device(DEVICE), torch.bfloat16, 32, 1, rounds=1)([((), 1)])
    assert [r.cfg.weight_format for r in built] == [tk.WeightFormat.NATIVE] and built[0].fused.w12 is None


def test_token_counts_follow_the_regime_the_build_serves():
    from specpilot.deployments import load_deployment
    from specpilot.stages.catalog import stock_candidate
    from specpilot.stages.tune_kernels import token_counts

    single = load_deployment("smollm2-135m-h200")
    assert token_counts(stock_candidate(single), single.regime.concurrency) == [1, 16]  # AR step, verify tile
    batch = load_deployment("smollm2-135m-batch-h200")
    stock = stock_candidate(batch)  # n-gram, 5 draft tokens a request: 16/20/24 and 96/120/144 tokens a step
    assert stock.config.draft_len == 5 and stock.batch_config is not None
    assert token_counts(stock, batch.regime.concurrency) == [16, 32, 96, 128, 144]  # the graph buckets they run in
    small = dataclasses.replace(stock, batch_config=dataclasses.replace(stock.batch_config, graph_max_tokens=64))
    assert token_counts(small, (16,)) == [16, 64]  # capped at the largest graph (larger steps run eagerly)
    ar = dataclasses.replace(stock, config=stock.config.replace(drafter="none"))
    assert token_counts(ar, (16, 20)) == [16, 32]


def test_coordinate_search_moves_one_field_at_a_time_within_its_budget():
    """Hand-built scores: the best setting differs from the start in block_k alone (as Llama-3-8B's projections'
    did on an H200), then improves in split_k once block_k moved; refused settings (inf) are skipped."""
    from types import SimpleNamespace

    spec = SimpleNamespace(params=SimpleNamespace(SEARCH_SPACE={"block_k": (64, 128, 256, 512), "split_k": (1, 2, 4)}))
    cost = {(64, 1): 5.0, (128, 1): 4.0, (256, 1): 3.0, (512, 1): float("inf"),
            (256, 2): 2.5, (256, 4): 2.9, (128, 2): 9.0, (128, 4): 9.0, (64, 2): 9.0, (64, 4): 9.0,
            (512, 2): 9.0, (512, 4): 9.0}
    scored = []

    def score(s):
        scored.append((s["block_k"], s["split_k"]))
        return cost[(s["block_k"], s["split_k"])]

    start = {"block_k": 128, "split_k": 1}
    assert tk._coordinate_search(spec, ["block_k", "split_k"], start, 100, score) == {"block_k": 256, "split_k": 2}
    # block_k's values first (the start scored once), then split_k's from block_k 256; a second sweep finds nothing
    assert scored[:6] == [(128, 1), (64, 1), (256, 1), (512, 1), (256, 2), (256, 4)]
    assert len(scored) == len(set(scored))  # no setting scored twice
    scored.clear()
    assert tk._coordinate_search(spec, ["block_k", "split_k"], start, 3, score) == {"block_k": 256, "split_k": 1}
    assert len(scored) == 3  # the limit counts the start
