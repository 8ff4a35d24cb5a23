"""The worker-group protocol: start, poll (a frozen status), stop; the controller decides.

A worker group only knows how its processes come to be and how to learn about them: local
processes (:mod:`gpufleet.launch.engines.local.group`), Ray actors (:mod:`gpufleet.launch.engines.ray.group`) or a
workload's node commands (:mod:`gpufleet.workload.nodes`). Deadlines, the settle window, cancel,
retries and tracking belong to :class:`~gpufleet.launch.controller.Controller`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import GpufleetError, RankFailure
from ..results import RunDir
from .spec import LaunchSpec

if TYPE_CHECKING:
    from .store import Recovered


class GroupStartCanceled(GpufleetError):
    """A worker group gave up starting because its run was canceled (waiting for room, say)."""


@dataclass(frozen=True)
class GroupStatus:
    """What a worker group knows at one poll; never changes once taken.

    Attributes:
        num_ranks: ranks of the group (0 while a Ray group does not know its size yet).
        results: ``ok`` outcome records of ranks that returned, by rank.
        failures: failure records of ranks that failed (or were stopped), by rank.
        started: every rank's process was started (False while waiting for room on a cluster).
        progress: each rank's last progress record (step, collective count, last collectives),
            where the ranks report it (see :mod:`gpufleet.launch.progress`).
    """

    num_ranks: int
    results: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    failures: Mapping[int, RankFailure] = field(default_factory=dict)
    started: bool = True
    progress: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Every rank has an outcome (a result or a failure)."""
        return self.num_ranks > 0 and len(self.results) + len(self.failures) >= self.num_ranks

    @property
    def succeeded(self) -> bool:
        """Every rank returned a result."""
        return self.num_ranks > 0 and len(self.results) == self.num_ranks and not self.failures

    def first_failure(self) -> RankFailure | None:
        """The earliest failure in time, if any."""
        return min(self.failures.values(), key=lambda f: (f.time, f.rank)) if self.failures else None


class Replacement(NamedTuple):
    """The process that took a dead rank's place (:meth:`WorkerGroup.replace`)."""

    pid: int
    #: A warm spare (imports done) rather than a process started cold.
    warm: bool = False


class WorkerGroup(abc.ABC):
    """One attempt's ranks, wherever they run.

    Attributes:
        spec: what the ranks run; :meth:`add_env` extends it until :meth:`start`.
        run_id: the attempt's run id.
        run_dir: the attempt's run directory in the caller (logs, outcomes).
        abort: set by the controller on cancel or timeout; long waits inside the group
            (room on a cluster, a node being declared dead) give up when it is set.
        mlflow_run_id: the attempt's MLflow run, set by the tracking callback.
    """

    spec: LaunchSpec
    run_dir: RunDir
    #: The ranks run as soon as :meth:`start` returns (False: they wait for room on a cluster).
    starts_at_once: bool = True
    #: Each of the group's workers is one rank (False: a worker is a node whose command starts ranks).
    workers_are_ranks: bool = True

    def __init__(self, spec: LaunchSpec, run_dir: RunDir) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.abort = threading.Event()
        self.mlflow_run_id: str | None = None
        self._late_env = False

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def num_ranks(self) -> int:
        """How many ranks the group has (a Ray group knows once :meth:`start` checked the cluster)."""
        return self.spec.world_size

    @property
    def num_nodes(self) -> int | None:
        """How many nodes the ranks run on; None until they are placed."""
        return self.spec.num_nodes

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks on this machine, in rank order (empty where they run elsewhere)."""
        return []

    def add_env(self, env: Mapping[str, str]) -> None:
        """Give every rank ``env`` too; only before :meth:`start`."""
        self.spec = self.spec.with_env(env)

    #: The ranks can be started before all of their environment is known (:meth:`defer_env`).
    takes_late_env: bool = False

    def defer_env(self) -> None:
        """Before :meth:`start`: the ranks start at once but wait for :meth:`release_env` before the call.

        Lets a slow source of environment (opening the MLflow run) overlap the ranks' own start.
        Only where :attr:`takes_late_env`; whoever defers must release, failure or not.
        """
        if not self.takes_late_env:
            raise NotImplementedError(f"{type(self).__name__} cannot give its ranks environment after they start")
        self._late_env = True

    def release_env(self, env: Mapping[str, str]) -> None:
        """Hand the deferred environment (possibly empty) to the ranks; they go on with the call."""
        import json

        from ..results import write_atomic

        write_atomic(self.run_dir.late_env, json.dumps(dict(env)).encode())

    @property
    def env_deferred(self) -> bool:
        """:meth:`defer_env` was called for this group."""
        return self._late_env

    def log_path(self, rank: int) -> Path:
        """Where rank ``rank``'s output is kept in the caller."""
        return self.run_dir.log(rank)

    def logs(self, rank: int = 0) -> str:
        """Everything rank ``rank`` has printed so far (stdout and stderr)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in 0..{self.num_ranks - 1}, got {rank}")
        path = self.log_path(rank)
        return path.read_text("utf-8", "replace") if path.exists() else ""

    def stacks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Every live rank's stack of every thread, now (empty where the group cannot tell)."""
        return {}

    @abc.abstractmethod
    def start(self) -> None:
        """Start the ranks (or ask the cluster for room for them); returns without waiting for them."""

    @abc.abstractmethod
    def poll(self, wait_s: float) -> GroupStatus:
        """What is known now; may wait up to ``wait_s`` for news."""

    @abc.abstractmethod
    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        """Stop every rank still running (TERM, grace, KILL over each process tree).

        Ranks that had no outcome yet are recorded as stopped with ``reason``. With
        ``dump_stacks`` each live rank first prints every thread's stack into its log.
        Returns the final status.
        """

    #: A dead rank can be replaced in place (:meth:`replace`); only the local group, with ``recovery="replace"``.
    replaces_ranks: bool = False

    def replace(self, rank: int, cause: str) -> Replacement:
        """Start a new process for rank ``rank`` (or hand its place to a warm spare), whose process
        died of ``cause``, and tell the survivors to go on with it; which process took it."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace a rank in place")

    def refuse_replacement(self, rank: int, cause: str, reason: str) -> None:
        """Tell the survivors that rank ``rank`` is not replaced (they report their errors at once)."""
        return None

    def recovered(self) -> list[Recovered]:
        """The replacements that said they are back since the last call (:class:`~gpufleet.launch.store.Recovered`)."""
        return []

    @abc.abstractmethod
    def close(self, succeeded: bool) -> None:
        """Release what the group holds once the controller has its outcome (safe to call twice).

        After a success the ranks may still be exiting; the group lets them finish and stops
        anything left over, without making the caller wait.
        """


def reap_later(reapers: set[threading.Thread], run_id: str, reap: Callable[[], None]) -> threading.Thread:
    """Run ``reap`` (let a finished group's processes exit, then release what it held) on a thread of
    its own, listed in ``reapers`` while it runs. Not a daemon: the interpreter waits for it at exit."""

    def run() -> None:
        try:
            reap()
        finally:
            reapers.discard(threading.current_thread())

    reaper = threading.Thread(target=run, name=f"gpufleet-reap-{run_id}")
    reapers.add(reaper)
    reaper.start()
    return reaper

