"""What the live view reads from a run folder, and how it shows it (no processes: files written by hand)."""

from __future__ import annotations

import json
import re
import time

from gpufleet.errors import EXCEPTION, STOPPED, RankFailure
from gpufleet.launch.group import GroupStatus
from gpufleet.live.html import render
from gpufleet.live.snapshot import RunWatcher
from gpufleet.live.text import status_line, summary_line


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _progress(folder, rank, step, when, **extra):
    (folder / f"progress-{rank}.json").write_text(json.dumps({"time": when, "step": step, **extra}))


def test_steps_rate_eta_metrics_and_last_lines(tmp_path):
    clock = Clock()
    watcher = RunWatcher("run-1", tmp_path, 3, clock=clock)
    (tmp_path / "rank-0.log").write_text("loading\n\x1b[32mepoch 1 loss 0.5\x1b[0m\n\n")
    (tmp_path / "metrics-0.jsonl").write_text(
        json.dumps({"step": 1, "time": 0, "metrics": {"loss": 2.0, "lr": 0.1}}) + "\n"
        + "not json\n" + json.dumps({"step": "x", "metrics": {}}) + "\n"
        + json.dumps({"step": 2, "time": 0, "metrics": {"loss": 1.5, "acc": "high"}}) + "\n"
        + '{"step": 3, "metr'  # a line being written: read next time
    )  # fmt: skip
    t0 = clock.now
    _progress(tmp_path, 0, 10, t0, total=110, seq=4, collectives=[{"op": "allreduce"}])  # fields of other writers
    _progress(tmp_path, 1, 12, t0, total=110)
    (tmp_path / "progress-2.json").write_text("[1, 2]")  # not a record: rank 2 is still starting
    first = watcher.read(GroupStatus(3))
    assert [r.state for r in first.ranks] == ["running", "running", "starting"]
    assert first.ranks[0].last_line == "epoch 1 loss 0.5"  # colours and blank lines left out
    assert first.metrics["loss"] == ((1, 2.0), (2, 1.5)) and "acc" not in first.metrics

    clock.now += 2.0
    _progress(tmp_path, 0, 30, t0 + 2.0, total=110)
    _progress(tmp_path, 1, 32, t0 + 2.0, total=110)
    with open(tmp_path / "metrics-0.jsonl", "a") as f:
        f.write('ics": {"loss": 1.0}}\n')
    snap = watcher.read(GroupStatus(3, results={1: {"status": "ok"}}))
    assert snap.ranks[0].rate == 10.0 and snap.ranks[0].total == 110
    assert [r.state for r in snap.ranks] == ["running", "done", "starting"]
    assert snap.metrics["loss"][-1] == (3, 1.0)
    assert snap.step == 30 and snap.eta_s == 8.0  # (110 - 30) / 10 steps/s
    line = status_line(snap)
    assert "3 ranks: 1 starting, 1 running, 1 done" in line and "step 30/110" in line and "ETA 8.0 s" in line
    assert "loss 1" in line and line.endswith("run run-1")

    html = render(snap)
    assert len(re.findall(r'<tr data-rank="\d" data-state="\w+"', html)) == 3
    assert 'data-points="3"' in html and "data-gpufleet-summary" not in html


def test_a_failed_rank_and_the_summary(tmp_path):
    watcher = RunWatcher("run-2", tmp_path, 2)
    _progress(tmp_path, 0, 5, time.time())
    _progress(tmp_path, 1, 3, time.time())
    failures = {
        1: RankFailure(rank=1, kind=EXCEPTION, time=1.0, exc_type="ValueError", message="bad batch <3>\nmore"),
        0: RankFailure(rank=0, kind=STOPPED, time=2.0, message="stopped by gpufleet after rank 1 failed"),
    }
    error = ValueError("bad batch <3>")
    error.gpufleet_error = type("E", (), {"failures": failures})()  # as failures.py attaches it
    snap = watcher.read(GroupStatus(2), state="FAILED", error=error, mlflow_run_id="abc",
                        mlflow_link="http://127.0.0.1:5000/#/runs/abc")  # fmt: skip
    assert [r.state for r in snap.ranks] == ["stopped", "failed"]
    assert snap.ranks[1].error == "ValueError: bad batch <3>"
    html = render(snap)
    assert 'data-rank="1" data-state="failed"' in html and 'data-state="FAILED"' in html
    assert "ValueError: bad batch &lt;3&gt;" in html and "<3>" not in html  # escaped
    assert "data-gpufleet-summary" in html and "MLflow run <code>abc</code>" in html
    assert "failed: rank 1" in summary_line(snap) and "MLflow run abc" in summary_line(snap)


def test_files_of_an_earlier_attempt_and_oversized_files_are_ignored(tmp_path):
    _progress(tmp_path, 0, 99, time.time() - 3600)  # left by an attempt an hour ago
    (tmp_path / "progress-1.json").write_text(json.dumps({"time": time.time(), "step": 1, "pad": "x" * 100_000}))
    snap = RunWatcher("run-3", tmp_path, 2).read(None)
    assert [r.state for r in snap.ranks] == ["starting", "starting"] and snap.step == 0
    assert "no metrics yet" in render(snap)


def test_gpu_rows_from_nvml(tmp_path, monkeypatch):
    import sys
    import types

    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87 if h == "h3" else 12),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=40 << 30, total=141 << 30),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    watcher = RunWatcher("run-4", tmp_path, 2, gpu_indices=(2, 3))  # the run's physical GPUs
    snap = watcher.read(None)
    watcher.close()
    assert [(g.index, g.name, g.util_percent) for g in snap.gpus] == [(2, "NVIDIA H200", 12.0), (3, "NVIDIA H200", 87.0)]
    assert "GPU2 12%" in status_line(snap) and "GPU3 87%" in status_line(snap)
    html = render(snap)
    assert 'data-gpu="3"' in html and "40.0 GiB / 141.0 GiB" in html
    assert calls == ["init", "shutdown"]
