"""The agent's tools: their Messages API schemas, the proposals they carry, and checks done without running code."""
from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from specpilot.costmodel import Attribution
from specpilot.engines.config import knob_schema
from specpilot.engines.policy import EnginePolicy

MAX_CODE_CHARS = 20_000
TOP_GAPS = 5


class ToolName(str, Enum):
    READ_ATTRIBUTION = "read_attribution"
    READ_TRACES = "read_traces"
    LIST_KNOBS = "list_knobs"
    TRY_CANDIDATE = "try_candidate"
    SUBMIT_CANDIDATES = "submit_candidates"


class ExtensionPoint(str, Enum):
    """EnginePolicy hooks agent code may override; the value is the method name."""

    REQUEST_START = "begin_request"
    DRAFT_LENGTH = "draft_depth"
    TREE_SHAPING = "shape_tree"
    ACCEPTANCE = "accept"
    COMMIT = "commit"
    WEIGHTS = "transform_weights"  # weight formats and layouts (kernel variants also come as kernel_table)
    RESPONSE_CACHE = "cached_response"


class ToolInputError(ValueError):
    """The agent's tool input is malformed; the message goes back to it as an error tool result."""


_POLICY = {"type": "object", "required": ["code", "class_name", "extension_points"], "properties": {
    "code": {"type": "string", "description": "a Python module defining an EnginePolicy subclass "
             "(from specpilot.engines.policy import EnginePolicy)"},
    "class_name": {"type": "string"},
    "extension_points": {"type": "array", "items": {"type": "string", "enum": [e.value for e in ExtensionPoint]},
                         "description": "the EnginePolicy methods the class overrides"}}}
_CANDIDATE = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "description": "short identifier, letters, digits, '-' and '_'"},
    "config_delta": {"type": "object", "description": "EngineConfig fields to change (see list_knobs)"},
    "policy": _POLICY, "rationale": {"type": "string"}}}
_EMPTY = {"type": "object", "properties": {}}
TOOLS: tuple[dict[str, Any], ...] = (
    {"name": ToolName.READ_ATTRIBUTION.value, "input_schema": _EMPTY,
     "description": "The cost model's attribution of the gap to the ceiling: tau (draft tree shape), kernel and "
                    "overhead factors, the largest per-op kernel gaps and the ranked directions."},
    {"name": ToolName.READ_TRACES.value, "input_schema": _EMPTY,
     "description": "Summary of the current build's step traces: tokens per step, acceptance histogram, "
                    "acceptance by draft depth, drafting and verify time per step."},
    {"name": ToolName.LIST_KNOBS.value, "input_schema": _EMPTY,
     "description": "EngineConfig's fields (types, defaults, choices), the current build's values, and the "
                    "EnginePolicy extension points policy code may override."},
    {"name": ToolName.TRY_CANDIDATE.value, "input_schema": _CANDIDATE,
     "description": "Quick-benchmark one candidate against AR on the tune prompts: geometric-mean speedup and "
                    "whether every token matched. Policy code runs in an isolated sandbox (no network, writes "
                    "only in its own directory)."},
    {"name": ToolName.SUBMIT_CANDIDATES.value,
     "input_schema": {"type": "object", "required": ["candidates"],
                      "properties": {"candidates": {"type": "array", "items": _CANDIDATE, "minItems": 1}}},
     "description": "Hand candidates to validation (token forcing against stock on held-out prompts). Ends the "
                    "session when every candidate is accepted."},
)


@dataclass(frozen=True)
class PolicyCode:
    code: str
    class_name: str
    extension_points: tuple[ExtensionPoint, ...]


@dataclass(frozen=True)
class Proposal:
    name: str
    config_delta: dict[str, Any]
    policy: PolicyCode | None
    rationale: str = ""

    @classmethod
    def from_tool(cls, data: Any) -> "Proposal":
        if not isinstance(data, dict):
            raise ToolInputError(f"a candidate must be an object, got {type(data).__name__}")
        name = data.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,48}", name):
            raise ToolInputError(f"name {name!r}: use 1-48 letters, digits, '-' or '_'")
        delta = data.get("config_delta", {})
        if not isinstance(delta, dict):
            raise ToolInputError("config_delta must be an object of EngineConfig fields")
        if "kernel_table" in delta:
            raise ToolInputError("kernel_table comes from the tune_kernels stage, not from a proposal")
        policy = None
        if (raw := data.get("policy")) is not None:
            try:
                points = tuple(ExtensionPoint(p) for p in raw["extension_points"])
                policy = PolicyCode(str(raw["code"]), str(raw["class_name"]), points)
            except (KeyError, TypeError, ValueError) as e:
                raise ToolInputError(f"policy needs code, class_name and extension_points from "
                                     f"{[p.value for p in ExtensionPoint]}: {e}") from None
        if not delta and policy is None:
            raise ToolInputError("a candidate needs a config_delta, policy code, or both")
        return cls(name, delta, policy, str(data.get("rationale", "")))


def check_policy_code(policy: PolicyCode) -> str:
    """Static checks (the code is parsed, never run here): '' if fine, else what is wrong."""
    if len(policy.code) > MAX_CODE_CHARS:
        return f"policy code is {len(policy.code)} characters; the limit is {MAX_CODE_CHARS}"
    if not policy.class_name.isidentifier():
        return f"class_name {policy.class_name!r} is not a Python identifier"
    try:
        tree = ast.parse(policy.code)
    except SyntaxError as e:
        return f"policy code does not parse: {e}"
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == policy.class_name), None)
    if cls is None:
        return f"policy code defines no top-level class {policy.class_name}"
    hooks = {e.value for e in ExtensionPoint}
    overridden = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in hooks}
    declared = {e.value for e in policy.extension_points}
    if not overridden:
        return f"{policy.class_name} overrides no extension point ({sorted(hooks)})"
    if overridden - declared:
        return f"{policy.class_name} overrides {sorted(overridden - declared)} without declaring them in extension_points"
    return ""


def attribution_summary(attribution: Attribution | None) -> dict[str, Any]:
    if attribution is None:
        return {"available": False, "note": "no attribution for this round (profile and attribute have not run)"}
    t, k, o = attribution.tau, attribution.kernel, attribution.overhead
    return {
        "available": True, "total_gap": round(attribution.total_gap, 4),
        "directions": [{"name": d.name.value, "factor": round(d.factor, 4), "predicted_gain": round(d.predicted_gain, 4),
                        "rationale": d.rationale} for d in attribution.directions],
        "tau": {"tau": round(t.tau, 4), "best_budget": t.best_budget,
                "current_tokens_per_step": round(t.current_tokens_per_step, 3),
                "optimal_tokens_per_step": round(t.optimal_tokens_per_step, 3), "steps": t.steps},
        "kernel": {"factor": round(k.factor, 4), "launches_per_step": round(k.launches, 1), "tokens": k.tokens,
                   "largest_gaps": [{"op": g.op.value, "gap": None if g.gap is None else round(g.gap, 3),
                                     "excess_ms": round(1e3 * g.excess_s, 4), "bound": g.bound.value,
                                     "top_kernel": g.top_kernel[:80]} for g in k.op_gaps[:TOP_GAPS]]},
        "overhead": {"factor": round(o.factor, 4), "wall_ms": round(1e3 * o.wall_s, 4),
                     "kernel_ms": round(1e3 * o.kernel_s, 4),
                     "draft_ms": round(1e3 * o.draft_s, 4), "verify_ms": round(1e3 * o.verify_s, 4)},
    }


def knobs_and_hooks(current: dict[str, Any]) -> dict[str, Any]:
    hooks = [{"name": e.value, "signature": f"{e.value}{inspect.signature(getattr(EnginePolicy, e.value))}",
              "doc": inspect.getdoc(getattr(EnginePolicy, e.value)) or ""} for e in ExtensionPoint]
    return {"knobs": knob_schema(), "current": current, "extension_points": hooks,
            "notes": ["batch scheduling has no extension point in this engine build (single-request engine loop)",
                      "kernel variants: kernel_backend, or transform_weights; launch tables come from tune_kernels",
                      "accept/commit overrides must stay exact: token forcing rejects any output change"]}
