"""DuckDB mechanism memory: schema and migrations, writes, scope-similarity retrieval, SQL access.

One writer at a time (DuckDB's rule): see specpilot.memory.db for what that means for readers.
"""
from specpilot.memory.db import MEMORY_ENV, Memory, MemoryOpenError, ReadOnlyMemoryError, default_memory_path
from specpilot.memory.query import QueryResult, ReadOnlyQueryError, TraceView, attach_run_traces
from specpilot.memory.ranking import ScopeWeights, rank_mechanisms
from specpilot.memory.records import (
    Evidence, Failure, Mechanism, MechanismCategory, RankedMechanism, RunStatus, Scope, Verdict,
)
from specpilot.memory.schema import LATEST_VERSION, MIGRATIONS, SchemaVersionError
from specpilot.memory.summary import MemorySummary

__all__ = [
    "Evidence", "Failure", "LATEST_VERSION", "MEMORY_ENV", "MIGRATIONS", "Mechanism", "MechanismCategory", "Memory",
    "MemoryOpenError", "MemorySummary", "QueryResult", "RankedMechanism", "ReadOnlyMemoryError",
    "ReadOnlyQueryError", "RunStatus", "Scope", "ScopeWeights", "SchemaVersionError", "TraceView", "Verdict",
    "attach_run_traces", "default_memory_path", "rank_mechanisms",
]
