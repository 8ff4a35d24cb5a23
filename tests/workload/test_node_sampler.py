"""A node's system-metrics sampler never holds up the end of the command it watches.

Each node of a Ray run (a call's ranks, a workload's node command) starts a sampler beside its
child; starting it imports MLflow, which takes a minute or more on a loaded machine. A child that
ends first must be reported at once; the sampler, once started, logs one sample and stops.
"""

from __future__ import annotations

import threading
from pathlib import Path

from gpufleet.launch.engines.ray.actor import NodeCommand


class _Sampler:
    def __init__(self) -> None:
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()  # the real sampler logs its last sample here


def test_a_child_that_ends_while_its_sampler_starts_is_reported_at_once(tmp_path: Path, monkeypatch) -> None:
    release, sampler = threading.Event(), _Sampler()

    def slow_start(env, node_id):  # stands in for MLflow's import on a loaded machine
        release.wait(120)
        return sampler

    monkeypatch.setattr("gpufleet.tracking.system_metrics.start_node_sampler", slow_start)
    node = NodeCommand("sampler-test", 0)
    node.start("exit 0", {"MLFLOW_RUN_ID": "r1", "MLFLOW_TRACKING_URI": "sqlite:///unused.db"}, str(tmp_path), {})
    reports: list[dict] = []

    def poll_to_the_end() -> None:
        while not reports or reports[-1]["exit_code"] is None:
            reports.append(node.poll(0.5))

    poller = threading.Thread(target=poll_to_the_end, daemon=True)
    poller.start()
    try:
        poller.join(20)  # the child exits at once; a poll that waited for the sampler would take 30 s or more
        assert not poller.is_alive(), "the node's end waited for its system-metrics sampler to start"
        assert reports[-1]["exit_code"] == 0 and not release.is_set()
    finally:
        release.set()
    assert sampler.stopped.wait(30), "a sampler that started after its child ended must stop (with its last sample)"
    node.stop(1.0)
