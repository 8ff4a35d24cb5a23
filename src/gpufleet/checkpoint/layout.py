"""Checkpoint folders on disk: ``step-N`` names, the completion marker, discovery, pruning.

A checkpoint is the folder ``<root>/step-<N>``. Every rank writes its part into it; the
marker file ``COMPLETE.json`` is written last (atomically, by rank 0, once every rank's data
and the checkpoint's metadata are on disk). A folder without the marker is *torn* (a crash
or a kill during the save) and is never loaded nor deleted by pruning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "MARKER_NAME",
    "CheckpointInfo",
    "step_dir",
    "list_checkpoints",
    "latest_complete",
    "write_marker",
    "read_marker",
    "remove_checkpoint",
    "prune",
]

MARKER_NAME = "COMPLETE.json"
DCP_METADATA_NAME = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``step-N`` folder and whether it is complete.

    Attributes:
        step: the training step it was saved at.
        path: the folder.
        complete: the marker is present (and, for DCP checkpoints, the DCP metadata).
        marker: the marker's content (format, world size, time, ...); empty when torn.
    """

    step: int
    path: Path
    complete: bool
    marker: dict[str, Any]


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The folder of the checkpoint of ``step`` under ``root``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    return Path(root) / f"step-{step}"


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of checkpoint folder ``path``, or None when it is missing or unreadable."""
    try:
        with open(Path(path) / MARKER_NAME, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _is_complete(path: Path, marker: dict[str, Any] | None) -> bool:
    if marker is None:
        return False
    if marker.get("format", "dcp") == "dcp":
        return (path / DCP_METADATA_NAME).is_file()
    return True


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every ``step-N`` folder under ``root``, oldest step first (torn ones included)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m is None or not entry.is_dir():
            continue
        marker = read_marker(entry)
        complete = _is_complete(entry, marker)
        found.append(CheckpointInfo(int(m.group(1)), entry, complete, marker if complete and marker else {}))
    return sorted(found, key=lambda c: c.step)


def latest_complete(root: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    complete = [c for c in list_checkpoints(root) if c.complete]
    return complete[-1] if complete else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_marker(path: str | os.PathLike[str], content: dict[str, Any]) -> None:
    """Mark checkpoint folder ``path`` complete (temporary file, fsync, rename)."""
    path = Path(path)
    data = {"time": time.time(), **content}
    tmp = path / f".{MARKER_NAME}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MARKER_NAME)
    _fsync_dir(path)


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint folder, its marker first so it never looks complete half-deleted."""
    path = Path(path)
    try:
        (path / MARKER_NAME).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def prune(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last``; torn ones are kept.

    Returns:
        The folders deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    complete = [c for c in list_checkpoints(root) if c.complete]
    doomed = [c.path for c in complete[:-keep_last]]
    for path in doomed:
        logger.info("deleting old checkpoint %s (keeping the last %d)", path, keep_last)
        remove_checkpoint(path)
    return doomed
