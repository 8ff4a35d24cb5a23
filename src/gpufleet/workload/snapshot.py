"""Snapshot of a workload's code folder, leaving out what ``.gitignore`` ignores."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: Never copied, wherever they are.
_ALWAYS_SKIPPED = {".git", "__pycache__"}


class SnapshotError(ValueError):
    """The code source cannot be snapshotted (missing folder or path)."""


def check_code_source(root: Path, include_paths: list[str] | None) -> list[str]:
    """Problems with a code source on disk (missing root or include paths), as messages."""
    if not root.is_dir():
        return [f"code_source.root_path: folder {str(root)!r} does not exist"]
    problems = []
    for i, rel in enumerate(include_paths or []):
        if not (root / rel).exists():
            problems.append(f"code_source.include_paths[{i}]: {rel!r} does not exist under {root}")
    return problems


def _git_files(root: Path, include_paths: list[str] | None) -> list[str] | None:
    """Files under ``root`` that git does not ignore, relative to ``root``; None outside git."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        inside = subprocess.run(
            [git, "-C", str(root), "rev-parse", "--is-inside-work-tree"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        out = subprocess.run(
            [git, "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
             "--", *(include_paths or ["."])],
            capture_output=True, timeout=120, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("git ls-files failed in %s (%s); using .gitignore matching instead", root, e)
        return None
    files = [f for f in out.decode("utf-8", "surrogateescape").split("\0") if f]
    return [f for f in files if not (set(Path(f).parts) & _ALWAYS_SKIPPED)]


def _walk_files(root: Path, include_paths: list[str] | None) -> list[str]:
    """Files under ``root`` not ignored by the ``.gitignore`` files found on the way."""
    import pathspec

    specs: list[tuple[Path, pathspec.PathSpec]] = []  # (folder, its .gitignore)

    def ignored(path: Path, is_dir: bool) -> bool:
        # the deepest .gitignore with a matching pattern decides, as in git
        for folder, spec in reversed(specs):
            try:
                rel = path.relative_to(folder).as_posix()
            except ValueError:
                continue
            result = spec.check_file(rel + ("/" if is_dir else ""))
            if result.include is not None:
                return bool(result.include)
        return False

    def load_ignore(folder: Path) -> None:
        gi = folder / ".gitignore"
        if gi.is_file():
            lines = gi.read_text(encoding="utf-8", errors="replace").splitlines()
            specs.append((folder, pathspec.GitIgnoreSpec.from_lines(lines)))

    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        load_ignore(here)
        dirnames[:] = sorted(
            d for d in dirnames if d not in _ALWAYS_SKIPPED and not ignored(here / d, True)
        )
        for name in sorted(filenames):
            p = here / name
            if not ignored(p, False):
                files.append(p.relative_to(root).as_posix())
    if include_paths:
        wanted = [Path(p).as_posix().rstrip("/") for p in include_paths]
        files = [f for f in files if any(f == w or f.startswith(w + "/") or w == "." for w in wanted)]
    return sorted(files)


def list_files(root: Path, include_paths: list[str] | None = None) -> list[str]:
    """The files a snapshot of ``root`` holds, relative to it."""
    files = _git_files(root, include_paths)
    return sorted(set(files)) if files is not None else _walk_files(root, include_paths)


def snapshot(root: Path, dest: Path, include_paths: list[str] | None = None) -> int:
    """Copy the non-ignored files of ``root`` (or of ``include_paths`` in it) into ``dest``.

    Returns the number of files copied. Raises :class:`SnapshotError` for a missing path.
    """
    problems = check_code_source(root, include_paths)
    if problems:
        raise SnapshotError("; ".join(problems))
    dest.mkdir(parents=True, exist_ok=True)
    count = 0
    for rel in _existing(root, list_files(root, include_paths)):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
        count += 1
    return count


def _existing(root: Path, files: Iterable[str]) -> Iterable[str]:
    for rel in files:
        p = root / rel
        if p.is_file():  # tracked files deleted from the work tree, broken links: skipped
            yield rel
