"""Where in a long output a block drafter drafts well: its top-1 accuracy and top-1 chain length by the anchor's place
in the output, per drafter context window, as a table and a picture.

A drafter trained on short sequences can lose its way far into a long output (the shipped SmolLM2 one: depth-1
accuracy 0.68 at output positions 256-384, 0.30 past 1536); a context window (EngineConfig.drafter_window) that
keeps it to what it saw in training shows here as a flat line.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specpilot.drafting.replay import AnchorCandidates, Reference

POSITION_BINS = (0, 128, 256, 512, 1024, 1536)


@dataclass(frozen=True)
class PositionBin:
    start: int  # output positions [start, end) of the anchor (0: the first generated token)
    end: int | None  # None: to the end of the longest output
    anchors: int
    depth1_accuracy: float  # the block's top-1 at depth 1 equals the output's next token
    chain_length: float  # mean leading run of top-1 candidates equal to the output (draft tokens a chain accepts)


def position_accuracy(refs: list[Reference], cands: list[AnchorCandidates],
                      bins: tuple[int, ...] = POSITION_BINS) -> list[PositionBin]:
    """The drafter's top-1 candidates against each output, grouped by the anchor's output position (bins: the
    starts; the last bin runs to the end). Anchors whose block reaches past the output's end are left out."""
    if list(bins) != sorted(set(bins)) or not bins or bins[0] != 0:
        raise ValueError(f"bins={bins}: want increasing starts from 0")
    hits = [[0, 0, 0] for _ in bins]  # anchors, depth-1 hits, summed chain lengths
    for ref, cand in zip(refs, cands):
        top1 = cand.tokens[:, :, 0]  # [anchors, depth]
        depth = top1.shape[1]
        out = torch.tensor(ref.output)
        n = len(ref.output) - depth  # anchor a (the pending token output[a]) needs output[a + 1 .. a + depth]
        if n <= 0:
            continue
        truth = out.unfold(0, depth, 1)[1:n + 1]  # [n, depth]
        right = (top1[:n] == truth).int()
        chain = right.cumprod(dim=1).sum(dim=1)
        which = torch.bucketize(torch.arange(n), torch.tensor(bins), right=True) - 1
        for b in range(len(bins)):
            sel = which == b
            hits[b][0] += int(sel.sum())
            hits[b][1] += int(right[sel, 0].sum())
            hits[b][2] += int(chain[sel].sum())
    ends = list(bins[1:]) + [None]
    return [PositionBin(s, e, n, h / n if n else float("nan"), c / n if n else float("nan"))
            for s, e, (n, h, c) in zip(bins, ends, hits)]


def as_rows(bins: list[PositionBin]) -> list[dict]:
    return [asdict(b) for b in bins]


def format_table(by_window: dict[int, list[PositionBin]]) -> str:
    """One row per window: depth-1 accuracy / chain length in each position bin."""
    first = next(iter(by_window.values()))
    heads = [f"{b.start}-{'' if b.end is None else b.end}" for b in first]
    lines = ["| drafter window | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|",
             "| anchors | " + " | ".join(str(b.anchors) for b in first) + " |"]
    for window, bins in by_window.items():
        lines.append(f"| {window or 'whole context'} | "
                     + " | ".join(f"{b.depth1_accuracy:.3f} / {b.chain_length:.2f}" for b in bins) + " |")
    return "\n".join(lines)


def plot_position_accuracy(by_window: dict[int, list[PositionBin]], path: str | Path) -> Path | None:
    """A PNG of depth-1 accuracy and chain length by output position, one line per window; None where matplotlib
    is absent (bare GPU hosts)."""
    try:  # the object API with the Agg canvas: nothing touches pyplot's global backend
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    acc_ax, chain_ax = fig.subplots(1, 2)
    for window, bins in by_window.items():
        labels = [f"{b.start}-{'' if b.end is None else b.end}" for b in bins]
        name = f"window {window}" if window else "whole context"
        acc_ax.plot(labels, [b.depth1_accuracy for b in bins], marker="o", label=name)
        chain_ax.plot(labels, [b.chain_length for b in bins], marker="o", label=name)
    acc_ax.set(title="depth-1 top-1 accuracy", xlabel="output position of the anchor", ylim=(0, 1))
    chain_ax.set(title="top-1 chain: draft tokens accepted", xlabel="output position of the anchor")
    for ax in (acc_ax, chain_ax):
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
