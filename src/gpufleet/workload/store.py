"""The run store: an embedded SQLite database of workload runs and their attempts.

One file (``$GPUFLEET_HOME/runs.db``) in WAL mode with a busy timeout, so several CLI
processes and background supervisors read and write it at once. Every write is a short
``BEGIN IMMEDIATE`` transaction; a state only leaves PENDING/RUNNING once (the first
terminal state written wins).

Reads only read. A run whose supervisor died is found, marked FAILED and stopped by
:mod:`gpufleet.workload.liveness`, which the CLI commands read runs through.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import GpufleetError
from ..results import gpufleet_home
from ..states import (  # noqa: F401 - re-exported for the workload modules
    ACTIVE_STATES,
    CANCELED,
    FAILED,
    PENDING,
    RUNNING,
    STATES,
    SUCCESS,
    TERMINAL_STATES,
    TIMEDOUT,
    RunState,
)
from .records import AttemptRecord, RunRecord

__all__ = ["AttemptRecord", "HEARTBEAT_S", "RunNotFoundError", "RunRecord", "RunStore"]

#: Seconds between supervisor heartbeats.
HEARTBEAT_S = 2.0

_SCHEMA = """
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
);
"""


class RunNotFoundError(GpufleetError, LookupError):
    """No run has this id (or the prefix is ambiguous)."""


_RUN_COLUMNS = [
    "id", "experiment", "state", "created_at", "started_at", "ended_at", "idempotency_key",
    "workload_path", "config", "run_dir", "num_nodes", "world_size", "max_attempts", "tracking",
    "supervisor_pid", "supervisor_started", "heartbeat_at", "cancel_requested", "exit_code",
    "message",
]  # fmt: skip


def _run_from_row(row: sqlite3.Row) -> RunRecord:
    d = dict(row)
    d["state"] = RunState(d["state"])
    d["config"] = json.loads(d["config"])
    d["tracking"] = bool(d["tracking"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return RunRecord(**d)


def _attempt_from_row(row: sqlite3.Row) -> AttemptRecord:
    d = dict(row)
    d["state"] = RunState(d["state"])
    d["nodes"] = json.loads(d["nodes"] or "[]")
    return AttemptRecord(**d)


class RunStore:
    """Runs and attempts in ``<home>/runs.db``; safe to use from many processes at once."""

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = Path(home) if home else gpufleet_home()
        self.home.mkdir(parents=True, exist_ok=True)
        self.path = self.home / "runs.db"
        with self._tx() as db:
            db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")

    @property
    def runs_dir(self) -> Path:
        """Folder holding one directory per workload run."""
        return self.home / "workloads"

    @contextlib.contextmanager
    def _tx(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA busy_timeout = 60000")
            for _ in range(100):
                try:
                    db.execute("PRAGMA journal_mode = WAL")
                    break
                except sqlite3.OperationalError:  # another process is switching it right now
                    time.sleep(0.05)
            db.execute("PRAGMA synchronous = NORMAL")
            if write:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            else:
                yield db
        finally:
            db.close()

    # ------------------------------------------------------------ runs

    def create_run(self, record: RunRecord) -> tuple[RunRecord, bool]:
        """Insert a new run; with an idempotency key already used, return that run instead.

        Returns ``(run, created)``.
        """
        values = asdict(record)
        values.pop("attempts")
        values["config"] = json.dumps(values["config"], sort_keys=True, default=str)
        with self._tx(write=True) as db:
            if record.idempotency_key is not None:
                row = db.execute(
                    "SELECT id FROM runs WHERE idempotency_key = ?", (record.idempotency_key,)
                ).fetchone()
                if row is not None:
                    existing_id = row["id"]
                    created = False
                else:
                    existing_id = None
            else:
                existing_id = None
            if existing_id is None:
                cols = ", ".join(_RUN_COLUMNS)
                marks = ", ".join("?" for _ in _RUN_COLUMNS)
                db.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", [values[c] for c in _RUN_COLUMNS])
                created = True
        if existing_id is not None:
            return self.get(existing_id), False
        return self.get(record.id), created

    def _load(self, db: sqlite3.Connection, run_id: str) -> RunRecord:
        row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            rows = db.execute(
                "SELECT * FROM runs WHERE id LIKE ? ESCAPE '\\' OR id LIKE ? ESCAPE '\\' LIMIT 2",
                (_like_prefix(run_id), "%" + _like_prefix(run_id)),
            ).fetchall()
            if len(rows) != 1:
                what = "is ambiguous" if rows else "does not exist"
                raise RunNotFoundError(
                    f"run {run_id!r} {what} in {self.path}; `gpufleet list --all-status` shows the runs"
                )
            row = rows[0]
        run = _run_from_row(row)
        run.attempts = [
            _attempt_from_row(r)
            for r in db.execute(
                "SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt", (run.id,)
            ).fetchall()
        ]
        return run

    def get(self, run_id: str) -> RunRecord:
        """The run with this id (or a unique id prefix or suffix), as stored."""
        with self._tx() as db:
            return self._load(db, run_id)

    def list(
        self,
        states: tuple[str, ...] | None = ACTIVE_STATES,
        limit: int | None = 20,
        filters: dict[str, str] | None = None,
    ) -> list[RunRecord]:
        """Runs as stored, newest first, in ``states`` (None: all) matching ``filters`` (column=value)."""
        where, args = [], []
        if states:
            where.append(f"state IN ({', '.join('?' for _ in states)})")
            args.extend(states)
        for key, value in (filters or {}).items():
            if key not in _FILTERABLE:
                raise ValueError(
                    f"cannot filter on {key!r}; filter on one of: {', '.join(sorted(_FILTERABLE))}"
                )
            col = _FILTERABLE[key]
            if col == "id":
                where.append("id LIKE ? ESCAPE '\\'")
                args.append(_like_prefix(value))
            elif col == "state":
                wanted = [v.strip().upper() for v in value.split(",")]
                where.append(f"state IN ({', '.join('?' for _ in wanted)})")
                args.extend(wanted)
            else:
                where.append(f"{col} = ?")
                args.append(value)
        sql = "SELECT id FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._tx() as db:
            return [self._load(db, r["id"]) for r in db.execute(sql, args).fetchall()]

    def count(self) -> dict[str, int]:
        """Number of runs in each state."""
        with self._tx() as db:
            rows = db.execute("SELECT state, COUNT(*) AS n FROM runs GROUP BY state").fetchall()
        return {r["state"]: r["n"] for r in rows}

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set columns of a run."""
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx(write=True) as db:
            db.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*fields.values(), run_id])

    def finish_run(self, run_id: str, state: str, **fields: Any) -> bool:
        """Move an active run to a terminal ``state``; False if it already had one."""
        assert RunState(state).terminal
        fields = {"state": state, "ended_at": time.time(), **fields}
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx(write=True) as db:
            cur = db.execute(
                f"UPDATE runs SET {sets} WHERE id = ? AND state IN (?, ?)",
                [*fields.values(), run_id, *ACTIVE_STATES],
            )
            if cur.rowcount:
                db.execute(
                    "UPDATE attempts SET state = ?, ended_at = COALESCE(ended_at, ?) "
                    "WHERE run_id = ? AND state IN (?, ?)",
                    (state, fields["ended_at"], run_id, *ACTIVE_STATES),
                )
            return cur.rowcount > 0

    def mark_running(self, run_id: str, pid: int, pid_started: float) -> bool:
        """Register the supervisor of a PENDING run; False if the run is no longer PENDING."""
        now = time.time()
        with self._tx(write=True) as db:
            cur = db.execute(
                "UPDATE runs SET state = ?, started_at = ?, supervisor_pid = ?, "
                "supervisor_started = ?, heartbeat_at = ? WHERE id = ? AND state = ?",
                (RUNNING, now, pid, pid_started, now, run_id, PENDING),
            )
            return cur.rowcount > 0

    def heartbeat(self, run_id: str) -> tuple[str, bool]:
        """Record that the supervisor is alive; returns the run's (state, cancel_requested)."""
        with self._tx(write=True) as db:
            db.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ?", (time.time(), run_id))
            row = db.execute(
                "SELECT state, cancel_requested FROM runs WHERE id = ?", (run_id,)
            ).fetchone()
        return row["state"], bool(row["cancel_requested"])

    def request_cancel(self, run_id: str) -> None:
        """Ask the run's supervisor to cancel it."""
        self.update_run(run_id, cancel_requested=1)

    # ------------------------------------------------------------ attempts

    def start_attempt(self, attempt: AttemptRecord) -> None:
        """Record a new attempt (RUNNING)."""
        d = asdict(attempt)
        d["nodes"] = json.dumps(d["nodes"])
        cols = list(d)
        with self._tx(write=True) as db:
            db.execute(
                f"INSERT INTO attempts ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                [d[c] for c in cols],
            )

    def update_attempt(self, run_id: str, attempt: int, **fields: Any) -> None:
        """Set columns of an attempt (``nodes`` as a list of dicts)."""
        if "nodes" in fields:
            fields["nodes"] = json.dumps(fields["nodes"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx(write=True) as db:
            db.execute(
                f"UPDATE attempts SET {sets} WHERE run_id = ? AND attempt = ?",
                [*fields.values(), run_id, attempt],
            )


_FILTERABLE = {
    "state": "state",
    "status": "state",
    "experiment": "experiment",
    "experiment_name": "experiment",
    "id": "id",
    "idempotency_key": "idempotency_key",
    "key": "idempotency_key",
}


def _like_prefix(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
