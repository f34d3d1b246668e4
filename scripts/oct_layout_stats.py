"""The oct kernel layout (specpilot/weights/oct.py) on SmolLM2-135M's matrices, on CPU: every matrix decoded back
and compared bit for bit, then escapes and bytes per weight against W12's own arrays, and how escapes cluster over
(row, 256-block) cells.

python scripts/oct_layout_stats.py
"""
from __future__ import annotations

import time

import torch

from specpilot.engines.loader import load_model
from specpilot.testbed import fetch_smollm2
from specpilot.weights import bitwise_equal, encode
from specpilot.weights.oct import BLOCK, WINDOW, decode_oct, oct_layout


def cell_escapes(t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Escapes (elements outside the row's window) per (row, 256-block) cell, int64 [N, Kp/256]."""
    d = ((t.view(torch.int16).to(torch.int64) >> 7) & 0xFF) - base[:, None].to(torch.int64)
    out = ((d < 0) | (d >= WINDOW)).to(torch.int64)
    K = t.shape[1]
    out = torch.nn.functional.pad(out, (0, -(-K // BLOCK) * BLOCK - K))
    return out.view(t.shape[0], -1, BLOCK).sum(2)


def main() -> int:
    model = load_model(fetch_smollm2(), torch.bfloat16, "cpu")
    t0 = time.time()
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        w = encode(p.data)
        lay = oct_layout(w)
        if not bitwise_equal(decode_oct(lay), p.data):
            raise SystemExit(f"{name}: the oct layout does not decode to the weights")
        g = groups.setdefault("embedding / LM head" if "embed" in name else "projections",
                              [0, 0, 0, 0, 0, torch.zeros(4, dtype=torch.int64), 0])
        counts = cell_escapes(p.data, lay.base).flatten()
        if not torch.equal(counts > 0, (lay.fat_cells >= 0).flatten()):
            raise SystemExit(f"{name}: correction words do not match the cells with escapes")
        g[0] += p.numel()
        g[1] += lay.escapes
        g[2] += w.stats.escapes
        g[3] += lay.kernel_bytes
        g[4] += w.stats.kernel_bytes
        g[5] += torch.bincount(counts.clamp(max=3), minlength=4)
        g[6] = max(g[6], int(counts.max()))
    print(f"every matrix exact ({time.time() - t0:.0f} s)")
    print("| matrices | weights | oct escapes | W12 escapes | oct bytes/weight | W12 bytes/weight | cells with 0/1/2/3+ "
          "escapes | most in a cell |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (n, e, e12, kb, kb12, hist, most) in groups.items():
        frac = " / ".join(f"{x:.3f}" for x in (hist / hist.sum()).tolist())
        print(f"| {k} | {n} | {e / n:.2e} | {e12 / n:.2e} | {kb / n:.4f} | {kb12 / n:.4f} | {frac} | {most} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
