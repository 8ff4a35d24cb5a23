"""The run store: an embedded SQLite database of runs (workload runs and decorated calls) and their attempts.

One file (``$GPUFLEET_HOME/runs.db``, created 0600 in a 0700 state folder checked by
:func:`gpufleet.private.private_dir`) in WAL mode, so several CLI processes and background
supervisors read and write it at once. Every write is a short ``BEGIN IMMEDIATE``
transaction; a state only leaves PENDING/RUNNING once (the first terminal state written wins).

A store that another process keeps locked is waited for: each operation is retried with a
growing pause until ``wait_s`` has passed (``$GPUFLEET_STORE_WAIT_S``, 30 s by default, for
the CLI; the supervisor waits far longer), and ``on_busy`` is told once per wait. Past the
bound it raises :class:`StoreBusyError`; a damaged or unusable file raises
:class:`StoreError`.

Reads only read (opening the store writes only when it has no tables yet, or an older schema
version to migrate: :mod:`gpufleet.runs.migrations`; a newer one is refused). A run whose
supervisor died is found, marked FAILED and stopped by :mod:`gpufleet.runs.liveness`,
which the CLI commands read runs through.

One concern past 400 lines: the SQL of the run store (its tables, transactions and retries
under contention); records, liveness and migrations live in their own modules.
"""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from ..errors import GpufleetError
from ..launch.node import envcontract
from ..private import private_dir
from ..results import gpufleet_home
from ..states import (  # noqa: F401 - re-exported for the modules that read runs
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
from .migrations import SCHEMA_VERSION, SchemaVersionError, check_version, migrate, schema_version
from .records import AttemptRecord, RunRecord

__all__ = [
    "AttemptRecord", "HEARTBEAT_S", "MIN_PREFIX", "RunIdError", "RunNotFoundError", "RunRecord", "RunStore",
    "StoreBusyError", "StoreError",
]  # fmt: skip

#: Seconds between supervisor heartbeats.
HEARTBEAT_S = 2.0
#: Seconds a CLI command waits for a store that another process keeps locked (``GPUFLEET_STORE_WAIT_S``).
DEFAULT_WAIT_S = 30.0
#: A run id given by prefix must have at least this many characters.
MIN_PREFIX = 6
#: Milliseconds SQLite itself waits for a lock before the store's own backoff takes over.
_BUSY_SLICE_MS = 250
_MAX_BACKOFF_S = 1.0
_T = TypeVar("_T")

class RunNotFoundError(GpufleetError, LookupError):
    """No run has this id (or the id given is not one a run can be found by: see :class:`RunIdError`)."""


class RunIdError(RunNotFoundError, ValueError):
    """A run id that names no run by its rules: empty, a prefix shorter than :data:`MIN_PREFIX`, or ambiguous."""


class StoreError(GpufleetError, RuntimeError):
    """The run store cannot be used: it stayed locked, it is damaged, or it cannot be written."""


class StoreBusyError(StoreError, TimeoutError):
    """Another process kept the run store locked for longer than the store waits."""


def store_wait_s(default: float = DEFAULT_WAIT_S, env: str = envcontract.STORE_WAIT_S) -> float:
    """Seconds to wait for a locked store: ``$env`` when it is a number >= 0, else ``default``."""
    try:
        value = float(os.environ[env])
    except (KeyError, ValueError):
        return default
    return value if value >= 0 else default


_RUN_COLUMNS = [
    "id", "experiment", "state", "created_at", "started_at", "ended_at", "idempotency_key",
    "workload_path", "config", "run_dir", "num_nodes", "world_size", "max_attempts", "tracking",
    "supervisor_pid", "supervisor_started", "heartbeat_at", "cancel_requested", "exit_code",
    "message", "kind", "origin", "placement",
]  # fmt: skip
#: Columns stored as JSON text.
_JSON_COLUMNS = ("config", "origin", "placement")
_ATTEMPT_JSON_COLUMNS = ("nodes", "recoveries")

# SQLite's primary result codes (``sqlite3.Error.sqlite_errorcode & 0xff``)
_SQLITE_PERM, _SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY = 3, 5, 6, 8
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 10, 11, 13, 14, 26


def _error_code(e: sqlite3.Error) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _is_busy(e: sqlite3.Error) -> bool:
    code = _error_code(e)
    if code is not None:
        return code in (_SQLITE_BUSY, _SQLITE_LOCKED)
    text = str(e).lower()
    return "locked" in text or "busy" in text


def _run_from_row(row: sqlite3.Row) -> RunRecord:
    d = dict(row)
    d["state"] = RunState(d["state"])
    for col in _JSON_COLUMNS:
        d[col] = json.loads(d[col] or "{}")
    d["tracking"] = bool(d["tracking"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return RunRecord(**d)


def _attempt_from_row(row: sqlite3.Row) -> AttemptRecord:
    d = dict(row)
    d["state"] = RunState(d["state"])
    for col in _ATTEMPT_JSON_COLUMNS:
        d[col] = json.loads(d[col] or "[]")
    return AttemptRecord(**d)


class RunStore:
    """Runs and attempts in ``<home>/runs.db``; safe to use from many processes at once.

    Args:
        home: the state folder (default ``$GPUFLEET_HOME`` or ``~/.gpufleet``); created 0700,
            or checked (:func:`gpufleet.private.private_dir`) when it exists.
        wait_s: seconds an operation waits for a store another process keeps locked (default
            ``$GPUFLEET_STORE_WAIT_S`` or 30).
        on_busy: called with a one-line message when an operation starts waiting.

    Raises:
        UnsafeStateError: the state folder is not the user's own, is a file or is read-only.
        StoreError: ``runs.db`` is damaged or cannot be used; :class:`StoreBusyError` when it
            stayed locked for ``wait_s``.
    """

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        *,
        wait_s: float | None = None,
        on_busy: Callable[[str], None] | None = None,
    ) -> None:
        self.home = private_dir(Path(home) if home else gpufleet_home(), "gpufleet's state folder")
        self.path = self.home / "runs.db"
        self.wait_s = store_wait_s() if wait_s is None else float(wait_s)
        self.on_busy = on_busy
        self._create_file()
        self._open_schema()
        self._tighten()

    @property
    def runs_dir(self) -> Path:
        """Folder holding one directory per workload run."""
        return self.home / "workloads"

    def _open_schema(self) -> None:
        """Create the tables of a new store, migrate an older one, refuse a newer one (see :mod:`.migrations`)."""
        try:
            version = self._call(schema_version)
            check_version(version, self.path)
            if version != SCHEMA_VERSION:
                self._call(lambda db: migrate(db, self.path), write=True, wal=version == 0)
        except SchemaVersionError as e:
            raise StoreError(str(e)) from None

    def with_wait(self, wait_s: float) -> RunStore:
        """This store, waiting at most ``wait_s`` seconds for a lock (for writes that may be skipped)."""
        other = copy.copy(self)
        other.wait_s = wait_s
        return other

    # ------------------------------------------------------------ the file and its locks

    def _create_file(self) -> None:
        """Create ``runs.db`` 0600 (an empty file is an empty SQLite database)."""
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            st = self.path.lstat()
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"the run store {self.path} is not a regular file; move it away") from None
        except OSError as e:
            raise StoreError(f"the run store {self.path} cannot be created: {e.strerror}") from e

    def _tighten(self) -> None:
        """Make the store's files 0600 (its -wal and -shm files take the database's mode)."""
        for suffix in ("", "-wal", "-shm"):
            path = Path(f"{self.path}{suffix}")
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(path, 0o600)
            except OSError:
                pass

    def _error(self, e: sqlite3.Error) -> Exception:
        """The store error that ``e`` means for the user (``e`` itself when it is none of those)."""
        code = _error_code(e)
        if code in (_SQLITE_NOTADB, _SQLITE_CORRUPT) or "not a database" in str(e):
            return StoreError(
                f"the run store {self.path} is damaged or not a SQLite database ({e}); move it away to start "
                "a new, empty store, or put back a copy"
            )
        if code in (_SQLITE_READONLY, _SQLITE_CANTOPEN, _SQLITE_PERM, _SQLITE_IOERR, _SQLITE_FULL):
            return StoreError(f"the run store {self.path} cannot be used: {e}")
        return e

    def _call(self, fn: Callable[[sqlite3.Connection], _T], write: bool = False, wal: bool = False) -> _T:
        """``fn(db)`` in one transaction, retried while another process holds a lock, up to ``wait_s``.

        The transaction is rolled back before each retry, so ``fn`` runs afresh.
        """
        deadline = time.monotonic() + self.wait_s
        pause = 0.05
        waiting = False
        while True:
            try:
                return self._transaction(fn, write, wal)
            except sqlite3.Error as e:
                if not _is_busy(e):
                    error = self._error(e)
                    if error is e:
                        raise
                    raise error from e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreBusyError(
                        f"the run store {self.path} stayed busy (locked by another process) for {self.wait_s:g} s; "
                        f"try again once that process is done (`fuser {self.path}` names it)"
                    ) from e
                if not waiting:
                    waiting = True
                    if self.on_busy is not None:
                        self.on_busy(
                            f"the run store is busy (locked by another process); waiting up to {self.wait_s:g} s..."
                        )
                time.sleep(min(pause, left))
                pause = min(pause * 2, _MAX_BACKOFF_S)

    def _transaction(self, fn: Callable[[sqlite3.Connection], _T], write: bool, wal: bool) -> _T:
        db = sqlite3.connect(self.path, timeout=_BUSY_SLICE_MS / 1000, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            if wal:
                db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = fn(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass  # closing the connection rolls it back
                raise
            return result
        finally:
            db.close()

    # ------------------------------------------------------------ runs

    def create_run(self, record: RunRecord) -> tuple[RunRecord, bool]:
        """Insert a new run; with an idempotency key already used, return that run instead.

        Returns ``(run, created)``.
        """
        values = asdict(record)
        values.pop("attempts")
        for col in _JSON_COLUMNS:
            values[col] = json.dumps(values[col], sort_keys=True, default=str)

        def insert(db: sqlite3.Connection) -> str | None:
            if record.idempotency_key is not None:
                row = db.execute(
                    "SELECT id FROM runs WHERE idempotency_key = ?", (record.idempotency_key,)
                ).fetchone()
                if row is not None:
                    return str(row["id"])
            cols = ", ".join(_RUN_COLUMNS)
            marks = ", ".join("?" for _ in _RUN_COLUMNS)
            db.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", [values[c] for c in _RUN_COLUMNS])
            return None

        existing_id = self._call(insert, write=True)
        if existing_id is not None:
            return self.get(existing_id), False
        return self.get(record.id), True

    def _resolve(self, db: sqlite3.Connection, run_id: str) -> sqlite3.Row:
        """The row of the run named ``run_id``: its exact id, or a unique prefix of >= MIN_PREFIX characters."""
        row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is not None:
            return row
        if not run_id.strip():
            raise RunIdError("an empty run id names no run; give a run's id (or a unique prefix of at least "
                             f"{MIN_PREFIX} characters of it)")  # fmt: skip
        if len(run_id) < MIN_PREFIX:
            raise RunIdError(
                f"run id {run_id!r} is no run's id, and a prefix must have at least {MIN_PREFIX} characters; "
                "`gpufleet list --all-status` shows the runs"
            )
        rows = db.execute(
            "SELECT * FROM runs WHERE id LIKE ? ESCAPE '\\' ORDER BY created_at DESC, id DESC LIMIT 11",
            (_like_prefix(run_id),),
        ).fetchall()
        if not rows:
            raise RunNotFoundError(f"run {run_id!r} does not exist in {self.path}; `gpufleet list --all-status` "
                                   "shows the runs")  # fmt: skip
        if len(rows) > 1:
            ids = ", ".join(r["id"] for r in rows[:10]) + (", ..." if len(rows) > 10 else "")
            raise RunIdError(f"run id prefix {run_id!r} is ambiguous: it matches {ids}; give more of the id")
        return rows[0]

    def _load(self, db: sqlite3.Connection, row: sqlite3.Row) -> RunRecord:
        run = _run_from_row(row)
        run.attempts = [
            _attempt_from_row(r)
            for r in db.execute(
                "SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt", (run.id,)
            ).fetchall()
        ]
        return run

    def get(self, run_id: str) -> RunRecord:
        """The run with this id (or a unique prefix of at least :data:`MIN_PREFIX` characters), as stored.

        Raises:
            RunIdError: ``run_id`` is empty, a shorter prefix, or a prefix of several runs.
            RunNotFoundError: no run has this id or prefix.
        """
        return self._call(lambda db: self._load(db, self._resolve(db, run_id)))

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
            elif col == "created_at":
                where.append("created_at >= ?")
                args.append(float(value))
            elif col == "state":
                wanted = [v.strip().upper() for v in value.split(",")]
                where.append(f"state IN ({', '.join('?' for _ in wanted)})")
                args.extend(wanted)
            else:
                where.append(f"{col} = ?")
                args.append(value)
        sql = "SELECT * FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self._call(lambda db: [self._load(db, r) for r in db.execute(sql, args).fetchall()])

    def count(self) -> dict[str, int]:
        """Number of runs in each state."""
        rows = self._call(lambda db: db.execute("SELECT state, COUNT(*) AS n FROM runs GROUP BY state").fetchall())
        return {r["state"]: r["n"] for r in rows}

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set columns of a run (``origin`` and ``placement`` as dicts)."""
        if not fields:
            return
        for col in _JSON_COLUMNS:
            if col in fields:
                fields[col] = json.dumps(fields[col], sort_keys=True, default=str)
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._call(lambda db: db.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*fields.values(), run_id]), write=True)

    def finish_run(self, run_id: str, state: str, **fields: Any) -> bool:
        """Move an active run to a terminal ``state``; False if it already had one.

        An attempt still active ends with the run, in the same transaction: it gets the run's
        state, end time, exit code and message (where it has none of its own). A call's attempt
        ends this way; a workload's supervisor ends each attempt before its run.
        """
        assert RunState(state).terminal
        fields = {"state": state, "ended_at": time.time(), **fields}
        sets = ", ".join(f"{k} = ?" for k in fields)

        def finish(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                f"UPDATE runs SET {sets} WHERE id = ? AND state IN (?, ?)",
                [*fields.values(), run_id, *ACTIVE_STATES],
            )
            if cur.rowcount:
                db.execute(
                    "UPDATE attempts SET state = ?, ended_at = COALESCE(ended_at, ?), "
                    "exit_code = COALESCE(exit_code, ?), message = COALESCE(message, ?) "
                    "WHERE run_id = ? AND state IN (?, ?)",
                    (state, fields["ended_at"], fields.get("exit_code"), fields.get("message"), run_id, *ACTIVE_STATES),
                )
            return cur.rowcount > 0

        return self._call(finish, write=True)

    def mark_running(self, run_id: str, pid: int, pid_started: float) -> bool:
        """Register the supervisor of a PENDING run; False if the run is no longer PENDING."""
        now = time.time()
        return self._call(
            lambda db: db.execute(
                "UPDATE runs SET state = ?, started_at = ?, supervisor_pid = ?, "
                "supervisor_started = ?, heartbeat_at = ? WHERE id = ? AND state = ?",
                (RUNNING, now, pid, pid_started, now, run_id, PENDING),
            ).rowcount > 0,
            write=True,
        )  # fmt: skip

    def heartbeat(self, run_id: str) -> tuple[str, bool]:
        """Record that the supervisor is alive; returns the run's (state, cancel_requested).

        Raises:
            RunNotFoundError: the run's record was removed from the store.
        """

        def beat(db: sqlite3.Connection) -> tuple[str, bool]:
            db.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ?", (time.time(), run_id))
            row = db.execute("SELECT state, cancel_requested FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(f"run {run_id} is no longer in the run store {self.path}")
            return row["state"], bool(row["cancel_requested"])

        return self._call(beat, write=True)

    def request_cancel(self, run_id: str) -> None:
        """Ask the run's supervisor to cancel it."""
        self.update_run(run_id, cancel_requested=1)

    # ------------------------------------------------------------ attempts

    def start_attempt(self, attempt: AttemptRecord) -> None:
        """Record a new attempt (RUNNING)."""
        d = asdict(attempt)
        for col in _ATTEMPT_JSON_COLUMNS:
            d[col] = json.dumps(d[col])
        cols = list(d)
        self._call(
            lambda db: db.execute(
                f"INSERT INTO attempts ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                [d[c] for c in cols],
            ),
            write=True,
        )  # fmt: skip

    def update_attempt(self, run_id: str, attempt: int, **fields: Any) -> None:
        """Set columns of an attempt (``nodes`` and ``recoveries`` as lists of dicts)."""
        for col in _ATTEMPT_JSON_COLUMNS:
            if col in fields:
                fields[col] = json.dumps(fields[col])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._call(
            lambda db: db.execute(
                f"UPDATE attempts SET {sets} WHERE run_id = ? AND attempt = ?", [*fields.values(), run_id, attempt]
            ),
            write=True,
        )  # fmt: skip


_FILTERABLE = {
    "state": "state",
    "status": "state",
    "experiment": "experiment",
    "experiment_name": "experiment",
    "id": "id",
    "idempotency_key": "idempotency_key",
    "key": "idempotency_key",
    "kind": "kind",
    "name": "experiment",
    "since": "created_at",
}


def _like_prefix(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
