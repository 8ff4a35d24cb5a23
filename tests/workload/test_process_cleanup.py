"""Nothing of an attempt outlives it; stopping a run's processes; the workload errors are gpufleet errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.proc import run_processes
from tests.workload.helpers import cli, wait_for_text, wait_no_processes, wait_state, write_workload

# A child that leaves the node's process group (setsid) and carries on after its shell ends.
ESCAPE = 'setsid sleep 600 & echo started; '


@pytest.mark.parametrize(
    ("end", "state"),
    [("exit 0", "SUCCESS"), ("exit 3", "FAILED"), ("sleep 600", "CANCELED")],
)
def test_a_child_that_called_setsid_is_stopped_with_its_attempt(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str], end: str, state: str
) -> None:
    wl = write_workload(tmp_path, command=ESCAPE + end)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.strip()
    if state == "CANCELED":
        run = wait_state(store, run_id, ("RUNNING",))
        wait_for_text(Path(run.run_dir) / "attempts" / "1" / "node-0.log", "started")
        rc, out, err = cli(capsys, "cancel", run_id)
        assert rc == 0, out + err
    run = wait_state(store, run_id)
    assert run.state == state, run.message
    assert "started" in (Path(run.run_dir) / "attempts" / "1" / "node-0.log").read_text()
    # only the supervisor, on its way out, may still carry the run's id
    left = wait_no_processes(run_id)
    assert left == [], [p.cmdline() for p in left]


def test_kill_run_processes_counts_every_process_it_stopped() -> None:
    from gpufleet.runs.liveness import kill_run_processes

    run_id = f"kill-count-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "GPUFLEET_RUN_ID": run_id}
    stubborn = subprocess.Popen(  # ignores SIGTERM: only SIGKILL ends it
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(600)"],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    plain = subprocess.Popen(["sleep", "600"], env=env)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
        assert len(run_processes(run_id)) == 2
        t0 = time.monotonic()
        assert kill_run_processes(run_id, grace_period_s=0.3) == 2
        assert time.monotonic() - t0 < 60  # both sleep 600 s: stopped, and the one ignoring SIGTERM killed
        assert stubborn.wait(timeout=30) == -9 and plain.wait(timeout=30) == -15
        assert run_processes(run_id) == []
        assert kill_run_processes(run_id, grace_period_s=0.3) == 0
    finally:
        for p in (stubborn, plain):
            p.kill()
            p.wait()


def test_the_nodes_get_omp_num_threads_unless_the_workload_sets_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two = {"accelerator_type": "CPU_2", "num_accelerators": 2}
    wl = write_workload(tmp_path, compute=two, command='echo "omp=$OMP_NUM_THREADS"')
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err
    assert f"[node 0] omp={max(1, (os.cpu_count() or 1) // 2)}" in out
    wl = write_workload(tmp_path, name="own.yaml", compute=two, env_variables={"OMP_NUM_THREADS": 3},
                        command='echo "omp=$OMP_NUM_THREADS"')  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err
    assert "[node 0] omp=3" in out


def test_every_workload_error_is_a_gpufleet_error() -> None:
    from gpufleet.errors import GpufleetError
    from gpufleet.launch.node.envs import EnvironmentSetupCanceled, EnvironmentSetupError
    from gpufleet.runs.store import RunNotFoundError
    from gpufleet.workload.nodes import ExecutorUnavailableError
    for cls, other in [
        (RunNotFoundError, LookupError),
        (EnvironmentSetupError, RuntimeError),
        (EnvironmentSetupCanceled, RuntimeError),
        (ExecutorUnavailableError, RuntimeError),
    ]:
        assert issubclass(cls, GpufleetError) and issubclass(cls, other), cls


def test_the_guard_and_the_environment_builder_run_by_path(tmp_path: Path) -> None:
    """As on a Ray node: ``python .../guard.py`` and ``python .../envs.py`` find their helper beside them."""
    import gpufleet.launch.node as node

    folder = Path(node.__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(folder / "guard.py"), "--", "bash", "-c", "echo hi; exit 4"],
                          capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 4 and done.stdout == "hi\n", done.stderr
    env["GPUFLEET_DEPENDENCIES"] = '["gfmissing @ file:///nonexistent/gfmissing-0.1-py3-none-any.whl"]'
    env["GPUFLEET_HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, str(folder / "envs.py")], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1 and "could not build the run's environment on this node" in done.stderr, done.stderr
