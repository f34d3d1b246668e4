"""Recorded Messages API responses served through the anthropic client's own HTTP transport (httpx2, which
anthropic 2.x uses): no network, and every request body the client sends is kept for the test to inspect."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx2

DATA = Path(__file__).parent / "data"


class Replay:
    """Serves the recorded responses of one directory under tests/data in order and keeps each request body."""

    def __init__(self, name: str):
        self.responses = sorted((DATA / name).glob("*.json"))
        self.requests: list[dict] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        assert request.method == "POST" and request.url.path == "/v1/messages"
        self.requests.append(json.loads(request.content))
        body = json.loads(self.responses[len(self.requests) - 1].read_text())
        return httpx2.Response(200, json=body)

    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(api_key="recorded", max_retries=0,
                                   http_client=httpx2.Client(transport=httpx2.MockTransport(self)))

    def tool_results(self, turn: int) -> dict[str, tuple[dict, bool]]:
        """tool_use_id -> (parsed content, is_error) of the tool results sent with request `turn`."""
        last = self.requests[turn]["messages"][-1]
        return {r["tool_use_id"]: (json.loads(r["content"]), r.get("is_error", False)) for r in last["content"]}
