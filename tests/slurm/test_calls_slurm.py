"""Decorated calls on the real local Slurm cluster: ``@distributed(remote="slurm")`` across two nodes."""

from __future__ import annotations

import pytest

from gpufleet import distributed
from tests.proc import run_processes
from tests.slurm.conftest import squeue_ids

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


class StepDiverged(ValueError):
    """An exception type of the caller's own."""


def all_reduce_and_report(scale: float) -> dict:
    import os

    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    print(f"hello from rank {runtime.get_global_rank()} on {os.environ['SLURMD_NODENAME']}", flush=True)
    return {"rank": runtime.get_global_rank(), "node": runtime.get_node_rank(), "sum": t.item() * scale,
            "world": runtime.get_world_size(), "slurm_node": os.environ["SLURMD_NODENAME"]}


def test_two_node_call_returns_every_rank_in_order_with_logs(tmp_path, capfd) -> None:
    f = distributed(all_reduce_and_report, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2, "time": "5"},
                    runs_dir=str(tmp_path), timeout=240, tracking=False, log_ranks="all")  # fmt: skip
    handle = f.submit(2.0)
    values = handle.result()
    assert values == [
        {"rank": 0, "node": 0, "sum": 6.0, "world": 2, "slurm_node": "node1"},
        {"rank": 1, "node": 1, "sum": 6.0, "world": 2, "slurm_node": "node2"},
    ]
    out = capfd.readouterr().out
    assert "[rank 0] hello from rank 0 on node1" in out
    assert "[rank 1] hello from rank 1 on node2" in out
    assert "hello from rank 1 on node2" in handle.logs(1)
    from gpufleet.runs.store import RunStore

    placement = RunStore(None).get(handle.run_id).placement  # what `gpufleet get` shows
    assert placement["slurm_job_id"] and placement["hosts"] == ["node1", "node2"], placement
    assert squeue_ids() == [] or _wait_empty()
    assert run_processes(handle.run_id) == []


def _wait_empty(timeout: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while squeue_ids():
        assert time.monotonic() < deadline, f"jobs left in squeue: {squeue_ids()}"
        time.sleep(0.5)
    return True


def raise_on_rank_one() -> int:
    from gpufleet import runtime

    if runtime.get_global_rank() == 1:
        raise StepDiverged("loss is nan at step 7")
    return 0


def test_a_raising_rank_gives_the_caller_its_own_exception(tmp_path) -> None:
    f = distributed(raise_on_rank_one, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2},
                    runs_dir=str(tmp_path), timeout=240, tracking=False)  # fmt: skip
    with pytest.raises(StepDiverged, match="loss is nan at step 7") as info:
        f.distributed()
    assert "raise StepDiverged" in str(info.value.__cause__)  # the remote traceback
    assert _wait_empty()


def sleep_after_hello() -> None:
    import time

    print("rank is up", flush=True)
    time.sleep(300)


def test_cancel_of_a_running_call_empties_squeue(tmp_path) -> None:
    import time

    from gpufleet.errors import RunCanceledError

    f = distributed(sleep_after_hello, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2},
                    runs_dir=str(tmp_path), timeout=240, tracking=False, grace_period_s=1.0)  # fmt: skip
    handle = f.submit()
    deadline = time.monotonic() + 120
    while "rank is up" not in handle.logs(0) or "rank is up" not in handle.logs(1):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.3)
    assert squeue_ids()
    handle.cancel()
    with pytest.raises(RunCanceledError):
        handle.result()
    assert squeue_ids() == []  # cancel returns once Slurm has the job off the nodes
    assert run_processes(handle.run_id) == []


INTERRUPTED = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal or a notebook kernel
from gpufleet import distributed

def wait_up():
    import time
    print("rank is up", flush=True)
    time.sleep(300)

try:
    distributed(wait_up, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2}, runs_dir=sys.argv[1],
                timeout=240, tracking=False, grace_period_s=1.0, log_ranks="all").distributed()
except KeyboardInterrupt:
    print("CAUGHT KeyboardInterrupt", flush=True)
"""


def test_ctrl_c_at_the_caller_cancels_the_job_and_leaves_nothing(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    script = tmp_path / "caller.py"
    script.write_text(INTERRUPTED)
    runs = tmp_path / "runs"
    err_file = tmp_path / "caller.err"  # a file: only the reader below reads the caller's stdout
    with open(err_file, "w") as err_out:
        proc = subprocess.Popen([sys.executable, str(script), str(runs)], stdout=subprocess.PIPE, stderr=err_out,
                                text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not all(any(f"[rank {r}] rank is up" in line for line in lines) for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines) + err_file.read_text()
            time.sleep(0.2)
        assert squeue_ids()
        run_id = next(p.name for p in runs.iterdir() if p.is_dir())
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        reader.join(5)  # the pipe's last lines: it ends at the caller's exit
        assert "CAUGHT KeyboardInterrupt" in "".join(lines), "".join(lines) + err_file.read_text()
    finally:
        proc.kill()
    assert _wait_empty()
    assert run_processes(run_id) == []


def test_a_call_past_its_timeout_is_stopped_with_its_ranks_stacks(tmp_path) -> None:
    from gpufleet.errors import DistributedTimeoutError

    f = distributed(sleep_after_hello, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2},
                    runs_dir=str(tmp_path), timeout=25, tracking=False, grace_period_s=1.0)  # fmt: skip
    handle = f.submit()
    with pytest.raises(DistributedTimeoutError, match="ran past its timeout of 25 s") as info:
        handle.result()
    assert "rank is up" in handle.logs(0) and "rank is up" in handle.logs(1)
    assert "in sleep_after_hello" in handle.logs(0) + str(info.value), handle.logs(0)  # where they were, at the timeout
    assert _wait_empty()
    assert run_processes(handle.run_id) == []
