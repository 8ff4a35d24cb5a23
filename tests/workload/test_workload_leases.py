"""GPU workloads on this machine lease their GPUs like calls: side by side on different GPUs, or waiting."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, wait_state, wait_until, write_workload


def test_gpu_workloads_share_the_fake_gpus_and_the_third_waits(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    go = tmp_path / "go"  # a run holds its GPU until the test says so, not for a time start-ups could outlast
    hold = f'echo "gpus=$CUDA_VISIBLE_DEVICES"; while [ ! -e {go} ]; do sleep 0.1; done'
    wl = write_workload(tmp_path, compute={"accelerator_type": "GPU_1xFake", "num_accelerators": 1}, command=hold)
    ids = []
    try:
        for _ in range(3):
            code, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
            assert code == 0, out + err
            ids.append(out.strip())
        # two runs hold the two GPUs; whichever supervisor came last says it waits
        logs_of = [Path(store.get(run_id).run_dir) / "supervisor.log" for run_id in ids]
        wait_until("a supervisor waits for a GPU",
                   lambda: any(p.exists() and "waits for 1 GPU (2 of 2 busy)" in p.read_text() for p in logs_of),
                   detail=lambda: [p.read_text() for p in logs_of if p.exists()])  # fmt: skip
    finally:
        go.touch()
    runs = [wait_state(store, run_id, timeout=60) for run_id in ids]
    assert [r.state for r in runs] == ["SUCCESS"] * 3, [r.message for r in runs]
    seen = [(Path(r.attempts[-1].log_dir) / "node-0.log").read_text().splitlines()[0] for r in runs]
    assert sorted(seen) in (["gpus=0", "gpus=0", "gpus=1"], ["gpus=0", "gpus=1", "gpus=1"]), seen
    assert all(r.attempts[-1].nodes[0]["gpus"] == [int(s[-1])] for r, s in zip(runs, seen, strict=True))
    logs = [(Path(r.run_dir) / "supervisor.log").read_text() for r in runs]
    waited = [log for log in logs if "waits for 1 GPU (2 of 2 busy)" in log]
    assert len(waited) >= 1, logs
    assert any(f"run {other}" in waited[0] for other in ids), waited[0]
