"""SQL access to the memory: a read-only statement check, run traces as views, and plain-text tables.

Parquet traces need no import: DuckDB reads them in place, so `SELECT ... FROM read_parquet('run/**/steps.parquet')`
already works next to the memory tables. `attach_run_traces` adds short names for a run's traces.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

import duckdb

# Statement types a read-only query may contain. DuckDB classifies SHOW, DESCRIBE, SUMMARIZE, FROM-first and
# VALUES queries as SELECT; EXPLAIN is left out because EXPLAIN ANALYZE executes its statement.
_READ_ONLY_TYPES = {duckdb.StatementType.SELECT}
_MAX_CELL = 80


class ReadOnlyQueryError(ValueError):
    """A statement that could change the database was given without write=True."""


class TraceView(Enum):
    """Views over a run's parquet traces; each reads every `<name>.parquet` anywhere under the run directory."""
    STEPS = "steps"
    REQUESTS = "requests"
    KERNELS = "kernels"

    @property
    def filename(self) -> str:
        return f"{self.value}.parquet"


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Reject any statement that is not a query, naming it, before anything runs."""
    try:
        statements = con.extract_statements(query)
    except duckdb.ParserException as e:
        raise ValueError(f"cannot parse SQL: {e}") from None
    for statement in statements:
        if statement.type not in _READ_ONLY_TYPES:
            text = " ".join(statement.query.split())[:60]
            raise ReadOnlyQueryError(f"read-only SQL accepts queries only (SELECT/WITH/SHOW/DESCRIBE), got a "
                                     f"{statement.type.name} statement: {text!r}; pass write=True (--write) to modify")


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def attach_run_traces(con: duckdb.DuckDBPyConnection, run_dir: Path) -> dict[TraceView, int]:
    """Create temporary views steps/requests/kernels over <run_dir>/**/<view>.parquet (those present).

    Views are TEMP so this works on read-only connections and never persists into the memory file. Each view
    adds a `filename` column: a run holds one trace per stage and round, and that says which one a row is from.
    Returns how many files each created view reads.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    created: dict[TraceView, int] = {}
    for view in TraceView:
        files = sorted(str(p) for p in run_dir.rglob(view.filename) if p.is_file())
        if not files:
            continue
        file_list = "[" + ", ".join(_sql_string(f) for f in files) + "]"
        con.execute(f"CREATE OR REPLACE TEMP VIEW {view.value} AS "
                    f"SELECT * FROM read_parquet({file_list}, filename = true, union_by_name = true)")
        created[view] = len(files)
    return created


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    text = " ".join(str(value).split())
    return text if len(text) <= _MAX_CELL else text[:_MAX_CELL - 3] + "..."


def _is_numeric_column(values: list[Any]) -> bool:
    numbers = [v for v in values if v is not None]
    return bool(numbers) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)


@dataclass(frozen=True)
class QueryResult:
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def format(self) -> str:
        """A plain-text table with a row count; numbers right-aligned."""
        if not self.columns:
            return "OK"
        cells = [[_cell(v) for v in row] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        numeric = [_is_numeric_column([row[i] for row in self.rows]) for i in range(len(self.columns))]

        def line(values: list[str]) -> str:
            return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

        out = [line(list(self.columns)), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in cells]
        out.append(f"({len(self.rows)} row{'s' if len(self.rows) != 1 else ''})")
        return "\n".join(out)


def run_query(con: duckdb.DuckDBPyConnection, query: str, params: list[Any] | None = None) -> QueryResult:
    """Execute and fetch the last statement's result (statements without one give an empty result)."""
    cursor = con.execute(query, params) if params else con.execute(query)
    if cursor.description is None:
        return QueryResult((), ())
    columns = tuple(d[0] for d in cursor.description)
    return QueryResult(columns, tuple(tuple(r) for r in cursor.fetchall()))
