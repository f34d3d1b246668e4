"""The memory's schema as numbered migrations, applied in order and recorded in `schema_version`.

Never edit a migration that has shipped: add the next one. A writable open applies whatever is missing,
each migration in its own transaction; a read-only open only checks that the file is at the version this
code expects.
"""
from __future__ import annotations

from dataclasses import dataclass

import duckdb


class SchemaVersionError(RuntimeError):
    """The database file's schema is older than this code (and cannot be migrated now) or newer."""


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.version < 1 or not self.statements:
            raise ValueError(f"migration {self.version} needs a positive version and at least one statement")


_V1 = Migration(1, "mechanisms, scopes, runs, evidence, failures", (
    "CREATE SEQUENCE mechanisms_id_seq START 1",
    """CREATE TABLE mechanisms (
        id INTEGER PRIMARY KEY DEFAULT nextval('mechanisms_id_seq'),
        name VARCHAR NOT NULL UNIQUE,
        category VARCHAR NOT NULL CHECK (category IN ('algorithm', 'kernel', 'scheduling')),
        description VARCHAR NOT NULL DEFAULT '',
        config_delta JSON NOT NULL DEFAULT '{}',
        code_ref VARCHAR,
        created TIMESTAMPTZ NOT NULL DEFAULT now(),
        updated TIMESTAMPTZ NOT NULL DEFAULT now())""",
    "CREATE SEQUENCE scopes_id_seq START 1",
    """CREATE TABLE scopes (
        id INTEGER PRIMARY KEY DEFAULT nextval('scopes_id_seq'),
        model_family VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        drafter VARCHAR NOT NULL,
        gpu VARCHAR NOT NULL,
        regime VARCHAR NOT NULL,
        UNIQUE (model_family, model, drafter, gpu, regime))""",
    """CREATE TABLE runs (
        run_id VARCHAR PRIMARY KEY,
        deployment VARCHAR NOT NULL,
        started TIMESTAMPTZ NOT NULL,
        finished TIMESTAMPTZ,
        status VARCHAR NOT NULL CHECK (status IN ('running', 'succeeded', 'failed', 'cancelled')),
        fingerprint JSON NOT NULL DEFAULT '{}',
        report_uri VARCHAR)""",
    "CREATE SEQUENCE evidence_id_seq START 1",
    """CREATE TABLE evidence (
        id INTEGER PRIMARY KEY DEFAULT nextval('evidence_id_seq'),
        mechanism_id INTEGER NOT NULL REFERENCES mechanisms (id),
        scope_id INTEGER NOT NULL REFERENCES scopes (id),
        run_id VARCHAR NOT NULL REFERENCES runs (run_id),
        deployment VARCHAR NOT NULL,
        benchmark VARCHAR NOT NULL,
        metric VARCHAR NOT NULL,
        before DOUBLE NOT NULL CHECK (before > 0),
        after DOUBLE NOT NULL CHECK (after > 0),
        higher_is_better BOOLEAN NOT NULL DEFAULT TRUE,
        verdict VARCHAR NOT NULL CHECK (verdict IN ('pass', 'fail', 'tie')),
        artifact_uris JSON NOT NULL DEFAULT '[]',
        created TIMESTAMPTZ NOT NULL DEFAULT now())""",
    "CREATE SEQUENCE failures_id_seq START 1",
    """CREATE TABLE failures (
        id INTEGER PRIMARY KEY DEFAULT nextval('failures_id_seq'),
        run_id VARCHAR NOT NULL REFERENCES runs (run_id),
        mechanism VARCHAR,
        config_delta JSON,
        stage VARCHAR NOT NULL,
        reason VARCHAR NOT NULL,
        created TIMESTAMPTZ NOT NULL DEFAULT now())""",
    "CREATE INDEX evidence_mechanism_idx ON evidence (mechanism_id)",
))

MIGRATIONS: tuple[Migration, ...] = (_V1,)
LATEST_VERSION = MIGRATIONS[-1].version
assert [m.version for m in MIGRATIONS] == list(range(1, LATEST_VERSION + 1)), "migrations must be numbered 1..N"

_VERSION_TABLE = """CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER PRIMARY KEY, description VARCHAR NOT NULL, applied TIMESTAMPTZ NOT NULL DEFAULT now())"""


def current_version(con: duckdb.DuckDBPyConnection) -> int:
    """The highest applied migration; 0 for a fresh file."""
    exists = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'schema_version' "
                         "AND database_name = current_database() AND schema_name = 'main'").fetchone()[0]
    if not exists:
        return 0
    return int(con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0])


def _too_new(path: str, version: int) -> SchemaVersionError:
    return SchemaVersionError(f"memory {path} is at schema version {version}, newer than this code's "
                              f"{LATEST_VERSION}; upgrade specpilot")


def migrate(con: duckdb.DuckDBPyConnection, path: str) -> int:
    """Apply every missing migration in order; return the resulting version."""
    con.execute(_VERSION_TABLE)
    version = current_version(con)
    if version > LATEST_VERSION:
        raise _too_new(path, version)
    for migration in MIGRATIONS[version:]:
        con.execute("BEGIN TRANSACTION")
        try:
            for statement in migration.statements:
                con.execute(statement)
            con.execute("INSERT INTO schema_version (version, description) VALUES (?, ?)",
                        [migration.version, migration.description])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return current_version(con)


def check_version(con: duckdb.DuckDBPyConnection, path: str) -> int:
    """For read-only opens: the file must already be at this code's version."""
    version = current_version(con)
    if version > LATEST_VERSION:
        raise _too_new(path, version)
    if version < LATEST_VERSION:
        raise SchemaVersionError(f"memory {path} is at schema version {version}, this code needs {LATEST_VERSION}; "
                                 f"open it writable once to migrate "
                                 f"(e.g. `specpilot memory sql --write --db {path} 'SELECT 1'`)")
    return version
