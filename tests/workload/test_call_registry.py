"""Every @distributed call is in the run store beside workloads: get, list, logs, cancel, ps; a program's end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.errors import GPUUnavailableError, RunCanceledError
from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    REPO,
    cli,
    cli_json,
    cli_process,
    wait_no_processes,
    wait_state,
    write_workload,
)


@pytest.fixture(autouse=True)
def _fake_gpus(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")  # leased under $GPUFLEET_HOME/gpu-leases-fake
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@distributed(gpus=1, stream_logs=False)
def visible(seconds: float = 0.0) -> str | None:
    import os
    import time

    print("rank sees GPUs", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    time.sleep(seconds)
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@distributed(gpus=2, gpu_type="cpu", stream_logs=False)
def sleeper(seconds: float) -> None:
    import time

    print("sleeping", flush=True)
    time.sleep(seconds)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_call_is_recorded_and_get_list_logs_take_its_run_id(
    store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = visible.submit(0.0)
    assert handle.result(60) == ["0"]
    run_id = handle.run_id
    run = cli_json(capsys, "get", run_id)
    assert (run["kind"], run["state"], run["experiment"], run["world_size"]) == ("call", "SUCCESS", "visible", 1)
    assert run["placement"]["gpus"] == [0] and run["placement"]["gpu_name"] == "Fake GPU"
    assert run["origin"]["pid"] == os.getpid() and run["origin"]["host"] and run["origin"]["user"]
    assert run["run_dir"] == handle.run_dir and run["ended_at"] >= run["started_at"] >= run["created_at"]
    code, out, _ = cli(capsys, "logs", run_id)
    assert code == 0 and "rank sees GPUs 0" in out
    code, out, _ = cli(capsys, "get", run_id)
    assert code == 0 and "placement          GPU 0 (Fake GPU)" in out
    ids = [r["id"] for r in cli_json(capsys, "list", "--kind", "call", "--state", "SUCCESS", "--since", "1h")]
    assert run_id in ids
    assert cli_json(capsys, "list", "--kind", "workload", "--all-status") == []
    assert [r["id"] for r in cli_json(capsys, "list", "--name", "visible", "--all-status")] == [run_id]
    assert cli_json(capsys, "list", "--name", "other", "--all-status") == []
    code, out, _ = cli(capsys, "list", "--all-status")
    assert out.splitlines()[0].split("\t")[:4] == ["ID", "STATE", "KIND", "NAME"]


def test_two_calls_get_different_gpus_a_third_names_the_holders(store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = visible.submit(3.0), visible.submit(3.0)
    with pytest.raises(GPUUnavailableError) as info:
        visible.with_overrides(gpu_wait=0.3).distributed()
    assert f"run {first.run_id} (call, pid {os.getpid()}" in str(info.value)
    assert f"run {second.run_id} (call, pid {os.getpid()}" in str(info.value)
    ps = cli_json(capsys, "ps")
    held = {g["index"]: g["holder"]["run_id"] for g in ps["gpus"] if g["held"]}
    assert sorted(held.values()) == sorted([first.run_id, second.run_id])
    assert {r["id"]: r["gpus"] for r in ps["runs"]}[first.run_id] == [int(first.result(60)[0])]
    assert sorted([first.result(60)[0], second.result(60)[0]]) == ["0", "1"]
    failed = store.list(states=("FAILED",), filters={"kind": "call"})
    assert len(failed) == 1 and "GPUUnavailableError" in (failed[0].message or "")


def test_a_cancel_from_another_process_ends_the_call_with_run_canceled_error(store: RunStore) -> None:
    handle = sleeper.submit(60)
    wait_state(store, handle.run_id, ("RUNNING",), timeout=30)
    start = time.monotonic()
    done = cli_process("cancel", handle.run_id, "-o", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)[0]["state"] == "CANCELED"
    with pytest.raises(RunCanceledError, match=r"the run was canceled \(canceled by the user\)"):
        handle.result(60)
    assert time.monotonic() - start < 45  # the call sleeps 60 s: it was stopped, not waited for
    run = store.get(handle.run_id)
    assert (run.state, run.message) == ("CANCELED", "canceled by the user")  # a workload's words
    assert wait_no_processes(handle.run_id) == []


def test_a_script_that_ends_with_a_submitted_run_says_so(tmp_path: Path, store: RunStore) -> None:
    script = _script(tmp_path, """
        from gpufleet import distributed

        @distributed(gpus=1, gpu_type="cpu", tracking=False)
        def train(seconds):
            import time
            time.sleep(seconds)

        handle = train.submit(60)
        print(handle.run_id, flush=True)
    """)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO)
    run_id = done.stdout.strip()
    assert done.returncode == 0, done.stderr
    assert f"the program is exiting while run {run_id} is still RUNNING" in done.stderr
    assert "`handle.result()`" in done.stderr and "detach=True" in done.stderr
    run = wait_state(store, run_id)
    assert run.state == "CANCELED" and run.origin["path"] == str(script)
    assert wait_no_processes(run_id) == []


def test_a_killed_caller_frees_its_gpus_and_its_call_is_marked_failed(tmp_path: Path, store: RunStore) -> None:
    script = _script(tmp_path, """
        from gpufleet import distributed

        @distributed(gpus=2)
        def train():
            import time
            time.sleep(60)

        handle = train.submit()
        print(handle.run_id, flush=True)
        handle.result()
    """)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        run_id = proc.stdout.readline().strip()
        assert run_id
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    assert visible.with_overrides(gpus=2, gpu_wait=10).distributed() == ["0,1", "0,1"]  # its lease died with it
    assert wait_no_processes(run_id) == []
    run = cli_process("get", run_id, "-o", "json")
    assert json.loads(run.stdout)["state"] == "FAILED", run.stdout + run.stderr
    assert "died" in json.loads(run.stdout)["message"]


def test_warm_ranks_keep_their_gpus_while_idle_and_give_them_back(store: RunStore) -> None:
    from gpufleet.launch.leasing.leases import gpu_uses

    warm = visible.with_overrides(keep_warm=True)
    try:
        first = warm.distributed()
        second = warm.distributed()  # the same ranks, on the same GPU
        assert first == second
        held = [u for u in gpu_uses() if u.held]
        assert [u.gpu.index for u in held] == [int(first[0])]  # idle, they still hold it
    finally:
        warm.shutdown()
    assert all(u.free for u in gpu_uses())


@distributed(gpus=2, gpu_type="cpu", stream_logs=False)
def says_its_rank() -> None:
    import os

    print(f"hello from rank {os.environ['RANK']}", flush=True)


def test_logs_of_a_call_take_rank_and_prefix_lines_as_follow_does(store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    handle = says_its_rank.submit()
    handle.result(120)
    code, out, err = cli(capsys, "logs", handle.run_id, "--rank", "1")
    assert (code, out) == (0, "hello from rank 1\n"), err  # one rank asked for: its lines as they are
    code, out, err = cli(capsys, "logs", handle.run_id)
    assert code == 0, err
    assert out.splitlines() == ["[rank 0] hello from rank 0", "[rank 1] hello from rank 1"]
    code, out, err = cli(capsys, "logs", handle.run_id, "--follow")  # a finished call: the same lines
    assert code == 0 and out.splitlines() == ["[rank 0] hello from rank 0", "[rank 1] hello from rank 1"], err
    code, _, err = cli(capsys, "logs", handle.run_id, "--rank", "2")
    assert code == 2 and "ranks 0..1" in err


@distributed(gpus=2, gpu_type="cpu", stream_logs=False, secrets={"API_TOKEN": {"env": "GF_TEST_CALL_TOKEN"}})
def rank_one_refuses_its_token() -> None:
    import os

    print("starting", flush=True)
    if os.environ["RANK"] == "1":
        raise PermissionError(f"token {os.environ['API_TOKEN']} was refused")


def test_a_failed_rank_log_ends_with_its_traceback_secrets_masked(
    store: RunStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GF_TEST_CALL_TOKEN", "s3cr3t-t0ken-value")
    handle = rank_one_refuses_its_token.submit()
    with pytest.raises(PermissionError):
        handle.result(120)
    code, out, err = cli(capsys, "logs", handle.run_id, "--rank", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "starting" and "gpufleet: rank 1 failed with PermissionError" in out
    assert "Traceback (most recent call last):" in out and "rank_one_refuses_its_token" in out
    assert lines[-1] == "PermissionError: token *** was refused"
    assert "s3cr3t-t0ken-value" not in out
    assert Path(handle.run_dir, "rank-1.log").read_text().splitlines()[-1] == lines[-1]
    code, out, _ = cli(capsys, "logs", handle.run_id, "--rank", "0")  # rank 0 did not fail
    assert code == 0 and "Traceback" not in out


def test_idle_warm_ranks_are_named_and_give_their_gpus_to_a_waiting_run_or_to_cancel(
    store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    # seen: idle warm ranks held GPUs under a finished run's id that `gpufleet cancel` could not free,
    # and keep_warm (600 s) outlasted another notebook's gpu_wait (300 s)
    from gpufleet.launch.leasing.leases import gpu_uses

    def wait_free() -> None:
        deadline = time.monotonic() + 30
        while not all(u.free for u in gpu_uses()):
            assert time.monotonic() < deadline, gpu_uses()
            time.sleep(0.1)

    warm = visible.with_overrides(keep_warm=600, gpus=2)
    try:
        handle = warm.submit()
        assert handle.result(60) == ["0,1", "0,1"]
        uses = gpu_uses()
        assert all(u.held and u.holder and (u.holder.run_id, u.holder.kind) == (handle.run_id, "warm") for u in uses)
        code, out, _ = cli(capsys, "ps")
        assert f"idle warm ranks of run {handle.run_id}" in out and f"gpufleet cancel {handle.run_id}" in out
        code, out, _ = cli(capsys, "cancel", handle.run_id)
        assert code == 0 and "gave their GPUs back" in out, out
        wait_free()
        warm.distributed()  # warm again (new ranks)
        waiter = subprocess.Popen([sys.executable, "-m", "tests.leases.holder", "run-waiting", "1", "60"], cwd=REPO,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert waiter.stdout is not None and waiter.stdout.readline().startswith("GOT ")  # within its wait
        finally:
            waiter.kill()
            waiter.wait()
            waiter.stdin.close()
            waiter.stdout.close()
    finally:
        warm.shutdown()
    wait_free()


@distributed(gpus=2, gpu_type="cpu", stream_logs=False, max_retries=1, grace_period_s=1.0)
def fails_on_attempt_1() -> str:
    import os

    if os.environ["GPUFLEET_ATTEMPT"] == "1":
        raise ConnectionError("the first attempt breaks")
    return os.environ["GPUFLEET_ATTEMPT"]


def test_a_call_numbers_its_attempts_from_1_as_a_workload_does(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = fails_on_attempt_1.submit()
    assert handle.result(120) == ["2", "2"]  # GPUFLEET_ATTEMPT of the retry
    calls = cli_json(capsys, "list", "--name", "fails_on_attempt_1", "--all-status")
    numbers = sorted((a["attempt"], r["state"]) for r in calls for a in cli_json(capsys, "get", r["id"])["attempts"])
    assert numbers == [(1, "FAILED"), (2, "SUCCESS")]
    wl = write_workload(tmp_path, max_retries=1, command='[ "$GPUFLEET_ATTEMPT" = 2 ] || exit 3')
    rc, out, err = cli(capsys, "run", "-f", str(wl))
    assert rc == 0, err
    assert wait_state(store, out.strip()).state == "SUCCESS"
    run = cli_json(capsys, "get", out.strip())
    assert [(a["attempt"], a["state"]) for a in run["attempts"]] == [(1, "FAILED"), (2, "SUCCESS")]

