"""The target's own output tokens, most frequent first: which rows a block drafter's LM head can keep.

The drafter's head is the target's whole LM head (SmolLM2: 49152 x 576, 56.6 MB read every draft) and its top-k
runs over the whole vocabulary. Restricted to the N tokens the target generates most often (EngineConfig
drafter_head_rows), it reads a third of that at N = 16384 while 97.9% of the target's benchmark output tokens stay
proposable (session 44's replay, scripts/replay_vocab_head.py). The ranking is counted on the sequences a training
call generated (their generated part, not the prompts) and saved beside the drafter as token_ranking.json, JSON
rather than safetensors: every *.safetensors in a drafter directory is read as weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.drafting.data import load_sequence_tensors

RANKING_FILE = "token_ranking.json"
RANKING_FORMAT = "specpilot-token-ranking/1"


class TokenRankingError(ValueError):
    pass


def generated_counts(sequence_files: list[str | Path], vocab: int) -> torch.Tensor:
    """How often each token id occurs in the generated part (after the prompt) of saved training sequences."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for f in sequence_files:
        flat, length, prompt_len = load_sequence_tensors(f, vocab)
        start = torch.cumsum(length, 0) - length
        offset = torch.arange(flat.numel()) - start.repeat_interleave(length)  # each token's place in its sequence
        counts += torch.bincount(flat[offset >= prompt_len.repeat_interleave(length)], minlength=vocab)
    return counts


def padded_counts(tokens: torch.Tensor, prompt_len: torch.Tensor, length: torch.Tensor, vocab: int) -> torch.Tensor:
    """generated_counts of right-padded sequences in memory (DraftData's tokens [N, T], prompt_len, length)."""
    t = torch.arange(tokens.shape[1], device=tokens.device)
    generated = (t >= prompt_len[:, None]) & (t < length[:, None])
    return torch.bincount(tokens[generated].long().cpu(), minlength=vocab)


def ranking_of(counts: torch.Tensor) -> list[int]:
    """Token ids that occur, most frequent first (ties: the lower id first)."""
    seen = torch.nonzero(counts > 0).flatten()
    order = torch.sort(counts[seen], descending=True, stable=True).indices  # stable: ties keep ascending ids
    return seen[order].tolist()


def save_token_ranking(drafter_dir: str | Path, counts: torch.Tensor, source: str) -> Path:
    path = Path(drafter_dir) / RANKING_FILE
    ranking = ranking_of(counts)
    path.write_text(json.dumps({"format": RANKING_FORMAT, "vocab": counts.numel(), "source": source,
                                "generated_tokens": int(counts.sum()), "ranking": ranking}))
    return path


def load_token_ranking(drafter_dir: str | Path, vocab: int) -> torch.Tensor | None:
    """The saved ranking (int64 ids, most frequent first), or None where the drafter has none."""
    path = Path(drafter_dir) / RANKING_FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        ok = isinstance(d, dict) and d.get("format") == RANKING_FORMAT
        ranking = torch.tensor(d["ranking"], dtype=torch.long) if ok else None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # JSONDecodeError is a ValueError
        raise TokenRankingError(f"{path}: unreadable token ranking: {e}") from None
    if ranking is None:
        raise TokenRankingError(f"{path}: not a {RANKING_FORMAT} file")
    if d.get("vocab") != vocab or (ranking.numel() and not 0 <= int(ranking.min()) <= int(ranking.max()) < vocab):
        raise TokenRankingError(f"{path}: ranks ids of a {d.get('vocab')}-token vocabulary, the target has {vocab}")
    if ranking.unique().numel() != ranking.numel():
        raise TokenRankingError(f"{path}: a token ranked twice")
    return ranking
