"""Per-run Python environments: a venv layered on the current one, cached by its spec.

Standard library only: a node of a multi-node workload runs this file by path
(``python envs.py``) to build the run's environment on that node when it does not see the
submitting machine's (``node_main``). Imported as a module, its errors are gpufleet errors.

A dependency list holds pip requirement specs and a few pip options (:data:`PIP_OPTIONS`), one
option with its value per item: ``-r requirements.txt`` and ``-c constraints.txt`` (relative to
the code folder), ``--index-url`` / ``--extra-index-url`` / ``--find-links`` (a URL, or a folder
relative to the code folder), ``--no-index``, ``--no-build-isolation``, ... The cache key covers
the list, the content of the requirement files (and of those they name with ``-r`` / ``-c``)
and the file names of local ``--find-links`` folders.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import IO

if __package__:
    from ...errors import GpufleetError
    from . import envcontract
    from .procgroup import terminate_group
else:  # run by path on a node: the standard library and the helpers beside this file only
    import envcontract  # type: ignore[no-redef]
    from procgroup import terminate_group  # type: ignore[no-redef]

    class GpufleetError(Exception):  # type: ignore[no-redef]
        """Stands in for :class:`gpufleet.errors.GpufleetError` when this file runs by path."""


logger = logging.getLogger(__name__)

_READY = ".gpufleet-ready"


class EnvironmentSetupError(GpufleetError, RuntimeError):
    """Installing a run's dependencies failed."""


class EnvironmentSetupCanceled(EnvironmentSetupError):
    """The run was canceled while its environment was being built (pip was stopped)."""


#: pip options a dependency list may hold: option -> whether it takes a value.
PIP_OPTIONS = {
    "-r": True, "--requirement": True, "-c": True, "--constraint": True,
    "-i": True, "--index-url": True, "--extra-index-url": True, "-f": True, "--find-links": True,
    "--trusted-host": True, "--no-index": False, "--no-build-isolation": False, "--pre": False,
    "--prefer-binary": False,
}  # fmt: skip
#: Options whose value is a file of requirements (relative to the code folder).
FILE_OPTIONS = ("-r", "--requirement", "-c", "--constraint")
_LINKS_OPTIONS = ("-f", "--find-links")


def split_dependency(item: str) -> list[str]:
    """One item of a dependency list as pip arguments: ``["trl==1.16.0"]`` or ``["-r", "req.txt"]``.

    An option's value may follow a space or ``=`` (``--index-url=URL``). Raises ValueError for
    an option that is not in :data:`PIP_OPTIONS`, a missing or extra value.
    """
    text = item.strip()
    if not text.startswith("-"):
        return [text]
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"cannot read {item!r}: {e}") from None
    option, _, value = words[0].partition("=")
    if option not in PIP_OPTIONS:
        raise ValueError(f"{option!r} is not an allowed pip option; allowed: {', '.join(PIP_OPTIONS)}")
    values = ([value] if value else []) + words[1:]
    if PIP_OPTIONS[option] and len(values) != 1:
        raise ValueError(f"{option} takes one value in the same item, e.g. '{option} VALUE'; got {item!r}")
    if not PIP_OPTIONS[option] and values:
        raise ValueError(f"{option} takes no value; got {item!r}")
    return [option, *values]


def _is_url(value: str) -> bool:
    return "://" in value


def _local(value: str, base_dir: Path | None) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() or base_dir is None else base_dir / path


def pip_arguments(dependencies: list[str], base_dir: Path | None = None) -> list[str]:
    """The arguments pip gets for ``dependencies``: relative requirement files and folders made absolute."""
    args: list[str] = []
    for item in dependencies:
        words = split_dependency(item)
        if len(words) == 2 and (words[0] in FILE_OPTIONS or words[0] in _LINKS_OPTIONS) and not _is_url(words[1]):
            words = [words[0], str(_local(words[1], base_dir))]
        args += words
    return args


def _file_digests(path: Path, seen: dict[str, str]) -> None:
    """The sha256 of ``path`` and of the requirement files it names (``-r``, ``-c``), by absolute path."""
    key = str(path.resolve())
    if key in seen:
        return
    try:
        data = path.read_bytes()
    except OSError:
        seen[key] = "missing"
        return
    seen[key] = hashlib.sha256(data).hexdigest()
    for line in data.decode("utf-8", "replace").splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        option, _, value = words[0].partition("=")
        value = value or (words[1] if len(words) > 1 else "")
        if option in FILE_OPTIONS and value and not _is_url(value):
            _file_digests(_local(value, path.parent), seen)


def env_hash(dependencies: list[str], base_dir: Path | None = None) -> str:
    """Cache key of an environment: the dependency list, the files it names and the interpreter.

    Requirement files count by content, named as the list names them (the code folder
    ``base_dir`` they are read from is not part of the key); a local ``--find-links`` folder
    by the names of its files.
    """
    files: dict[str, str] = {}
    links: dict[str, list[str]] = {}
    for item in dependencies:
        try:
            words = split_dependency(item)
        except ValueError:
            continue
        if len(words) != 2 or _is_url(words[1]):
            continue
        if words[0] in FILE_OPTIONS:
            seen: dict[str, str] = {}
            _file_digests(_local(words[1], base_dir), seen)
            files[words[1]] = hashlib.sha256(json.dumps(sorted(seen.values())).encode()).hexdigest()
        elif words[0] in _LINKS_OPTIONS:
            folder = _local(words[1], base_dir)
            links[words[1]] = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    spec = {
        "dependencies": sorted(d.strip() for d in dependencies),
        "python": sys.executable,
        "version": sys.version,
    }
    if files or links:  # lists without files keep the keys they had
        spec["files"] = files
        spec["find_links"] = links
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _parent_site_dirs() -> list[str]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    out: list[str] = []
    for d in dirs:
        if d not in out and os.path.isdir(d):
            out.append(d)
    return out


def ensure_environment(
    dependencies: list[str], envs_dir: Path, log: IO[str], cancel: threading.Event | None = None,
    base_dir: Path | None = None,
) -> Path:
    """The ``bin`` folder of a venv with ``dependencies`` installed, built once per spec.

    ``base_dir`` is the code folder that relative requirement files and ``--find-links``
    folders are read from (the run's code snapshot).

    The venv sees the packages of the current environment (``--system-site-packages`` plus a
    ``.pth`` file naming the current site-packages, since a venv built from a venv would
    otherwise see only the base interpreter's); its own packages take precedence. Once
    ``cancel`` is set, pip is stopped and :class:`EnvironmentSetupCanceled` raised (the
    unfinished venv is rebuilt by the next run that needs it).
    """
    key = env_hash(dependencies, base_dir)
    args = pip_arguments(dependencies, base_dir)
    envs_dir.mkdir(parents=True, exist_ok=True)
    target = envs_dir / key
    with open(envs_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per spec; the others wait and reuse it
        if (target / _READY).exists():
            log.write(f"gpufleet: reusing environment {target}\n")
            log.flush()
            return target / "bin"
        if target.exists():
            shutil.rmtree(target)  # a build that was interrupted
        log.write(f"gpufleet: building environment {target} for {dependencies}\n")
        log.flush()
        _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(target)], log, cancel)
        purelib = _venv_purelib(target)
        (purelib / "_gpufleet_parent_env.pth").write_text("\n".join(_parent_site_dirs()) + "\n")
        _run(
            [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install",
             "--disable-pip-version-check", "--no-input", *args],
            log, cancel,
        )  # fmt: skip
        (target / _READY).write_text(json.dumps({"dependencies": dependencies}))
        return target / "bin"


def _venv_purelib(target: Path) -> Path:
    out = subprocess.run(
        [str(target / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    path = Path(out.stdout.strip())
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list[str], log: IO[str], cancel: threading.Event | None = None) -> None:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    # pip in a process group of its own: `pip --python X` runs a second pip under X, and a cancel
    # must stop both.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while True:
        try:
            proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if cancel is not None and cancel.is_set():
                # TERM, up to 10 s for pip to exit, then KILL whatever is left of the group
                terminate_group(proc.pid, 10.0, finished=lambda: proc.poll() is not None)
                proc.wait()
                log.write("gpufleet: canceled; stopped pip\n")
                log.flush()
                raise EnvironmentSetupCanceled(f"`{' '.join(cmd[:4])} ...` was stopped: the run was canceled") from None
    if proc.returncode != 0:
        raise EnvironmentSetupError(
            f"`{' '.join(cmd[:4])} ...` failed with exit code {proc.returncode}; see the "
            "environment log of the run (gpufleet logs RUN_ID --setup) for pip's output"
        )


def node_envs_dir() -> Path:
    """Where a node keeps its environments: ``$GPUFLEET_HOME/envs`` (default ``~/.gpufleet``)."""
    return Path(os.environ.get(envcontract.HOME) or Path.home() / ".gpufleet") / "envs"


def node_main() -> int:
    """Build (or reuse) the environment of ``$GPUFLEET_DEPENDENCIES`` on this node; print its ``bin``.

    pip's output goes to stderr, which is the node's log; the ``bin`` folder is the last line of stdout.
    """
    dependencies = json.loads(os.environ[envcontract.DEPENDENCIES])
    code_dir = Path(os.environ.get(envcontract.CODE_SOURCE_PATH) or os.getcwd())  # requirement files are read there
    try:
        bin_dir = ensure_environment(dependencies, node_envs_dir(), sys.stderr, base_dir=code_dir)
    except EnvironmentSetupError as e:
        sys.stderr.write(f"gpufleet: could not build the run's environment on this node: {e}\n")
        return 1
    sys.stdout.write(f"{bin_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
