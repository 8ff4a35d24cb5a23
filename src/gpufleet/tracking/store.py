"""gpufleet's default MLflow store: created whole or not at all, and repaired when it is not whole.

MLflow creates the tables of a SQLite store on first use, in place. When that is cut short (a
full disk, a killed process), the file is left with some tables, MLflow's next attempt to create
them fails, and tracking stays off for good. Here a new store is built beside its final path and
renamed into place once complete (under a file lock, so concurrent callers never replace each
other's store), and a store that lacks tables is moved aside (kept for inspection) and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_ready: set[str] = set()  # stores checked by this process


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Hold back MLflow's and alembic's INFO lines ("Creating initial MLflow database tables...")."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


#: The loggers of MLflow's and alembic's schema creation and migration messages.
STORE_CREATION_LOGGERS = ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration")


def quiet_store_creation() -> contextlib.AbstractContextManager[None]:
    """Hold back the INFO lines MLflow prints while it creates or upgrades a database store."""
    return _quiet(*STORE_CREATION_LOGGERS)


def _is_whole(path: Path) -> bool:
    """Whether the SQLite file at ``path`` has every table MLflow's models define."""
    import sqlalchemy
    from mlflow.store.db.utils import _all_tables_exist

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        return bool(_all_tables_exist(engine))
    finally:
        engine.dispose()


def _forget_engine(uri: str) -> None:
    """Close and drop MLflow's cached engine of ``uri`` in this process, if it has one."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = SqlAlchemyStore._engine_map.pop(uri, None)
    if engine is not None:
        engine.dispose()


def _build(path: Path, artifact_root: Path) -> None:
    """Create a complete store at ``path`` (MLflow's own schema and migrations)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    uri = f"sqlite:///{path}"
    with _quiet(*STORE_CREATION_LOGGERS):
        store = SqlAlchemyStore(uri, str(artifact_root))
    store.engine.dispose()
    _forget_engine(uri)  # the file is renamed: no engine may keep it


def ensure_default_store(path: Path, artifact_root: Path) -> None:
    """Make sure the SQLite store at ``path`` exists with all its tables; build or repair it.

    Raises:
        OSError: the store cannot be written (no space left, a read-only folder); the message
            names the file.
    """
    key = str(path)
    if key in _ready:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)  # the folder itself is the lock: no file is left behind
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists() and path.stat().st_size > 0 and not _is_whole(path):
                aside = path.with_name(f"{path.name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}")
                _forget_engine(f"sqlite:///{path}")  # pooled connections would still write to the moved file
                os.replace(path, aside)
                logger.warning(
                    "the MLflow store %s was incomplete (its creation was cut short, e.g. by a full disk); "
                    "it was moved to %s and a new one is created", path, aside,
                )
            if not path.exists() or path.stat().st_size == 0:
                building = path.with_name(f"{path.name}.creating-{os.getpid()}")
                try:
                    _build(building, artifact_root)
                    os.chmod(building, 0o600)
                    os.replace(building, path)
                except OSError as e:
                    raise OSError(e.errno, f"could not create the MLflow store {path}: {e.strerror or e}") from e
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        building.unlink()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)
    _ready.add(key)
