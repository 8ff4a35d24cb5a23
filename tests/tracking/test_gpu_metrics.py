"""On a GPU machine: the call's run gets NVML GPU metrics (utilisation, memory, power) per GPU."""

from __future__ import annotations

import os
import uuid

import pytest

from gpufleet import distributed


def _num_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_num_gpus() < 2, reason="needs 2 NVIDIA GPUs"),
]


def busy_gpu(seconds: float) -> float:
    import time

    import torch

    from gpufleet import runtime

    device = runtime.setup()
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(50):
            a = torch.nn.functional.normalize(a @ a, dim=-1)
        torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() / 2**20)


def test_gpu_utilisation_memory_and_power_are_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    exp = f"test-gpu-{uuid.uuid4().hex[:8]}"
    handle = distributed(busy_gpu, gpus=2, experiment_name=exp, stream_logs=False).submit(8.0)
    handle.result(timeout=300)
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(handle.mlflow_run_id)
    for i in (0, 1):
        util = client.get_metric_history(run.info.run_id, f"system/gpu_{i}_utilization_percentage")
        assert len(util) >= 3 and max(m.value for m in util) > 50, util
        memory = client.get_metric_history(run.info.run_id, f"system/gpu_{i}_memory_usage_megabytes")
        assert max(m.value for m in memory) > 100  # the 32 MiB matrices, CUDA context and workspace
        assert run.data.metrics[f"system/gpu_{i}_power_usage_watts"] > 0
    print({k: v for k, v in sorted(run.data.metrics.items()) if k.startswith("system/gpu_")})
