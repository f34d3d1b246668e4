"""Token forcing (stages/validate) against real engines over a tiny random Llama, and the lossy suite it must reject."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

from specpilot.bench.session import TokenizedPrompt
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, DType, EngineConfig
from specpilot.engines.engine import SpecEngine
from specpilot.engines.llama import LlamaModel
from specpilot.engines.loader import random_model
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.shapes import LlamaShape
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.lossy import (LOSSY_POLICIES, PerturbLMHead, ReplayCachedOutputs, RoundWeights4Bit,
                                    SkipLastLayer, lossy_candidates)
from specpilot.stages.validate import (DivergenceKind, Verdict, VerdictKind, read_verdict, validate, write_verdict)
from specpilot.workload import Benchmark, Prompt

SHAPE = LlamaShape(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, rms_eps=1e-6,
                   rope_theta=10000.0, tie_embeddings=False)
TWINS = 64  # tokens 0..63 get near-duplicate twins 448..511, as real vocabularies have (' the' / 'the')
MAX_NEW = 40
EPS = 1e-6
BASE = EngineConfig(dtype=DType.FP32, cuda_graphs=False, max_seq_len=128)  # the stock build: n-gram, k=5
STOCK_BUILD = Candidate("stock", BASE, source=CandidateSource.STOCK)


class TinyDeployment:
    """A real engine factory over a tiny model, like DeploymentSession: one shared target (and a draft model
    made of its first layer), engines cached per (config, drafter, policy instance)."""

    def __init__(self, target: LlamaModel, draft: LlamaModel, eos: frozenset[int]):
        self.target, self.draft, self.eos, self.device = target, draft, eos, "cpu"
        self._engines: dict[tuple[str, str, int], SpecEngine] = {}
        self._policies: list[EnginePolicy] = []  # keeps policy ids unique while engines live

    def engine(self, cfg: EngineConfig, drafter_label: str | None = None, policy: EnginePolicy = STOCK) -> SpecEngine:
        key = (cfg.digest(), drafter_label or "", id(policy))
        if key not in self._engines:
            self._policies.append(policy)
            draft = self.draft if cfg.drafter is DrafterKind.DRAFT_MODEL else None
            self._engines[key] = build_engine(cfg, self.target, self.eos, self.device, draft_model=draft, policy=policy)
        return self._engines[key]


@dataclass(frozen=True)
class World:
    deployment: TinyDeployment
    tune: tuple[TokenizedPrompt, ...]
    held_out: tuple[TokenizedPrompt, ...]
    stock_outputs: dict[str, list[int]]  # per prompt key, under the chosen EOS


def tiny_target() -> LlamaModel:
    model = random_model(SHAPE, torch.float32, "cpu", seed=0)
    with torch.no_grad():
        # At std 0.02 a random model's next token barely depends on context (outputs fall into short loops):
        # larger embeddings and layer weights make the output vary with the prompt.
        model.embed_tokens.weight.mul_(10)
        for name, p in model.named_parameters():
            if name.startswith("layers.") and not name.endswith("norm.weight"):
                p.mul_(3)
        gen = torch.Generator().manual_seed(1)
        head = model.lm_head.weight
        head[-TWINS:] = head[:TWINS] * (1 + 1e-3 * torch.randn(TWINS, SHAPE.hidden, generator=gen))
    return model


def first_layer_draft(target: LlamaModel) -> LlamaModel:
    draft = LlamaModel(dataclasses.replace(SHAPE, layers=1))
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("layers.1.")})
    return draft.eval().requires_grad_(False)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(one_thread) -> World:
    target = tiny_target()
    gen = torch.Generator().manual_seed(2)
    prompts = [TokenizedPrompt(Prompt(Benchmark.GSM8K, str(i), f"prompt {i}"),
                               tuple(torch.randint(0, SHAPE.vocab, (40,), generator=gen).tolist())) for i in range(10)]
    tune, held_out = tuple(prompts[:4]), tuple(prompts[4:])
    # EOS: a token that one held-out output first reaches mid-way and no other output contains, so one
    # prompt stops at EOS (stop handling matters) and the others run the full length.
    ar = build_engine(BASE.replace(drafter=DrafterKind.NONE), target, frozenset(), "cpu")
    free = [ar.generate(list(p.ids), MAX_NEW).tokens for p in held_out]
    half = MAX_NEW // 2
    eos = next(t for out in free for t in out[half:] if t not in out[:half] and sum(t in o for o in free) == 1)
    deployment = TinyDeployment(target, first_layer_draft(target), frozenset({eos}))
    stock = deployment.engine(BASE)
    outputs = {p.key: stock.generate(list(p.ids), MAX_NEW).tokens for p in tune + held_out}
    return World(deployment, tune, held_out, outputs)


def check(world: World, candidate: Candidate, eps: float = EPS, prompts=None, **kw) -> Verdict:
    return validate(world.deployment, STOCK_BUILD, candidate, list(prompts or world.held_out), MAX_NEW, eps, **kw)


def test_the_tiny_model_is_not_degenerate(world):
    outs = [world.stock_outputs[p.key] for p in world.held_out]
    assert all(len(set(o)) >= 4 for o in outs if len(o) >= 8), "an output collapsed to a repeated token"
    assert len({tuple(o[:8]) for o in outs}) == len(outs)
    eos = next(iter(world.deployment.eos))
    assert sum(o[-1] == eos for o in outs) == 1 and sum(len(o) == MAX_NEW for o in outs) == len(outs) - 1
    ar = world.deployment.engine(BASE.replace(drafter=DrafterKind.NONE))
    assert all(ar.generate(list(p.ids), MAX_NEW).tokens == world.stock_outputs[p.key] for p in world.held_out)


def test_stock_against_itself_passes_three_times(world):
    separately_built = EnginePolicy()  # a second stock policy instance: the factory builds a second engine
    for policy in (None, None, separately_built):
        v = check(world, STOCK_BUILD, candidate_policy=policy)
        assert v.kind is VerdictKind.PASS and v.divergences == () and v.ties == () and v.first_divergence is None
        assert v.speedup.remeasured is None and v.reasons == ()
        for row, margins in zip(v.prompts, v.margins):  # every position's margin is logged, for both builds
            assert len(margins.stock) == len(margins.candidate) == row.stock_tokens == row.candidate_tokens
            assert margins.stock == margins.candidate and row.min_stock_margin == min(margins.stock) > 0


@pytest.mark.parametrize("delta", [dict(draft_len=2), dict(draft_len=12, ngram_max=2),
                                   dict(drafter=DrafterKind.DRAFT_MODEL, draft_len=4),
                                   dict(drafter=DrafterKind.NONE)], ids=["ngram-k2", "ngram-k12", "draft-model", "ar"])
def test_lossless_candidates_pass(world, delta):
    cfg = BASE.replace(**delta)
    v = check(world, Candidate("lossless", cfg))
    assert v.kind is VerdictKind.PASS, v.reasons
    assert v.forced_flips == 0 and all(r.first_divergence is None for r in v.prompts)
    if cfg.speculative:  # the candidate really speculated: some drafted tokens were accepted
        engine = world.deployment.engine(cfg)
        assert any(s.accepted > 0 for p in world.held_out for s in engine.generate(list(p.ids), MAX_NEW).steps)


def test_the_suite_is_large_and_loadable():
    suite = lossy_candidates(BASE)
    assert len(suite) == len(LOSSY_POLICIES) >= 8 and len({c.name for c in suite}) == len(suite)
    assert all(c.source is CandidateSource.LOSSY_SUITE and type(c.load_policy()) in LOSSY_POLICIES for c in suite)


@pytest.mark.parametrize("cls", [RoundWeights4Bit, PerturbLMHead, SkipLastLayer], ids=lambda c: c.name)
def test_weight_transforms_return_a_new_model_and_leave_the_shared_one_alone(cls):
    target = tiny_target()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    changed = cls().transform_weights(target)
    assert changed is not target and len(target.layers) == SHAPE.layers and target.lm_head is not None
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    after = changed.state_dict()
    assert any(k not in after or not torch.equal(v, after[k]) for k, v in before.items())


def suite_member(cls: type[EnginePolicy]) -> Candidate:
    return next(c for c in lossy_candidates(BASE) if c.policy.endswith(":" + cls.__name__))


def loaded_policy(world: World, candidate: Candidate) -> EnginePolicy:
    """The candidate as the explorer left it: the replay cheat has memorised stock outputs on the tune prompts."""
    policy = candidate.load_policy()
    if isinstance(policy, ReplayCachedOutputs):
        policy.prime([p.ids for p in world.tune], [world.stock_outputs[p.key] for p in world.tune])
    return policy


@pytest.mark.parametrize("candidate", lossy_candidates(BASE), ids=lambda c: c.name.split(":")[1])
def test_every_lossy_candidate_is_rejected(world, candidate):
    v = check(world, candidate, candidate_policy=loaded_policy(world, candidate))
    assert v.kind is not VerdictKind.PASS
    first = v.first_divergence
    assert first is not None and v.to_dict()["first_divergence"] == first.to_dict() and v.reasons
    if first.kind is DivergenceKind.FREE_RUNNING:  # it names the stock token the candidate got wrong
        stock_out = world.stock_outputs[first.prompt]
        assert first.stock_token == (stock_out[first.index] if first.index < len(stock_out) else None)
        assert first.stock_token != first.candidate_token


def test_forced_mode_catches_the_flip_free_running_sees(world):
    candidate = suite_member(RoundWeights4Bit)
    v = check(world, candidate)
    assert v.kind is VerdictKind.FAIL
    free = [d for d in v.divergences if d.kind is DivergenceKind.FREE_RUNNING]
    assert free
    for d in free:  # same context up to the first divergence: forced mode flips at exactly that index
        forced = [f for f in v.divergences if f.kind is DivergenceKind.FORCED and f.prompt == d.prompt]
        assert forced and (forced[0].index, forced[0].candidate_token) == (d.index, d.candidate_token)
    # ...and keeps checking on the stock sequence, so flips after each first divergence are found too.
    assert v.forced_flips > len(free)


def test_ties_are_classified_with_a_hand_set_epsilon(world, tmp_path):
    candidate = suite_member(PerturbLMHead)
    strict = check(world, candidate, eps=0.0)
    flips = [d for d in strict.divergences if d.kind is DivergenceKind.FORCED]
    assert strict.kind is VerdictKind.FAIL and flips and strict.ties == ()
    closeness = sorted(max(d.stock_margin, d.candidate_margin) for d in flips)
    # The flips are twin swaps: both builds rank the same two tokens first and second.
    assert all(d.candidate_runner_up == d.stock_token and d.stock_runner_up == d.candidate_token for d in flips)

    loose = check(world, candidate, eps=closeness[-1])
    assert loose.kind is VerdictKind.TIE  # never a silent PASS
    assert [(d.prompt, d.index) for d in loose.ties] == [(d.prompt, d.index) for d in flips]
    assert all(d.tie for d in loose.divergences)  # every output mismatch is explained by a tie at its index
    write_verdict(loose, tmp_path)
    assert len((tmp_path / "ties.jsonl").read_text().splitlines()) == len(flips)

    middle = (closeness[0] + closeness[-1]) / 2
    mixed = check(world, candidate, eps=middle)
    assert mixed.kind is VerdictKind.FAIL and 0 < len(mixed.ties) < len(flips)
    assert all(d.tie == (max(d.stock_margin, d.candidate_margin) <= middle)
               for d in mixed.divergences if d.kind is DivergenceKind.FORCED)


def test_replayed_outputs_pass_on_tune_prompts_only_and_their_speedup_is_remeasured(world):
    candidate = suite_member(ReplayCachedOutputs)
    policy = loaded_policy(world, candidate)
    seen = check(world, candidate, prompts=world.tune, candidate_policy=policy)
    assert seen.kind is VerdictKind.PASS  # on what it memorised the cheat is exact: why validate needs held-out prompts
    held_out = check(world, candidate, candidate_policy=policy)
    assert held_out.kind is VerdictKind.FAIL and held_out.first_divergence.index == 0
    for v in (seen, held_out):
        assert v.speedup.geomean > 20 and v.speedup.remeasured is not None and v.speedup.remeasured_geomean > 20
        assert any("re-measured" in r for r in v.reasons)
    assert {d.prompt for d in held_out.divergences if d.kind is DivergenceKind.RERUN} == \
           {d.prompt for d in held_out.divergences if d.kind is DivergenceKind.FREE_RUNNING}


def test_verdict_json_round_trip(world, tmp_path):
    v = check(world, suite_member(PerturbLMHead), eps=1e-3)
    assert v.divergences and v.margins
    assert Verdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    path = write_verdict(v, tmp_path / "out")
    assert path.name == "verdict.json" and "margins" not in json.loads(path.read_text())
    assert read_verdict(tmp_path / "out") == v
    ties = [json.loads(line) for line in (tmp_path / "out" / "ties.jsonl").read_text().splitlines()]
    assert ties == [d.to_dict() for d in v.ties]


def test_bad_arguments_are_refused(world):
    with pytest.raises(ValueError, match="held-out prompt"):
        validate(world.deployment, STOCK_BUILD, STOCK_BUILD, [], MAX_NEW, EPS)
    with pytest.raises(ValueError, match="tie_epsilon"):
        validate(world.deployment, STOCK_BUILD, STOCK_BUILD, list(world.held_out), MAX_NEW, -1.0)


@pytest.mark.slow
def test_smollm2_ngram_passes_and_lossy_candidates_fail():
    from specpilot.bench.session import DeploymentSession
    from specpilot.deployments import load_deployment
    from specpilot.stages.lossy import AcceptWithoutVerifying
    from specpilot.testbed import cache_dir

    if not (cache_dir() / "models" / "smollm2-135m" / "model.safetensors").is_file():
        pytest.skip("the SmolLM2-135M testbed is not cached (specpilot testbed fetch)")
    deployment = load_deployment("smollm2-135m-cpu")
    session = DeploymentSession(deployment)
    prompts = session.tokenize(deployment.workload.select().validate[:2])
    stock = Candidate("stock", deployment.drafters[0].engine_config(deployment.engine), source=CandidateSource.STOCK)
    run = lambda c: validate(session, stock, c, prompts, 24, 1e-3)  # noqa: E731
    assert run(Candidate("ngram-k3", stock.config.replace(draft_len=3))).kind is VerdictKind.PASS
    for cls in (AcceptWithoutVerifying, RoundWeights4Bit):
        lossy = next(c for c in lossy_candidates(stock.config) if c.policy.endswith(":" + cls.__name__))
        v = run(lossy)
        assert v.kind is not VerdictKind.PASS and v.first_divergence is not None, cls.__name__
