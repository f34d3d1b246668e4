"""The agent's budget, its cost accounting from the API's `usage`, and the transcript of every exchange."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prices:
    """USD per million tokens. Defaults: Claude Sonnet list prices; set them for the model you use."""

    input_per_mtok: float = 3.0
    output_per_mtok: float = 15.0
    cache_write_per_mtok: float = 3.75
    cache_read_per_mtok: float = 0.30

    def cost(self, input_tokens: int, output_tokens: int, cache_write: int = 0, cache_read: int = 0) -> float:
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok
                + cache_write * self.cache_write_per_mtok + cache_read * self.cache_read_per_mtok) / 1e6


@dataclass(frozen=True)
class AgentBudget:
    max_turns: int = 12  # Messages API calls per session
    max_cost_usd: float = 2.0
    max_output_tokens: int = 4096  # per call

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_cost_usd <= 0 or self.max_output_tokens < 1:
            raise ValueError(f"{self}: turns, cost and output tokens must all be positive")


class CostMeter:
    """Tokens and dollars spent so far in one session."""

    def __init__(self, prices: Prices):
        self.prices = prices
        self.input_tokens = self.output_tokens = self.cache_write = self.cache_read = 0
        self.last_input_tokens = 0

    def add(self, usage: Any) -> None:
        self.last_input_tokens = int(usage.input_tokens) + int(getattr(usage, "cache_read_input_tokens", 0) or 0) \
            + int(getattr(usage, "cache_creation_input_tokens", 0) or 0)
        self.input_tokens += int(usage.input_tokens)
        self.output_tokens += int(usage.output_tokens)
        self.cache_write += int(getattr(usage, "cache_creation_input_tokens", 0) or 0)
        self.cache_read += int(getattr(usage, "cache_read_input_tokens", 0) or 0)

    @property
    def cost_usd(self) -> float:
        return self.prices.cost(self.input_tokens, self.output_tokens, self.cache_write, self.cache_read)

    def next_call_bound(self, max_output_tokens: int) -> float:
        """What the next call costs at least on input (the conversation only grows) and at most on output."""
        return self.prices.cost(self.last_input_tokens, max_output_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cache_write_tokens": self.cache_write, "cache_read_tokens": self.cache_read,
                "cost_usd": round(self.cost_usd, 6), "prices_per_mtok": vars(self.prices)}


class Transcript:
    """One directory per session: NNN-request.json, NNN-response.json, NNN-tools.json, session.json."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=False)

    def _write(self, name: str, body: Any) -> Path:
        path = self.dir / name
        path.write_text(json.dumps(body, indent=1, default=str))
        return path

    def request(self, turn: int, body: dict[str, Any]) -> Path:
        return self._write(f"{turn:03d}-request.json", body)

    def response(self, turn: int, body: dict[str, Any]) -> Path:
        return self._write(f"{turn:03d}-response.json", body)

    def tools(self, turn: int, calls: list[dict[str, Any]]) -> Path:
        return self._write(f"{turn:03d}-tools.json", calls)

    def error(self, turn: int, body: dict[str, Any]) -> Path:
        return self._write(f"{turn:03d}-error.json", body)

    def session(self, body: dict[str, Any]) -> Path:
        return self._write("session.json", body)
