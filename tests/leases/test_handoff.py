"""A caller that dies hands its GPUs on only after its ranks are gone (fake GPUs, real calls).

The ranks inherit the lease's lock, so the lease outlives a SIGKILLed caller until its last rank
has exited. The test freezes the dead caller's ranks (SIGSTOP: a rank slow to exit, as one stuck
in a driver call is) so that the window is as wide as the test wants, not a race.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

CALLER = """
import os, sys, time
from gpufleet import distributed

out = sys.argv[1]

@distributed(gpus=2, stream_logs=False, gpu_wait=120)
def use_gpus(name: str, hold_s: float) -> str:
    from gpufleet import runtime
    mark = f"{name}-rank{runtime.get_global_rank()}"
    tmp = os.path.join(out, f".{mark}.tmp")  # a name the test's "a-rank*" never matches
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {time.time()!r} {os.environ.get('CUDA_VISIBLE_DEVICES')}")
    os.replace(tmp, os.path.join(out, mark))
    time.sleep(hold_s)
    return os.environ.get("CUDA_VISIBLE_DEVICES")

print("RESULT", use_gpus.distributed(sys.argv[2], float(sys.argv[3])), flush=True)
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "GPUFLEET_FAKE_GPUS": "2", "GPUFLEET_TRACKING": "0", "PYTHONPATH": str(REPO / "src"),
            "GPUFLEET_HOME": str(tmp_path / "home")}  # fmt: skip


@pytest.fixture
def callers(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


@pytest.fixture
def ranks() -> Iterator[list[psutil.Process]]:
    """Ranks of a caller the test kills: resumed and ended however the test ends."""
    procs: list[psutil.Process] = []
    yield procs
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.resume()
            p.kill()


def _start(callers: list, env: dict[str, str], script: Path, out: Path, name: str, hold_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(script), str(out), name, str(hold_s)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    callers.append(proc)
    return proc


def _wait_for(path_glob: Path, count: int, proc: subprocess.Popen[str], timeout: float = 120) -> list[Path]:
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(path_glob.parent.glob(path_glob.name))
        if len(found) >= count:
            return found
        assert proc.poll() is None or len(found) >= count, f"the caller ended first:\n{proc.communicate()}"
        assert time.monotonic() < deadline, f"{count} files like {path_glob.name} did not appear"
        time.sleep(0.05)


def test_a_sigkilled_callers_gpus_go_to_the_waiter_only_after_its_ranks_exit(tmp_path: Path, env, callers, ranks) -> None:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER))
    out = tmp_path / "marks"
    out.mkdir()
    a = _start(callers, env, script, out, "a", 600)
    ranks_a = [psutil.Process(int(p.read_text().split()[0])) for p in _wait_for(out / "a-rank*", 2, a)]
    ranks.extend(ranks_a)
    b = _start(callers, env, script, out, "b", 0)
    assert b.stderr is not None
    waiting = b.stderr.readline()
    assert "waits for 2 GPUs" in waiting, waiting
    try:
        for r in ranks_a:
            r.suspend()  # ranks slow to exit: they outlive their caller as long as they are stopped
        a.kill()
        a.wait(30)
        killed = time.time()
        time.sleep(2.0)
        assert not list(out.glob("b-rank*")), "the waiter started while the dead caller's ranks were still alive"
        assert all(r.is_running() and r.status() == psutil.STATUS_STOPPED for r in ranks_a)
        resumed = time.time()
    finally:
        for r in ranks_a:
            with contextlib.suppress(psutil.Error):
                r.resume()  # they see their caller gone and exit
    gone, alive = psutil.wait_procs(ranks_a, timeout=30)
    assert not alive, alive
    marks_b = _wait_for(out / "b-rank*", 2, b)
    started_b = min(float(p.read_text().split()[1]) for p in marks_b)
    assert started_b > resumed, (started_b - killed, resumed - killed)
    stdout, stderr = b.communicate(timeout=120)
    assert b.returncode == 0, stdout + stderr
    assert "RESULT ['0,1', '0,1']" in stdout, stdout  # both GPUs, the dead caller's
