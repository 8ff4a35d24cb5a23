"""The run store's schema version (``PRAGMA user_version``) and its migrations.

Version 1 is the first schema (workload runs and their attempts); a store written before
versions existed has ``user_version`` 0 and those tables, and is version 1. Each migration
moves a store one version up inside the write transaction that opened it, so several
processes opening an old store at once migrate it once. A store whose version is newer than
:data:`SCHEMA_VERSION` was written by a newer gpufleet and is refused with
:class:`SchemaVersionError` (nothing is written to it).

Versions:

1. ``runs`` and ``attempts`` (workload runs).
2. ``runs.kind`` (``workload`` or ``call``), ``runs.origin`` (JSON: path, host, user, pid of
   the process that started the run) and ``runs.placement`` (JSON: the GPUs and nodes it got).
3. ``attempts.recoveries`` (JSON: each lost rank replaced in place, or refused, in the attempt;
   :class:`gpufleet.launch.recoveries.Recovery`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from ..errors import GpufleetError
from ..launch.node import envcontract

#: The schema version this gpufleet writes.
SCHEMA_VERSION = 3

_V1 = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    experiment TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    idempotency_key TEXT UNIQUE,
    workload_path TEXT,
    config TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    num_nodes INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    tracking INTEGER NOT NULL DEFAULT 1,
    supervisor_pid INTEGER,
    supervisor_started REAL,
    heartbeat_at REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    message TEXT
);
CREATE INDEX IF NOT EXISTS runs_state ON runs (state);
CREATE INDEX IF NOT EXISTS runs_created ON runs (created_at);
CREATE TABLE IF NOT EXISTS attempts (
    run_id TEXT NOT NULL REFERENCES runs (id),
    attempt INTEGER NOT NULL,
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    exit_code INTEGER,
    mlflow_run_id TEXT,
    log_dir TEXT NOT NULL,
    nodes TEXT NOT NULL DEFAULT '[]',
    message TEXT,
    PRIMARY KEY (run_id, attempt)
)
"""

_V2 = """
ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'workload';
ALTER TABLE runs ADD COLUMN origin TEXT NOT NULL DEFAULT '{}';
ALTER TABLE runs ADD COLUMN placement TEXT NOT NULL DEFAULT '{}';
CREATE INDEX IF NOT EXISTS runs_kind ON runs (kind)
"""

_V3 = """
ALTER TABLE attempts ADD COLUMN recoveries TEXT NOT NULL DEFAULT '[]'
"""


def _script(sql: str) -> Callable[[sqlite3.Connection], None]:
    def apply(db: sqlite3.Connection) -> None:
        for statement in sql.split(";"):
            if statement.strip():
                db.execute(statement)

    return apply


#: ``MIGRATIONS[n]`` moves a store from version ``n`` to ``n + 1`` (0: an empty file).
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _script(_V1), 1: _script(_V2), 2: _script(_V3)}


class SchemaVersionError(GpufleetError, RuntimeError):
    """The store was written by a newer gpufleet (its schema version is above :data:`SCHEMA_VERSION`)."""


def _has_tables(db: sqlite3.Connection) -> bool:
    row = db.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN ('runs', 'attempts')"
    ).fetchone()
    return bool(row[0] == 2)


def schema_version(db: sqlite3.Connection) -> int:
    """The store's version: ``user_version``, or 1 for a store written before versions (0 for an empty one)."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version == 0 and _has_tables(db):
        return 1
    return version


def check_version(version: int, path: object) -> None:
    """Refuse a store newer than this gpufleet."""
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"the run store {path} has schema version {version}, written by a newer gpufleet; this gpufleet "
            f"knows versions up to {SCHEMA_VERSION}. Upgrade gpufleet (pip install -U gpufleet), or point "
            f"{envcontract.HOME} (--home) at another folder to start a separate store"
        )


def migrate(db: sqlite3.Connection, path: object = "") -> int:
    """Bring the store up to :data:`SCHEMA_VERSION` (inside the caller's write transaction); returns the old version."""
    old = version = schema_version(db)
    check_version(version, path)
    while version < SCHEMA_VERSION:
        MIGRATIONS[version](db)
        version += 1
    if db.execute("PRAGMA user_version").fetchone()[0] != version:
        db.execute(f"PRAGMA user_version = {int(version)}")
    return old
