"""The records of the run store: one run (a workload run, or one attempt of a call) and its attempts.

Two small files in a run's folder stand beside its record, written by its supervisor where no
lock of the store can stop it: ``outcome.json``, how the run ended (written atomically before
the store learns it, so a busy store never changes an outcome), and ``supervisor.alive``,
touched at every heartbeat (so a supervisor waiting on a busy store is not taken for a hung one).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..states import RunState

#: How the run ended, as its supervisor saw it: ``{"state", "exit_code", "message", "ended_at"}``.
OUTCOME_FILE = "outcome.json"
#: Touched by the supervisor at every heartbeat.
ALIVE_FILE = "supervisor.alive"


def write_run_outcome(
    run_dir: str | os.PathLike[str], state: str, exit_code: int | None, message: str | None
) -> dict[str, Any]:
    """Write a run's outcome file atomically (it holds all of it or does not exist); returns what it holds."""
    from ..results import write_atomic

    outcome = {"state": str(RunState(state)), "exit_code": exit_code, "message": message, "ended_at": time.time()}
    write_atomic(Path(run_dir) / OUTCOME_FILE, json.dumps(outcome).encode())
    return outcome


def read_run_outcome(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A run's outcome file, or None when there is none (or it is not one)."""
    try:
        outcome = json.loads((Path(run_dir) / OUTCOME_FILE).read_bytes())
        state = RunState(outcome["state"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not state.terminal:
        return None
    code = outcome.get("exit_code")
    ended = outcome.get("ended_at")
    message = outcome.get("message")
    return {
        "state": state,
        "exit_code": code if isinstance(code, int) and not isinstance(code, bool) else None,
        "message": message if isinstance(message, str) else None,
        "ended_at": float(ended) if isinstance(ended, (int, float)) else time.time(),
    }


def touch_alive(run_dir: str | os.PathLike[str]) -> None:
    """Mark the supervisor alive now (its alive file's modification time)."""
    path = Path(run_dir) / ALIVE_FILE
    try:
        os.utime(path)
    except FileNotFoundError:
        path.touch(mode=0o600)


def alive_at(run_dir: str | os.PathLike[str]) -> float | None:
    """When the supervisor last marked itself alive (None: never, or no such folder)."""
    try:
        return (Path(run_dir) / ALIVE_FILE).stat().st_mtime
    except OSError:
        return None


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended, as the run store records it: its state, its exit code, a message."""

    state: RunState
    exit_code: int | None = None
    message: str | None = None


@dataclass
class AttemptRecord:
    """One attempt of a run: its state, MLflow run and per-node processes and logs."""

    run_id: str
    attempt: int
    state: RunState
    started_at: float
    log_dir: str
    ended_at: float | None = None
    exit_code: int | None = None
    mlflow_run_id: str | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    message: str | None = None
    #: Each lost rank replaced in place (or refused) in this attempt (``Recovery.to_dict()``), in order.
    recoveries: list[dict[str, Any]] = field(default_factory=list)

    def log_paths(self) -> list[str]:
        """Per-node log files of this attempt, in node-rank order."""
        return [n["log_path"] for n in sorted(self.nodes, key=lambda n: n["node_rank"])]


@dataclass
class RunRecord:
    """One run as stored: a workload run, or one attempt of a ``@distributed`` call (``kind``)."""

    id: str
    experiment: str
    state: RunState
    created_at: float
    config: dict[str, Any]
    run_dir: str
    num_nodes: int
    world_size: int
    max_attempts: int
    tracking: bool = True
    started_at: float | None = None
    ended_at: float | None = None
    idempotency_key: str | None = None
    workload_path: str | None = None
    supervisor_pid: int | None = None
    supervisor_started: float | None = None
    heartbeat_at: float | None = None
    cancel_requested: bool = False
    exit_code: int | None = None
    message: str | None = None
    #: ``workload`` (``gpufleet run``) or ``call`` (one attempt of a ``@distributed`` call, see :mod:`gpufleet.runs.calls`).
    kind: str = "workload"
    #: Where the run came from: ``path`` (script, notebook or workload file), ``host``, ``user``, ``pid``.
    origin: dict[str, Any] = field(default_factory=dict)
    #: What it got: ``host``, ``gpus`` (indices on that host), ``gpu_name``, ``nodes`` (Ray hosts).
    placement: dict[str, Any] = field(default_factory=dict)
    attempts: list[AttemptRecord] = field(default_factory=list)

    @property
    def is_call(self) -> bool:
        """Whether the run is an attempt of a ``@distributed`` call (its logs are ``rank-R.log``)."""
        return self.kind == "call"

    @property
    def own_supervisor(self) -> bool:
        """Whether a process of gpufleet's own supervises the run (a workload's, a detached call's), so that a
        SIGTERM may stop it; an in-process call's "supervisor" is its caller (a notebook kernel, say)."""
        return not self.is_call or self.origin.get("detached_from") is not None

    @property
    def log_name(self) -> str:
        """What one log file belongs to: ``rank`` (a call) or ``node`` (a workload)."""
        return "rank" if self.is_call else "node"

    @property
    def log_units(self) -> int:
        """How many ``<log_name>-N.log`` files an attempt writes: a call's ranks, a workload's command nodes."""
        return self.world_size if self.is_call else self.command_nodes

    @property
    def command_nodes(self) -> int:
        """Nodes whose command runs and writes ``node-N.log``: every node, or node 0 for a Ray driver."""
        return 1 if (self.config.get("compute") or {}).get("ray_driver") else self.num_nodes

    @property
    def attempt(self) -> int:
        """The number of the run's latest attempt, from 1 for calls and workloads alike (0: none yet).

        A call's record is one attempt (its retries are records of their own, numbered on); a
        workload's attempts are its rows. A preempted attempt is numbered but spends no retry, so
        after preemptions the number can pass ``max_attempts``.
        """
        if self.attempts:
            return self.attempts[-1].attempt
        return int(self.config.get("attempt", 0)) if self.is_call else 0

    @property
    def is_active(self) -> bool:
        """Whether the run is still PENDING or RUNNING."""
        return not RunState(self.state).terminal

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to end (or to now while running)."""
        if self.started_at is None:
            return None
        return (self.ended_at or time.time()) - self.started_at

    def mlflow_run_ids(self) -> list[str]:
        """MLflow run ids of the attempts, oldest first."""
        return [a.mlflow_run_id for a in self.attempts if a.mlflow_run_id]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (what ``-o json`` prints)."""
        d = asdict(self)
        d["duration_s"] = self.duration_s
        d["mlflow_run_ids"] = self.mlflow_run_ids()
        d["log_paths"] = self.attempts[-1].log_paths() if self.attempts else []
        if self.is_call:
            d["log_paths"] = [str(self.log_dir / f"rank-{r}.log") for r in range(self.world_size)]
        return d

    @property
    def log_dir(self) -> Path:
        """The folder of the latest attempt's logs (a call's own run folder when its attempt is the run)."""
        return Path(self.attempts[-1].log_dir) if self.attempts else Path(self.run_dir)
