"""Mechanism memory on real DuckDB files: migrations, writes, retrieval ranking, read-only SQL, parquet traces."""
from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from specpilot.engines.traces import REQUEST_SCHEMA, STEP_SCHEMA, RequestTrace, StepTrace, to_table
from specpilot.memory import (
    LATEST_VERSION, Evidence, Failure, Mechanism, MechanismCategory, Memory, MemoryOpenError, ReadOnlyMemoryError,
    ReadOnlyQueryError, RunStatus, Scope, ScopeWeights, SchemaVersionError, TraceView, Verdict, default_memory_path,
)
from specpilot.memory.cli import main as memory_cli

QUERY = Scope(model_family="llama", model="llama-3.1-8b", drafter="dflash-b16", gpu="H200", regime="batch1")
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "mem" / "memory.duckdb"


def _evidence(mechanism: str, scope: Scope, verdict: Verdict = Verdict.PASS, before: float = 100.0,
              after: float = 120.0, **kw) -> Evidence:
    return Evidence(mechanism=mechanism, scope=scope, run_id="r1", deployment="llama8b-h200", benchmark="gsm8k",
                    metric="tok_s", before=before, after=after, verdict=verdict, **kw)


def test_migrations_apply_once_and_versions_are_checked(db: Path):
    with Memory.open(db) as m:
        assert m.schema_version == LATEST_VERSION
        tables = {r[0] for r in m.sql("SELECT table_name FROM duckdb_tables()").rows}
        assert {"schema_version", "mechanisms", "scopes", "evidence", "runs", "failures"} <= tables
    with Memory.open(db) as m:  # reopening applies nothing again
        assert m.schema_version == LATEST_VERSION
        assert m.sql("SELECT version FROM schema_version ORDER BY version").rows == tuple(
            (v,) for v in range(1, LATEST_VERSION + 1))
    with Memory.open(db, read_only=True) as m:
        assert m.schema_version == LATEST_VERSION
    with Memory.open(db) as m:
        m.sql("INSERT INTO schema_version (version, description) VALUES (999, 'from the future')", write=True)
    for read_only in (False, True):
        with pytest.raises(SchemaVersionError, match="schema version 999, newer than"):
            Memory.open(db, read_only=read_only)

    old = db.parent / "old.duckdb"  # a file no migration has touched: readers must not try to migrate it
    duckdb.connect(str(old)).close()
    with pytest.raises(SchemaVersionError, match="schema version 0, this code needs"):
        Memory.open(old, read_only=True)
    with pytest.raises(MemoryOpenError, match="does not exist"):
        Memory.open(db.parent / "absent.duckdb", read_only=True)


def test_writes_round_trip(db: Path):
    with Memory.open(db) as m:
        m.record_run("r1", "llama8b-h200", {"gpu": "H200", "model": "llama-3.1-8b"}, started=T0)
        first = m.record_mechanism(Mechanism("wide-tree", MechanismCategory.ALGORITHM, "wider tree",
                                             {"tree_budget": 32}))
        again = m.record_mechanism(Mechanism("wide-tree", MechanismCategory.ALGORITHM, "wider tree, deeper",
                                             {"tree_budget": 48, "depth": 6}, code_ref="specpilot/x.py:f"))
        assert again == first  # upsert by name
        eid = m.record_evidence(_evidence("wide-tree", QUERY, artifact_uris=("file:///a", "s3://b/c"),
                                          created=T0))
        m.record_failure(Failure(run_id="r1", stage="validate", reason="token 17 differs",
                                 config_delta={"accept_unverified": True}))
        m.record_failure(Failure(run_id="r1", stage="explore", reason="OOM", mechanism="wide-tree"))
        m.finish_run("r1", RunStatus.SUCCEEDED, report_uri="file:///report.md")

        mech = m.sql("SELECT name, category, description, config_delta::VARCHAR, code_ref FROM mechanisms").rows
        assert mech == (("wide-tree", "algorithm", "wider tree, deeper", '{"depth": 6, "tree_budget": 48}',
                         "specpilot/x.py:f"),)
        ev = m.sql("SELECT e.id, s.model, e.before, e.after, e.verdict, e.artifact_uris->>'$[1]', e.created "
                   "FROM evidence e JOIN scopes s ON s.id = e.scope_id").rows
        assert ev == ((eid, "llama-3.1-8b", 100.0, 120.0, "pass", "s3://b/c", T0),)
        assert m.sql("SELECT stage, mechanism, config_delta->>'accept_unverified' FROM failures ORDER BY id").rows \
            == (("validate", None, "true"), ("explore", "wide-tree", None))
        status = m.sql("SELECT status, report_uri, finished IS NOT NULL, fingerprint->>'gpu' FROM runs").rows
        assert status == (("succeeded", "file:///report.md", True, "H200"),)
        assert m.record_scope(QUERY) == m.record_scope(Scope(**QUERY.__dict__))  # one row per exact scope

        with pytest.raises(ValueError, match="mechanism 'nope' is not recorded"):
            m.record_evidence(_evidence("nope", QUERY))
        with pytest.raises(ValueError, match="run 'r9' is not recorded"):
            m.record_failure(Failure(run_id="r9", stage="profile", reason="x"))
        with pytest.raises(ValueError, match="already recorded"):
            m.record_run("r1", "llama8b-h200", {})
        with pytest.raises(RuntimeError, match="boom"), m.transaction():  # all or nothing
            m.record_mechanism(Mechanism("half-written", MechanismCategory.KERNEL))
            raise RuntimeError("boom")
        assert m.sql("SELECT count(*) FROM mechanisms WHERE name = 'half-written'").rows == ((0,),)

    with pytest.raises(ValueError, match="positive finite"):
        _evidence("wide-tree", QUERY, before=0.0)
    with pytest.raises(ValueError, match="Scope.gpu"):
        Scope(model_family="llama", model="m", drafter="d", gpu="", regime="batch1")
    with Memory.open(db, read_only=True) as ro:
        with pytest.raises(ReadOnlyMemoryError, match="opened read-only"):
            ro.record_mechanism(Mechanism("x", MechanismCategory.KERNEL))


def test_retrieval_ranks_by_scope_similarity_then_gain(db: Path):
    def scope(**changes: str) -> Scope:
        return Scope(**{**QUERY.__dict__, **changes})
    elsewhere = Scope(model_family="qwen3", model="qwen3-8b", drafter="ngram", gpu="A100", regime="batch16")
    elsewhere_on_h200 = Scope(**{**elsewhere.__dict__, "gpu": "H200"})
    with Memory.open(db) as m:
        m.record_run("r1", "llama8b-h200", {})
        for name in ("same-model", "family-gpu-drafter-regime", "gpu-fast", "gpu-slow", "latency",
                     "only-fails", "only-ties", "unrelated", "two-scopes"):
            m.record_mechanism(Mechanism(name, MechanismCategory.KERNEL))
        # same model (16 + family 8) beats everything else combined (gpu 4 + drafter 2 + regime 1 = 7 more than 8)
        m.record_evidence(_evidence("same-model", scope(gpu="A100", drafter="ngram", regime="batch16"), after=101))
        m.record_evidence(_evidence("family-gpu-drafter-regime", scope(model="llama-3.2-1b"), after=300))
        m.record_evidence(_evidence("gpu-fast", elsewhere_on_h200, after=150))
        m.record_evidence(_evidence("gpu-slow", elsewhere_on_h200, after=110))
        # latency: lower is better, 10 -> 5 ms is a gain of 2, ranking it above gpu-fast (1.5) at equal score
        m.record_evidence(_evidence("latency", elsewhere_on_h200, before=10, after=5, higher_is_better=False))
        m.record_evidence(_evidence("only-fails", QUERY, Verdict.FAIL, after=500))
        m.record_evidence(_evidence("only-ties", QUERY, Verdict.TIE, after=500))
        m.record_evidence(_evidence("unrelated", elsewhere, after=200))
        m.record_evidence(_evidence("unrelated", QUERY, Verdict.FAIL))
        # best similarity wins over a bigger gain on a less similar scope; the gain reported is the exact one's
        m.record_evidence(_evidence("two-scopes", QUERY, after=110))
        m.record_evidence(_evidence("two-scopes", elsewhere, after=400))

    with Memory.open(db, read_only=True) as m:
        ranked = m.retrieve(QUERY, limit=20)
        assert [r.mechanism.name for r in ranked] == [
            "two-scopes", "same-model", "family-gpu-drafter-regime", "latency", "gpu-fast", "gpu-slow", "unrelated"]
        assert [r.score for r in ranked] == [31, 24, 15, 4, 4, 4, 0]
        top = ranked[0]
        assert top.best_gain == pytest.approx(1.1) and top.proven_on == QUERY and top.passing_evidence == 2
        assert top.matched == ("model_family", "model", "drafter", "gpu", "regime")
        assert ranked[3].best_gain == pytest.approx(2.0) and ranked[3].mechanism.category is MechanismCategory.KERNEL
        assert [r.mechanism.name for r in m.retrieve(QUERY, limit=2)] == ["two-scopes", "same-model"]
        # a deployment on another GPU and drafter: the GPU-only mechanisms drop to the bottom
        other = m.retrieve(scope(gpu="B200", drafter="eagle3"), limit=3)
        assert [r.mechanism.name for r in other] == ["two-scopes", "same-model", "family-gpu-drafter-regime"]
    with pytest.raises(ValueError, match="model > model_family > gpu"):
        ScopeWeights(model=4, gpu=8)


def test_sql_is_read_only_unless_asked(db: Path):
    with Memory.open(db) as m:
        m.record_run("r1", "d", {})
        for statement in ("INSERT INTO runs (run_id, deployment, started, status) VALUES ('r2', 'd', now(), 'running')",
                          "SELECT 1; DELETE FROM runs", "COPY runs TO 'x.csv'", "EXPLAIN ANALYZE DELETE FROM runs",
                          "CREATE TABLE t (a INT)"):
            with pytest.raises(ReadOnlyQueryError, match="read-only SQL accepts queries only"):
                m.sql(statement)
        assert m.sql("WITH x AS (SELECT run_id FROM runs) SELECT * FROM x").rows == (("r1",),)
        with pytest.raises(ValueError, match="cannot parse SQL"):
            m.sql("SELEC 1")
        m.sql("DELETE FROM runs WHERE run_id = 'r1'", write=True)
        assert m.sql("SELECT count(*) FROM runs").rows == ((0,),)
    with Memory.open(db, read_only=True) as ro:
        with pytest.raises(ReadOnlyMemoryError):
            ro.sql("DELETE FROM runs", write=True)
        with pytest.raises(duckdb.Error, match="read-only"):  # the connection itself refuses, too
            ro.connection.execute("INSERT INTO runs (run_id, deployment, started, status) "
                                  "VALUES ('r3', 'd', now(), 'running')")


def _write_traces(run_dir: Path) -> None:
    for mode, accepted in (("ar", 0), ("spec", 3)):
        out = run_dir / "profile" / mode
        out.mkdir(parents=True)
        steps = [StepTrace(request_id=f"{mode}-q0", step=i, position=10 + i, drafted=4 if accepted else 0,
                           depth=4 if accepted else 0, accepted=accepted, committed=accepted + 1,
                           verify_tokens=5 if accepted else 1, draft_s=0.001, verify_s=0.01) for i in range(4)]
        pq.write_table(to_table(steps, STEP_SCHEMA), out / "steps.parquet")
    requests = [RequestTrace(request_id="spec-q0", benchmark="gsm8k", mode="spec", prompt_tokens=10, new_tokens=16,
                             prefill_s=0.01, decode_s=0.04, steps=4, stop_reason="max_tokens")]
    pq.write_table(to_table(requests, REQUEST_SCHEMA), run_dir / "profile" / "spec" / "requests.parquet")


def test_run_traces_are_queryable_beside_memory_tables(db: Path, tmp_path: Path):
    run_dir = tmp_path / "runs" / "r1"
    _write_traces(run_dir)
    with Memory.open(db) as m:
        m.record_run("r1", "smollm2-cpu", {})
    with Memory.open(db, read_only=True) as m:
        assert m.attach_run_traces(run_dir) == {TraceView.STEPS: 2, TraceView.REQUESTS: 1}
        rows = m.sql("SELECT r.deployment, s.request_id, sum(s.committed) AS committed, "
                     "any_value(q.benchmark) AS bench FROM steps s JOIN runs r ON r.run_id = 'r1' "
                     "LEFT JOIN requests q USING (request_id) GROUP BY ALL ORDER BY s.request_id").rows
        assert rows == (("smollm2-cpu", "ar-q0", 4, None), ("smollm2-cpu", "spec-q0", 16, "gsm8k"))
        assert m.sql("SELECT count(DISTINCT filename) FROM steps").rows == ((2,),)
        direct = m.sql(f"SELECT count(*) FROM read_parquet('{run_dir}/**/steps.parquet')").rows
        assert direct == ((8,),)
        with pytest.raises(duckdb.CatalogException):  # no kernels.parquet in this run, so no view
            m.sql("SELECT * FROM kernels")
    with Memory.open(db) as m:  # views are temporary: nothing was persisted into the memory file
        assert m.sql("SELECT count(*) FROM duckdb_views() WHERE view_name = 'steps'").rows == ((0,),)


def test_cli_sql_and_show(db: Path, tmp_path: Path, capsys):
    with Memory.open(db) as m:
        m.record_run("r1", "llama8b-h200", {})
        m.record_mechanism(Mechanism("wide-tree", MechanismCategory.ALGORITHM))
        m.record_evidence(_evidence("wide-tree", QUERY, after=150))
    assert memory_cli(["memory", "show", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "1 mechanisms, 1 scopes, 1 evidence, 1 runs, 0 failures" in shown
    assert [line.split() for line in shown.splitlines() if line.startswith("wide-tree")] == [
        ["wide-tree", "algorithm", "1", "0", "0", "1.5", "1"]]  # pass/fail/tie, best passing gain, scopes
    assert memory_cli(["memory", "sql", "SELECT name, category FROM mechanisms", "--db", str(db)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "category"] and out[2].split() == ["wide-tree", "algorithm"]
    assert out[3] == "(1 row)"
    assert memory_cli(["memory", "sql", "DELETE FROM evidence", "--db", str(db)]) == 2
    assert "DELETE statement" in capsys.readouterr().err
    assert memory_cli(["memory", "sql", "DELETE FROM evidence", "--write", "--db", str(db)]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == ["Count", "-----", "    1"]  # rows deleted
    run_dir = tmp_path / "run"
    _write_traces(run_dir)
    assert memory_cli(["memory", "sql", "SELECT count(*) AS n FROM steps", "--db", str(db),
                       "--run-dir", str(run_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[2].strip() == "8"
    assert memory_cli(["memory", "sql", "SELECT 1", "--db", str(tmp_path / "absent.duckdb")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_one_writer_at_a_time(db: Path):
    code = ("import sys\nfrom specpilot.memory import Memory, MemoryOpenError\n"
            "try:\n    Memory.open(sys.argv[1], read_only=True)\nexcept MemoryOpenError as e:\n    print(e)\n")
    with Memory.open(db):
        other = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=60)
        assert f"memory {db} is locked by another process" in other.stdout, other.stderr
        with pytest.raises(MemoryOpenError, match="already open in this process"):
            Memory.open(db, read_only=True)


def test_default_path_follows_the_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("SPECPILOT_MEMORY", str(tmp_path / "x.duckdb"))
    assert default_memory_path() == tmp_path / "x.duckdb"
    monkeypatch.delenv("SPECPILOT_MEMORY")
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    assert default_memory_path() == tmp_path / "cache" / "memory.duckdb"


def test_run_started_comes_from_the_run_id():
    from datetime import datetime, timezone

    from specpilot.artifacts.manifest import new_run_id, run_started
    t = datetime(2026, 11, 30, 2, 58, 0, tzinfo=timezone.utc)
    assert run_started(new_run_id(t)) == t
    assert run_started("hand-made-id") is None
