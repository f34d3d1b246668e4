"""`Memory`: the DuckDB mechanism memory, one file (default $SPECPILOT_MEMORY or ~/.cache/specpilot/memory.duckdb).

Concurrency is DuckDB's rule: one process may hold the file read-write, and while it does no other
process can open it, not even read-only; several read-only processes may share it otherwise. So writes go
through one place (the integrate stage), everything else opens with `read_only=True` and closes promptly,
and a conflicting open fails with MemoryLockedError naming the file. A Memory wraps one connection and is
not meant to be shared between threads.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping

import duckdb

from specpilot.memory.query import QueryResult, TraceView, attach_run_traces, check_read_only, run_query
from specpilot.memory.ranking import PassingEvidence, ScopeWeights, rank_mechanisms
from specpilot.memory.records import (
    Evidence, Failure, Mechanism, MechanismCategory, RankedMechanism, RunStatus, Scope, json_text,
)
from specpilot.memory.schema import check_version, migrate
from specpilot.memory.summary import MemorySummary, summarize

MEMORY_ENV = "SPECPILOT_MEMORY"


class MemoryOpenError(RuntimeError):
    """The memory file could not be opened (missing, locked by another process, or open here differently)."""


class ReadOnlyMemoryError(RuntimeError):
    """A write was attempted through a Memory opened with read_only=True."""


def default_memory_path() -> Path:
    """$SPECPILOT_MEMORY, else <$SPECPILOT_CACHE or ~/.cache/specpilot>/memory.duckdb."""
    if env := os.environ.get(MEMORY_ENV):
        return Path(env).expanduser()
    return Path(os.environ.get("SPECPILOT_CACHE") or "~/.cache/specpilot").expanduser() / "memory.duckdb"


def _connect(path: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    if read_only and not path.exists():
        raise MemoryOpenError(f"memory {path} does not exist; it is created by the first writable open")
    if not read_only:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            raise MemoryOpenError(f"memory {path} is locked by another process (DuckDB allows one writer and no "
                                  f"readers while it writes; retry when it is done): {e}") from None
        raise MemoryOpenError(f"cannot open memory {path}: {e}") from None
    except duckdb.ConnectionException as e:
        raise MemoryOpenError(f"memory {path} is already open in this process with a different read_only "
                              f"setting; reuse that Memory: {e}") from None
    con.execute("SET TimeZone = 'UTC'")  # timestamps read back in UTC whatever the host's zone
    return con


class Memory:
    """Mechanisms, the scopes they were proven on, evidence, runs and failures. Use `Memory.open`."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: Path, read_only: bool, schema_version: int) -> None:
        self._con, self.path, self.read_only, self.schema_version = con, path, read_only, schema_version

    @classmethod
    def open(cls, path: Path | str | None = None, read_only: bool = False) -> "Memory":
        """Open (creating and migrating when writable) the memory file; read-only opens never change it."""
        path = Path(path).expanduser() if path is not None else default_memory_path()
        con = _connect(path, read_only)
        try:
            version = check_version(con, str(path)) if read_only else migrate(con, str(path))
        except BaseException:
            con.close()
            raise
        return cls(con, path, read_only, version)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The underlying connection, for queries beyond `sql` (e.g. with pandas or pyarrow results)."""
        return self._con

    def _writable(self, action: str) -> duckdb.DuckDBPyConnection:
        if self.read_only:
            raise ReadOnlyMemoryError(f"cannot {action}: memory {self.path} was opened read-only")
        return self._con

    @contextmanager
    def transaction(self) -> Iterator["Memory"]:
        """Group writes so they land together or not at all (e.g. everything one integrate stage records)."""
        con = self._writable("start a transaction")
        con.execute("BEGIN TRANSACTION")
        try:
            yield self
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    def _one(self, query: str, params: list[Any]) -> tuple[Any, ...] | None:
        return self._con.execute(query, params).fetchone()

    def _require_run(self, run_id: str) -> None:
        if self._one("SELECT 1 FROM runs WHERE run_id = ?", [run_id]) is None:
            raise ValueError(f"run {run_id!r} is not recorded in memory {self.path}; call record_run first")

    # -- writes ------------------------------------------------------------------------------------------

    def record_run(self, run_id: str, deployment: str, fingerprint: Mapping[str, Any],
                   started: datetime | None = None) -> None:
        """Start a run; `fingerprint` says what it ran on (model, drafter, GPU, code versions)."""
        con = self._writable("record a run")
        if not run_id or not deployment:
            raise ValueError("record_run needs a non-empty run_id and deployment")
        if started is not None and started.tzinfo is None:
            raise ValueError(f"started must be timezone-aware, got {started!r}")
        if self._one("SELECT 1 FROM runs WHERE run_id = ?", [run_id]) is not None:
            raise ValueError(f"run {run_id!r} is already recorded in memory {self.path}")
        con.execute("INSERT INTO runs (run_id, deployment, started, status, fingerprint) VALUES (?, ?, ?, ?, ?)",
                    [run_id, deployment, started or datetime.now(timezone.utc), RunStatus.RUNNING.value,
                     json_text("fingerprint", dict(fingerprint))])

    def finish_run(self, run_id: str, status: RunStatus, report_uri: str | None = None,
                   finished: datetime | None = None) -> None:
        con = self._writable("finish a run")
        if not isinstance(status, RunStatus) or status is RunStatus.RUNNING:
            raise ValueError(f"finish_run needs a final RunStatus, got {status!r}")
        self._require_run(run_id)
        con.execute("UPDATE runs SET status = ?, finished = ?, report_uri = ? WHERE run_id = ?",
                    [status.value, finished or datetime.now(timezone.utc), report_uri, run_id])

    def record_mechanism(self, mechanism: Mechanism) -> int:
        """Insert, or update the mechanism of the same name (its evidence stays attached); return its id."""
        con = self._writable("record a mechanism")
        values = [mechanism.category.value, mechanism.description,
                  json_text("config_delta", mechanism.config_delta), mechanism.code_ref]
        # Select-then-update rather than ON CONFLICT: DuckDB rejects upserts on rows that foreign keys reference.
        existing = self._one("SELECT id FROM mechanisms WHERE name = ?", [mechanism.name])
        if existing is not None:
            con.execute("UPDATE mechanisms SET category = ?, description = ?, config_delta = ?, code_ref = ?, "
                        "updated = now() WHERE id = ?", [*values, existing[0]])
            return int(existing[0])
        return int(con.execute("INSERT INTO mechanisms (name, category, description, config_delta, code_ref) "
                               "VALUES (?, ?, ?, ?, ?) RETURNING id", [mechanism.name, *values]).fetchone()[0])

    def record_scope(self, scope: Scope) -> int:
        """The id of this exact scope, creating it if new."""
        con = self._writable("record a scope")
        values = [scope.model_family, scope.model, scope.drafter, scope.gpu, scope.regime]
        where = "model_family = ? AND model = ? AND drafter = ? AND gpu = ? AND regime = ?"
        if (existing := self._one(f"SELECT id FROM scopes WHERE {where}", values)) is not None:
            return int(existing[0])
        return int(con.execute("INSERT INTO scopes (model_family, model, drafter, gpu, regime) "
                               "VALUES (?, ?, ?, ?, ?) RETURNING id", values).fetchone()[0])

    def record_evidence(self, evidence: Evidence) -> int:
        con = self._writable("record evidence")
        mechanism = self._one("SELECT id FROM mechanisms WHERE name = ?", [evidence.mechanism])
        if mechanism is None:
            raise ValueError(f"mechanism {evidence.mechanism!r} is not recorded in memory {self.path}; "
                             f"call record_mechanism first")
        self._require_run(evidence.run_id)
        scope_id = self.record_scope(evidence.scope)
        return int(con.execute(
            "INSERT INTO evidence (mechanism_id, scope_id, run_id, deployment, benchmark, metric, before, after, "
            "higher_is_better, verdict, artifact_uris, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "RETURNING id",
            [mechanism[0], scope_id, evidence.run_id, evidence.deployment, evidence.benchmark, evidence.metric,
             float(evidence.before), float(evidence.after), evidence.higher_is_better, evidence.verdict.value,
             json.dumps(list(evidence.artifact_uris)), evidence.created or datetime.now(timezone.utc)],
        ).fetchone()[0])

    def record_failure(self, failure: Failure) -> int:
        con = self._writable("record a failure")
        self._require_run(failure.run_id)
        delta = None if failure.config_delta is None else json_text("config_delta", failure.config_delta)
        return int(con.execute(
            "INSERT INTO failures (run_id, mechanism, config_delta, stage, reason) VALUES (?, ?, ?, ?, ?) RETURNING id",
            [failure.run_id, failure.mechanism, delta, failure.stage, failure.reason]).fetchone()[0])

    # -- reads -------------------------------------------------------------------------------------------

    def retrieve(self, scope: Scope, limit: int = 10, weights: ScopeWeights = ScopeWeights()) -> list[RankedMechanism]:
        """Mechanisms with passing evidence, most relevant to `scope` first (see memory.ranking)."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        rows = self._con.execute("""
            SELECT m.id, m.name, m.category, m.description, m.config_delta, m.code_ref,
                   s.model_family, s.model, s.drafter, s.gpu, s.regime,
                   CASE WHEN e.higher_is_better THEN e.after / e.before ELSE e.before / e.after END, e.run_id
            FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id
            WHERE e.verdict = 'pass'""").fetchall()
        passing = (PassingEvidence(
            mechanism_id=r[0],
            mechanism=Mechanism(name=r[1], category=MechanismCategory(r[2]), description=r[3],
                                config_delta=json.loads(r[4]), code_ref=r[5]),
            scope=Scope(*r[6:11]), gain=float(r[11]), run_id=r[12]) for r in rows)
        return rank_mechanisms(passing, scope, weights, limit)

    def sql(self, query: str, write: bool = False, params: list[Any] | None = None) -> QueryResult:
        """Run SQL; without write=True only queries are accepted (checked per statement before running)."""
        if write:
            self._writable("run writing SQL")
        else:
            check_read_only(self._con, query)
        return run_query(self._con, query, params)

    def attach_run_traces(self, run_dir: Path) -> dict[TraceView, int]:
        """Views steps/requests/kernels over a run directory's parquet traces, for `sql` joins."""
        return attach_run_traces(self._con, run_dir)

    def show(self, recent_runs: int = 10) -> MemorySummary:
        return summarize(self._con, str(self.path), self.read_only, self.schema_version, recent_runs)
