"""`Memory.show()`: table sizes, the latest runs and every mechanism's evidence tally, as one summary."""
from __future__ import annotations

from dataclasses import dataclass

import duckdb

from specpilot.memory.query import QueryResult, run_query

TABLES = ("mechanisms", "scopes", "evidence", "runs", "failures")

_RECENT_RUNS = """
SELECT run_id, deployment, status, started, finished, report_uri
FROM runs ORDER BY started DESC, run_id LIMIT ?"""

_MECHANISMS = """
SELECT m.name, m.category,
       count(e.id) FILTER (WHERE e.verdict = 'pass') AS pass,
       count(e.id) FILTER (WHERE e.verdict = 'fail') AS fail,
       count(e.id) FILTER (WHERE e.verdict = 'tie') AS tie,
       max(CASE WHEN e.higher_is_better THEN e.after / e.before ELSE e.before / e.after END)
           FILTER (WHERE e.verdict = 'pass') AS best_gain,
       count(DISTINCT e.scope_id) AS scopes
FROM mechanisms m LEFT JOIN evidence e ON e.mechanism_id = m.id
GROUP BY m.name, m.category
ORDER BY best_gain DESC NULLS LAST, m.name"""


@dataclass(frozen=True)
class MemorySummary:
    path: str
    read_only: bool
    schema_version: int
    row_counts: dict[str, int]
    recent_runs: QueryResult
    mechanisms: QueryResult

    def format(self) -> str:
        mode = "read-only" if self.read_only else "read-write"
        counts = ", ".join(f"{n} {t}" for t, n in self.row_counts.items())
        return "\n".join([
            f"memory {self.path} (schema v{self.schema_version}, {mode})",
            counts,
            "",
            "recent runs:",
            self.recent_runs.format(),
            "",
            "mechanisms (evidence verdicts, best passing gain):",
            self.mechanisms.format(),
        ])


def summarize(con: duckdb.DuckDBPyConnection, path: str, read_only: bool, schema_version: int,
              recent: int = 10) -> MemorySummary:
    counts = {t: int(con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in TABLES}
    return MemorySummary(path=path, read_only=read_only, schema_version=schema_version, row_counts=counts,
                         recent_runs=run_query(con, _RECENT_RUNS, [recent]),
                         mechanisms=run_query(con, _MECHANISMS))
