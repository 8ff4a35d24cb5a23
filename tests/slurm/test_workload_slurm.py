"""CLI workloads on the real local Slurm cluster (two emulated nodes): ``compute.cluster: slurm``."""

from __future__ import annotations

import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import squeue_ids
from tests.workload.helpers import cli, cli_json, wait_no_processes, write_workload

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

TRAIN = textwrap.dedent(
    """
    import os
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ["NUM_NODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURMD_NODENAME"]
    env = " ".join(f"{k}={os.environ[k]}" for k in keys)
    print(f"rank={dist.get_rank()} sum={t.item()} secret={os.environ['TOKEN'] == 's3cr3t-value'} {env}", flush=True)
    dist.destroy_process_group()
    """
)

TORCHRUN = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py\n"
)


def slurm_workload(tmp_path: Path, monkeypatch, name: str, command: str, files: dict[str, str] | None = None,
                   slurm: dict | None = None, **fields) -> Path:  # fmt: skip
    """A two-node CPU workload folder for the local cluster, in a private GPUFLEET_HOME; its YAML."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    code = tmp_path / "project"
    code.mkdir()
    for file_name, text in (files or {}).items():
        (code / file_name).write_text(text)
    compute = {"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": "slurm"}
    if slurm is not None:
        compute["slurm"] = slurm
    return write_workload(code, experiment_name=name, compute=compute, code_source={"root_path": "."},
                          command=command, **fields)  # fmt: skip


def test_torchrun_once_per_node_on_two_slurm_nodes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SLURM_TEST_TOKEN", "s3cr3t-value")
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-two-nodes", TORCHRUN, files={"train.py": TRAIN},
                               slurm={"partition": "debug", "time": "5"}, secrets={"TOKEN": {"env": "SLURM_TEST_TOKEN"}})  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "SUCCESS", run
    nodes = run["attempts"][0]["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    job_id = nodes[0]["slurm_job_id"]
    assert job_id and nodes[1]["slurm_job_id"] == job_id
    folder = Path(run["attempts"][0]["log_dir"])
    for node in (0, 1):
        log = (folder / f"node-{node}.log").read_text()
        assert f"rank={node} sum=3.0 secret=True NUM_NODES=2 NODE_RANK={node} WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 " \
               f"SLURMD_NODENAME=node{node + 1}" in log, log  # fmt: skip
    # the secret is in no file of the run folder (the batch script holds paths only)
    for path in folder.rglob("*"):
        if path.is_file():
            assert b"s3cr3t-value" not in path.read_bytes(), path
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []


def _wait(predicate, what: str, timeout: float = 150.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def _job_of(capsys, run_id: str, attempt: int = 1) -> str | None:
    run = cli_json(capsys, "get", run_id)
    attempts = [a for a in run["attempts"] if a["attempt"] == attempt]
    nodes = attempts[0]["nodes"] if attempts else []
    return nodes[0].get("slurm_job_id") if nodes else None


SLEEPER = 'echo "node $NODE_RANK up"; touch "$MARKER_DIR/up-$NODE_RANK"; sleep 300\n'


def test_cancel_leaves_nothing_in_squeue_or_on_the_nodes(tmp_path: Path, monkeypatch, capsys) -> None:
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-cancel", SLEEPER, env_variables={"MARKER_DIR": str(tmp_path)})
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.split()[0]
    _wait(lambda: (tmp_path / "up-0").exists() and (tmp_path / "up-1").exists(), "both nodes to start")
    job_id = _job_of(capsys, run_id)
    assert job_id in squeue_ids()
    from gpufleet.launch.engines.slurm.stacks import collect_on_slurm

    def both_nodes_read():  # on the job's nodes, through srun --overlap
        rid, found = collect_on_slurm(run_id[:-3]) or (None, [])
        return rid == run_id and {"0", "1"} <= {p["node_rank"] for p in found}

    _wait(both_nodes_read, "the stacks of both nodes", timeout=60, every=1.0)
    rc, out, err = cli(capsys, "cancel", run_id)
    assert rc == 0, out + err
    _wait(lambda: cli_json(capsys, "get", run_id)["state"] == "CANCELED", "the run to end CANCELED")
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []


PREEMPTIBLE = textwrap.dedent(
    """
    import os, time
    import torch
    import torch.distributed as dist
    from gpufleet.checkpoint import CheckpointManager

    attempt = os.environ["GPUFLEET_ATTEMPT"]
    marker = os.environ["MARKER_DIR"]
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    model = torch.nn.Linear(1, 1)
    torch.nn.init.zeros_(model.weight)               # after step N the weight is exactly N
    manager = CheckpointManager(os.environ["GPUFLEET_CHECKPOINT_DIR"], model=model)
    start = manager.resume() or 0
    for step in range(start, 12):
        with torch.no_grad():
            model.weight += 1.0                       # the state a lost step would show
        with open(os.path.join(marker, f"steps-{rank}.txt"), "a") as f:
            f.write(f"{attempt} {step + 1} {model.weight.item():g}\\n")
        if step + 1 == 3 and rank == 0:
            open(os.path.join(marker, "ready"), "w").close()
        stop = manager.save_if_preempted(step + 1)
        deadline = time.monotonic() + 150
        while not stop and attempt == "1" and step + 1 >= 3 and time.monotonic() < deadline:
            time.sleep(0.2)                           # the first attempt waits here for Slurm
            stop = manager.save_if_preempted(step + 1)
        if stop:
            print(f"rank {rank} checkpointed step {step + 1} for the scheduler", flush=True)
            break
    if distributed:
        dist.destroy_process_group()
    """
)


def _steps(path: Path) -> list[tuple[int, int, float]]:
    return [(int(a), int(s), float(w)) for a, s, w in (line.split() for line in path.read_text().splitlines())]


def _ended(capsys, run_id: str):
    return _wait(lambda: (r := cli_json(capsys, "get", run_id))["state"] in ("SUCCESS", "FAILED", "CANCELED") and r,
                 "the run to end", timeout=240)  # fmt: skip


def test_the_time_limit_signal_checkpoints_and_the_resubmitted_attempt_resumes(tmp_path: Path, monkeypatch, capsys) -> None:
    # a one-minute job that asks for SIGUSR1 50 s before its end: Slurm itself sends it
    yaml_path = slurm_workload(
        tmp_path, monkeypatch, "slurm-time-limit", "python train.py\n", files={"train.py": PREEMPTIBLE},
        env_variables={"MARKER_DIR": str(tmp_path)}, max_retries=0, slurm={"time": "1", "signal_before_s": 50},
    )  # fmt: skip
    yaml_path.write_text(yaml_path.read_text().replace("num_accelerators: 2", "num_accelerators: 1"))
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.split()[0]
    # Slurm may send the signal early (by up to its event resolution): at any step of attempt 1
    job_id = _wait(lambda: _job_of(capsys, run_id), "the first attempt's Slurm job")
    run = _ended(capsys, run_id)
    assert run["state"] == "SUCCESS", run
    attempts = run["attempts"]
    assert len(attempts) >= 2 and attempts[0]["attempt"] == 1, attempts  # max_retries=0: a preemption is not a retry
    assert "time limit" in attempts[0]["message"] and job_id in attempts[0]["message"], attempts[0]
    assert _job_of(capsys, run_id, 2) != job_id  # resubmitted as a new job
    lines = _steps(tmp_path / "steps-0.txt")
    first = [s for a, s, _ in lines if a == 1]
    second = [s for a, s, _ in lines if a == 2]
    assert first and second[0] == first[-1] + 1, lines  # checkpointed at that step, resumed right after it
    assert [w for _, _, w in lines] == [float(s) for _, s, _ in lines] == [float(i + 1) for i in range(12)], lines
    assert "slurm job" in cli(capsys, "get", run_id)[1]
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []


def test_a_preemption_by_a_higher_priority_job_checkpoints_and_resumes(tmp_path: Path, monkeypatch, capsys) -> None:
    # the local cluster's "urgent" partition preempts "debug" (CANCEL with a grace time): the
    # ranks get SIGTERM, which their checkpoint manager turns into a checkpoint at the next step
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-preempt", TORCHRUN, files={"train.py": PREEMPTIBLE},
                               env_variables={"MARKER_DIR": str(tmp_path)}, max_retries=0)  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.split()[0]
    _wait(lambda: (tmp_path / "ready").exists(), "the first attempt to train a few steps")
    job_id = _job_of(capsys, run_id)
    urgent = subprocess.run(["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                             f"--output={tmp_path / 'urgent.log'}", "--wrap", "sleep 1"],
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    run = _ended(capsys, run_id)
    assert run["state"] == "SUCCESS", run
    attempts = run["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2], attempts  # max_retries=0: a preemption is not a retry
    assert "preempted" in attempts[0]["message"] and "higher" in attempts[0]["message"], attempts[0]
    assert job_id in attempts[0]["message"]
    for rank in (0, 1):
        lines = _steps(tmp_path / f"steps-{rank}.txt")
        first = [s for a, s, _ in lines if a == 1]
        second = [s for a, s, _ in lines if a == 2]
        assert second[0] == first[-1] + 1, lines  # checkpointed at the next step after SIGTERM, resumed after it
        assert [w for _, _, w in lines] == [float(s) for _, s, _ in lines] == [float(i + 1) for i in range(12)], lines
    log = (Path(attempts[0]["log_dir"]) / "node-0.log").read_text()
    assert "got SIGTERM from the scheduler" in log and "checkpointed step" in log, log
    _wait(lambda: urgent not in squeue_ids(), "the urgent job to end", timeout=30)
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []


RETRIED = ('echo "attempt $GPUFLEET_ATTEMPT node $NODE_RANK mlflow=${MLFLOW_RUN_ID:-none}"; '
           'if [ "$GPUFLEET_ATTEMPT" = 1 ]; then exit 3; fi; sleep 300\n')


def test_a_failed_attempt_is_retried_as_a_new_job_and_the_timeout_stops_the_next(tmp_path: Path, monkeypatch,
                                                                                  capsys) -> None:  # fmt: skip
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-retry", RETRIED, max_retries=1, timeout_minutes=0.25)
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path))  # tracked: each attempt is an MLflow run
    assert rc == 0, out + err
    run_id = out.split()[0]
    rc, followed, err = cli(capsys, "logs", run_id, "--follow")  # returns once the run has ended
    run = cli_json(capsys, "get", run_id)
    assert rc == 0 and f"run {run_id} TIMEDOUT" in err, err
    assert run["state"] == "TIMEDOUT", run
    first, second = run["attempts"]
    # both nodes exit 3 at about the same time: the first one seen is named
    assert first["state"] == "FAILED" and re.search(r"node [01] exited with code 3", first["message"]), first
    assert second["state"] == "TIMEDOUT" and "timeout_minutes=0.25" in second["message"], second
    jobs = [_job_of(capsys, run_id, 1), _job_of(capsys, run_id, 2)]
    assert jobs[0] and jobs[1] and jobs[0] != jobs[1]  # the retry is a new job
    ids = [a.get("mlflow_run_id") for a in (first, second)]
    assert ids[0] and ids[1] and ids[0] != ids[1], ids
    order = [followed.index("--- attempt 1/2 ---"), followed.index("--- attempt 2/2 ---")]
    for attempt, mlflow_id in ((1, ids[0]), (2, ids[1])):  # each node's line, under its attempt, with its MLflow run
        for node in (0, 1):
            at = followed.index(f"[node {node}] attempt {attempt} node {node} mlflow={mlflow_id}")
            assert order[attempt - 1] < at and (attempt == 2 or at < order[1]), followed
    assert not set(jobs) & set(squeue_ids())
    assert wait_no_processes(run_id) == []


HANGS = textwrap.dedent(
    """
    import time
    import torch
    import torch.distributed as dist
    from gpufleet import runtime

    runtime.setup()
    t = torch.ones(4)
    for step in range(1, 6):
        dist.all_reduce(t)
        runtime.report_step()
        if runtime.get_global_rank() == 1 and step == 2:
            time.sleep(600)  # rank 1 stops coming
    dist.destroy_process_group()
    """
)


def test_the_hang_watchdog_names_the_missing_rank_on_its_slurm_node(tmp_path: Path, monkeypatch, capsys) -> None:
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-hang", TORCHRUN, files={"train.py": HANGS},
                               hang_timeout_minutes=0.08)  # about 5 s  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    run_id = out.splitlines()[0]
    run = cli_json(capsys, "get", run_id)
    assert rc != 0 and run["state"] == "TIMEDOUT", out + err
    assert "rank 1 missing from all_reduce #3 [[4]], which rank 0 waits in" in run["message"], run["message"]
    assert "time.sleep(600)" in run["message"], run["message"]  # rank 1's line, read on its node (srun --overlap)
    job_id = _job_of(capsys, run_id)
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []


def test_bad_slurm_keys_fail_validation_listing_every_error(tmp_path: Path, capsys) -> None:
    yaml_path = write_workload(
        tmp_path, experiment_name="bad-slurm", command="true",
        compute={"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": "slurm",
                 "slurm": {"partiton": "gpu", "time": "forever", "sbatch_args": ["--nodes=4", "mem=1G"], "qos": 3}},
    )  # fmt: skip
    rc, out, err = cli(capsys, "validate", "-f", str(yaml_path))
    assert rc != 0
    text = out + err
    assert "compute.slurm: unknown key 'partiton' (did you mean 'partition'?)" in text
    assert "compute.slurm.time" in text and "not a Slurm time limit" in text
    assert "--nodes is set by gpufleet" in text and "'mem=1G' is not an option" in text
    assert "compute.slurm.qos" in text


def _kill_node(name: str) -> None:
    """What a dead node looks like: its slurmd, the job steps' slurmstepd on it and their tasks all gone."""
    import os
    import signal

    import psutil

    from tests.slurm.conftest import STATE

    victims = [int(Path(STATE, f"slurmd-{name}.pid").read_text())]
    for p in psutil.process_iter():
        try:
            if p.environ().get("SLURMD_NODENAME") == name:
                victims.append(p.pid)
                parent = p.parent()
                if parent is not None and parent.name().startswith("slurmstepd"):
                    victims.append(parent.pid)
        except (psutil.Error, OSError):
            continue
    for pid in set(victims):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_node_that_dies_fails_the_attempt_clearly(tmp_path: Path, monkeypatch, capsys) -> None:
    from tests.slurm.conftest import SCRIPT

    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-node-dies", SLEEPER, env_variables={"MARKER_DIR": str(tmp_path)})
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.split()[0]
    _wait(lambda: (tmp_path / "up-0").exists() and (tmp_path / "up-1").exists(), "both nodes to start")
    job_id = _job_of(capsys, run_id)
    try:
        _kill_node("node2")
        run = _wait(lambda: (r := cli_json(capsys, "get", run_id))["state"] not in ("PENDING", "RUNNING") and r,
                    "the run to end after its node died", timeout=120)  # fmt: skip
        assert run["state"] == "FAILED", run
        message = run["attempts"][0]["message"]
        assert f"Slurm ended job {job_id} NODE_FAIL" in message, message  # Slurm's own word, not a guess
    finally:
        subprocess.run([str(SCRIPT), "revive"], check=True, capture_output=True, timeout=90)
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []
