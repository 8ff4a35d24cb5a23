"""Cancel while a node is being lost: a module of its own, since it kills a raylet of its cluster."""

from __future__ import annotations

import time

import pytest

from gpufleet import errors
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
    # about 2 s; it was 13 s here when the cancel waited for the cluster to mark the node dead
    assert time.monotonic() - t0 < 11, f"cancel took {time.monotonic() - t0:.0f} s"
    assert handle.status == "CANCELED"
    deadline = time.monotonic() + 30
    while run_processes(handle.run_id):
        assert time.monotonic() < deadline, [p.cmdline() for p in run_processes(handle.run_id)]
        time.sleep(0.5)
