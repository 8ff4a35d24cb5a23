"""The public surface: names, import cost, GPU discovery rules, CLI commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpufleet
from gpufleet.errors import GPUUnavailableError
from gpufleet.launch import gpus as gpus_mod
from gpufleet.launch.gpus import GPUInfo, gpu_type_matches, resolve_local


def test_public_api_is_pinned():
    assert sorted(gpufleet.__all__) == sorted(
        [
            "distributed", "ray_launch", "runtime", "errors", "DistributedFunction", "RunHandle",
            "StoredRunHandle", "run_handle",
            "GpufleetError", "LaunchConfigError", "GPUUnavailableError", "PayloadPicklingError",
            "WorkerGroupError", "WorkerSignalError", "WorkerExitError", "DistributedTimeoutError",
            "RunCanceledError", "SchedulingTimeoutError", "DistributedHangError", "__version__",
            "prepare", "plan", "advise", "PreparedModel", "DDPConfig", "FSDP2Config", "DeepSpeedConfig",
            "StrategyConfigError", "CheckpointManager", "CheckpointError", "export_checkpoint",
            "FileDataset", "TimedDataLoader", "start_tracked_run", "shutdown_workers",
        ]
    )
    for name in gpufleet.__all__:
        assert getattr(gpufleet, name) is not None


def test_import_gpufleet_imports_no_heavy_dependency():
    code = (
        "import sys, json, gpufleet, gpufleet.api, gpufleet.runtime\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch','ray','deepspeed','mlflow','transformers','lightning','pydantic','rich','numpy'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


H100 = GPUInfo(0, "NVIDIA H100 80GB HBM3", "GPU-aaa", 80 << 30)


@pytest.mark.parametrize(
    "short,name,ok",
    [
        ("H100", "NVIDIA H100 80GB HBM3", True),
        ("h100", "NVIDIA H100 80GB HBM3", True),
        ("A100", "NVIDIA A100-SXM4-80GB", True),
        ("A10", "NVIDIA A100-SXM4-80GB", False),
        ("A10", "NVIDIA A10G", True),
        ("H200", "NVIDIA H100 80GB HBM3", False),
        ("B200", "NVIDIA B200", True),
    ],
)
def test_gpu_type_matching(short, name, ok):
    assert gpu_type_matches(short, name) is ok


def test_gpu_count_and_type_are_checked_against_the_machine(monkeypatch):
    monkeypatch.setattr(gpus_mod, "list_gpus", lambda: [H100, GPUInfo(1, H100.name, "GPU-bbb", H100.memory_bytes)])
    p = resolve_local(None, "h100")
    assert p.num_workers == 2 and p.use_gpus and p.gpu_indices == (0, 1)
    with pytest.raises(GPUUnavailableError, match=r"gpus=8 was asked for, but this machine has 2 visible GPU"):
        resolve_local(8, None)
    with pytest.raises(GPUUnavailableError, match=r"gpu_type='A100' was asked for, but this machine has NVIDIA H100"):
        resolve_local(1, "A100")
    cpu = resolve_local(3, "CPU")
    assert cpu.num_workers == 3 and not cpu.use_gpus


def test_cuda_visible_devices_is_respected(monkeypatch):
    monkeypatch.setattr(gpus_mod, "_query_nvml", lambda: [H100, GPUInfo(1, H100.name, "GPU-bbb", 1)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.index for g in gpus_mod.list_gpus()] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,1")
    assert [g.index for g in gpus_mod.list_gpus()] == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_mod.list_gpus() == []


def test_cli_surface_is_pinned():
    from gpufleet.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"run", "get", "list", "logs", "wait", "cancel", "validate", "schema", "advise", "doctor", "stacks", "ps"}


def test_every_gpufleet_exception_is_a_gpufleet_error():
    """Catching GpufleetError catches whatever gpufleet raises (RemoteTraceback is only a cause's carrier)."""
    import importlib
    import inspect
    import pkgutil

    classes = {}
    for info in pkgutil.walk_packages(gpufleet.__path__, "gpufleet."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("gpufleet."):
                classes[f"{obj.__module__}.{obj.__qualname__}"] = obj
    assert len(classes) > 15
    outside = sorted(n for n, c in classes.items() if not issubclass(c, gpufleet.GpufleetError))
    assert outside == ["gpufleet.errors.RemoteTraceback"]
