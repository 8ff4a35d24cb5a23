"""Cancel while a node is being lost: a module of its own, since it kills a raylet of its cluster."""

from __future__ import annotations

import time

import pytest

from gpufleet import errors
from gpufleet.launch.engines.ray import group as ray_group
from tests.proc import run_processes
from tests.ray.conftest import sleepers_then_lose_the_worker_node

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_cancel_while_a_node_is_being_lost_returns_promptly(two_nodes, tmp_path):
    """A cancel does not wait out the grace that tells a lost node from a dead actor (up to 30 s)."""
    handle = sleepers_then_lose_the_worker_node(two_nodes, tmp_path)
    time.sleep(2.0)  # the actor on that node fails; the cluster has not marked the node dead yet
    t0 = time.monotonic()
    handle.cancel()
    with pytest.raises(errors.RunCanceledError):
        handle.result(timeout=60)
    # About 2 s on a quiet machine, 11 s with both cores busy: the stop waits up to grace_period_s
    # + 10 s for each rank's last report. Without the cancel ending the wait for the cluster to mark
    # the node dead, it also waited that out (13 s here; up to _NODE_DEATH_WAIT_S). That the cancel
    # ends it is shown without a cluster in tests/unit/test_ray_group_waits.py.
    waited = time.monotonic() - t0
    assert waited < ray_group._NODE_DEATH_WAIT_S, f"the cancel waited {waited:.0f} s, the wait for a lost node"
    assert handle.status == "CANCELED"
    deadline = time.monotonic() + 30
    while run_processes(handle.run_id):
        assert time.monotonic() < deadline, [p.cmdline() for p in run_processes(handle.run_id)]
        time.sleep(0.5)
