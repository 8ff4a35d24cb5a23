"""How a Slurm attempt tells a preemption or a time limit from a failure or a cancel (against a fake job).

The real cluster's tests (tests/slurm) show the whole path; these pin each rule: a node's exit code
is taken only after a fresh look at the job, a preempted job's nodes may end with any code, a rank's
SIGTERM alone is no preemption (``scancel`` sends it too), and gpufleet's own cancel is marked before
the job is signaled. Also the rank's side: the scheduler's SIGTERM becomes a checkpoint request, and
gpufleet's own cancel still ends the rank at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpufleet.launch.engines.base import Unit
from gpufleet.launch.engines.slurm.engine import PREEMPTED_EXIT_CODE, SlurmProc
from gpufleet.launch.engines.slurm.job import CANCELED_FILE, PREEMPTED_FILE, JobState
from gpufleet.workload.schema import WorkloadConfig
from gpufleet.workload.slurm_executor import SlurmExecutor

REPO = Path(__file__).resolve().parents[2]


class FakeJob:
    """What ``scontrol show job`` would say; counts the fresh reads and records a cancel."""

    def __init__(self, folder: Path, state: JobState) -> None:
        self.job_id = "41"
        self.folder = folder
        self.current = state
        self.seen: JobState | None = None
        self.fresh_reads = 0
        self.canceled_with_mark: bool | None = None
        self.ran = True

    def state(self, max_age_s: float = 1.0) -> JobState:
        """The last answer stands (as a cached one may) unless a fresh one is asked for."""
        if max_age_s == 0.0 or self.seen is None:
            self.fresh_reads += max_age_s == 0.0
            self.seen = self.current
        return self.seen

    def requeued(self) -> bool:
        return self.current.restarts > 0

    def cancel(self, wait_s: float = 30.0) -> JobState:
        self.canceled_with_mark = (self.folder / CANCELED_FILE).exists()
        self.current = JobState("CANCELLED")
        return self.current

    def nodes(self) -> list[str]:
        return ["node1", "node2"]


def _attempt(tmp_path: Path, state: JobState) -> tuple[SlurmExecutor, FakeJob, list[SlurmProc]]:
    config = WorkloadConfig.model_validate({
        "experiment_name": "t", "command": "true",
        "compute": {"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": "slurm"},
    })  # fmt: skip
    ex = SlurmExecutor(config)
    ex.rendezvous(2)
    ex.folder = tmp_path
    job = FakeJob(tmp_path, state)
    ex.job = job  # type: ignore[assignment]
    nodes = [SlurmProc(ex, Unit(r, {}, str(tmp_path), command="true", log_path=str(tmp_path / f"node-{r}.log"))) for r in (0, 1)]
    return ex, job, nodes


def _exit(tmp_path: Path, node: int, code: int) -> None:
    (tmp_path / f"node-{node}.exit").write_text(json.dumps({"exit_code": code}))


def test_nodes_that_exit_0_after_a_preemption_make_a_preempted_attempt_not_a_success(tmp_path: Path) -> None:
    ex, job, nodes = _attempt(tmp_path, JobState("RUNNING"))
    assert [n.poll() for n in nodes] == [None, None]  # running; that answer is what the executor holds
    job.current = JobState("RUNNING", preempt_time="2026-12-04T10:00:00")  # Slurm preempts: SIGTERM to the tasks
    for r in (0, 1):  # the ranks saved at SIGTERM and ended their loop early: exit 0, the training is not done
        _exit(tmp_path, r, 0)
    assert nodes[0].poll() is None and job.fresh_reads == 1  # a code is taken only after a fresh look
    assert [n.poll() for n in nodes] == [PREEMPTED_EXIT_CODE] * 2
    assert "a job of a higher priority took its nodes" in (ex.preempted or "") and "41" in (ex.preempted or "")
    assert "next one resumes from the newest checkpoint" in (tmp_path / "node-0.log").read_text()


def test_a_rank_s_sigterm_mark_alone_is_no_preemption(tmp_path: Path) -> None:
    # someone ran `scancel`: a rank marked its SIGTERM, but Slurm never preempted the job
    ex, job, nodes = _attempt(tmp_path, JobState("CANCELLED"))
    (tmp_path / PREEMPTED_FILE).write_text(json.dumps({"signal": "TERM", "rank": "0"}))
    _exit(tmp_path, 0, 1)
    _exit(tmp_path, 1, 1)
    assert [n.poll() for n in nodes] == [1, 1]
    assert ex.preempted is None


def test_the_batch_step_s_time_limit_mark_is_a_preemption(tmp_path: Path) -> None:
    ex, job, nodes = _attempt(tmp_path, JobState("RUNNING"))
    (tmp_path / PREEMPTED_FILE).write_text(json.dumps({"signal": "USR1", "job": "41"}))
    assert ex.preempted and "time limit" in ex.preempted
    job.current = JobState("COMPLETED")
    _exit(tmp_path, 0, 0)
    _exit(tmp_path, 1, 0)
    assert [n.poll() for n in nodes] == [PREEMPTED_EXIT_CODE] * 2


def test_a_job_slurm_requeued_anyway_is_a_preemption_and_leaves_the_queue(tmp_path: Path) -> None:
    # jobs go in --no-requeue; a site policy or an administrator may requeue one all the same: it
    # would wait behind Slurm's begin-time hold with the old attempt's environment
    ex, job, nodes = _attempt(tmp_path, JobState("RUNNING"))
    assert nodes[0].poll() is None
    job.current = JobState("PENDING", reason="BeginTime", restarts=1)
    job.seen = None
    assert [n.poll() for n in nodes] == [PREEMPTED_EXIT_CODE] * 2
    assert ex.preempted == "preempted: Slurm requeued job 41"
    nodes[0].cleanup()
    assert job.canceled_with_mark is True  # canceled, not left to its hold; the next attempt is a new job


def test_gpufleet_marks_its_own_cancel_before_it_signals_the_job(tmp_path: Path) -> None:
    ex, job, nodes = _attempt(tmp_path, JobState("RUNNING"))
    nodes[0].cancel(1.0)
    assert job.canceled_with_mark is True
    _exit(tmp_path, 0, 143)
    assert nodes[0].poll() == 143 and ex.preempted is None  # its own cancel is never a preemption


RANK = textwrap.dedent(
    """
    import sys, time
    import torch
    from gpufleet.checkpoint import CheckpointManager
    from gpufleet.checkpoint.preemption import preemption_requested

    CheckpointManager(sys.argv[1], model=torch.nn.Linear(1, 1))
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not preemption_requested() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("asked to checkpoint" if preemption_requested() else "never asked", flush=True)
    """
)


def _rank(tmp_path: Path, env_extra: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_PREEMPT_FILE"}
    env.update(PYTHONPATH=str(REPO / "src"), **env_extra)
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_the_scheduler_s_sigterm_makes_a_rank_checkpoint_instead_of_dying(tmp_path: Path) -> None:
    mark = tmp_path / PREEMPTED_FILE
    proc = _rank(tmp_path, {"GPUFLEET_PREEMPT_FILE": str(mark), "RANK": "3"})
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "asked to checkpoint" in out, out + err
    assert "rank 3 got SIGTERM from the scheduler" in err
    assert json.loads(mark.read_text())["signal"] == "TERM"


def test_gpufleet_s_own_cancel_still_ends_a_rank_at_once(tmp_path: Path) -> None:
    (tmp_path / CANCELED_FILE).write_text("{}")
    proc = _rank(tmp_path, {"GPUFLEET_PREEMPT_FILE": str(tmp_path / PREEMPTED_FILE)})
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert not (tmp_path / PREEMPTED_FILE).exists()


def test_outside_slurm_sigterm_keeps_its_default(tmp_path: Path) -> None:
    proc = _rank(tmp_path, {})
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM


ORPHAN = 'python3 -c "import os, time\nif os.fork() == 0:\n    time.sleep(1.5); open(\'{out}\', \'w\').close()\n"'


@pytest.mark.parametrize("how", ["a-rank-marked-sigterm", "the-guard-got-sigterm", "no-preemption", "gpufleet-cancels"])
def test_the_node_guard_lets_ranks_that_outlive_their_launcher_finish_a_preemption_s_checkpoint(
    tmp_path: Path, how: str
) -> None:
    # torchrun ends at the scheduler's SIGTERM while its ranks still save: they are orphans of the guard
    mark = tmp_path / PREEMPTED_FILE
    command = ORPHAN.format(out=tmp_path / "saved")
    if how == "a-rank-marked-sigterm":
        mark.write_text(json.dumps({"signal": "TERM", "rank": "0"}))
    elif how in ("the-guard-got-sigterm", "gpufleet-cancels"):  # a rank still inside a collective marks nothing yet
        command += "; kill -TERM $PPID"
    if how == "gpufleet-cancels":
        (tmp_path / CANCELED_FILE).write_text("{}")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "GPUFLEET_PREEMPT_FILE": str(mark)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gpufleet.launch.node.guard", "--", "bash", "-c", command],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    if how in ("a-rank-marked-sigterm", "the-guard-got-sigterm"):
        assert (tmp_path / "saved").exists(), done.stderr  # the orphan finished its work before the node ended
        assert "ends once its ranks have saved their checkpoint" in done.stderr
    else:
        time.sleep(max(0.0, 2.5 - (time.monotonic() - started)))
        assert not (tmp_path / "saved").exists()  # stopped with the node, as before
        assert "saved their checkpoint" not in done.stderr


@pytest.mark.parametrize("gpus", [True, False], ids=["gpu-job", "cpu-job"])
def test_the_tasks_of_a_job_without_gpus_see_none(tmp_path: Path, gpus: bool) -> None:
    # Slurm unsets CUDA_VISIBLE_DEVICES for a job without GPUs on a node that has them (seen on an
    # H200 node: two CPU ranks then both took GPU 0)
    from gpufleet.launch.engines.slurm.job import batch_script

    script = batch_script(tmp_path, "node", sys.executable, gpus=gpus).read_text()
    step = next(line for line in script.splitlines() if "-m gpufleet.launch.engines.slurm.node " in line)
    args = step.split("gpufleet.launch.engines.slurm.node ", 1)[1].removesuffix(" &").split()
    assert args[:2] == ["batch", "node"] and (args[-1] == "cpu") is (not gpus)
    (tmp_path / "node-command.sh").write_text('echo "visible=[${CUDA_VISIBLE_DEVICES-unset}]"\n')
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=str(REPO / "src"), SLURM_NODEID="0")
    task = ["task", "node", str(tmp_path)] + (["cpu"] if not gpus else [])
    done = subprocess.run([sys.executable, "-m", "gpufleet.launch.engines.slurm.node", *task], env=env, timeout=60)
    assert done.returncode == 0
    assert ("visible=[]" if not gpus else "visible=[unset]") in (tmp_path / "node-0.log").read_text()


def test_the_batch_script_marks_a_time_limit_signal_that_comes_before_python_is_up(tmp_path: Path) -> None:
    """Slurm may send ``SIGUSR1`` to the batch shell at the job's start (its timer's resolution is
    coarse): a batch step still importing Python died of it, and the job failed instead of resubmitting."""
    from gpufleet.launch.engines.slurm.job import batch_script

    started = tmp_path / "started"
    stub = tmp_path / "python"  # stands for the batch step: up, a moment of work, then its exit code
    stub.write_text(f"#!/bin/bash\ntouch {started}\nsleep 1\nexit 7\n")
    stub.chmod(0o755)
    script = batch_script(tmp_path, "node", str(stub), gpus=False)
    shell = subprocess.Popen(["bash", str(script)], env={**os.environ, "SLURM_JOB_ID": "41"}, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert time.monotonic() < deadline and shell.poll() is None, "the batch step never started"
            time.sleep(0.01)
        shell.send_signal(signal.SIGUSR1)  # as Slurm does (--signal=B:USR1@N), to the batch shell only
        shell.send_signal(signal.SIGUSR1)  # twice: the mark is rewritten, the step goes on
        _, err = shell.communicate(timeout=30)
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
    assert shell.returncode == 7, err  # the batch step's own exit code, not death by SIGUSR1
    mark = json.loads((tmp_path / PREEMPTED_FILE).read_text())
    assert mark["signal"] == "USR1" and mark["job"] == "41" and mark["time"] > 0, mark
    assert "Slurm job 41 was told to stop soon" in err
    assert not list(tmp_path.glob("*.tmp"))

