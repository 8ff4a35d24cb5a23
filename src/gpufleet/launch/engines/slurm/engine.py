"""The Slurm engine: one Slurm job per attempt, for a call's ranks and a workload's node commands alike.

The job allocates the attempt's nodes with ``--gpus-per-node`` (or CPUs per node) plus the run's
Slurm options (``--partition``, ``--time``, extra ``sbatch`` arguments); its batch step
(:mod:`gpufleet.launch.engines.slurm.node`) sets ``MASTER_ADDR`` to the first node's address and
``MASTER_PORT`` to a free port there, and ``srun`` starts one task per rank (a call's ranks, which
run the one worker entry) or per node (a workload's command under the node guard, ``NODE_RANK`` =
Slurm's node id). The job's environment is the submitting process's contract (secrets included:
they are in no file and on no command line). Each unit's exit code goes to ``rank-R.exit`` or
``node-N.exit`` in the attempt's folder, which must be on storage the login node and the nodes
share (as the code snapshot and checkpoints must be).

One rule for both payloads: a unit that never reports (its node died, Slurm ended the job:
``NODE_FAIL``, ``TIMEOUT``, ``CANCELLED``) is lost once the job has ended and its exit file had
:data:`EXIT_FILE_WAIT_S` more to appear, with a message naming the job's state.

For workloads (``preemptible``), a job Slurm signaled to stop before its time limit (``SIGUSR1``
to the batch step), preempted (its ``PreemptTime`` is set: the tasks got ``SIGTERM`` at the start
of the grace time) or requeued on its own ends the attempt as preempted (:meth:`SlurmEngine.preemption`),
whatever exit codes its nodes wrote: a node's code is taken only after a fresh look at the job.
The controller resubmits it as the next attempt without counting it against ``max_retries``, and
the command resumes from its newest checkpoint. Before it ends a job itself, the engine writes the
attempt's ``canceled.json`` (a rank's ``SIGTERM`` is then no preemption).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ....results import write_atomic
from ...group import GroupStartCanceled
from ...node import envcontract
from ..base import GRACE_PERIOD_S, Engine, Proc, Unit
from .job import (
    CANCELED_FILE,
    PREEMPT_FILE_ENV,
    PREEMPTED_FILE,
    JobState,
    SlurmJob,
    SlurmOptions,
    batch_script,
    resource_args,
)

__all__ = ["EXIT_FILE_WAIT_S", "FIRST_NODE", "LOST_EXIT_CODE", "PREEMPTED_EXIT_CODE", "SlurmEngine", "SlurmProc"]

#: Exit code of a node whose command never reported one (its node or job was lost), as for SIGKILL.
LOST_EXIT_CODE = 137
#: Exit code recorded for a node of a preempted attempt (EX_TEMPFAIL: try again).
PREEMPTED_EXIT_CODE = 75
#: Seconds a unit's exit file may take to appear once Slurm says the job ended (shared storage).
EXIT_FILE_WAIT_S = 5.0
#: Placeholder that node 0's batch step replaces with its own address and a free port.
FIRST_NODE = "slurm-first-node"


def _mark_signal(path: Path) -> str | None:
    """The signal a preempted mark records (``USR1``: the batch shell's; ``TERM``: a rank's), or None without one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "USR1"  # unreadable: taken for the batch shell's (a rank's mark is written whole, atomically)
    return str(data.get("signal", "USR1")) if isinstance(data, dict) else "USR1"


class SlurmEngine(Engine):
    """One Slurm job per attempt, with ``options`` (``--partition``, ``--time``, ...) and the run's id as its name.

    A call's group submits its ranks itself (:meth:`submit`, ``rank`` tasks) and reads their exit
    files and the job's end through the engine; a workload's attempt starts its node commands with
    :meth:`start` (node 0 submits the job for all, ``per_node`` GPUs or CPUs on each node).
    ``preemptible`` (workloads) turns on :meth:`preemption`: a job Slurm stops early ends the
    attempt as preempted, and the controller resubmits it; a call is never resubmitted.
    """

    def __init__(self, options: SlurmOptions, run_id: str, per_node: int = 1, use_gpus: bool = False,
                 preemptible: bool = False) -> None:  # fmt: skip
        self.options = options
        self.run_id = run_id
        self.per_node = per_node
        self.use_gpus = use_gpus
        self.preemptible = preemptible
        self.job: SlurmJob | None = None
        self.folder = Path(".")
        self._num_nodes = 0
        self._node_names: list[str] = []
        self._preempted: str | None = None
        self._canceling = False
        self._ended_at: float | None = None

    # -- the job --------------------------------------------------------------------------
    def submit(self, folder: Path, payload: str, env: dict[str, str], cwd: str, num_nodes: int,
               tasks_per_node: int) -> SlurmJob:  # fmt: skip
        """Submit the attempt's job: ``payload`` (``rank`` or ``node``) tasks, ``tasks_per_node`` on each of
        ``num_nodes`` nodes, its batch log and its units' files in ``folder``."""
        if self.canceled():
            raise GroupStartCanceled("before its Slurm job was submitted")
        self.folder = folder
        self._ended_at = None
        script = batch_script(folder, payload, sys.executable, gpus=self.use_gpus)
        args = [
            *resource_args(num_nodes, self.per_node, self.use_gpus, tasks_per_node=tasks_per_node),
            f"--job-name=gpufleet-{self.run_id}",
            f"--output={folder / 'slurm-batch.log'}",
            f"--signal=B:USR1@{self.options.signal_before_s}",
            "--no-requeue",
            *self.options.args(),
        ]
        self.job = SlurmJob.submit(script, args, env, cwd)
        return self.job

    def ended_unreported(self) -> JobState | None:
        """The job's state once Slurm ended it and a unit's exit file had :data:`EXIT_FILE_WAIT_S` more to
        appear (shared storage); None while it runs or that time is not over."""
        if self.job is None:
            return None
        state = self.job.state()
        if not state.ended:
            return None
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        return state if time.monotonic() - self._ended_at >= EXIT_FILE_WAIT_S else None

    def lost_message(self, state: JobState, what: str, lost: str) -> str:
        """Why a unit never reported: the job ended ``state`` before ``what``."""
        assert self.job is not None
        why = f" ({state.reason})" if state.reason and state.reason != "None" else ""
        return (f"Slurm job {self.job.job_id} ended {state.state}{why} before {what} (on nodes {state.nodes or '?'}): "
                f"{lost} was lost; Slurm's messages are in {self.folder / 'slurm-batch.log'}")  # fmt: skip

    # -- the node-command payload ---------------------------------------------------------
    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        self.finish()
        self.job, self._num_nodes, self._node_names, self._preempted = None, num_nodes, [], None
        self._canceling = False
        return FIRST_NODE, 0  # the batch step on node 0 sets both (its address, a free port there)

    def start(self, unit: Unit) -> Proc:
        """A node command: node 0 submits the job for every node (``srun`` starts each under the node guard)."""
        assert unit.command is not None and unit.log_path is not None, "the Slurm engine's start runs node commands"
        if unit.index == 0:
            folder = Path(unit.log_path).parent
            (folder / "node-command.sh").write_text(unit.command)
            env = self.node_job_env(dict(unit.env), folder)
            self.submit(folder, "node", env, unit.cwd or os.getcwd(), self._num_nodes, tasks_per_node=1)
            assert self.job is not None
            print(f"gpufleet: attempt submitted as Slurm job {self.job.job_id}", file=sys.stderr, flush=True)
        return SlurmProc(self, unit)

    def node_job_env(self, env: dict[str, str], folder: Path) -> dict[str, str]:
        """The job's environment for node commands: node 0's less what each node sets itself."""
        for key in (envcontract.MASTER_ADDR, envcontract.MASTER_PORT, envcontract.NODE_RANK):
            env.pop(key, None)  # each node's own (slurm_node sets them)
        env[PREEMPT_FILE_ENV] = str(folder / PREEMPTED_FILE)
        return env

    @property
    def preempted(self) -> str | None:
        """Why Slurm ended or is ending the current job early (see :meth:`preemption`), or None."""
        return self.preemption()

    def preemption(self, max_age_s: float = 1.0) -> str | None:
        """Why Slurm ended or is ending the current job early, from what it said at most ``max_age_s`` ago; or None.

        The batch shell's mark of ``SIGUSR1`` (the time limit is near), the job's ``PreemptTime`` (a
        preemption, whose ``SIGTERM`` went to the tasks), a requeue, or the state ``PREEMPTED``. A
        mark a rank wrote on ``SIGTERM`` alone is none of these: a ``scancel`` sends that signal too.
        """
        if self._preempted is None and self.preemptible and self.job is not None and not self._canceling:
            job = self.job.job_id
            if _mark_signal(self.folder / PREEMPTED_FILE) == "USR1":
                self._preempted = f"preempted: Slurm signaled job {job} to stop (its time limit is near)"
                return self._preempted
            state = self.job.state(max_age_s)
            if state.preempt_time:
                self._preempted = (f"preempted: Slurm preempted job {job} at {state.preempt_time} (a job of a higher "
                                   "priority took its nodes)")  # fmt: skip
            elif self.job.requeued():
                self._preempted = f"preempted: Slurm requeued job {job}"
            elif state.state == "PREEMPTED":  # preempted without a grace time: no signal came
                self._preempted = f"preempted: Slurm preempted job {job} without a signal first"
        return self._preempted

    @property
    def lost(self) -> str | None:
        """What Slurm said when it ended the job under the nodes (a node failed, say), or None."""
        if self.job is None or self._preempted:
            return None
        s = self.job.state()
        if s.state in ("NODE_FAIL", "BOOT_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "REVOKED"):
            why = f" ({s.reason})" if s.reason and s.reason != "None" else ""
            return f"Slurm ended job {self.job.job_id} {s.state}{why} on nodes {s.nodes or '?'}"
        return None

    def exit_code(self, kind: str, index: int) -> int | None:
        """The exit code task ``index`` (``kind``: ``rank`` or ``node``) wrote, or None."""
        try:
            return int(json.loads((self.folder / f"{kind}-{index}.exit").read_text())["exit_code"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def job_over(self) -> bool:
        """Every node reported, or Slurm ended the job (a requeued job counts: it is canceled)."""
        if self.job is None:
            return False
        if all(self.exit_code("node", r) is not None for r in range(self._num_nodes)):
            return True
        return self.job.state().ended or self.job.requeued()

    def node_names(self) -> list[str]:
        """The job's nodes (empty until it runs)."""
        if not self._node_names and self.job is not None:
            try:
                self._node_names = self.job.nodes()
            except Exception:  # noqa: BLE001 - describing never fails the run
                return []
        return self._node_names

    def stacks(self, run_id: str) -> list[dict[str, Any]]:
        """The run's processes and stacks, read on the job's nodes (``srun --overlap``)."""
        from .stacks import collect_on_slurm

        got = collect_on_slurm(run_id)
        return got[1] if got else []

    def cancel_job(self, grace_period_s: float) -> None:
        """Cancel the attempt's job and wait until nothing of it runs (up to ``grace_period_s`` + 20 s, at least 30 s)."""
        if self.job is not None:
            self._canceling = True
            if self.preemptible:  # first: the ranks' SIGTERM handlers read it (this SIGTERM is no preemption)
                with contextlib.suppress(OSError):
                    write_atomic(self.folder / CANCELED_FILE, json.dumps({"time": time.time()}).encode())
            self.job.cancel(wait_s=max(30.0, grace_period_s + 20.0))

    def finish(self, wait_s: float = 0.0) -> None:
        """Let the job end by itself for up to ``wait_s`` (units that returned are exiting), then cancel what is left."""
        job = self.job
        if job is None:
            return
        deadline = time.monotonic() + wait_s
        while not job.state(max_age_s=0.0).ended and time.monotonic() < deadline:
            time.sleep(0.25)
        if not job.state(max_age_s=0.0).ended:
            self.cancel_job(1.0)

    def close(self) -> None:
        self.finish()


class SlurmProc(Proc):
    """One node's command in the attempt's job: its exit file, or the job's end, says how it ended."""

    def __init__(self, engine: SlurmEngine, unit: Unit) -> None:
        self.index = unit.index
        self._engine = engine
        self._unit = unit
        self._code: int | None = None

    def _note(self, text: str) -> None:
        with open(self._unit.log_path, "a") as f:
            f.write(f"gpufleet: {text}\n")

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ex = self._engine
        job = ex.job
        if job is None:
            return None
        if ex.preempted:
            # The ranks are saving: the attempt ends once the whole job has, never in the middle of a save.
            if not ex.job_over():
                return None
            self._code = PREEMPTED_EXIT_CODE
            self._note(f"{ex.preempted}; this attempt ended there and the next one resumes from the newest checkpoint")
            return self._code
        code = ex.exit_code("node", self.index)
        if code is not None:
            if ex.preemption(max_age_s=0.0):  # a preempted job's nodes end too, with 0 or with the signal's code
                return None
            self._code = code
            return code
        state = ex.ended_unreported()
        if state is None:
            return None
        self._code = LOST_EXIT_CODE
        self._note(ex.lost_message(state, f"node {self.index}'s command reported an exit code", "the node or the job"))
        return self._code

    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        self._engine.cancel_job(grace_period_s)

    def cleanup(self) -> None:
        self._engine.finish()

    def describe(self) -> dict[str, Any]:
        job = self._engine.job
        nodes = self._engine.node_names()
        return {
            "node_rank": self.index,
            "host": nodes[self.index] if self.index < len(nodes) else None,
            "slurm_job_id": job.job_id if job else None,
            "log_path": self._unit.log_path,
        }
