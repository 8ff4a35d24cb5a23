"""Item: a tracking server that refuses, never answers or stalls costs a call, a workload and a cancel
a few seconds and one warning; the run goes on untracked and its result is never lost."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.runs.store import RunStore
from tests.security.dead_servers import closed_port, silent_server, stalling_server
from tests.workload.helpers import cli, wait_no_processes, wait_state, write_workload

CPU = {"gpus": 2, "gpu_type": "cpu", "stream_logs": False}


def _wait_for_file(path: Path, timeout: float = 90) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _returns_at_once() -> int:
    return 5


def _call_with_server(uri: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[str]]:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = distributed(_returns_at_once, timeout=60, **CPU).distributed()  # 250 s of retries before
    return values, [str(w.message) for w in caught if "MLflow" in str(w.message)]


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.tracking import bounds

    monkeypatch.setattr(bounds, "_verdicts", {})


def test_a_call_with_a_server_that_refuses_returns_its_result_untracked(monkeypatch):
    uri = f"http://127.0.0.1:{closed_port()}"
    values, said = _call_with_server(uri, monkeypatch)
    assert values == [5, 5]
    assert len(said) == 1, said
    assert f"the tracking server {uri} refuses connections" in said[0] and "goes on untracked" in said[0]


def test_a_call_with_a_server_that_never_answers_returns_its_result_untracked(monkeypatch):
    with silent_server() as port:
        values, said = _call_with_server(f"http://127.0.0.1:{port}", monkeypatch)
    assert values == [5, 5]
    assert len(said) == 1 and "did not answer within 3 s" in said[0], said


def test_a_server_that_answers_health_but_stalls_is_given_up_after_the_tracking_wait(monkeypatch):
    monkeypatch.setenv("GPUFLEET_TRACKING_WAIT_S", "2")
    with stalling_server() as port:
        values, said = _call_with_server(f"http://127.0.0.1:{port}", monkeypatch)
    assert values == [5, 5]
    assert len(said) == 1 and "did not answer within 2 s (open a run)" in said[0], said


def test_a_workload_runs_and_is_canceled_with_a_server_that_refuses(tmp_path: Path, store: RunStore, capsys, monkeypatch):
    # the never-answering server goes through the same probe (the call tests above)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    quick = write_workload(tmp_path, command="echo done")
    rc, out, err = cli(capsys, "run", "-f", str(quick), "--watch")
    assert rc == 0 and "done" in out, out + err  # was: not started after 8 minutes (MLflow's retries)
    assert [r.state for r in store.list(states=None, limit=None)] == ["SUCCESS"]

    slow = write_workload(tmp_path, name="slow.yaml", command='touch "$GPUFLEET_RUN_DIR/started"; sleep 60')
    rc, out, err = cli(capsys, "run", "-f", str(slow))
    assert rc == 0, out + err
    run_id = out.strip().splitlines()[-1]
    _wait_for_file(Path(store.get(run_id).run_dir) / "started")
    rc, out, err = cli(capsys, "cancel", run_id)  # was: 52 s
    assert rc == 0 and out.split() == [run_id, "CANCELED"], out + err
    assert wait_state(store, run_id).state == "CANCELED"
    assert wait_no_processes(run_id) == []
