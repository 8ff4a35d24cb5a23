"""The Ray group's waits on Ray, against a fake Ray: what a loaded cluster does to them.

- a thread that lets a finished call's ranks exit (a "reaper") must be out of Ray before the
  connection ends: Ray crashes the whole process (SIGSEGV) under a thread still inside ray.wait;
- a rank whose start has not answered yet is not a lost rank;
- a cancel ends the wait for the ranks' starts (under load they take a minute or more).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet.launch.engines.ray import connect as ray_connect
from gpufleet.launch.engines.ray.engine import RayEngine
from gpufleet.launch.engines.ray.group import RayWorkerGroup
from gpufleet.launch.group import GroupStartCanceled


class FakeRayError(Exception):
    pass


class FakeRay:
    """ray.wait/get over refs that answer when the test says so; counts who is inside ray.wait."""

    def __init__(self) -> None:
        self.answers: dict[Any, Any] = {}  # ref -> value, or an exception to raise from get
        self.inside = 0
        self.inside_at_shutdown: int | None = None
        self.entered = threading.Event()
        self.initialized = True
        self._lock = threading.Lock()

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        with self._lock:
            self.inside += 1
        self.entered.set()
        try:
            time.sleep(min(timeout or 0.0, 0.05))
            with self._lock:
                ready = [r for r in refs if r in self.answers]
            return ready, [r for r in refs if r not in ready]
        finally:
            with self._lock:
                self.inside -= 1

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if ref not in self.answers:
            raise TimeoutError("no answer yet")
        value = self.answers[ref]
        if isinstance(value, BaseException):
            raise value
        return value

    def nodes(self) -> list[dict[str, Any]]:
        return []

    def kill(self, actor: Any, no_restart: bool = True) -> None:
        pass

    def is_initialized(self) -> bool:
        return self.initialized

    def shutdown(self) -> None:
        self.inside_at_shutdown = self.inside
        self.initialized = False


class FakeActor:
    def __init__(self) -> None:
        self.finish = SimpleNamespace(remote=lambda *args: object())


def fake_group(fake: FakeRay, tmp_path: Any, ranks: int = 2) -> RayWorkerGroup:
    group = object.__new__(RayWorkerGroup)  # no cluster: only what the waits use
    group.spec = SimpleNamespace(run_id="run-fake")
    group.run_dir = SimpleNamespace(log=lambda rank: tmp_path / f"rank-{rank}.log")
    group.abort = threading.Event()
    group.engine = RayEngine("127.0.0.1:1", "run-fake")
    group.engine.ray = fake
    group.engine.actors = [FakeActor() for _ in range(ranks)]
    group._rank_logs = []
    group._closed = False
    group._failures = {}
    group._unreachable_since = {}
    group.node_ids = [f"node{r}" for r in range(ranks)]
    return group


def test_no_thread_is_inside_ray_when_the_connection_ends(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay()
    monkeypatch.setattr(ray_connect, "import_ray", lambda: fake)
    monkeypatch.setattr(ray_connect, "_connected_address", "127.0.0.1:1")
    group = fake_group(fake, tmp_path)
    group.close(succeeded=True)  # the ranks never finish exiting: the reaper waits on them
    assert fake.entered.wait(10.0), "the reaper never waited on the ranks"
    reaper = next(t for t in threading.enumerate() if t.name == "gpufleet-reap-run-fake")

    ray_connect.disconnect()

    assert fake.inside_at_shutdown == 0, "a thread was inside ray.wait when Ray shut down"
    reaper.join(10.0)
    assert not reaper.is_alive()
    assert not fake.initialized


def test_a_start_not_answered_yet_is_not_a_lost_rank(tmp_path: Any) -> None:
    fake = FakeRay()
    group = fake_group(fake, tmp_path)
    starts = ["start-0", "start-1"]
    fake.answers["start-1"] = FakeRayError("the actor died unexpectedly before finishing this task")

    def answer_late() -> None:  # rank 0's start answers well after rank 1's error
        time.sleep(0.5)
        fake.answers["start-0"] = None

    threading.Thread(target=answer_late, daemon=True).start()
    group.engine.wait_for(starts, group.abort, "ranks")
    group._record_lost_from(starts)

    assert sorted(group._failures) == [1]
    assert group._failures[1].kind == "lost"


def test_a_cancel_ends_the_wait_for_the_ranks_starts(tmp_path: Any) -> None:
    fake = FakeRay()  # no start ever answers
    group = fake_group(fake, tmp_path)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            group.engine.wait_for(["start-0", "start-1"], group.abort, "ranks")
        except BaseException as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert fake.entered.wait(10.0)
    group.abort.set()
    waiter.join(30.0)
    assert not waiter.is_alive(), "the wait for the starts went on after the cancel"
    assert len(raised) == 1 and isinstance(raised[0], GroupStartCanceled)


def test_a_cancel_ends_the_wait_that_tells_a_lost_node_from_a_dead_actor(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # An actor on a node that went away fails seconds before the cluster marks the node dead; the
    # group waits up to _NODE_DEATH_WAIT_S (30 s) to name the failure. A cancel ends that wait.
    fake = FakeRay()
    monkeypatch.setattr(fake, "nodes", lambda: [{"NodeID": "node1", "Alive": True}])  # never marked dead
    group = fake_group(fake, tmp_path)
    failure: list[Any] = []
    waiter = threading.Thread(target=lambda: failure.append(group._lost(1, FakeRayError("actor unavailable"))), daemon=True)
    waiter.start()
    waiter.join(1.5)
    assert waiter.is_alive(), "the group did not wait for the cluster to mark the node dead"
    group.abort.set()
    waiter.join(10.0)  # the wait itself is 30 s
    assert not waiter.is_alive(), "the wait went on after the cancel"
    assert failure[0].kind == "lost" and "died (FakeRayError: actor unavailable)" in failure[0].message
