"""gpufleet's default MLflow store: created whole or not at all, and repaired when it is not whole.

MLflow creates the tables of a SQLite store on first use, in place. When that is cut short (a
full disk, a killed process), the file is left with some tables, MLflow's next attempt to create
them fails, and tracking stays off for good. Here a new store is built beside its final path and
renamed into place once complete (under a file lock, so concurrent callers never replace each
other's store), and a store that lacks tables is moved aside (kept for inspection) and rebuilt. A finished
run's artifacts in it are made the user's alone (:func:`make_artifacts_private`).
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


#: At most this many entries of one run's artifacts are tightened (a run with more keeps the rest
#: as MLflow wrote them, inside folders that are the user's alone).
MAX_PRIVATE_ENTRIES = 20_000


def make_artifacts_private(artifact_uri: str | None) -> None:
    """Make a run's artifacts in gpufleet's default store (``$GPUFLEET_HOME/mlartifacts``) the
    user's alone: folders 0700, files 0600 (0700 when executable). MLflow writes them with the
    umask of the process that logged them (a caller's, a rank's), 0644 with a shell's default.
    Artifacts elsewhere (a server, a store of the user's own) are left as they are."""
    from urllib.parse import unquote, urlsplit

    from ..results import gpufleet_home

    if not artifact_uri or urlsplit(artifact_uri).scheme != "file":
        return
    folder = Path(unquote(urlsplit(artifact_uri).path))
    root = (gpufleet_home() / "mlartifacts").absolute()
    if root not in folder.parents:
        return
    uid = os.getuid()

    def tighten(path: Path, mode: int) -> None:
        st = os.lstat(path)
        if st.st_uid == uid and not os.path.islink(path) and (st.st_mode & 0o7777) != mode:
            os.chmod(path, mode)

    for parent in [p for p in folder.parents if p == root or root in p.parents]:
        tighten(parent, 0o700)  # the experiment's folder and the run's
    entries = 0
    for here, dirs, files in os.walk(folder):
        tighten(Path(here), 0o700)
        for name in files:
            path = Path(here, name)
            if not os.path.islink(path):
                tighten(path, os.lstat(path).st_mode & 0o700 | 0o600)
        entries += len(dirs) + len(files)
        if entries > MAX_PRIVATE_ENTRIES:
            return
