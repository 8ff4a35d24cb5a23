"""Run directory layout and the atomically written per-rank outcome files."""

from __future__ import annotations

import os
import pickle
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .launch.node import envcontract

OK = "ok"
ERROR = "error"


def gpufleet_home() -> Path:
    """Root folder for gpufleet's state: ``$GPUFLEET_HOME`` or ``~/.gpufleet``."""
    return Path(os.environ.get(envcontract.HOME) or Path.home() / ".gpufleet")


def new_run_id(name: str = "run") -> str:
    """A sortable, unique run id such as ``20261130-081500-train-3f9a1c``."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:40] or "run"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run's private directory."""

    path: Path

    @classmethod
    def create(cls, base: str | os.PathLike[str] | None, run_id: str) -> RunDir:
        """Make the run's private folder under ``base`` (default ``$GPUFLEET_HOME/runs``).

        Raises:
            UnsafeStateError: ``base`` (or the state folder) is not the user's own (see
                :mod:`gpufleet.private`); nothing is read from it then.
        """
        from .private import private_dir

        if base:
            root = private_dir(base, "the runs folder")
        else:
            private_dir(gpufleet_home())
            root = private_dir(gpufleet_home() / "runs", "the runs folder")
        path = root / run_id
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        return cls(path)

    @property
    def payload(self) -> Path:
        return self.path / "payload.pkl"

    def log(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.log"

    def outcome(self, rank: int) -> Path:
        return self.path / f"outcome-{rank}.pkl"

    @property
    def late_env(self) -> Path:
        """Environment the ranks take after they started (see :meth:`~gpufleet.launch.group.WorkerGroup.defer_env`)."""
        return self.path / "late-env.json"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` either does not exist or holds all of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_outcome(path: Path, status: str, rank: int, **fields: Any) -> None:
    """Record a rank's outcome (``ok`` with a pickled value, or ``error``) atomically."""
    record = {"status": status, "rank": rank, "time": time.time(), **fields}
    write_atomic(path, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))


def read_outcome(path: Path) -> dict[str, Any] | None:
    """Read an outcome file; ``None`` when the rank wrote none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    record = pickle.loads(data)
    if not isinstance(record, dict) or record.get("status") not in (OK, ERROR):
        return None
    return record


def tail(path: Path, num_lines: int = 20, max_bytes: int = 16384) -> str:
    """Last ``num_lines`` lines of a text file (empty when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-num_lines:])
