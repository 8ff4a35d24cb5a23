"""End to end: torchrun workloads submitted, watched, inspected, canceled, retried, timed out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    cli,
    cli_json,
    cli_process,
    wait_for_text,
    wait_no_processes,
    wait_state,
    write_workload,
)

TRAIN = textwrap.dedent(
    """
    import os, sys, time, yaml
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = yaml.safe_load(open(os.environ["HYPERPARAMETERS_PATH"]))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    keys = ["NUM_NODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "PYTHONUNBUFFERED", "GPUFLEET_ATTEMPT"]
    env = " ".join(f"{k}={os.environ[k]}" for k in keys)
    same_dir = os.environ["CODE_SOURCE_PATH"] == os.getcwd()
    # one write() per line: both ranks share the node's log file, and print() writes the
    # text and the newline separately, so lines of the two ranks could interleave
    os.write(1, f"rank={rank} sum={t.item()} lr={params['lr']} {env} in_snapshot={same_dir}\\n".encode())
    os.write(1, b"started\\n")
    time.sleep(float(params.get("sleep", 0)))
    dist.barrier()
    dist.destroy_process_group()
    """
)

TORCHRUN = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py\n"
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A code folder with a training script, a .gitignore'd file and a 2-worker workload."""
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    (code / ".gitignore").write_text("*.ckpt\nscratch/\n")
    (code / "big.ckpt").write_text("ignored")
    (code / "scratch").mkdir()
    (code / "scratch" / "notes.txt").write_text("ignored")
    write_workload(
        code,
        experiment_name="e2e",
        compute={"accelerator_type": "CPU_2", "num_accelerators": 2},
        code_source={"root_path": "."},
        command=TORCHRUN,
        parameters={"lr": 0.5, "sleep": 0},
    )
    return code


def test_torchrun_workload_watched_and_inspected(project: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "run", "-f", str(project / "workload.yaml"), "--watch", "--no-tracking")
    assert code == 0, err
    run_id = out.splitlines()[0]
    for rank in (0, 1):
        assert f"[node 0] [rank {rank}] rank={rank} sum=3.0 lr=0.5" in out  # each rank's lines prefixed
    assert "NUM_NODES=1 NODE_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1" in out
    assert "PYTHONUNBUFFERED=1 GPUFLEET_ATTEMPT=1 in_snapshot=True" in out
    assert "SUCCESS" in err

    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "SUCCESS" and run["exit_code"] == 0
    assert len(run["attempts"]) == 1 and run["attempts"][0]["state"] == "SUCCESS"
    assert run["config"]["compute"]["num_accelerators"] == 2
    snapshot = Path(run["run_dir"]) / "code"
    assert (snapshot / "train.py").exists() and (snapshot / ".gitignore").exists()
    assert not (snapshot / "big.ckpt").exists() and not (snapshot / "scratch").exists()
    (log,) = run["log_paths"]
    assert "rank=1 sum=3.0" in Path(log).read_text()

    listed = cli_json(capsys, "list", "--all-status")
    assert [r["id"] for r in listed] == [run_id]
    assert cli_json(capsys, "list") == []  # finished runs are hidden by default
    rc, text, _ = cli(capsys, "list")
    assert "1 finished" in text

    logs = cli_json(capsys, "logs", run_id, "--node", "0", "--lines", "3")
    assert len(logs["logs"]) == 1 and len(logs["logs"][0]["lines"]) == 3
    rc, text, _ = cli(capsys, "logs", run_id)
    assert rc == 0 and "rank=0 sum=3.0" in text


def test_cancel_mid_run_stops_every_process(project: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "run", "-f", str(project / "workload.yaml"), "--no-tracking",
                     "--override", "parameters.sleep=120")  # fmt: skip
    run_id = out.strip()
    run = wait_state(store, run_id, ("RUNNING",))
    wait_for_text(Path(run.run_dir) / "attempts" / "1" / "node-0.log", "started")
    assert len(wait_no_processes(run_id, timeout=0)) >= 4  # supervisor, guard, bash/torchrun, ranks
    t0 = time.monotonic()
    result = cli_json(capsys, "cancel", run_id)
    assert result == [{"id": run_id, "state": "CANCELED", "canceled": True}]
    assert time.monotonic() - t0 < 60  # the job sleeps 120 s: it was stopped, not waited for
    assert wait_no_processes(run_id) == []
    final = store.get(run_id)
    assert final.state == "CANCELED" and final.attempts[0].state == "CANCELED"
    # canceling again says so and changes nothing
    again = cli_json(capsys, "cancel", run_id)
    assert again[0]["state"] == "CANCELED" and again[0]["canceled"] is False


def test_a_run_removed_from_the_store_stops_and_its_supervisor_says_why(
    project: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    # seen: its supervisor ran the command to its end, invisible and uncancelable, its log
    # repeating "heartbeat failed: 'NoneType' object is not subscriptable"
    import contextlib
    import sqlite3

    import psutil

    rc, out, _ = cli(capsys, "run", "-f", str(project / "workload.yaml"), "--no-tracking",
                     "--override", "parameters.sleep=300")  # fmt: skip
    run_id = out.strip()
    run = wait_state(store, run_id, ("RUNNING",))
    wait_for_text(Path(run.run_dir) / "attempts" / "1" / "node-0.log", "started")
    assert len(wait_no_processes(run_id, timeout=0)) >= 4
    with sqlite3.connect(store.path) as db:
        db.execute("DELETE FROM attempts WHERE run_id = ?", (run_id,))
        db.execute("DELETE FROM runs WHERE id = ?", (run_id,))
    left = wait_no_processes(run_id, timeout=60)  # supervisor, guard, torchrun and ranks
    for p in left:  # a failed check must not leave the run behind
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert left == []
    log = (Path(run.run_dir) / "supervisor.log").read_text()
    assert f"gpufleet: stopped: run {run_id} is no longer in the run store" in log, log
    assert "heartbeat failed" not in log, log


RETRY = textwrap.dedent(
    """
    import os, pathlib, sys
    ckpt = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_DIR"]) / "state.txt"
    if ckpt.exists():
        step = int(ckpt.read_text())
        print(f"attempt {os.environ['GPUFLEET_ATTEMPT']} resumed from step {step}")
        ckpt.write_text(str(step + 5))
        sys.exit(0)
    ckpt.write_text("5")
    print(f"attempt {os.environ['GPUFLEET_ATTEMPT']} saved step 5 and crashed", flush=True)
    sys.exit(3)
    """
)


def test_failure_then_retry_resumes_from_checkpoint(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "retry.py").write_text(RETRY)
    wl = write_workload(tmp_path, code_source={"root_path": "."}, command="python retry.py", max_retries=1)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err
    order = [out.index(text) for text in ("--- attempt 1/2 ---", "attempt 1 saved step 5 and crashed",
                                          "--- attempt 2/2 ---", "attempt 2 resumed from step 5")]  # fmt: skip
    assert order == sorted(order), out  # each attempt's separator before its own lines
    rc, followed, _ = cli(capsys, "logs", out.splitlines()[0], "--follow")  # the same, for the finished run
    assert rc == 0 and followed == cli(capsys, "logs", out.splitlines()[0])[1], followed
    run = store.get(out.splitlines()[0])
    assert [a.state for a in run.attempts] == ["FAILED", "SUCCESS"]
    assert run.attempts[0].exit_code == 3 and "node 0 exited with code 3" in run.attempts[0].message
    assert (Path(run.run_dir) / "checkpoints" / "state.txt").read_text() == "10"


def test_failure_without_retries_fails_with_exit_code(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command="echo doomed >&2; exit 7", max_retries=0)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 1
    assert "[node 0] doomed" in out
    run = store.get(out.splitlines()[0])
    assert run.state == "FAILED" and run.exit_code == 7 and "exited with code 7" in run.message


def test_timeout_marks_timedout_and_stops_processes(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command="echo going; sleep 300 & sleep 300; wait", timeout_minutes=0.03)
    t0 = time.monotonic()
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 124, err
    assert time.monotonic() - t0 < 150  # the job sleeps 300 s: the 1.8 s timeout stopped it
    run_id = out.splitlines()[0]
    run = store.get(run_id)
    assert run.state == "TIMEDOUT" and "timeout_minutes=0.03" in run.message
    assert wait_no_processes(run_id) == []


def test_idempotent_resubmit_returns_the_same_run(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command="echo once")
    first = cli_json(capsys, "run", "-f", str(wl), "--idempotency-key", "nightly-1", "--no-tracking")
    second = cli_json(capsys, "run", "-f", str(wl), "--idempotency-key", "nightly-1", "--no-tracking")
    assert first["created"] is True and second["created"] is False
    assert first["id"] == second["id"]
    wait_state(store, first["id"])
    third = cli_json(capsys, "run", "-f", str(wl), "--idempotency-key", "nightly-2", "--no-tracking")
    assert third["id"] != first["id"]
    wait_state(store, third["id"])
    assert len(store.list(states=None, limit=None)) == 2


def test_concurrent_cli_processes_share_the_store(tmp_path: Path, home: Path) -> None:
    wl = write_workload(tmp_path, command="echo hi")
    argv = ["run", "-f", str(wl), "--no-tracking", "-o", "json", "--home", str(home)]
    procs = [
        subprocess.Popen(
            [os.sys.executable, "-m", "gpufleet.cli", *argv, *(["--idempotency-key", "race"] if i < 3 else [])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for i in range(5)
    ]
    lister = [cli_process("list", "--all-status", "-o", "json", "--home", str(home)) for _ in range(2)]
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    ids = [json.loads(out)["id"] for out, _ in results]
    assert len(set(ids[:3])) == 1  # one run for the shared key
    assert len(set(ids)) == 3
    assert all(r.returncode == 0 for r in lister), [r.stderr for r in lister]
    store = RunStore(home)
    for run_id in set(ids):
        assert wait_state(store, run_id).state == "SUCCESS"
    assert len(store.list(states=None, limit=None)) == 3


def test_run_returns_at_once_and_outlives_the_cli(tmp_path: Path, home: Path) -> None:
    go = tmp_path / "go"  # the job ends only once the test says so, after the CLI has returned
    wl = write_workload(tmp_path, command=f"while [ ! -e {go} ]; do sleep 0.1; done; echo finished")
    proc = cli_process("run", "-f", str(wl), "--no-tracking", "--home", str(home))
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    store = RunStore(home)
    assert store.get(run_id).state in ("PENDING", "RUNNING")
    go.touch()
    run = wait_state(store, run_id)
    assert run.state == "SUCCESS"
    logs = cli_process("logs", run_id, "--home", str(home))
    assert logs.stdout.strip() == "[node 0] finished"  # as --follow prints it
    logs = cli_process("logs", run_id, "--node", "0", "--home", str(home))
    assert logs.stdout.strip() == "finished"  # one node asked for: no prefix, as with --follow


def test_killed_supervisor_leaves_run_failed_and_nothing_running(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command="echo up; sleep 300 & sleep 300; wait")
    rc, out, _ = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    run_id = out.strip()
    run = wait_state(store, run_id, ("RUNNING",))
    wait_for_text(Path(run.run_dir) / "attempts" / "1" / "node-0.log", "up")
    os.kill(run.supervisor_pid, signal.SIGKILL)
    # the node's guard notices on its own, without anyone reading the store
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(wait_no_processes(run_id, timeout=0)) > 0:
        time.sleep(0.2)
    assert wait_no_processes(run_id, timeout=0) == []
    got = cli_json(capsys, "get", run_id)
    assert got["state"] == "FAILED"
    assert f"supervisor process (pid {run.supervisor_pid}) died" in got["message"]
    assert cli_json(capsys, "list") == []  # never shown as running again


def test_logs_follow_streams_until_the_end(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command="for i in 1 2 3; do echo line $i; sleep 0.3; done")
    rc, out, _ = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    run_id = out.strip()
    rc, text, err = cli(capsys, "logs", run_id, "--follow", "--node", "0")
    assert rc == 0
    assert text.splitlines() == ["line 1", "line 2", "line 3"]
    assert "SUCCESS" in err


def test_cancel_all(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command="sleep 300")
    ids = [cli(capsys, "run", "-f", str(wl), "--no-tracking")[1].strip() for _ in range(2)]
    for rid in ids:
        wait_state(store, rid, ("RUNNING",))
    result = cli_json(capsys, "cancel", "--all")
    assert sorted(r["id"] for r in result) == sorted(ids)
    assert all(r["state"] == "CANCELED" for r in result)
    rc, out, _ = cli(capsys, "cancel", "--all")
    assert "no pending or running runs" in out
