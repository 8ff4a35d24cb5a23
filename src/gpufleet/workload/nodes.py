"""A workload's node commands: the node-command payload of an engine, one attempt of them as a worker group.

Where the commands run is an engine's (:mod:`gpufleet.launch.engines.base`): the local engine
(:class:`~gpufleet.launch.engines.local.engine.LocalEngine`) for one node here, the same one that
runs a call's ranks; the Ray and Slurm node executors (``gpufleet.workload.ray_executor``,
``gpufleet.workload.slurm_executor``) for a cluster. :mod:`gpufleet.workload.executors` chooses.

:class:`WorkloadNodeGroup` is the worker group (:mod:`gpufleet.launch.group`) of one attempt:
its "ranks" are the nodes that run the command, each a :class:`~gpufleet.launch.engines.base.Unit`
whose ``command`` is the node script, ending as a result (exit code 0) or a failure (any other
exit code); the controller decides the rest.
"""

from __future__ import annotations

import pickle
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import GpufleetError, RankFailure
from ..launch import failures
from ..launch.engines.base import GRACE_PERIOD_S, Engine, Proc, Unit
from ..launch.group import GroupStartCanceled, GroupStatus, WorkerGroup
from ..launch.node import envcontract
from ..launch.spec import LaunchSpec, Rendezvous, default_threads
from ..results import OK, RunDir
from .schema import WorkloadConfig

__all__ = ["GRACE_PERIOD_S", "ExecutorUnavailableError", "WorkloadNodeGroup", "failed_line", "needs_cluster",
           "node_script"]  # fmt: skip
#: Put before a workload's ``command`` (one line, so the command's own lines keep their numbers
#: less one): fail fast (``set -eEo pipefail``; ``set +e`` in the command opts out), and name the
#: line that made the shell exit in the node's log (:data:`FAILED_LINE_RE`, read by :func:`failed_line`).
COMMAND_PRELUDE = (
    """set -eEo pipefail; trap '__gf_rc=$?; if [[ $- == *e* ]]; then __gf_in=; [[ $BASH_SUBSHELL == 0 ]] || """
    """__gf_in=", in a subshell"; printf "gpufleet: the command failed at line %s (exit code %s%s): %s\\n" """
    """"$((LINENO - 1))" "$__gf_rc" "$__gf_in" "$BASH_COMMAND" >&2; fi' ERR"""
    "\n"
)
FAILED_LINE_RE = re.compile(r"^gpufleet: the command failed at line (\d+) \(exit code (\d+)(, in a subshell)?\): ")
RAY_EXECUTOR_MODULE = "gpufleet.workload.ray_executor"


class ExecutorUnavailableError(GpufleetError, RuntimeError):
    """The workload needs an executor (multi-node / Ray) that this installation lacks."""


def node_script(command: str) -> str:
    """The bash script a node runs: :data:`COMMAND_PRELUDE`, then the workload's ``command``."""
    return COMMAND_PRELUDE + command


def failed_line(log_path: str | Path, command: str, max_bytes: int = 1 << 16) -> tuple[int, str] | None:
    """``(line number, text)`` of the ``command`` line that ended a node's script, from its log.

    The last failure the top-level shell reported, or the innermost one of a subshell that led
    to it (the first of the markers just before it). None when the log names none (the command
    ran ``exit N``, was killed, or opted out with ``set +e``).
    """
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    marks = [(int(m.group(1)), bool(m.group(3))) for m in map(FAILED_LINE_RE.match, lines) if m]
    top = max((i for i, (_, sub) in enumerate(marks) if not sub), default=None)
    if top is None:
        return None
    first = top
    while first > 0 and marks[first - 1][1]:
        first -= 1
    number = marks[first][0]
    source = command.splitlines()
    text = source[number - 1].strip() if 0 < number <= len(source) else ""
    return number, text[:200] + ("..." if len(text) > 200 else "")


def needs_cluster(config: WorkloadConfig) -> bool:
    """Whether the workload must run on a Ray cluster (several nodes or a named cluster)."""
    return config.compute.cluster is not None or config.compute.num_nodes > 1


# ------------------------------------------------------------------ the worker group


class WorkloadNodeGroup(WorkerGroup):
    """One attempt's node commands, started through an engine (:class:`~gpufleet.launch.engines.base.Engine`).

    Its ranks are the nodes that run the command (every node, or node 0 alone for a Ray
    driver). Each node's environment is the inherited one, the launch spec's node contract
    (:meth:`~gpufleet.launch.spec.LaunchSpec.node_env`, whose ``env`` carries the workload's own
    variables) and ``OMP_NUM_THREADS`` when nothing set it.

    Attributes:
        start_canceled: why starting gave up, when the run was canceled during the rendezvous.
    """

    workers_are_ranks = False  # a worker is a node; its command (torchrun) starts the ranks

    def __init__(
        self,
        spec: LaunchSpec,
        run_dir: RunDir,
        executor: Engine,
        command: str,
        cwd: str,
        num_command_nodes: int,
        local_world_size: int,
        inherited_env: Mapping[str, str],
    ) -> None:
        super().__init__(spec, run_dir)
        self.executor = executor
        self.command = command
        self.cwd = cwd
        self.local_world_size = local_world_size
        self._num_command_nodes = num_command_nodes
        self._inherited_env = dict(inherited_env)
        self.nodes: list[Proc] = []
        self.rendezvous: Rendezvous | None = None
        self.start_canceled: str | None = None
        self._results: dict[int, dict[str, Any]] = {}
        self._failures: dict[int, RankFailure] = {}
        self._progress: dict[int, dict[str, Any]] = {}
        self._progress_read = 0.0
        self._started_at = time.time()
        self._closed = False

    @property
    def num_ranks(self) -> int:
        return self._num_command_nodes

    def log_path(self, rank: int) -> Path:
        return self.run_dir.path / f"node-{rank}.log"

    def node_env(self, node_rank: int, rendezvous: Rendezvous) -> dict[str, str]:
        """Everything node ``node_rank``'s command sees."""
        env = dict(self._inherited_env)
        env.update(self.spec.node_env(node_rank, self.local_world_size, rendezvous))
        env.update(default_threads(env, self.local_world_size))  # also keeps torchrun's OMP banner away
        return env

    @property
    def preempted(self) -> str | None:
        """Why the scheduler stopped this attempt early (a Slurm preemption), or None; the controller resubmits it."""
        return getattr(self.executor, "preempted", None)

    @property
    def lost(self) -> str | None:
        """Why the cluster ended this attempt under its nodes (a Slurm node failure), or None."""
        return getattr(self.executor, "lost", None)

    def describe_nodes(self) -> list[dict[str, Any]]:
        """What the run store records about each started node."""
        return [n.describe() for n in self.nodes]

    def start(self) -> None:
        self._started_at = time.time()
        self.executor.cancel_event = self.abort
        try:
            addr, port = self.executor.rendezvous(self.spec.num_nodes, code_dir=self.cwd)
        except GroupStartCanceled as e:
            self.start_canceled = str(e)
            raise
        self.rendezvous = Rendezvous(addr, port)
        for rank in range(self._num_command_nodes):
            env = self.node_env(rank, self.rendezvous)
            unit = Unit(rank, env, self.cwd, command=node_script(self.command), log_path=str(self.log_path(rank)))
            self.nodes.append(self.executor.start(unit))

    def _known(self, rank: int) -> bool:
        return rank in self._results or rank in self._failures

    def _collect(self) -> bool:
        """Record the nodes that ended since the last look; True if any did."""
        news = False
        for node in self.nodes:
            rank = node.index
            if self._known(rank):
                continue
            code = node.poll()
            if code is None:
                continue
            news = True
            if code == 0:  # a result without a value (the controller unpickles it)
                self._results[rank] = {"status": OK, "rank": rank, "time": time.time(),
                                       "value": pickle.dumps(None), "exit_code": 0}  # fmt: skip
            else:
                self._failures[rank] = failures.failure_from_exit(rank, code, self.log_path(rank))
        return news

    def _status(self) -> GroupStatus:
        return GroupStatus(self.num_ranks, dict(self._results), dict(self._failures), progress=self._read_progress())

    def _read_progress(self) -> dict[int, dict[str, Any]]:
        """Progress of the ranks that use gpufleet (``progress-RANK.json`` in the run folder), this attempt's only."""
        from ..launch.progress import PROGRESS_INTERVAL_ENV, read_progress

        folder = self.spec.env.get(envcontract.RUN_DIR)
        now = time.monotonic()
        if not folder or PROGRESS_INTERVAL_ENV not in self.spec.env or now - self._progress_read < 1.0:
            return dict(self._progress)
        self._progress_read = now
        for rank in range(self.spec.world_size):
            record = read_progress(Path(folder), rank)
            if record is not None and record.get("time", 0) >= self._started_at:  # not a file of an earlier attempt
                self._progress[rank] = record
        return dict(self._progress)

    def stacks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Every rank's stack on this machine (the processes under the node commands), read with py-spy."""
        from ..stacks import collect

        try:
            _, found = collect(self.run_id, stored=False)
        except LookupError:  # none here: an executor whose nodes are elsewhere may read them there
            remote = getattr(self.executor, "stacks", None)
            found = remote(self.run_id) if remote is not None else []
        return {p["rank"]: p["stack"] for p in found if p["rank"] is not None}

    def poll(self, wait_s: float) -> GroupStatus:
        if not self._collect() and wait_s > 0:
            self.abort.wait(wait_s)
        return self._status()

    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        """Stop every node still running; ``dump_stacks`` is ignored (a node's command is bash)."""
        self._collect()
        t_stop = time.time()
        self.executor.stop([n for n in self.nodes if not self._known(n.index)], grace_period_s)
        for rank in range(self.num_ranks):
            if not self._known(rank):
                self._failures[rank] = failures.stopped(rank, reason, t_stop, self.log_path(rank))
        return self._status()

    def close(self, succeeded: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for node in self.nodes:
                node.cleanup()
        finally:
            self.executor.release([n.pid for n in self.nodes if n.pid is not None])  # a lease goes back
