"""Helpers of the workload tests: run the CLI in-process or as a process, wait for states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet.cli import main
from gpufleet.runs.store import TERMINAL_STATES, RunStore
from tests.proc import run_processes

REPO = Path(__file__).resolve().parents[2]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``gpufleet ARGV`` in this process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """Run a command with ``-o json`` and parse what it printed."""
    code, out, err = cli(capsys, *argv, "-o", "json")
    assert out, f"no output (exit {code}): {err}"
    return json.loads(out)


def cli_process(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``gpufleet ARGV`` as its own process."""
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


def wait_state(store: RunStore, run_id: str, states: tuple[str, ...] = TERMINAL_STATES, timeout: float = 120) -> Any:
    """Poll the store until the run is in one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        run = store.get(run_id)
        if run.state in states:
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} still {run.state} after {timeout} s")
        time.sleep(0.1)


def wait_for_text(path: Path, text: str, timeout: float = 60) -> None:
    """Wait until a file contains ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}")


def wait_until(what: str, check: Callable[[], object], timeout: float = 120, detail: Callable[[], object] | None = None) -> None:
    """Poll ``check`` until it is true; past ``timeout`` fail with ``what`` (and ``detail()``, if given)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s" + (f"; {detail()}" if detail else ""))
        time.sleep(0.1)


def wait_no_processes(run_id: str, timeout: float = 30) -> list[Any]:
    """Wait until no process of the run is alive; returns what is left after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = run_processes(run_id)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def write_workload(folder: Path, name: str = "workload.yaml", **fields: Any) -> Path:
    """Write a workload YAML (fields as given) into ``folder``."""
    import yaml

    doc = {
        "experiment_name": "test",
        "compute": {"accelerator_type": "CPU_1", "num_accelerators": 1},
        "command": "true",
        **fields,
    }
    path = folder / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def tiny_wheel(folder: Path, name: str = "gfnodedemo", value: str = "installed on this node", tag: str = "py3") -> Path:
    """A pure-Python wheel of package ``name`` whose ``VALUE`` is ``value``, tagged ``TAG-none-any``,
    built by hand (no build backend, no network)."""
    import base64
    import hashlib
    import zipfile

    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
        f"{name}-0.1.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}-none-any\n".encode(),
    }
    record = "".join(
        f"{member},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for member, data in files.items()
    ) + f"{name}-0.1.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.1-{tag}-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{name}-0.1.dist-info/RECORD", record)
    return path


def detach_script(tmp_path: Path, body: str) -> str:
    """Run a script that defines ``train`` (``body``), submits it detached and ends; the run's id."""
    import textwrap

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body) + "\nprint(train.submit(detach=True).run_id, flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert f"run {done.stdout.strip()} runs detached" in done.stderr
    return done.stdout.strip()


#: A call of two CPU ranks that print "waiting" and sleep for two minutes (for ``detach_script``).
SLEEPER = """
    from gpufleet import distributed

    @distributed(gpus=2, gpu_type="cpu", tracking=False)
    def train():
        import time
        print("waiting", flush=True)
        time.sleep(120)
"""
