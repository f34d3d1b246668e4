"""Extension points a candidate mechanism (or an agent's code) may override. The defaults are stock.

Every hook sits where a real mechanism plugs in: tree shaping and draft depth (algorithm), acceptance and
stop handling (must stay exact: lossy overrides are what token forcing exists to catch), weight transforms
(weight formats, kernel variants) and a response cache.
"""
from __future__ import annotations

from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.llama import LlamaModel
from specpilot.engines.traces import StepTrace


class EnginePolicy:
    name = "stock"

    def begin_request(self, prompt: list[int], max_new_tokens: int) -> None:
        """A request starts (per-request state: limits, counters)."""

    def draft_depth(self, history: list[StepTrace], default: int) -> int:
        """How deep to draft this step, given this request's steps so far."""
        return default

    def shape_tree(self, tree: DraftTree) -> DraftTree:
        """Prune or reorder the drafter's proposal before verification."""
        return tree

    def accept(self, block: list[int], parents: list[int], argmax: list[int]):
        """Which drafted tokens to commit. Stock: the longest path equal to the target's argmax + a bonus."""
        from specpilot.engines.engine import greedy_accept
        return greedy_accept(block, parents, argmax)

    def commit(self, new: list[int], eos: frozenset[int], remaining: int) -> tuple[list[int], bool]:
        """Cut the step's tokens at the first EOS (inclusive) and at the token limit; (tokens, stopped)."""
        new = new[:remaining]
        for i, tok in enumerate(new):
            if tok in eos:
                return new[:i + 1], True
        return new, False

    def transform_weights(self, model: LlamaModel) -> LlamaModel:
        """Rewrite the target's weights (formats, layouts) before the runner is built. Return a new model:
        engines of one session share the loaded target, so never modify `model` in place."""
        return model

    def cached_response(self, prompt: list[int], max_new_tokens: int) -> list[int] | None:
        """A response served without decoding (a response cache), or None to decode."""
        return None


STOCK = EnginePolicy()
