"""Kernel launch tables: which LaunchParams each fused kernel runs with, per (kernel, N x K, token count).

EngineConfig.kernel_table holds (f"{kernel}@{N}x{K}@T{t}", params JSON) pairs, written by the kernel tuner
(stages/tune_kernels.py) and read by the fused forward through `LaunchTable`. Fields outside a params class's
T_NEUTRAL set the reduction order, so every T of one shape must agree on them (check_invariance). A T without
its own entry takes the entry of the nearest tuned T that spans as many 16-row tiles (the same programs doing the
same work, only masked differently: the profile's verify width, say 6, runs what T=1 or T=16 was tuned for); a T
with no such neighbour gets the shape's order-setting fields with default T-neutral ones. Either way a table never
makes a token count reduce differently from another.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from ._common import BLOCK_M
from .accept import AcceptParams
from .attn import AttentionParams
from .gemm import LinearParams
from .norm_gemm import RMSNormLinearParams

# The fused forward's kernels by the names tables use, and the params class each one takes (rotary and SwiGLU run
# in the qkv and gate_up epilogues: no launch of their own to tune); then the block drafter's fused step's
# projections (engines/drafters/block_fused.DraftLaunches: draft_<field>@NxK@T<rows>, the drafter's own shapes).
PARAMS: dict[str, type] = {
    "qkv": RMSNormLinearParams, "gate_up": RMSNormLinearParams, "lm_head": RMSNormLinearParams,
    "o_proj": LinearParams, "down": LinearParams, "attention": AttentionParams, "greedy_accept": AcceptParams,
    "draft_qkv": RMSNormLinearParams, "draft_o_proj": LinearParams, "draft_gate_up": RMSNormLinearParams,
    "draft_down": LinearParams, "draft_head": RMSNormLinearParams,
}

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down", "lm_head")  # the launches whose weights a weight format stores


class KernelTableError(ValueError):
    """A malformed key, an unknown kernel, or invalid params."""


class InvarianceError(KernelTableError):
    """Order-setting fields that differ across the token counts of one shape."""


def table_key(kernel: str, n: int, k: int, tokens: int) -> str:
    return f"{kernel}@{n}x{k}@T{tokens}"


def parse_key(key: str) -> tuple[str, int, int, int]:
    try:
        kernel, nk, t = key.split("@")
        n, k = nk.split("x")
        return kernel, int(n), int(k), int(t.removeprefix("T"))
    except ValueError:
        raise KernelTableError(f"kernel table key {key!r} is not kernel@NxK@Tt") from None


def order_fields(kernel: str, params: dict[str, Any]) -> dict[str, Any]:
    """The fields of `params` that set the reduction order (not T-neutral)."""
    neutral = PARAMS[kernel](**params).t_neutral()  # a setting may make more fields numerics (row_tile=1)
    return {k: v for k, v in params.items() if k not in neutral}


def numerics_only(pairs: Sequence[tuple[str, str]], kernels: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`pairs` with the entries of `kernels` cut to the fields that set their numerics (order_fields): their
    T-neutral launch shape (tile width, warps, stages, register cap) was chosen for other inputs, e.g. the weights of
    another weight format, and falls back to the defaults; the bits stay the table's."""
    def cut(key: str, text: str) -> str:
        kernel = parse_key(key)[0]
        return json.dumps(order_fields(kernel, json.loads(text)), sort_keys=True) if kernel in kernels else text
    return tuple((key, cut(key, text)) for key, text in pairs)


def read_pairs(path: str | Path) -> tuple[tuple[str, str], ...]:
    """The (key, params JSON) pairs of a kernel-table file: a tuner's summary.json (its kernel_table) or a list of
    [key, params JSON] pairs."""
    raw = json.loads(Path(path).read_text())
    return tuple(tuple(p) for p in (raw["kernel_table"] if isinstance(raw, dict) else raw))


def check_invariance(pairs: Sequence[tuple[str, str]]) -> None:
    """Every entry is a valid LaunchParams, and the fields that set numerics agree across the T of a shape."""
    seen: dict[tuple[str, int, int], dict[str, Any]] = {}
    for key, text in pairs:
        kernel, n, k, _ = parse_key(key)
        if kernel not in PARAMS:
            raise KernelTableError(f"{key}: unknown kernel {kernel!r} (known: {', '.join(PARAMS)})")
        params = json.loads(text)
        try:
            PARAMS[kernel](**params)  # validates the values
        except (TypeError, ValueError) as e:
            raise KernelTableError(f"{key}: {e}") from None
        fixed = order_fields(kernel, params)
        if seen.setdefault((kernel, n, k), fixed) != fixed:
            raise InvarianceError(f"{key}: {fixed} breaks batch invariance; other T of {kernel}@{n}x{k} use "
                                   f"{seen[(kernel, n, k)]}")


def launch_params(pairs: Sequence[tuple[str, str]], kernel: str, n: int, k: int, tokens: int) -> dict[str, Any] | None:
    """What the engine launches `kernel` with at (N, K, T): the entry for T; else the entry of the nearest T (the
    smaller on a tie) with as many 16-row tiles; else, if the shape has entries, their numerics-setting fields with
    default T-neutral ones (they hold for every T); else None (defaults)."""
    rows = {parse_key(key)[3]: json.loads(text) for key, text in pairs if parse_key(key)[:3] == (kernel, n, k)}
    if tokens in rows:
        return rows[tokens]
    if not rows:
        return None
    tiles = -(-tokens // BLOCK_M)
    same_tiles = sorted((abs(t - tokens), t) for t in rows if -(-t // BLOCK_M) == tiles)
    if same_tiles and next(iter(rows.values())).get("row_tile", BLOCK_M) == BLOCK_M:
        return rows[same_tiles[0][1]]
    return dataclasses.asdict(PARAMS[kernel](**order_fields(kernel, next(iter(rows.values())))))


def with_fields(pairs: Sequence[tuple[str, str]], kernel: str, n: int, k: int,
                fields: dict[str, Any], tokens: int | None = None) -> tuple[tuple[str, str], ...]:
    """`pairs` with `fields` set on every entry of kernel@NxK (each T it has; a T=1 entry where it has none, whose
    order-setting fields then hold for every T), or with `tokens` on that T's entry only (made if missing), checked
    (check_invariance)."""
    table = dict(pairs)
    keys = ([table_key(kernel, n, k, tokens)] if tokens is not None else
            [key for key in table if parse_key(key)[:3] == (kernel, n, k)] or [table_key(kernel, n, k, 1)])
    for key in keys:
        table[key] = json.dumps({**json.loads(table.get(key, "{}")), **fields}, sort_keys=True)
    out = tuple(table.items())
    check_invariance(out)
    return out


@dataclasses.dataclass(frozen=True)
class LaunchTable:
    """A validated kernel table the fused forward asks at trace time (T is static inside a captured graph)."""

    pairs: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_invariance(self.pairs)

    def get(self, kernel: str, n: int, k: int, tokens: int, **defaults: Any) -> dict[str, Any]:
        """Keyword arguments for the kernel's wrapper: `defaults` overridden by the table's entry."""
        found = launch_params(self.pairs, kernel, n, k, tokens) if self.pairs else None
        return defaults | (found or {})
