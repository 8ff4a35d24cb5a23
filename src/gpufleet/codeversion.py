"""Which code ran: the git commit, branch and dirty flag of a folder in a git work tree.

Recorded with every workload run (its stored config, ``gpufleet get``) and as MLflow tags
(:func:`mlflow_tags`: ``gpufleet.git.commit``, ``gpufleet.git.branch``, ``gpufleet.git.dirty``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["code_version", "describe", "mlflow_tags"]

_TIMEOUT_S = 30


def _git(folder: Path, *args: str) -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        out = subprocess.run(
            [git, "-C", str(folder), *args], capture_output=True, text=True, timeout=_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def code_version(folder: str | Path) -> dict[str, Any] | None:
    """``{"commit", "branch", "dirty", "path"}`` of ``folder`` when it is in a git work tree, else None.

    ``commit`` is None in a repository without commits, ``branch`` None on a detached HEAD;
    ``dirty`` is True when a file under ``folder`` differs from the commit (changed, staged,
    deleted, or untracked and not ignored: what a code snapshot would take); ``path`` is
    ``folder`` relative to the top of the work tree.
    """
    folder = Path(folder)
    inside = _git(folder, "rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        return None
    commit = _git(folder, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    branch = _git(folder, "symbolic-ref", "--quiet", "--short", "HEAD")
    status = _git(folder, "status", "--porcelain", "--untracked-files=normal", "--", ".")
    prefix = _git(folder, "rev-parse", "--show-prefix")
    return {
        "commit": commit.strip() if commit else None,
        "branch": branch.strip() if branch else None,
        "dirty": None if status is None else bool(status.strip()),
        "path": (prefix or "").strip().rstrip("/") or ".",
    }


def describe(version: dict[str, Any] | None) -> str:
    """One line: ``3f2a9c1d7e0b (main, dirty)``; ``-`` when there is none."""
    if not version:
        return "-"
    commit = (version.get("commit") or "no commit yet")[:12]
    notes = [version.get("branch") or "detached HEAD"]
    if version.get("dirty"):
        notes.append("dirty")
    return f"{commit} ({', '.join(notes)})"


def mlflow_tags(version: dict[str, Any] | None) -> dict[str, str]:
    """MLflow tags of a code version (empty when there is none)."""
    if not version:
        return {}
    tags = {
        "gpufleet.git.commit": version.get("commit") or "",
        "gpufleet.git.branch": version.get("branch") or "",
        "gpufleet.git.dirty": str(bool(version.get("dirty"))).lower(),
    }
    if version.get("commit"):
        tags["mlflow.source.git.commit"] = version[
            "commit"
        ]  # what the MLflow UI shows as the run's commit
    return tags
