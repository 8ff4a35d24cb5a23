"""A real two-node Ray cluster on this machine (two raylets), shared by a test module."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import psutil
import pytest


def _private_auth() -> None:
    """Token auth with a token that lives in the environment only (never in ~/.ray).

    Ray reads the mode when it is imported and caches the token per process, so this runs
    before ``import ray`` and one token serves the whole test session.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


_private_auth()
ray = pytest.importorskip("ray")

NODE_ARGS = {
    "num_cpus": 1,
    "object_store_memory": 100 * 1024 * 1024,
    "min_worker_port": 0,
    "max_worker_port": 0,
    "node_ip_address": "127.0.0.1",  # the suite's traffic stays on loopback (Ray would register the network address)
}


class TwoNodeCluster:
    """A head node and one worker node, each with one CPU and a marker resource."""

    def __init__(self) -> None:
        from ray._private.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="gf-ray-")  # short: raylet socket paths
        # Ray notes the head's address in its default folder (/tmp/ray/ray_current_cluster) whatever
        # temp_dir says, and fails when that folder does not exist yet (a machine that never ran Ray)
        os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
        self.cluster = None
        try:
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    **NODE_ARGS,
                    "include_dashboard": False,
                    "temp_dir": self.temp_dir,
                    "resources": {"node0": 1},
                },
            )
            self.worker = self.cluster.add_node(**NODE_ARGS, resources={"node1": 1})
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()  # a half-started cluster is stopped, not left to load every later test
            raise

    @property
    def address(self) -> str:
        return self.cluster.address

    def shutdown(self) -> None:
        from gpufleet.launch.engines.ray.connect import disconnect

        disconnect()  # after the threads still waiting on Ray are out of it (a shutdown under them crashes)
        if self.cluster is not None:
            self.cluster.shutdown()
        for p in cluster_processes(self.temp_dir):  # a node whose start failed is not in the cluster
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of a test cluster: every one of them names its session folder."""
    found = []
    for p in psutil.process_iter():
        try:
            if any(temp_dir in arg for arg in p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodeCluster]:
    cluster = TwoNodeCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def sleep_long() -> None:
    """A rank that runs until it is stopped."""
    import time

    time.sleep(300)


def sleepers_then_lose_the_worker_node(two_nodes, tmp_path):
    """Two sleeping ranks, one per node; once both run, the worker node's raylet is killed. The handle."""
    import time

    from gpufleet import distributed
    from tests.proc import run_processes

    handle = distributed(
        sleep_long, gpus=2, gpu_type="cpu", remote=two_nodes.address,
        runs_dir=str(tmp_path), grace_period_s=1.0, timeout=200,
    ).submit()  # fmt: skip
    deadline = time.monotonic() + 90
    while len(run_processes(handle.run_id)) < 2 * 2:  # two actors, two ranks
        if time.monotonic() > deadline:
            handle.cancel()  # not left running into the next test
            raise AssertionError("the ranks did not start")
        time.sleep(0.5)
    two_nodes.worker.kill_raylet()
    return handle


@contextlib.contextmanager
def ended_at_exit(handle):
    """The call is canceled when the test ends before it (a failed assertion): nothing of it runs on."""
    try:
        yield handle
    finally:
        if handle.status in ("PENDING", "RUNNING"):
            handle.cancel()
