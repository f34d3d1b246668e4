"""Draft-model drafter: a smaller model sharing the target's tokenizer drafts k tokens greedily."""
from __future__ import annotations

import torch

from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.llama import LlamaModel
from specpilot.engines.runner import ModelRunner, chain_anc


class DraftModelDrafter:
    """Keeps its own KV cache in step with the committed sequence: on each call it re-feeds only the tokens
    it has not seen (the bonus token and any accepted tokens it drafted but never fed), then drafts."""

    def __init__(self, runner: ModelRunner, draft_len: int):
        if runner.topk < 1:
            raise ValueError("the draft model's runner must be built with topk >= 1 to record its distributions")
        self.runner, self.draft_len = runner, draft_len
        self.reset()

    @classmethod
    def for_target(cls, draft_model: LlamaModel | None, cfg: EngineConfig, target_vocab: int,
                   device: str | torch.device) -> DraftModelDrafter:
        """The drafter of `cfg.drafter=draft_model` over a LlamaModel sharing the target's vocabulary."""
        if draft_model is None:
            raise ConfigError("drafter=draft_model needs a draft model")
        if draft_model.shape.vocab != target_vocab:
            raise ConfigError(f"draft model vocab {draft_model.shape.vocab} != target vocab {target_vocab}")
        # The drafter runs at its fastest shapes: its outputs are only proposals, verified by the target.
        draft_cfg = cfg.replace(batch_invariant=False, compile=False)
        return cls(ModelRunner(draft_model, draft_cfg, device, block_width=16, topk=4), cfg.draft_len)

    def reset(self) -> None:
        self._fed: list[int] = []  # tokens whose KV sits in the draft cache, in order

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        k = min(self.draft_len, max_depth)
        if k <= 0:
            return DraftTree()
        valid = _common_prefix(self._fed, context)
        if valid == 0:
            out = self.runner.prefill(context)
            self._fed = list(context)
        else:
            pending = context[valid:]
            if not pending:  # everything seen: re-feed the last token to get its prediction again
                valid -= 1
                pending = context[valid:]
            out = self._feed(valid, pending)
            self._fed = list(context)
        tokens, probs, topk_t, topk_p = [], [], [], []
        for i in range(k):
            tok = out.argmax[-1]
            tokens.append(tok)
            topk_t.append(out.topk_tokens[-1])
            topk_p.append(out.topk_probs[-1])
            probs.append(topk_p[-1][0] * (probs[-1] if probs else 1.0))
            if i + 1 < k:
                out = self._feed(len(self._fed), [tok])
                self._fed.append(tok)
        return DraftTree.chain(tokens, probs, topk_tokens=topk_t, topk_probs=topk_p)

    def _feed(self, base: int, tokens: list[int]):
        n = len(tokens)
        if n > self.runner.block_width:  # a long catch-up (rare): feed it as a prefill-style chunked pass
            for s in range(0, n - 1, self.runner.block_width):
                chunk = tokens[s:min(s + self.runner.block_width, n - 1)]
                self.runner.verify(base + s, chunk, list(range(len(chunk))), chain_anc(len(chunk)))
            base, tokens = base + n - 1, tokens[-1:]
            n = 1
        return self.runner.verify(base, tokens, list(range(n)), chain_anc(n))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
