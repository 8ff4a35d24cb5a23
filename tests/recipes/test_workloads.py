"""Every workload.yaml validates and dry-runs; each workload's smoke configuration runs on 2 CPU workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.nb import RECIPES, REPO, env_python, require_env

GPUFLEET = [sys.executable, "-m", "gpufleet.cli"]
WORKLOADS = sorted(p.parent.name for p in RECIPES.glob("*/workload.yaml"))
EXPECTED_WORLD = {
    "ray-train-resnet50": 2,
    "ray-train-qwen25-3b-sft": 8,
    "fsdp-llama31-8b-sft": 16,
    "fsdp2-qwen-27b-packing": 32,
    "trl-zero3-qwen3-8b-invoices": 8,
}


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    run_env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([*GPUFLEET, *args], cwd=cwd, env=run_env, capture_output=True, text=True, timeout=timeout)


def test_every_spec_workload_is_present() -> None:
    assert WORKLOADS == sorted(EXPECTED_WORLD)


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_validates_and_dry_runs_at_its_real_shape(name: str) -> None:
    folder = RECIPES / name
    proc = _cli("validate", "-f", "workload.yaml", "-o", "json", cwd=folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _cli("run", "-f", "workload.yaml", "--dry-run", "-o", "json", cwd=folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f'"world_size": {EXPECTED_WORLD[name]}' in proc.stdout.replace("\n", " ") or str(EXPECTED_WORLD[name]) in proc.stdout
    for path in (folder / "README.md", folder / "train.py"):
        assert path.exists(), f"{name} lacks {path.name}"


def test_a_broken_override_is_reported_with_its_field_path() -> None:
    proc = _cli("validate", "-f", "workload.yaml", "--override", "compute.num_accelerators=3", cwd=RECIPES / "fsdp-llama31-8b-sft")
    assert proc.returncode != 0
    assert "num_accelerators" in (proc.stdout + proc.stderr)


def _assets(tmp: Path, arch: str, data: str) -> dict[str, str]:
    code = (
        f"import sys; sys.path.insert(0, {str(RECIPES)!r})\n"
        "from _smoke import make_tiny_causal_lm, make_chat_jsonl, make_invoice_jsonl\n"
        f"make_tiny_causal_lm({arch!r}, {str(tmp / 'model')!r})\n"
        f"make_{data}({str(tmp / 'data.jsonl')!r}, num_rows=64)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {"model": str(tmp / "model"), "data": str(tmp / "data.jsonl")}


SMOKE = {
    "fsdp-llama31-8b-sft": ("llama", "chat_jsonl", lambda a, o: [
        f"parameters.model={a['model']}", f"parameters.train_file={a['data']}", f"parameters.output_dir={o}",
        "parameters.max_steps=2", "parameters.save_steps=2", "parameters.max_length=128", "parameters.logging_steps=1"]),
    "fsdp2-qwen-27b-packing": ("qwen2", "chat_jsonl", lambda a, o: [
        f"parameters.model={a['model']}", f"parameters.train_file={a['data']}", f"parameters.checkpoint_dir={o}",
        "parameters.max_steps=4", "parameters.seq_len=128", "parameters.micro_batch_size=2", "parameters.checkpoint_every=2"]),
    "trl-zero3-qwen3-8b-invoices": ("qwen3", "invoice_jsonl", lambda a, o: [
        f"parameters.model={a['model']}", f"parameters.raw_invoices={a['data']}", f"parameters.prepared_dir={o}/prepared",
        f"parameters.output_dir={o}", "parameters.max_steps=3", "parameters.max_length=128",
        "parameters.eval_fraction=0.2", "parameters.eval_steps=2"]),
    "ray-train-qwen25-3b-sft": ("qwen2", "chat_jsonl", lambda a, o: [
        f"parameters.model={a['model']}", f"parameters.train_file={a['data']}", f"parameters.output_dir={o}",
        "parameters.max_steps=3", "parameters.max_length=128", "parameters.use_gpu=false"]),
}


def _smoke_run(name: str, overrides: list[str], tmp: Path, python_bin: Path | None = None, timeout: int = 600) -> str:
    env = {"GPUFLEET_HOME": str(tmp / "home"), "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}
    args = ["run", "-f", "workload.yaml", "--watch", "--no-tracking",
            "--override", "compute.accelerator_type=CPU_2", "--override", "compute.num_accelerators=2",
            "--override", "environment.dependencies=[]"]
    if not name.startswith("ray-train"):  # a retry would hide a failed attempt (a rank that aborted at exit)
        args += ["--override", "max_retries=0"]  # (Ray's own start may time out on a busy machine: its retry stays)
    if python_bin is not None:  # the workload's command runs ${PYTHON:-python}
        overrides = [*overrides, f"env_variables.PYTHON={python_bin}"]
    for o in overrides:
        args += ["--override", o]
    proc = _cli(*args, cwd=RECIPES / name, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{name} smoke run failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _result(output: str) -> dict:
    lines = [line.split("RESULT ", 1)[1] for line in output.splitlines() if "RESULT " in line]
    assert lines, f"no RESULT line in:\n{output[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_workload_smoke_runs_on_two_cpu_workers(name: str, tmp_path: Path) -> None:
    arch, data, overrides = SMOKE[name]
    assets = _assets(tmp_path, arch, data)
    result = _result(_smoke_run(name, overrides(assets, str(tmp_path / "out")), tmp_path))
    if name == "ray-train-qwen25-3b-sft":
        # Ray Train's result carries the metrics reported with the last checkpoint (step 3); the
        # end-of-training summary rank 0 left beside the outputs joins them
        assert result["num_workers"] == 2 and result["step"] == 3, result
        assert result["epoch"] > 0
        assert result["steps"] == 3 and result["wrapper"] == "DistributedDataParallel", result
        assert result["tokens_per_second"] > 0 and result["final_train_loss"] > 0
    else:
        assert result["world_size"] == 2
    if name == "fsdp2-qwen-27b-packing":
        assert result["strategy"] == "fsdp2" and result["checkpoints"][-1] == "step-4"
        assert result["packed_rows"] < 64  # several chat examples share each packed row
    if name == "trl-zero3-qwen3-8b-invoices":
        assert result["wrapper"] == "DeepSpeedEngine" and result["zero_stage"] == 3
        assert result["eval_loss"] is not None
        prepared = (tmp_path / "out" / "prepared" / "train.jsonl").read_text().splitlines()
        answer = json.loads(json.loads(prepared[0])["messages"][-1]["content"])
        assert set(answer) == {"invoice_number", "vendor", "customer", "date", "total"}
    if name == "fsdp-llama31-8b-sft":
        assert result["steps"] == 2 and result["resumed_from"] is None
        # a longer run (or a retried attempt) continues from the checkpoint of step 2, on CPU workers
        # too (the Trainer reads its optimizer state to `cpu:0` there), and no rank aborts at exit
        longer = [o.replace("max_steps=2", "max_steps=3") for o in overrides(assets, str(tmp_path / "out"))]
        result = _result(_smoke_run(name, longer, tmp_path))
        assert result["steps"] == 3 and result["resumed_from"] == "checkpoint-2", result
        assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.recipe_env("vision")
def test_ray_train_resnet50_smoke_in_the_vision_environment(tmp_path: Path) -> None:
    python = require_env("vision")
    subprocess.run([str(python), "-c", f"import sys; sys.path.insert(0, {str(RECIPES)!r}); "
                    f"from _smoke import make_image_folder; make_image_folder({str(tmp_path / 'images')!r}, images_per_class=6, size=48)"],
                   check=True)
    out = _smoke_run("ray-train-resnet50", [
        f"parameters.data_dir={tmp_path / 'images'}", "parameters.weights=none", "parameters.image_size=32",
        "parameters.batch_size=4", "parameters.epochs=1", "parameters.use_gpu=false",
        f"parameters.storage_path={tmp_path / 'ray'}"], tmp_path, python_bin=python)
    result = _result(out)
    assert result["num_workers"] == 2 and result["metrics"]["epoch"] == 0
    assert result["checkpoint"] is not None


def test_vision_env_helper_points_into_the_env_root() -> None:
    assert env_python("vision").parts[-3:] == ("vision", "bin", "python")
