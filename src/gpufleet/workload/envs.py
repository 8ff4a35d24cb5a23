"""Per-run Python environments: a venv layered on the current one, cached by its spec.

Standard library only: a node of a multi-node workload runs this file by path
(``python envs.py``) to build the run's environment on that node when it does not see the
submitting machine's (``node_main``). Imported as a module, its errors are gpufleet errors.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import IO

if __package__:
    from ..errors import GpufleetError
    from .procgroup import terminate_group
else:  # run by path on a node: the standard library and the helper beside this file only
    from procgroup import terminate_group  # type: ignore[no-redef]

    class GpufleetError(Exception):  # type: ignore[no-redef]
        """Stands in for :class:`gpufleet.errors.GpufleetError` when this file runs by path."""


logger = logging.getLogger(__name__)

_READY = ".gpufleet-ready"


class EnvironmentSetupError(GpufleetError, RuntimeError):
    """Installing a run's dependencies failed."""


class EnvironmentSetupCanceled(EnvironmentSetupError):
    """The run was canceled while its environment was being built (pip was stopped)."""


def env_hash(dependencies: list[str]) -> str:
    """Cache key of an environment: the dependency list and the interpreter it layers on."""
    spec = {
        "dependencies": sorted(d.strip() for d in dependencies),
        "python": sys.executable,
        "version": sys.version,
    }
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
    dependencies: list[str], envs_dir: Path, log: IO[str], cancel: threading.Event | None = None
) -> Path:
    """The ``bin`` folder of a venv with ``dependencies`` installed, built once per spec.

    The venv sees the packages of the current environment (``--system-site-packages`` plus a
    ``.pth`` file naming the current site-packages, since a venv built from a venv would
    otherwise see only the base interpreter's); its own packages take precedence. Once
    ``cancel`` is set, pip is stopped and :class:`EnvironmentSetupCanceled` raised (the
    unfinished venv is rebuilt by the next run that needs it).
    """
    key = env_hash(dependencies)
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
             "--disable-pip-version-check", "--no-input", *dependencies],
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


#: A node command's dependencies (JSON list), for nodes that build the run's environment themselves.
DEPENDENCIES_ENV = "GPUFLEET_DEPENDENCIES"


def node_envs_dir() -> Path:
    """Where a node keeps its environments: ``$GPUFLEET_HOME/envs`` (default ``~/.gpufleet``)."""
    return Path(os.environ.get("GPUFLEET_HOME") or Path.home() / ".gpufleet") / "envs"


def node_main() -> int:
    """Build (or reuse) the environment of ``$GPUFLEET_DEPENDENCIES`` on this node; print its ``bin``.

    pip's output goes to stderr, which is the node's log; the ``bin`` folder is the last line of stdout.
    """
    dependencies = json.loads(os.environ[DEPENDENCIES_ENV])
    try:
        bin_dir = ensure_environment(dependencies, node_envs_dir(), sys.stderr)
    except EnvironmentSetupError as e:
        sys.stderr.write(f"gpufleet: could not build the run's environment on this node: {e}\n")
        return 1
    sys.stdout.write(f"{bin_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
