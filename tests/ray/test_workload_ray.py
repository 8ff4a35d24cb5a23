"""A CLI workload across two Ray nodes: ``torchrun --nnodes=2`` once per node."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    cli,
    cli_json,
    tiny_wheel,
    wait_no_processes,
    wait_state,
    write_workload,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRAIN = textwrap.dedent(
    """
    import os, yaml
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    params = yaml.safe_load(open(os.environ["HYPERPARAMETERS_PATH"]))
    keys = ["NUM_NODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
    env = " ".join(f"{k}={os.environ[k]}" for k in keys)
    print(f"rank={dist.get_rank()} sum={t.item()} lr={params['lr']} {env}", flush=True)
    dist.destroy_process_group()
    """
)

TORCHRUN = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py\n"
)


def _two_node_workload(
    two_nodes, tmp_path: Path, monkeypatch, name: str, command: str, files: dict[str, str] | None = None,
    ray_driver: bool = False, **fields
) -> Path:
    """A workload folder (with ``files``) for the two-node cluster, in a private GPUFLEET_HOME; its YAML."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    code = tmp_path / "project"
    code.mkdir()
    for file_name, text in (files or {}).items():
        (code / file_name).write_text(text)
    return write_workload(
        code,
        experiment_name=name,
        compute={"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": two_nodes.address,
                 **({"ray_driver": True} if ray_driver else {})},
        code_source={"root_path": "."},
        command=command,
        **fields,
    )


def test_torchrun_once_per_node(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    home = tmp_path / "home"
    yaml_path = _two_node_workload(
        two_nodes, tmp_path, monkeypatch, "two-nodes", TORCHRUN, files={"train.py": TRAIN}, parameters={"lr": 0.25}
    )
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    assert "rank=0 sum=3.0 lr=0.25 NUM_NODES=2 NODE_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1" in out
    assert "rank=1 sum=3.0 lr=0.25 NUM_NODES=2 NODE_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1" in out

    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "SUCCESS"
    nodes = run["attempts"][0]["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    assert nodes[0]["ray_node_id"] != nodes[1]["ray_node_id"]
    logs = cli_json(capsys, "logs", run_id, "--node", "1")
    assert any("NODE_RANK=1" in line for line in logs["logs"][0]["lines"])
    assert wait_no_processes(run_id) == []
    store = RunStore(home)
    assert store.get(run_id).state == "SUCCESS"


FAIL_ON_NODE_1 = textwrap.dedent(
    """
    if [ "$NODE_RANK" = "1" ]; then echo "node 1 gives up" >&2; exit 3; fi
    sleep 300 & echo $! > "$MARKER_DIR/node$NODE_RANK.pid"; wait
    """
)


def test_a_failing_node_stops_the_others_and_fails_the_run(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    import psutil

    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "two-nodes-fail", FAIL_ON_NODE_1,
                                   env_variables={"MARKER_DIR": str(tmp_path)}, max_retries=0)
    started = time.monotonic()
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    elapsed = time.monotonic() - started
    assert rc != 0
    assert elapsed < 60, f"node 0 was not stopped when node 1 failed ({elapsed:.0f} s)"
    run_id = out.splitlines()[0]
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "FAILED"
    assert "node 1" in (out + err) and "code 3" in (out + err)
    sleeper = tmp_path / "node0.pid"
    if sleeper.exists():  # node 0 had started its command: it must be gone
        assert not psutil.pid_exists(int(sleeper.read_text())) or psutil.Process(int(sleeper.read_text())).status() == psutil.STATUS_ZOMBIE
    assert wait_no_processes(run_id) == []


def test_a_tracked_workload_gets_system_metrics_from_each_node(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    import os

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
    stop = tmp_path / "stop"
    # the nodes run until the test has seen what it checks: each node's sampler starts beside the
    # ranks (it imports MLflow: a minute or more on a loaded machine) and logs every 10 s
    command = ('echo "node $NODE_RANK logs into $MLFLOW_RUN_ID; snapshot shipped=$GPUFLEET_SHIPPED_CODE"\n'
               'for i in $(seq 3000); do [ -e "$STOP_FILE" ] && break; sleep 0.1; done\n')
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "two-nodes-tracked", command,
                                   env_variables={"STOP_FILE": str(stop)})
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path))
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    system: set[str] = set()
    mlflow_run_id = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            mlflow_run_id = (cli_json(capsys, "get", run_id)["attempts"] or [{}])[0].get("mlflow_run_id")
            if mlflow_run_id:
                system = {k for k in client.get_run(mlflow_run_id).data.metrics if k.startswith("system/")}
                if {k.split("/")[1] for k in system} >= {"node0", "node1"}:
                    break
            time.sleep(1.0)
    finally:
        stop.touch()
    store = RunStore(tmp_path / "home")
    assert wait_state(store, run_id, timeout=120).state == "SUCCESS", cli(capsys, "logs", run_id)[1]
    # system metrics come from each node the command ran on
    assert {k.split("/")[1] for k in system} == {"node0", "node1"}, system
    # the code snapshot also travelled as the Ray job's working_dir (used where the run folder is missing)
    assert f"node 1 logs into {mlflow_run_id}; snapshot shipped=1" in cli(capsys, "logs", run_id)[1]


DRIVER = textwrap.dedent(
    """
    import os, time
    import ray

    ray.init()  # RAY_ADDRESS: the cluster gpufleet runs on
    print("driver NODE_RANK=%s WORLD_SIZE=%s NUM_NODES=%s" % (os.environ["NODE_RANK"], os.environ["WORLD_SIZE"],
          os.environ["NUM_NODES"]), flush=True)

    @ray.remote(num_cpus=1)  # every CPU of the cluster: nothing may be held back for the command
    class Worker:
        def where(self):
            return ray.get_runtime_context().get_node_id(), os.getpid()

        def hold(self, path):
            open(path, "w").write(str(os.getpid()))
            time.sleep(300)

    workers = [Worker.remote() for _ in range(int(os.environ["WORLD_SIZE"]))]
    placed = ray.get([w.where.remote() for w in workers], timeout=60)
    print("workers on %d nodes" % len({node for node, _ in placed}), flush=True)
    if os.environ.get("HOLD_DIR"):
        ray.get([w.hold.remote(os.path.join(os.environ["HOLD_DIR"], "w%d.pid" % i)) for i, w in enumerate(workers)])
    """
)


def test_a_ray_driver_runs_once_and_places_its_workers_on_every_node(
    two_nodes, tmp_path: Path, monkeypatch, capsys
) -> None:
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "ray-driver", "python driver.py\n",
                                   files={"driver.py": DRIVER}, ray_driver=True, max_retries=0)
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--dry-run")
    assert rc == 0 and "once, as a Ray driver" in out, out + err
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    assert rc == 0, out + err
    assert out.count("driver NODE_RANK=0 WORLD_SIZE=2 NUM_NODES=2") == 1, out
    assert "workers on 2 nodes" in out  # both CPUs were free for the driver's workers
    run_id = out.splitlines()[0]
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "SUCCESS" and [n["node_rank"] for n in run["attempts"][0]["nodes"]] == [0]
    rc, out, err = cli(capsys, "logs", run_id, "--node", "1")
    assert rc != 0 and "Ray driver run" in err
    assert wait_no_processes(run_id) == []


def _start_then_cancel(capsys, yaml_path: Path, pid_files: list[Path]) -> tuple[str, list[int]]:
    """Run a workload in the background, cancel it once every pid file is written; its id and those pids."""
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    deadline = time.monotonic() + 90
    while not all(p.exists() and p.read_text().strip() for p in pid_files) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(p.exists() for p in pid_files), cli(capsys, "logs", run_id)[1]
    pids = [int(p.read_text()) for p in pid_files]
    rc, out, err = cli(capsys, "cancel", run_id)
    assert rc == 0, out + err
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and cli_json(capsys, "get", run_id)["state"] == "RUNNING":
        time.sleep(0.5)
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "CANCELED", run
    return run_id, pids


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancelling_a_ray_driver_run_stops_its_workers(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "ray-driver-cancel", "python driver.py\n",
                                   files={"driver.py": DRIVER}, env_variables={"HOLD_DIR": str(tmp_path)},
                                   ray_driver=True, max_retries=0)
    run_id, pids = _start_then_cancel(capsys, yaml_path, [tmp_path / "w0.pid", tmp_path / "w1.pid"])
    deadline = time.monotonic() + 30  # Ray ends the workers of a driver that is gone
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.5)
    assert not any(_running(p) for p in pids), "the driver's Ray workers outlived the cancelled run"
    assert wait_no_processes(run_id) == []


def test_cancelling_a_two_node_workload_stops_both_nodes(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    """``gpufleet cancel`` reaches a supervisor connected to Ray (Ray's own SIGTERM handler must not end it)."""
    command = 'sleep 300 & echo $! > "$MARKER_DIR/node$NODE_RANK.pid"; wait\n'
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "two-nodes-cancel", command,
                                   env_variables={"MARKER_DIR": str(tmp_path)}, max_retries=0)
    run_id, pids = _start_then_cancel(capsys, yaml_path, [tmp_path / "node0.pid", tmp_path / "node1.pid"])
    assert not any(_running(p) for p in pids)
    assert wait_no_processes(run_id) == []


def test_a_ray_driver_the_cluster_can_never_serve_gets_a_clear_error(two_nodes, tmp_path: Path, monkeypatch) -> None:
    from gpufleet.errors import LaunchConfigError, SchedulingTimeoutError
    from gpufleet.launch.engines.ray import engine as ray_engine
    from gpufleet.workload import ray_executor
    from gpufleet.workload.schema import WorkloadConfig

    config = WorkloadConfig.model_validate({
        "experiment_name": "too-big", "command": "python driver.py",
        "compute": {"accelerator_type": "CPU_2", "num_accelerators": 4, "cluster": two_nodes.address, "ray_driver": True},
    })  # fmt: skip
    monkeypatch.setattr(ray_engine, "SCHEDULE_TIMEOUT_S", 1.0)
    executor = ray_executor.RayExecutor(config, two_nodes.address)
    started = time.monotonic()
    try:
        with pytest.raises(SchedulingTimeoutError, match=r"has 2 CPUs in all \(2 nodes alive\); this workload's Ray "
                                                         r"driver needs 4 \(compute.num_accelerators\)") as info:
            executor.rendezvous(config.compute.num_nodes)
        # waiting too long for room is not a wrong setting (it was a LaunchConfigError)
        assert not isinstance(info.value, LaunchConfigError) and isinstance(info.value, TimeoutError)
    finally:
        executor.close()
    assert time.monotonic() - started < 45  # the 1 s wait for room, not the 10 minutes of a real one


def test_dependencies_reach_every_node(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    wheel = tiny_wheel(tmp_path)
    command = 'python -c "import gfnodedemo; print(\'node\', $NODE_RANK, gfnodedemo.VALUE)"\n'
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "two-nodes-deps", command, max_retries=0,
                                   environment={"dependencies": [f"gfnodedemo @ {wheel.as_uri()}"]})
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    assert rc == 0, out + err
    assert "node 0 installed on this node" in out and "node 1 installed on this node" in out, out


def test_cancel_while_waiting_for_the_cluster_cancels_at_once(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    """A workload the cluster has no room for waits (up to 10 minutes); a cancel ends the wait."""
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "no-room", "true\n", max_retries=0)
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking",
                       "--override", "compute.accelerator_type=CPU_2", "--override", "compute.num_accelerators=4")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    deadline = time.monotonic() + 60
    while not cli_json(capsys, "get", run_id)["attempts"]:  # the attempt waits for its placement group
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(2.0)
    t0 = time.monotonic()
    rc, out, err = cli(capsys, "cancel", run_id)
    assert rc == 0, out + err
    while cli_json(capsys, "get", run_id)["state"] in ("PENDING", "RUNNING"):
        assert time.monotonic() - t0 < 60, "the cancel waited for the cluster"
        time.sleep(0.5)
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "CANCELED" and "while waiting for 2 nodes" in run["message"], run
    assert wait_no_processes(run_id) == []
