"""The lossy suite: deliberately lossy candidates that token forcing must reject, every one of them.

Each is an EnginePolicy subclass overriding one real extension point the way a buggy or cheating mechanism
would (acceptance, stop handling, weight transforms, a response cache), so `Candidate(policy=
'specpilot.stages.lossy:ClassName')` loads it like any explorer's candidate. Several are subtle on purpose:
they agree with stock on most tokens and differ only where drafts are rejected, near ties, or past a stop.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from specpilot.engines.config import EngineConfig
from specpilot.engines.engine import Acceptance, greedy_accept
from specpilot.engines.llama import LlamaModel
from specpilot.engines.policy import EnginePolicy
from specpilot.stages.candidate import Candidate, CandidateSource


def _first_child(parents: list[int], node: int) -> int | None:
    return next((i for i in range(node + 1, len(parents)) if parents[i] == node), None)


def _with_modules(model: LlamaModel, **modules: nn.Module) -> LlamaModel:
    """A shallow copy sharing every tensor with `model` except the named submodules: a new model without
    copying the weights, and without touching the shared original (its module table is not the copy's)."""
    out = copy.copy(model)
    out._modules = dict(model._modules)
    for name, module in modules.items():
        setattr(out, name, module)
    return out


class AcceptWithoutVerifying(EnginePolicy):
    """Commits every drafted token of the first chain, matching the target or not, plus a bonus token."""

    name = "accept_without_verifying"

    def accept(self, block: list[int], parents: list[int], argmax: list[int]) -> Acceptance:
        path = [0]
        while (child := _first_child(parents, path[-1])) is not None:
            path.append(child)
        return Acceptance(path, [block[i] for i in path[1:]] + [argmax[path[-1]]])


class OffByOneAcceptance(EnginePolicy):
    """Accepts one draft token past the first mismatch (the classic `<=` for `<` bug in the accept loop)."""

    name = "off_by_one_acceptance"

    def accept(self, block: list[int], parents: list[int], argmax: list[int]) -> Acceptance:
        acc = greedy_accept(block, parents, argmax)
        extra = _first_child(parents, acc.path[-1])
        if extra is None:
            return acc
        path = acc.path + [extra]
        return Acceptance(path, [block[i] for i in path[1:]] + [argmax[extra]])


class SwapBonusForDraft(EnginePolicy):
    """Greedy on the wrong logits: where the target rejects a draft token, commits that draft token (the
    runner-up candidate) instead of the target's own argmax, but keeps the verified prefix."""

    name = "swap_bonus_for_draft"

    def accept(self, block: list[int], parents: list[int], argmax: list[int]) -> Acceptance:
        acc = greedy_accept(block, parents, argmax)
        rejected = _first_child(parents, acc.path[-1])
        if rejected is None:
            return acc
        return Acceptance(acc.path, acc.tokens[:-1] + [block[rejected]])


class DropAcceptedToken(EnginePolicy):
    """Tokens skipped, KV committed: the accepted path's KV is kept, but the last accepted draft token is left
    out of the output (the bonus token takes its place), as a miscounted commit offset would do."""

    name = "drop_accepted_token"

    def accept(self, block: list[int], parents: list[int], argmax: list[int]) -> Acceptance:
        acc = greedy_accept(block, parents, argmax)
        if len(acc.path) < 2:  # nothing accepted: keep the bonus token so decoding still progresses
            return acc
        return Acceptance(acc.path, acc.tokens[:-2] + acc.tokens[-1:])


class TruncateOutput(EnginePolicy):
    """Stops early once the output is past half the token limit, reporting it as a normal stop."""

    name = "truncate_output"

    def __init__(self) -> None:
        self._limit = 0

    def begin_request(self, prompt: list[int], max_new_tokens: int) -> None:
        self._limit = max_new_tokens

    def commit(self, new: list[int], eos: frozenset[int], remaining: int) -> tuple[list[int], bool]:
        new, stopped = super().commit(new, eos, remaining)
        produced = self._limit - remaining + len(new)
        return new, stopped or produced > self._limit // 2


class IgnoreEOS(EnginePolicy):
    """Changed stop handling: runs past EOS to the token limit."""

    name = "ignore_eos"

    def commit(self, new: list[int], eos: frozenset[int], remaining: int) -> tuple[list[int], bool]:
        return new[:remaining], False


class StopAtRepeatedToken(EnginePolicy):
    """Stops at a different token: treats any frequent token (one already seen in the prompt or the output,
    like a newline or a period) as EOS."""

    name = "stop_at_repeated_token"

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def begin_request(self, prompt: list[int], max_new_tokens: int) -> None:
        self._seen = set(prompt)  # what counts as "seen" is this request's prompt

    def commit(self, new: list[int], eos: frozenset[int], remaining: int) -> tuple[list[int], bool]:
        new, stopped = super().commit(new, eos, remaining)
        for i, tok in enumerate(new):
            if tok in self._seen:
                return new[:i + 1], True
            self._seen.add(tok)
        return new, stopped


def round_to_significant_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """A new tensor: each value rounded to `bits` significant mantissa bits (sign and exponent kept)."""
    mantissa, exponent = torch.frexp(t.float())  # |mantissa| in [0.5, 1)
    scale = float(2 ** bits)
    return torch.ldexp(torch.round(mantissa * scale) / scale, exponent).to(t.dtype)


class RoundWeights4Bit(EnginePolicy):
    """Lossy weights: every weight rounded to 4 significant bits (a copy of the model; the original is shared)."""

    name = "round_weights_4bit"

    def transform_weights(self, model: LlamaModel) -> LlamaModel:
        out = copy.deepcopy(model)
        with torch.no_grad():
            for p in out.parameters():
                p.copy_(round_to_significant_bits(p, 4))
        return out


class PerturbLMHead(EnginePolicy):
    """Subtly perturbed weights: 1e-3 relative Gaussian noise on the LM head only (seeded). With tied
    embeddings the copy gets its own head, so the input embeddings stay exact."""

    name = "perturb_lm_head"
    relative_noise = 1e-3

    def transform_weights(self, model: LlamaModel) -> LlamaModel:
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        gen = torch.Generator(device=weight.device).manual_seed(0)
        noise = torch.randn(weight.shape, generator=gen, device=weight.device, dtype=torch.float32)
        perturbed = (weight.float() * (1.0 + self.relative_noise * noise)).to(weight.dtype)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(perturbed, requires_grad=False)
        return _with_modules(model, lm_head=head)


class SkipLastLayer(EnginePolicy):
    """Layer skipping without verification: the target runs without its last decoder layer (a faster,
    different model)."""

    name = "skip_last_layer"

    def transform_weights(self, model: LlamaModel) -> LlamaModel:
        return _with_modules(model, layers=nn.ModuleList(list(model.layers)[:-1]))


class ReplayCachedOutputs(EnginePolicy):
    """Replays memorised outputs: serves the output recorded for the most similar primed prompt (token-set
    Jaccard similarity) without decoding. `prime` is an explorer overfitting its tune prompts; on those it
    is exact and infinitely fast, on held-out prompts it is wrong."""

    name = "replay_cached_outputs"

    def __init__(self) -> None:
        self._cache: list[tuple[frozenset[int], tuple[int, ...]]] = []

    def prime(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        if len(prompts) != len(outputs):
            raise ValueError(f"prime needs one output per prompt ({len(prompts)} prompts, {len(outputs)} outputs)")
        self._cache += [(frozenset(p), tuple(o)) for p, o in zip(prompts, outputs)]

    def cached_response(self, prompt: list[int], max_new_tokens: int) -> list[int] | None:
        if not self._cache:
            return None
        ids = frozenset(prompt)
        _, output = max(self._cache, key=lambda entry: len(ids & entry[0]) / max(1, len(ids | entry[0])))
        return list(output[:max_new_tokens])


LOSSY_POLICIES: tuple[type[EnginePolicy], ...] = (
    AcceptWithoutVerifying, OffByOneAcceptance, SwapBonusForDraft, DropAcceptedToken, TruncateOutput, IgnoreEOS,
    StopAtRepeatedToken, RoundWeights4Bit, PerturbLMHead, SkipLastLayer, ReplayCachedOutputs,
)


def lossy_candidates(base: EngineConfig, drafter_label: str | None = None) -> list[Candidate]:
    """The suite as candidates on `base` (its drafter supplies the drafts the acceptance bugs mishandle)."""
    return [Candidate(name=f"lossy:{cls.name}", config=base, policy=f"{__name__}:{cls.__name__}",
                      mechanisms=(cls.name,), source=CandidateSource.LOSSY_SUITE, drafter_label=drafter_label)
            for cls in LOSSY_POLICIES]
