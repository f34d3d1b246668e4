"""Exploration agents: an LLM proposer (Anthropic API) for explore, the sandbox its code runs in, memory transfer.

- proposer.AgentProposer: explore's Proposer protocol over the Messages API with tools; budgeted; transcripts.
- sandbox.SandboxedPolicyRunner: agent policy code in a child process (limits, namespaces, Landlock, audit hook).
- forcing.validate_sandboxed: token forcing with stock in-process and the candidate in the sandbox.
- transfer: mechanisms proven on one scope tried first on a similar one, with carried-over evidence.
- proposer.proposers_for: search + memory, plus the agent when an API key exists (and a note saying which).
"""
from specpilot.agents.forcing import SandboxedVerdict, validate_sandboxed
from specpilot.agents.ledger import AgentBudget, Prices
from specpilot.agents.proposer import (DEFAULT_MODEL, AgentProposer, AgentSession, StopReason, proposers_for,
                                       sandbox_for_session)
from specpilot.agents.protocol import PromptIds, SandboxOutcome, SandboxStatus, TargetSpec, Violation
from specpilot.agents.sandbox import Isolation, SandboxedPolicyRunner, SandboxLimits, detect_isolation
from specpilot.agents.tools import ExtensionPoint, ToolName
from specpilot.agents.transfer import TransferOutcome, record_transfer, transfer_candidates, transfer_history
from specpilot.agents.trials import EngineTrial, QuickBenchTrial, SandboxTrial, TrialOutcome
from specpilot.agents.workbench import TraceSummary, Workbench, plain_delta

__all__ = [
    "AgentBudget", "AgentProposer", "AgentSession", "DEFAULT_MODEL", "EngineTrial", "ExtensionPoint", "Isolation",
    "Prices", "PromptIds", "QuickBenchTrial", "SandboxLimits", "SandboxOutcome", "SandboxStatus", "SandboxTrial",
    "SandboxedPolicyRunner", "SandboxedVerdict", "StopReason", "TargetSpec", "ToolName", "TraceSummary",
    "TransferOutcome", "TrialOutcome", "Violation", "Workbench", "detect_isolation", "plain_delta",
    "proposers_for", "record_transfer", "sandbox_for_session", "transfer_candidates", "transfer_history",
    "validate_sandboxed",
]
