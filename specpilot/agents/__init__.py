"""Exploration agents: an LLM proposer (Anthropic API) for explore, and the sandbox its code runs in.

- proposer.AgentProposer: explore's Proposer protocol over the Messages API with tools; budgeted; transcripts.
- plan.plan_proposers: search + memory, plus the agent when an API key exists (and a note saying which).
- sandbox.SandboxedPolicyRunner: agent policy code in a child process (limits, namespaces, Landlock, audit hook).
- trials: quick trials for the agent's tool; agent code's trials are logged in explore's QuickBench.
- forcing.validate_sandboxed: token forcing with stock in-process and the candidate in the sandbox.
Memory transfer (mechanisms proven on one scope tried first on a similar one) is specpilot.memory.transfer.
"""
from specpilot.agents.forcing import SandboxedVerdict, validate_isolated, validate_sandboxed
from specpilot.agents.ledger import AgentBudget, Prices
from specpilot.agents.plan import AgentSettings, AgentStatus, ProposerPlan, plan_proposers, sandbox_for_session
from specpilot.agents.proposer import DEFAULT_MODEL, AgentProposer, AgentSession, StopReason
from specpilot.agents.protocol import PromptIds, SandboxOutcome, SandboxStatus, TargetSpec, Violation
from specpilot.agents.sandbox import Isolation, SandboxedPolicyRunner, SandboxLimits, detect_isolation
from specpilot.agents.tools import ExtensionPoint, ToolName
from specpilot.agents.trials import EngineTrial, LoggedSandboxTrial, QuickBenchTrial, SandboxTrial, TrialOutcome
from specpilot.agents.workbench import TraceSummary, Workbench, plain_delta

__all__ = [
    "AgentBudget", "AgentProposer", "AgentSession", "AgentSettings", "AgentStatus", "DEFAULT_MODEL", "EngineTrial",
    "ExtensionPoint", "Isolation", "LoggedSandboxTrial", "Prices", "PromptIds", "ProposerPlan", "QuickBenchTrial",
    "SandboxLimits", "SandboxOutcome", "SandboxStatus", "SandboxTrial", "SandboxedPolicyRunner", "SandboxedVerdict",
    "StopReason", "TargetSpec", "ToolName", "TraceSummary", "TrialOutcome", "Violation", "Workbench",
    "detect_isolation", "plain_delta", "plan_proposers", "sandbox_for_session", "validate_isolated",
    "validate_sandboxed",
]
