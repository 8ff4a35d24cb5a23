"""``@distributed(remote=<address>)`` on a real two-node Ray cluster, CPU workers with gloo."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from gpufleet import distributed, errors
from tests.proc import run_processes
from tests.ray.conftest import cluster_processes, ended_at_exit, sleepers_then_lose_the_worker_node

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _all_reduce_and_where() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    print(f"hello from rank {runtime.get_global_rank()}", flush=True)
    return {
        "rank": runtime.get_global_rank(),
        "world": runtime.get_world_size(),
        "node_rank": runtime.get_node_rank(),
        "local_rank": runtime.get_local_rank(),
        "local_world": runtime.get_local_world_size(),
        "num_nodes": int(os.environ["NUM_NODES"]),
        "node_id": os.environ["GPUFLEET_RAY_NODE_ID"],
        "master_addr": os.environ["MASTER_ADDR"],
        "sum": t.item(),
    }


class CustomTrainingError(RuntimeError):
    """Raised on purpose by one rank."""


def _rank_one_raises() -> int:
    from gpufleet import runtime

    if runtime.get_global_rank() == 1:
        raise CustomTrainingError("loss became NaN at step 3")
    time.sleep(3600)  # until gpufleet stops it
    return 0


def _sleep_long() -> None:
    import time

    time.sleep(300)


def test_two_nodes_one_worker_each(two_nodes, tmp_path):
    f = distributed(
        _all_reduce_and_where, gpus=2, gpu_type="cpu", remote=two_nodes.address,
        runs_dir=str(tmp_path), log_ranks="all", timeout=120,
    )
    handle = f.submit()
    results = handle.result(timeout=150)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["num_nodes"] == 2 for r in results)
    assert all(r["sum"] == 3.0 for r in results)
    assert {r["node_rank"] for r in results} == {0, 1}
    assert all(r["local_rank"] == 0 and r["local_world"] == 1 for r in results)
    assert results[0]["node_id"] != results[1]["node_id"]
    assert {r["master_addr"] for r in results} == {"127.0.0.1"}  # the rendezvous stays on loopback
    assert "hello from rank 1" in handle.logs(1)
    assert handle.status == "SUCCESS"


def _mlflow_env(stop: str) -> dict[str, str | None]:
    import os
    import time

    print(f"tracked rank {os.environ['RANK']}", flush=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(stop) and time.monotonic() < deadline:  # the test has seen the nodes' metrics
        time.sleep(0.1)
    return {k: os.environ.get(k) for k in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI")}


def _world() -> int:
    from gpufleet import runtime

    return runtime.get_world_size()


def test_remote_true_takes_the_address_from_ray_address(two_nodes, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    f = distributed(_world, gpus=2, gpu_type="cpu", remote=True, runs_dir=str(tmp_path), stream_logs=False, timeout=120)
    assert f.distributed() == [2, 2]
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(errors.LaunchConfigError, match="remote=True needs a Ray cluster address in RAY_ADDRESS"):
        f.distributed()


def test_remote_call_is_tracked_in_mlflow(two_nodes, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
    experiment = f"ray-{uuid.uuid4().hex[:10]}"
    f = distributed(
        _mlflow_env, gpus=2, gpu_type="cpu", remote=two_nodes.address,
        runs_dir=str(tmp_path), experiment_name=experiment, stream_logs=False, timeout=300,
    )  # the ranks run until the test has seen the metrics (below): up to 240 s
    stop = tmp_path / "stop"
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    # the ranks run until the test has seen what it checks: each node's sampler starts beside the
    # ranks (it imports MLflow: a minute or more on a loaded machine) and logs every 10 s
    with ended_at_exit(f.submit(str(stop))) as handle:
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and handle.status in ("PENDING", "RUNNING"):
                if handle.mlflow_run_id:
                    metrics = client.get_run(handle.mlflow_run_id).data.metrics
                    if {k.split("/")[1] for k in metrics if k.startswith("system/")} >= {"node0", "node1"}:
                        break
                time.sleep(1.0)
        finally:
            stop.touch()
        envs = handle.result(timeout=150)
    run_id = handle.mlflow_run_id
    assert run_id and [e["MLFLOW_RUN_ID"] for e in envs] == [run_id, run_id]
    assert envs[0]["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"]

    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == run_id and run.info.run_name == handle.run_id
    assert run.info.status == "FINISHED" and run.data.tags["gpufleet.status"] == "SUCCESS"
    assert run.data.tags["gpufleet.launcher"] == "ray"
    assert run.data.params["gpufleet.world_size"] == "2" and run.data.params["gpufleet.num_nodes"] == "2"
    # system metrics come from each node the ranks ran on, not from the caller's machine
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {k.split("/")[1] for k in system} == {"node0", "node1"}, system
    assert "system/node1/cpu_utilization_percentage" in system
    logs = sorted(a.path for a in client.list_artifacts(run_id, "logs"))
    assert logs == ["logs/rank-0.log", "logs/rank-1.log"]
    text = (client.download_artifacts(run_id, "logs/rank-1.log", str(tmp_path / "dl")))
    assert "tracked rank 1" in open(text).read()


def test_rank_exception_keeps_its_type(two_nodes, tmp_path):
    f = distributed(
        _rank_one_raises, gpus=2, gpu_type="cpu", remote=two_nodes.address,
        runs_dir=str(tmp_path), grace_period_s=1.0, timeout=120,
    )
    with pytest.raises(CustomTrainingError, match="loss became NaN") as info:
        f.distributed()
    assert info.value.gpufleet_error.failures[0].kind == "stopped"  # rank 0 is stopped, not waited for
    assert info.value.gpufleet_rank == 1
    assert isinstance(info.value.__cause__, errors.RemoteTraceback)
    assert "_rank_one_raises" in str(info.value.__cause__)
    log = Path(info.value.gpufleet_error.failures[1].log_path).read_text().splitlines()  # ends with its traceback
    assert "gpufleet: rank 1 failed with CustomTrainingError; its traceback:" in log
    assert log[-1].endswith("CustomTrainingError: loss became NaN at step 3")


def test_cancel_and_timeout_stop_ranks_and_release_the_placement_group(two_nodes, tmp_path):
    from ray.util.placement_group import placement_group_table

    f = distributed(
        _sleep_long, gpus=2, gpu_type="cpu", remote=two_nodes.address,
        runs_dir=str(tmp_path), grace_period_s=1.0, timeout=200,
    )
    handle = f.submit()
    deadline = time.monotonic() + 90
    while len(run_processes(handle.run_id)) < 2 * 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.5)
    handle.cancel()
    with pytest.raises(errors.RunCanceledError):
        handle.result(timeout=60)
    assert handle.status == "CANCELED"

    with pytest.raises(errors.DistributedTimeoutError, match="timeout of 8 s"):
        f.with_overrides(timeout=8).distributed()

    deadline = time.monotonic() + 30
    while run_processes(handle.run_id) or any(
        pg["state"] != "REMOVED" for pg in placement_group_table().values()
    ):
        assert time.monotonic() < deadline, placement_group_table()
        time.sleep(0.5)


def test_lost_node_fails_clearly_and_leaves_nothing(two_nodes, tmp_path):
    handle = sleepers_then_lose_the_worker_node(two_nodes, tmp_path)
    with ended_at_exit(handle), pytest.raises(errors.WorkerGroupError) as info:
        handle.result(timeout=90)
    lost_node = two_nodes.worker.node_id[:12]
    root = info.value.root_cause
    assert root is not None and root.kind == "lost"
    assert f"node {lost_node}" in root.message and "was lost" in root.message, (lost_node, info.value.summary())
    others = [f for r, f in info.value.failures.items() if r != root.rank]
    assert [f.kind for f in others] == ["stopped"], info.value.summary()
    assert handle.status == "FAILED"
    deadline = time.monotonic() + 30
    while run_processes(handle.run_id):
        assert time.monotonic() < deadline, [p.cmdline() for p in run_processes(handle.run_id)]
        time.sleep(0.5)


def test_the_suites_ray_nodes_register_and_listen_on_loopback_only(two_nodes):
    """No Ray node of the suite registers (or serves on) the machine's network address."""
    import psutil

    from gpufleet.launch.engines.ray.connect import connect

    registered = {n["NodeManagerAddress"] for n in connect(two_nodes.address).nodes()}  # the calls' connection
    assert registered == {"127.0.0.1"}, registered
    listening = {}
    for p in cluster_processes(two_nodes.temp_dir):
        try:
            listening[f"{p.pid} {p.name()}"] = [c.laddr.ip for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass  # ended since it was found
    assert any(listening.values()), listening  # the GCS and both raylets were found
    assert all(ip.removeprefix("::ffff:").startswith("127.") for ips in listening.values() for ip in ips), listening
