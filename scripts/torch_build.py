"""Which torch build an install takes: CPU builds on a machine without an NVIDIA GPU, and saying which one it got.

Used by scripts/pip_install.sh (so by scripts/demo.sh, scripts/test.sh and scripts/recipe_env.sh);
standard library only, because it runs before any environment has packages.

    python scripts/torch_build.py pip-args     # stdout: which build and why, then extra pip arguments, one a line
    python scripts/torch_build.py describe [--pip-report FILE | --uv-log FILE]   # run by the environment's python

``pip-args``: with an NVIDIA GPU (``nvidia-smi -L`` lists one) nothing: pip takes torch from its
configured indexes, as always. Without one, PyTorch's CPU wheel index is asked for a few seconds;
when it answers, ``--extra-index-url`` makes it one more index of the same resolve, and pip takes
its ``+cpu`` builds (a ``2.13.0+cpu`` is newer than ``2.13.0`` to pip, and ``torch==2.13.0`` admits
it). When it cannot be reached, nothing is added and pip takes what its configured indexes and
caches hold (a CUDA build where only that is there; ``describe`` then says so).

``describe``: one line per installed torch / torchvision with its version, its build
(``torch.version.cuda``, read from ``torch/version.py`` without importing torch) and where pip
took it from (``download_info`` of pip's ``--report``; the file uv says it selected, in uv's
verbose output), e.g. ``torch 2.13.0+cpu: CPU build, from /opt/wheels/torch-2.13.0+cpu-cp311-...whl``.

Environment: ``GPUFLEET_TORCH_CPU_INDEX`` (default https://download.pytorch.org/whl/cpu; a mirror of
it, or ``none`` to never use one), ``GPUFLEET_TORCH_INDEX_TIMEOUT`` (seconds the index may take to
answer, default 4).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from importlib import metadata, util
from pathlib import Path
from urllib.parse import unquote, urlsplit

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DEFAULT_TIMEOUT_S = 4.0
PACKAGES = ("torch", "torchvision")


def nvidia_gpu() -> str | None:
    """The first line of ``nvidia-smi -L`` (``GPU 0: NVIDIA H200 (UUID: ...)``), or None without a working one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [line for line in done.stdout.splitlines() if line.startswith("GPU ")]
    return gpus[0].strip() if done.returncode == 0 and gpus else None


def probe(url: str, timeout_s: float) -> str | None:
    """None when ``url``'s page for torch answers within ``timeout_s`` seconds, else why not.

    The request runs in a daemon thread waited for at most ``timeout_s``: a name lookup that hangs
    (which a socket timeout does not bound) cannot hold the install up either.
    """
    outcome: list[str | None] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout_s) as page:
                page.read(1)
            outcome.append(None)
        except urllib.error.HTTPError as e:
            outcome.append(f"HTTP {e.code}")
        except urllib.error.URLError as e:
            outcome.append(str(e.reason))
        except Exception as e:  # a malformed URL, a reset connection, ...
            outcome.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return f"no answer within {timeout_s:g} s"
    return outcome[0]


def choose(env: dict[str, str] | None = None) -> tuple[list[str], str]:
    """The extra pip arguments and a line saying which torch build they lead to and why."""
    env = os.environ if env is None else env
    gpu = nvidia_gpu()
    if gpu is not None:
        return [], f"torch: NVIDIA GPU found ({gpu}): pip takes torch from its configured indexes (CUDA builds)"
    url = env.get("GPUFLEET_TORCH_CPU_INDEX", CPU_INDEX).strip() or CPU_INDEX
    if url.lower() == "none":
        return [], ("torch: no NVIDIA GPU; GPUFLEET_TORCH_CPU_INDEX=none: pip takes torch from its configured "
                    "indexes and caches")  # fmt: skip
    raw = env.get("GPUFLEET_TORCH_INDEX_TIMEOUT", "")
    try:
        timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        sys.exit(f"torch_build: GPUFLEET_TORCH_INDEX_TIMEOUT={raw!r} is not a number of seconds (e.g. 4)")
    why_not = probe(url, timeout_s)
    if why_not is None:
        return ["--extra-index-url", url], f"torch: no NVIDIA GPU: CPU builds of torch from {url}"
    return [], (f"torch: no NVIDIA GPU, but PyTorch's CPU index {url} cannot be reached ({why_not}): "
                "pip takes torch from its configured indexes and caches (a CUDA build where only that is there)")  # fmt: skip


def _where(entry: dict) -> str:
    url = (entry.get("download_info") or {}).get("url", "")
    parts = urlsplit(url)
    if parts.scheme == "file":
        return unquote(parts.path)
    return url or "an unknown place"


def _torch_build() -> str | None:
    """``torch.version.cuda`` of the installed torch, read from its version.py (importing torch takes seconds)."""
    spec = util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    namespace: dict[str, object] = {}
    exec(compile(version_py.read_text(), str(version_py), "exec"), namespace)  # a file of assignments
    cuda = namespace.get("cuda")
    return f"CUDA {cuda} build" if cuda else "CPU build"


def _uv_selected(uv_log: Path) -> dict[str, dict]:
    """What uv's verbose log says it selected (``Selecting: torch==2.13.0+cpu [..] (FILE)``), as
    entries shaped like pip's report (``{"metadata": {..}, "download_info": {"url": FILE}}``)."""
    pattern = re.compile(r"Selecting: ([A-Za-z0-9_.-]+)==(\S+) \[[^]]*\] \((.+)\)$")
    found: dict[str, dict] = {}
    for line in uv_log.read_text(errors="replace").splitlines():
        m = pattern.search(line)
        if m:
            found[m[1].lower()] = {"metadata": {"name": m[1], "version": m[2]}, "download_info": {"url": m[3]}}
    return found


def describe(pip_report: Path | None, gpu: str | None, uv_log: Path | None = None) -> list[str]:
    """One line per installed package of PACKAGES: version, build, where it came from."""
    installed: dict[str, dict] = {}
    if uv_log is not None and uv_log.is_file():
        installed, pip_report = _uv_selected(uv_log), uv_log
    elif pip_report is not None and pip_report.is_file():
        try:
            report = json.loads(pip_report.read_text())
            installed = {e["metadata"]["name"].lower(): e for e in report.get("install", [])}
        except (ValueError, KeyError, TypeError):
            installed = {}
    lines = []
    for name in PACKAGES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "torch":
                lines.append("torch: not installed in this environment")
            continue
        build = ""
        if name == "torch":
            build = f": {_torch_build() or 'build unknown'}"
        entry = installed.get(name)
        if entry is not None and entry.get("metadata", {}).get("version") == version:
            source = f", from {_where(entry)}"
        elif pip_report is not None and pip_report.is_file():
            source = ", already installed (kept)"
        else:
            source = ", installed before"
        lines.append(f"{name} {version}{build}{source}")
        if name == "torch" and gpu is None and "CUDA" in build:
            lines.append("  (this machine has no NVIDIA GPU: this CUDA build runs on CPU, but a CPU build is a "
                         f"fraction of its size; it is taken when {CPU_INDEX} can be reached)")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pip-args", help="print a line saying which torch build and why, then the extra pip arguments (one a line)")
    d = sub.add_parser("describe", help="say which torch build this interpreter's environment has")
    d.add_argument("--pip-report", type=Path, help="pip's --report of the install")
    d.add_argument("--uv-log", type=Path, help="uv's verbose output of the install (instead of a pip report)")
    args = parser.parse_args(argv)
    if args.command == "pip-args":
        pip_args, why = choose()
        print("\n".join([why, *pip_args]))
        return 0
    for line in describe(args.pip_report, nvidia_gpu(), args.uv_log):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
