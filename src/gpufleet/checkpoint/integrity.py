"""Whether a complete checkpoint's files are all there, and how a checkpoint that does not load
is described.

A checkpoint with its completion marker can still be damaged afterwards (a shard deleted or
truncated on a shared file system, an unreadable ``.metadata``). :func:`check_files` and
:func:`check_dcp_shards` find the common damage by looking at file sizes only, before anything
is read into the training state; a damage they cannot see (a shard with the right size but bad
bytes) shows as an error of the load itself. :func:`describe` and :func:`merge_reasons` turn the
errors of every rank into one reason, the same on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError

__all__ = [
    "SkippedCheckpoint",
    "file_sizes",
    "check_files",
    "check_dcp_shards",
    "describe",
    "merge_reasons",
]

_MARKER_FILES = ("COMPLETE.json", ".COMPLETE.json.tmp")


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint that ``resume()`` passed over.

    Attributes:
        step: its step.
        path: its folder.
        reason: why: torn, or the error that loading it raised (type and message; the ranks
            it failed on when not on every rank).
    """

    step: int
    path: Path
    reason: str


def file_sizes(path: str | os.PathLike[str]) -> dict[str, int]:
    """Every file of checkpoint folder ``path`` (relative POSIX paths) and its size, the marker excluded."""
    root = Path(path)
    sizes: dict[str, int] = {}
    for file in sorted(root.rglob("*")):
        name = file.relative_to(root).as_posix()
        if name in _MARKER_FILES:
            continue
        try:
            if file.is_file():
                sizes[name] = file.stat().st_size
        except OSError:
            continue
    return sizes


def check_files(path: Path, marker: dict[str, Any]) -> None:
    """Check the files the marker lists (``files``: name -> size) are there and not shorter.

    A marker written before the list existed has none: nothing is checked then.

    Raises:
        CheckpointError: a file is missing or shorter than when the checkpoint was saved.
    """
    files = marker.get("files")
    if not isinstance(files, dict):
        return
    problems = []
    for name, size in sorted(files.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if isinstance(size, int) and actual < size:
            problems.append(f"{name} is truncated ({actual} of {size} bytes)")
    if problems:
        raise CheckpointError(f"{path.name}: " + "; ".join(problems))


def check_dcp_shards(path: Path) -> None:
    """Read the DCP ``.metadata`` of ``path`` and check every shard it points into is long enough.

    Raises:
        CheckpointError: a shard file is missing or truncated.
        Exception: the metadata cannot be read (e.g. ``UnpicklingError``, ``EOFError``).
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            needed[name] = max(needed.get(name, 0), offset + length)
    problems = []
    for name, end in sorted(needed.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"shard {name} is missing")
            continue
        if actual < end:
            problems.append(f"shard {name} is truncated ({actual} bytes, the metadata needs {end})")
    if problems:
        raise CheckpointError(f"{path.name}: " + "; ".join(problems))


def _one(exc: BaseException) -> str:
    message = " ".join(str(exc).split())  # one line: reasons are listed one per line
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; for DCP's ``CheckpointException``, the errors it gathered
    from the ranks that failed, with their ranks."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        by_reason: dict[str, list[int]] = {}
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            reason = _one(inner) if isinstance(inner, BaseException) else str(inner)
            by_reason.setdefault(reason, []).append(rank)
        return "DCP load failed: " + "; ".join(f"{r} ({_ranks(ranks)})" for r, ranks in by_reason.items())
    return _one(exc)


def merge_reasons(reasons: Sequence[str | None]) -> str | None:
    """One reason from each rank's (None: that rank succeeded), or None when every rank succeeded.

    The same reason on every rank is given once; otherwise each reason names its ranks.
    """
    by_reason: dict[str, list[int]] = {}
    for rank, reason in enumerate(reasons):
        if reason is not None:
            by_reason.setdefault(reason, []).append(rank)
    if not by_reason:
        return None
    if len(by_reason) == 1 and len(next(iter(by_reason.values()))) == len(reasons):
        return next(iter(by_reason))
    return "; ".join(f"{_ranks(ranks)}: {reason}" for reason, ranks in by_reason.items())
