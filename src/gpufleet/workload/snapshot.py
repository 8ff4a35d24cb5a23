"""Snapshot of a workload's code folder, leaving out what ``.gitignore`` ignores.

Guards, so that a wrong ``root_path`` fails at once with a message instead of copying a disk:

* the file system root and the user's home folder are refused as roots;
* a gpufleet state folder (``$GPUFLEET_HOME``, or any folder holding a gpufleet ``runs.db``)
  inside the root is never copied: it holds the other runs, their snapshots included;
* ``.env`` files (``.env``, ``.env.local``, ...), which hold secrets by convention, are not
  copied unless ``include_paths`` names one; pass secrets with ``secrets:`` instead;
* a symbolic link is kept as a link when its target is inside the root, and refused (named
  in the error) when it leaves the root or points to a folder holding the link (a loop);
* at most :data:`DEFAULT_MAX_FILES` files and :data:`DEFAULT_MAX_BYTES` bytes, unless
  ``GPUFLEET_SNAPSHOT_MAX_FILES`` / ``GPUFLEET_SNAPSHOT_MAX_BYTES`` say otherwise; listing
  stops as soon as a limit is passed.

One concern past 400 lines: choosing, guarding and copying a code folder's files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..launch.node import envcontract
from .schema import Problem, WorkloadValidationError

logger = logging.getLogger(__name__)

#: Never copied, wherever they are.
_ALWAYS_SKIPPED = {".git", "__pycache__"}

#: Files of secrets by convention (``.env``, ``.env.local``): not copied unless ``include_paths`` names one.
_SECRETS_FILE = re.compile(r"^\.env(\..+)?$")


def _secrets_file(rel: str, include_paths: list[str] | None) -> bool:
    """Whether ``rel`` is a ``.env`` file that the snapshot leaves out (one ``include_paths`` names is copied)."""
    if not _SECRETS_FILE.match(rel.rsplit("/", 1)[-1]):
        return False
    return rel not in {Path(p).as_posix().strip("/") for p in include_paths or ()}

#: The run store's file; a folder holding one (a SQLite database) is a gpufleet state folder.
STORE_FILE = "runs.db"

DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_BYTES = 2**30

_GIT_TIMEOUT_S = 120
_MAX_LINKS_NAMED = 10


class SnapshotError(WorkloadValidationError, ValueError):
    """The code source cannot be snapshotted: a missing or refused folder, a limit, a link.

    A :class:`WorkloadValidationError` (a problem of the workload's ``code_source``), so the
    CLI reports it like any invalid workload.
    """

    def __init__(self, messages: str | Iterable[str], path: str = "code_source") -> None:
        problems = []
        for m in [messages] if isinstance(messages, str) else messages:
            where, sep, what = m.partition(": ")
            is_field = sep and where.startswith("code_source") and " " not in where
            problems.append(Problem(where, what) if is_field else Problem(path, m))
        super().__init__(problems, source="code snapshot")

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return f"cannot snapshot the code: {self.problems[0]}"
        return "cannot snapshot the code:\n" + "\n".join(f"  - {p}" for p in self.problems)


@dataclass(frozen=True)
class Limits:
    """Most files / bytes a snapshot may hold; None: no limit."""

    max_files: int | None = DEFAULT_MAX_FILES
    max_bytes: int | None = DEFAULT_MAX_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """The defaults, or ``GPUFLEET_SNAPSHOT_MAX_FILES`` / ``_MAX_BYTES`` (0: no limit)."""
        env = os.environ if environ is None else environ
        return cls(
            _env_limit(env, envcontract.SNAPSHOT_MAX_FILES, DEFAULT_MAX_FILES, _parse_count),
            _env_limit(env, envcontract.SNAPSHOT_MAX_BYTES, DEFAULT_MAX_BYTES, _parse_size),
        )


@dataclass(frozen=True)
class Entry:
    """One file of a snapshot: its path under the root, its size, and for a link its target."""

    rel: str
    size: int = 0
    link: str | None = None  # a symbolic link kept as a link: its target, relative to its folder


# ------------------------------------------------------------------ checks


def check_code_source(root: Path, include_paths: list[str] | None) -> list[str]:
    """Problems with a code source on disk (missing or refused root, missing include paths)."""
    if not root.is_dir():
        return [f"code_source.root_path: folder {str(root)!r} does not exist"]
    refused = refused_root(root)
    if refused:
        return [f"code_source.root_path: {refused}"]
    problems = []
    for i, rel in enumerate(include_paths or []):
        if not os.path.lexists(root / rel):
            problems.append(f"code_source.include_paths[{i}]: {rel!r} does not exist under {root}")
    return problems


def refused_root(root: Path) -> str | None:
    """Why ``root`` may not be a code folder (the file system root, a home, a state folder)."""
    real = root.resolve()
    what = "put the workload's code in a project folder and point root_path at it (e.g. root_path: . next to the workload file)"
    if real == Path(real.anchor):
        return f"{str(root)!r} is the root of the file system, not a code folder: {what}"
    if real in _home_folders():
        return f"{str(root)!r} is your home folder, not a code folder: {what}"
    if real == _state_home() or _is_store_file(real / STORE_FILE):
        return f"{str(root)!r} is a gpufleet state folder (it holds {STORE_FILE}), not a code folder: {what}"
    return None


def _home_folders() -> set[Path]:
    homes = set()
    try:
        homes.add(Path.home().resolve())
    except (RuntimeError, KeyError, OSError):
        pass
    try:
        import pwd

        homes.add(Path(pwd.getpwuid(os.getuid()).pw_dir).resolve())
    except (ImportError, KeyError, OSError):
        pass
    return homes


def _state_home() -> Path:
    from ..results import gpufleet_home

    return gpufleet_home().expanduser().resolve()


def _is_store_file(path: Path) -> bool:
    """Whether ``path`` is a run store: a SQLite database (or the empty file SQLite starts with)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:  # missing, a folder, unreadable
        return False
    return head in (b"", b"SQLite format 3\x00")


# ------------------------------------------------------------------ limits


def _parse_count(text: str) -> int:
    return int(text.replace(",", ""))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _env_limit(env: Mapping[str, str], name: str, default: int, parse: object) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)  # type: ignore[operator]
    except ValueError:
        example = "50000" if name == envcontract.SNAPSHOT_MAX_FILES else "4GiB"
        raise SnapshotError(f"{name}={raw!r} is not a limit; use e.g. {name}={example} (0: no limit)", name) from None
    if value < 0:
        raise SnapshotError(f"{name}={raw!r} is negative; use 0 for no limit", name)
    return value or None


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ scanning


class _Scan:
    """The entries of one snapshot, collected under the limits, the state-folder and link rules."""

    def __init__(self, root: Path, limits: Limits, exclude: Iterable[Path | str]) -> None:
        self.shown = root
        self.root = root.resolve()
        self.limits = limits
        self.entries: list[Entry] = []
        self.bytes = 0
        self.largest = (0, "")
        self.bad_links: list[str] = []
        self._state: dict[str, bool] = {}
        self._excluded: set[str] = set()
        for folder in (_state_home(), *exclude):
            real = Path(folder).expanduser().resolve()
            if real != self.root and real.is_relative_to(self.root):
                self._excluded.add(real.relative_to(self.root).as_posix())

    # --- state folders

    def is_state_dir(self, rel_dir: str) -> bool:
        """Whether the folder ``rel_dir`` (under the root) is a gpufleet state folder."""
        known = self._state.get(rel_dir)
        if known is None:
            known = rel_dir in self._excluded or _is_store_file(self.root / rel_dir / STORE_FILE)
            if known:
                logger.warning(
                    "%s/%s is a gpufleet state folder: left out of the code snapshot (list it in "
                    ".gitignore to leave it out quietly)", self.shown, rel_dir,
                )  # fmt: skip
            self._state[rel_dir] = known
        return known

    def in_state_dir(self, rel: str) -> bool:
        parts = rel.split("/")[:-1]
        return any(self.is_state_dir("/".join(parts[: i + 1])) for i in range(len(parts)))

    # --- entries

    def add(self, rel: str) -> None:
        """Take ``rel`` into the snapshot (a file or a link; anything else is left out)."""
        path = self.root / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # a tracked file deleted from the work tree
            return
        if stat.S_ISLNK(st.st_mode):
            entry = Entry(rel, 0, self._link(rel, path))  # a refused link is counted all the same
        elif stat.S_ISREG(st.st_mode):
            entry = Entry(rel, st.st_size)
        else:  # a folder (a git submodule), a socket, a fifo
            return
        self.entries.append(entry)
        self.bytes += entry.size
        self.largest = max(self.largest, (entry.size, rel))
        self._check_limits(rel)

    def _link(self, rel: str, path: Path) -> str | None:
        """The target to keep for the link ``rel``, relative to its folder; None when refused."""
        text = os.readlink(path)
        try:
            target = (path.parent / text).resolve()
        except (RuntimeError, OSError):  # a loop of links
            target = None
        if target is None or not target.is_relative_to(self.root):
            self.bad_links.append(
                f"{rel} is a symbolic link to {text!r}, outside root_path {str(self.shown)!r}: snapshots keep only "
                "links that stay inside root_path; copy the target into the folder, leave the link out "
                "(.gitignore, code_source.include_paths) or choose a root_path that holds its target"
            )  # fmt: skip
            return None
        if target.is_dir() and path.parent.is_relative_to(target):
            self.bad_links.append(
                f"{rel} is a symbolic link to {text!r}, a folder that holds the link itself: a loop for "
                "every tool that follows links; remove it or leave it out (.gitignore)"
            )  # fmt: skip
            return None
        return os.path.relpath(target, path.parent)

    def _check_limits(self, rel: str) -> None:
        n, max_files, max_bytes = len(self.entries), self.limits.max_files, self.limits.max_bytes
        cut = ("leave out what the run does not need (.gitignore, code_source.include_paths) or "
               "point root_path at a smaller folder")  # fmt: skip
        if max_files is not None and n > max_files:
            raise SnapshotError(
                f"more than {max_files:,} files to copy under {str(self.shown)!r} (stopped counting at {n:,}, "
                f"at {rel}); {cut}; to allow more, set {envcontract.SNAPSHOT_MAX_FILES}=<count> (0: no limit)"
            )
        if max_bytes is not None and self.bytes > max_bytes:
            size, largest = self.largest
            raise SnapshotError(
                f"more than {fmt_bytes(max_bytes)} to copy under {str(self.shown)!r} ({fmt_bytes(self.bytes)} in "
                f"{n:,} files so far; the largest: {largest}, {fmt_bytes(size)}); {cut}; to allow more, "
                f"set {envcontract.SNAPSHOT_MAX_BYTES}=<size, e.g. 4GiB> (0: no limit)"
            )

    def result(self) -> list[Entry]:
        if self.bad_links:
            named = self.bad_links[:_MAX_LINKS_NAMED]
            more = len(self.bad_links) - len(named)
            raise SnapshotError(named + ([f"... and {more} more links like these"] if more else []))
        return sorted(self.entries, key=lambda e: e.rel)


def _wanted(include_paths: list[str] | None) -> list[str] | None:
    """``include_paths`` as clean relative paths; None for all of the root."""
    if not include_paths:
        return None
    wanted = [Path(p).as_posix().strip("/") for p in include_paths]
    return None if any(w in (".", "") for w in wanted) else wanted


def _git_scan(root: Path, include_paths: list[str] | None, scan: _Scan) -> bool:
    """Fill ``scan`` with what git does not ignore; False outside git (``scan`` is then unusable)."""
    git = shutil.which("git")
    if git is None:
        return False
    try:
        inside = subprocess.run(
            [git, "-C", str(root), "rev-parse", "--is-inside-work-tree"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return False
    cmd = [git, "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
           "--", *(include_paths or ["."])]  # fmt: skip
    # the names are read as git lists them, so that a limit stops git too
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        except OSError as e:
            logger.warning("git ls-files failed in %s (%s); using .gitignore matching instead", root, e)
            return False
        timer = threading.Timer(_GIT_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            seen: set[str] = set()
            rest = b""
            while chunk := proc.stdout.read1(1 << 16):
                *names, rest = (rest + chunk).split(b"\0")
                for raw in names:
                    rel = raw.decode("utf-8", "surrogateescape")
                    if not rel or rel in seen:
                        continue
                    seen.add(rel)
                    if set(rel.split("/")) & _ALWAYS_SKIPPED or scan.in_state_dir(rel):
                        continue
                    if _secrets_file(rel, include_paths):
                        continue
                    scan.add(rel)
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if code != 0:
            err.seek(0)
            why = err.read().decode("utf-8", "replace").strip() or f"exit code {code}"
            logger.warning("git ls-files failed in %s (%s); using .gitignore matching instead", root, why)
            return False
    return True


def _walk_scan(root: Path, include_paths: list[str] | None, scan: _Scan) -> None:
    """Fill ``scan`` with the files not ignored by the ``.gitignore`` files found on the way."""
    import pathspec

    specs: list[tuple[Path, pathspec.PathSpec]] = []  # (folder, its .gitignore)
    wanted = _wanted(include_paths)

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

    def wanted_file(rel: str) -> bool:
        return wanted is None or any(rel == w or rel.startswith(w + "/") for w in wanted)

    def wanted_dir(rel: str) -> bool:
        return wanted is None or any(rel == w or rel.startswith(w + "/") or w.startswith(rel + "/") for w in wanted)

    def load_ignore(folder: Path) -> None:
        gi = folder / ".gitignore"
        if gi.is_file():
            lines = gi.read_text(encoding="utf-8", errors="replace").splitlines()
            specs.append((folder, pathspec.GitIgnoreSpec.from_lines(lines)))

    top = scan.root
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        rel_here = here.relative_to(top).as_posix()
        prefix = "" if rel_here == "." else rel_here + "/"
        load_ignore(here)
        walk_into = []
        for d in sorted(dirnames):
            p, rel = here / d, prefix + d
            if d in _ALWAYS_SKIPPED:
                continue
            if p.is_symlink():  # a link to a folder: an entry of its own (git's view), not walked
                if not ignored(p, False) and wanted_file(rel):
                    scan.add(rel)
            elif not ignored(p, True) and wanted_dir(rel) and not scan.is_state_dir(rel):
                walk_into.append(d)
        dirnames[:] = walk_into
        for name in sorted(filenames):
            rel = prefix + name
            if wanted_file(rel) and not ignored(here / name, False) and not _secrets_file(rel, include_paths):
                scan.add(rel)


def scan(
    root: Path,
    include_paths: list[str] | None = None,
    *,
    exclude: Iterable[Path | str] = (),
    limits: Limits | None = None,
) -> list[Entry]:
    """The entries a snapshot of ``root`` (or of ``include_paths`` in it) holds, sorted.

    ``exclude``: more folders never to copy (the state folder in use, when it is not
    ``$GPUFLEET_HOME``). Raises :class:`SnapshotError` for a refused root, a limit passed
    (as soon as it is passed) or a link leaving the root.
    """
    refused = refused_root(root)
    if refused:
        raise SnapshotError(refused, "code_source.root_path")
    limits = limits or Limits.from_env()
    exclude = list(exclude)
    found = _Scan(root, limits, exclude)
    if not _git_scan(found.root, include_paths, found):
        found = _Scan(root, limits, exclude)
        _walk_scan(found.root, include_paths, found)
    return found.result()


def list_files(root: Path, include_paths: list[str] | None = None, **kwargs: object) -> list[str]:
    """The files a snapshot of ``root`` holds, relative to it (see :func:`scan`)."""
    return [e.rel for e in scan(root, include_paths, **kwargs)]  # type: ignore[arg-type]


def snapshot(
    root: Path,
    dest: Path,
    include_paths: list[str] | None = None,
    *,
    entries: list[Entry] | None = None,
    exclude: Iterable[Path | str] = (),
    limits: Limits | None = None,
) -> int:
    """Copy the non-ignored files of ``root`` (or of ``include_paths`` in it) into ``dest``.

    ``entries``: the result of an earlier :func:`scan`, to copy without listing again. Links
    inside the root are recreated as links. Returns the number of entries copied. Raises
    :class:`SnapshotError` (see :func:`scan`) before anything is copied.
    """
    problems = check_code_source(root, include_paths)
    if problems:
        raise SnapshotError(problems)
    if entries is None:
        entries = scan(root, include_paths, exclude=exclude, limits=limits)
    real = root.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    count = 0
    for e in entries:
        target = dest / e.rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            if e.link is not None:
                os.symlink(e.link, target)
            else:
                shutil.copy2(real / e.rel, target, follow_symlinks=False)
                os.chmod(target, stat.S_IMODE(os.stat(target).st_mode) & 0o700)  # the user's alone, +x kept
        except FileNotFoundError:  # deleted since it was listed
            continue
        count += 1
    for folder, names, _ in os.walk(dest):  # folders that the copies made (mkdir follows the umask)
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    return count
