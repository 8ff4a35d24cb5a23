"""The engine seam: where a run's processes run, for both kinds of payload.

An :class:`Engine` places one attempt (:meth:`Engine.rendezvous`: GPUs leased, a cluster's room
found, node 0's address and a free port), starts one :class:`Unit` at a time
(:meth:`Engine.start`), stops what it started (:meth:`Engine.stop`), gives back what the attempt
held once its processes are gone (:meth:`Engine.release`) and, at the end of the run, what it
holds for good (:meth:`Engine.close`). A unit is one process of either payload:

- a **rank of a call**: ``command`` is None; the rank runs ``python -m gpufleet.launch.worker
  RUN_DIR RANK`` and reads its payload in ``run_dir``; its output comes back through pipes
  (``log_path`` None) so that the call's :class:`~gpufleet.launch.logstream.RankLog` can prefix,
  filter and mask it;
- a **workload's node command**: ``command`` is the bash script the node guard
  (:mod:`gpufleet.launch.node.guard`) runs; its output goes to ``log_path``.

The engine never knows which front door it serves. The engines, each serving both payloads:
the local one (:mod:`gpufleet.launch.engines.local.engine`), Ray's
(:mod:`gpufleet.launch.engines.ray.engine`) and Slurm's (:mod:`gpufleet.launch.engines.slurm.engine`).
A call's group drives its engine's parts directly (a call's ranks on Ray start when their
placement group is placed, without blocking the controller; on Slurm they are the tasks of one
job); a workload's group goes through :meth:`Engine.rendezvous` and :meth:`Engine.start`, with
the workload's own settings added by ``gpufleet.workload.executors`` (the local engine's lease),
``gpufleet.workload.ray_executor`` and ``gpufleet.workload.slurm_executor``.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["GRACE_PERIOD_S", "CLEANUP_GRACE_S", "Engine", "Proc", "Unit"]

#: Grace of a stop: SIGTERM (or the cluster's cancel), then this long before SIGKILL.
GRACE_PERIOD_S = 5.0
#: Grace of the stop that follows an attempt (whatever its processes left running).
CLEANUP_GRACE_S = 1.0


@dataclass(frozen=True)
class Unit:
    """One process an engine starts: a call's rank (``command`` None) or a workload's node command."""

    index: int  #: the rank of a call's rank; the node rank of a node command
    env: dict[str, str]
    cwd: str | None = None
    command: str | None = None  #: a node command's bash script; None: a call's rank
    run_dir: str | None = None  #: a call's run folder, where its rank reads the payload
    log_path: str | None = None  #: where the output goes; None: pipes that the caller reads


class Proc(abc.ABC):
    """Handle of one started unit."""

    index: int
    #: The process id of the unit on its node (None where none is known).
    pid: int | None = None

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The process's exit code, or None while it runs."""

    @abc.abstractmethod
    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        """Stop it and everything it started (TERM, grace period, KILL)."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Once the attempt is over: stop whatever it left running."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the run store records about it (``node_rank``, ``log_path``, pids, host)."""


class Engine(abc.ABC):
    """Places and starts the units of one attempt; one engine may serve every attempt of a run.

    ``cancel_event`` (the attempt's worker group sets it to its ``abort`` event) is checked by
    waits that can last long (free GPUs, room on a cluster); they raise
    :class:`~gpufleet.launch.group.GroupStartCanceled` once it is set.
    """

    cancel_event: threading.Event | None = None

    def canceled(self) -> bool:
        """Whether the run was canceled (a long wait should give up)."""
        return self.cancel_event is not None and self.cancel_event.is_set()

    @abc.abstractmethod
    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        """Place an attempt: ``(MASTER_ADDR, MASTER_PORT)``, node 0's address and a free port.

        ``code_dir`` is the run's code snapshot, for engines that bring it to other machines.
        """

    @abc.abstractmethod
    def start(self, unit: Unit) -> Proc:
        """Start one unit of the placed attempt."""

    def stop(self, procs: list[Proc], grace_period_s: float) -> None:
        """Stop ``procs`` (an engine that can stops them together, in one grace period)."""
        for proc in procs:
            proc.cancel(grace_period_s)

    def release(self, pids: list[int] | None = None) -> None:  # noqa: B027 - optional hook
        """Give back what the attempt held (its GPU lease) once ``pids``, its processes, are gone; safe twice."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """At the end of the run: release what the engine holds (connections, placement groups)."""
