"""The records of the run store: one workload run and its attempts, as stored and printed."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..states import RunState


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

    def log_paths(self) -> list[str]:
        """Per-node log files of this attempt, in node-rank order."""
        return [n["log_path"] for n in sorted(self.nodes, key=lambda n: n["node_rank"])]


@dataclass
class RunRecord:
    """One workload run as stored."""

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
    attempts: list[AttemptRecord] = field(default_factory=list)

    @property
    def command_nodes(self) -> int:
        """Nodes whose command runs and writes ``node-N.log``: every node, or node 0 for a Ray driver."""
        return 1 if (self.config.get("compute") or {}).get("ray_driver") else self.num_nodes

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
        return d
