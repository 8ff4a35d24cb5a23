"""Slurm executor for CLI workloads (``compute.cluster: slurm``): each attempt is one Slurm job.

The job allocates ``compute.num_nodes`` nodes with ``--gpus-per-node`` (or, for ``CPU_<n>``, ``n``
CPUs per node) plus ``compute.slurm``'s options; its batch step (:mod:`gpufleet.launch.engines.slurm.node`)
sets ``MASTER_ADDR`` to the first node's address and ``MASTER_PORT`` to a free port there, and
``srun`` runs the command once per node under the node guard with ``NODE_RANK`` = Slurm's node id.
The rest of the per-node contract is the one :class:`~gpufleet.workload.nodes.WorkloadNodeGroup`
builds for every executor; it reaches the job as ``sbatch``'s environment (secrets included: they
are in no file and on no command line). Each node's output goes to the attempt's ``node-N.log`` and
its exit code to ``node-N.exit``, both in the run folder, which must be on storage the login node and
the nodes share (as the code snapshot and checkpoints must be).

A node whose command never reports (the node died, Slurm ended the job: ``NODE_FAIL``, ``TIMEOUT``,
``CANCELLED``) ends with :data:`LOST_EXIT_CODE` and a line in its log naming the job's state, so the
attempt fails (and is retried) rather than waiting. A job Slurm signaled to stop before its time
limit (``SIGUSR1`` to the batch step), preempted (its ``PreemptTime`` is set: the tasks got
``SIGTERM`` at the start of the grace time) or requeued on its own ends the attempt as preempted
(:meth:`SlurmExecutor.preemption`), whatever exit codes its nodes wrote: a node's code is taken
only after a fresh look at the job. The controller resubmits it as the next attempt without
counting it against ``max_retries``, and the command resumes from its newest checkpoint. Before it
ends a job itself, the executor writes the attempt's ``canceled.json`` (a rank's ``SIGTERM`` is then
no preemption).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..launch.engines.base import GRACE_PERIOD_S, Engine, Proc, Unit
from ..launch.engines.slurm.job import (
    CANCELED_FILE,
    PREEMPT_FILE_ENV,
    PREEMPTED_FILE,
    SlurmJob,
    SlurmOptions,
    batch_script,
    require_slurm,
    resource_args,
)
from ..launch.group import GroupStartCanceled
from ..results import write_atomic
from .schema import WorkloadConfig

__all__ = ["SlurmExecutor", "create_executor", "LOST_EXIT_CODE", "PREEMPTED_EXIT_CODE"]

#: Exit code of a node whose command never reported one (its node or job was lost), as for SIGKILL.
LOST_EXIT_CODE = 137
#: Exit code recorded for a node of a preempted attempt (EX_TEMPFAIL: try again).
PREEMPTED_EXIT_CODE = 75
#: Seconds a node's exit file may take to appear once Slurm says the job ended (shared storage).
_EXIT_FILE_WAIT_S = 5.0
#: Placeholder that node 0's batch step replaces with its own address and a free port.
FIRST_NODE = "slurm-first-node"


def _mark_signal(path: Path) -> str | None:
    """The signal a preempted mark records (``USR1``: the batch step's; ``TERM``: a rank's), or None without one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "USR1"  # unreadable: taken for the batch step's (a rank's mark is written whole, atomically)
    return str(data.get("signal", "USR1")) if isinstance(data, dict) else "USR1"


def create_executor(config: WorkloadConfig) -> SlurmExecutor:
    """The executor of a workload with ``compute.cluster: slurm``."""
    require_slurm()
    return SlurmExecutor(config)


def options_of(config: WorkloadConfig) -> SlurmOptions:
    """The job's Slurm options from ``compute.slurm``."""
    s = config.compute.slurm
    if s is None:
        return SlurmOptions()
    return SlurmOptions(s.partition, s.account, s.qos, s.constraint, s.time, s.signal_before_s, tuple(s.sbatch_args))


class SlurmNodeProcess(Proc):
    """One node's command in the attempt's job: its exit file, or the job's end, says how it ended."""

    def __init__(self, executor: SlurmExecutor, spec: Unit) -> None:
        self.index = spec.index
        self._executor = executor
        self._spec = spec
        self._code: int | None = None
        self._ended_at: float | None = None

    def _note(self, text: str) -> None:
        with open(self._spec.log_path, "a") as f:
            f.write(f"gpufleet: {text}\n")

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ex = self._executor
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
        code = ex.exit_code(self.index)
        if code is not None:
            if ex.preemption(max_age_s=0.0):  # a preempted job's nodes end too, with 0 or with the signal's code
                return None
            self._code = code
            return code
        state = job.state()
        if not state.ended:
            return None
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        if time.monotonic() - self._ended_at < _EXIT_FILE_WAIT_S:
            return None
        self._code = LOST_EXIT_CODE
        why = f" ({state.reason})" if state.reason and state.reason != "None" else ""
        self._note(f"Slurm job {job.job_id} ended {state.state}{why} before node {self.index}'s command "
                   f"reported an exit code (on nodes {state.nodes or '?'}): the node or the job was lost; "
                   f"Slurm's messages are in {ex.folder / 'slurm-batch.log'}")  # fmt: skip
        return self._code

    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        self._executor.cancel_job(grace_period_s)

    def cleanup(self) -> None:
        self._executor._finish_job()

    def describe(self) -> dict[str, Any]:
        job = self._executor.job
        nodes = self._executor.node_names()
        return {
            "node_rank": self.index,
            "host": nodes[self.index] if self.index < len(nodes) else None,
            "slurm_job_id": job.job_id if job else None,
            "log_path": self._spec.log_path,
        }


class SlurmExecutor(Engine):
    """Submits each attempt's node commands as one Slurm job of ``compute.num_nodes`` nodes."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.options = options_of(config)
        self.job: SlurmJob | None = None
        self.folder = Path(".")
        self._num_nodes = 0
        self._node_names: list[str] = []
        self._preempted: str | None = None
        self._canceling = False

    # -- the attempt ----------------------------------------------------------------------
    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        self._finish_job()
        self.job, self._num_nodes, self._node_names, self._preempted = None, num_nodes, [], None
        self._canceling = False
        return FIRST_NODE, 0  # the batch step on node 0 sets both (its address, a free port there)

    def start(self, node: Unit) -> Proc:
        if node.index == 0:
            self._submit(node)
        return SlurmNodeProcess(self, node)

    def _submit(self, node: Unit) -> None:
        if self.canceled():
            raise GroupStartCanceled("before its Slurm job was submitted")
        self.folder = Path(node.log_path).parent
        (self.folder / "node-command.sh").write_text(node.command)
        env = dict(node.env)
        for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            env.pop(key, None)  # each node's own (slurm_node sets them)
        env[PREEMPT_FILE_ENV] = str(self.folder / PREEMPTED_FILE)
        if "OMP_NUM_THREADS" not in self.config.env_strings() and "OMP_NUM_THREADS" not in os.environ:
            env.pop("OMP_NUM_THREADS", None)  # from this machine's cores: each node sets its own
        c = self.config.compute
        script = batch_script(self.folder, "node", sys.executable, gpus=c.gpu_type is not None)
        args = [
            *resource_args(c.num_nodes, c.per_node, c.gpu_type is not None, tasks_per_node=1),
            f"--job-name=gpufleet-{env.get('GPUFLEET_RUN_ID', 'run')}",
            f"--output={self.folder / 'slurm-batch.log'}",
            f"--signal=B:USR1@{self.options.signal_before_s}",
            "--no-requeue",
            *self.options.args(),
        ]
        self.job = SlurmJob.submit(script, args, env, node.cwd)
        print(f"gpufleet: attempt submitted as Slurm job {self.job.job_id}", file=sys.stderr, flush=True)

    @property
    def preempted(self) -> str | None:
        """Why Slurm ended or is ending the current job early (see :meth:`preemption`), or None."""
        return self.preemption()

    def preemption(self, max_age_s: float = 1.0) -> str | None:
        """Why Slurm ended or is ending the current job early, from what it said at most ``max_age_s`` ago; or None.

        The batch step's mark of ``SIGUSR1`` (the time limit is near), the job's ``PreemptTime`` (a
        preemption, whose ``SIGTERM`` went to the tasks), a requeue, or the state ``PREEMPTED``. A
        mark a rank wrote on ``SIGTERM`` alone is none of these: a ``scancel`` sends that signal too.
        """
        if self._preempted is None and self.job is not None and not self._canceling:
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

    def exit_code(self, node_rank: int) -> int | None:
        """The exit code node ``node_rank``'s task wrote, or None."""
        try:
            return int(json.loads((self.folder / f"node-{node_rank}.exit").read_text())["exit_code"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def job_over(self) -> bool:
        """Every node reported, or Slurm ended the job (a requeued job counts: it is canceled)."""
        if self.job is None:
            return False
        if all(self.exit_code(r) is not None for r in range(self._num_nodes)):
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
        from ..launch.engines.slurm.stacks import collect_on_slurm

        got = collect_on_slurm(run_id)
        return got[1] if got else []

    def cancel_job(self, grace_period_s: float) -> None:
        """Cancel the attempt's job and wait until nothing of it runs."""
        if self.job is not None:
            self._canceling = True
            try:  # first: the ranks' SIGTERM handlers read it (this SIGTERM is no preemption)
                write_atomic(self.folder / CANCELED_FILE, json.dumps({"time": time.time()}).encode())
            except OSError:
                pass
            self.job.cancel(wait_s=max(30.0, grace_period_s + 20.0))

    def _finish_job(self) -> None:
        if self.job is not None and not self.job.state(max_age_s=0.0).ended:
            self.cancel_job(1.0)

    def close(self) -> None:
        self._finish_job()
