"""Notebook recipes that run in the separate ``vision`` environment (torch 2.14.1 + torchvision, Unsloth).

Each notebook runs in smoke mode (2 CPU workers) in a kernel of that environment's interpreter;
the tests are skipped when the environment is not built, and fail instead when
``GPUFLEET_RECIPE_ENVS`` promises it.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.recipes.nb import RECIPES, env_python, require_env, run_notebook

pytestmark = pytest.mark.slow
needs_vision = pytest.mark.recipe_env("vision")

RETINANET = "pytorch-ddp-retinanet/pytorch_ddp_retinanet.ipynb"
UNSLOTH = "unsloth-lora-sft-ddp/unsloth_lora_sft_ddp.ipynb"


def _same_on_every_rank(results: list[dict], key: str) -> object:
    values = {json.dumps(r[key]) for r in results}
    assert len(values) == 1, f"{key} differs between ranks: {values}"
    return results[0][key]


def _failing_notebook(notebook: str, tmp_path: Path, python: Path, env: dict[str, str]) -> str:
    with pytest.raises(AssertionError) as failed:
        run_notebook(notebook, tmp_path, env=env, python=python, timeout=240)
    return str(failed.value)


@needs_vision
def test_retinanet_trains_with_ddp_on_a_coco_folder(tmp_path: Path) -> None:
    python = require_env("vision")
    results = run_notebook(RETINANET, tmp_path, python=python, timeout=240)
    assert [r["rank"] for r in results] == [0, 1] and results[0]["world_size"] == 2
    assert all(r["wrapper"] == "DistributedDataParallel" and r["steps"] == 2 for r in results)
    # the kernel and its workers ran the vision environment's interpreter, not the caller's
    assert {r["python"] for r in results} == {str(env_python("vision"))}
    losses = _same_on_every_rank(results, "losses")  # all-reduced mean loss per step
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    # DDP kept the replicas identical, and the DistributedSampler split the 8 images between ranks
    _same_on_every_rank(results, "param_checksum")
    seen = [set(r["images_seen"]) for r in results]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(1, 9))
    assert results[0]["num_classes"] == 3  # 2 COCO categories + background
    out = tmp_path / "out"
    assert (out / "retinanet.pt").stat().st_size > 10_000_000  # the whole ResNet-50 FPN detector
    inference = json.loads((out / "inference.json").read_text())
    assert inference["image"] == "000001.jpg" and inference["boxes"][1:] == [4]


@needs_vision
def test_retinanet_starts_from_a_local_backbone_file(tmp_path: Path) -> None:
    python = require_env("vision")
    backbone = tmp_path / "resnet50.pth"
    counts = subprocess.run([str(python), "-c", "import sys, torch, torchvision\n"
                             "from torchvision.models.detection import retinanet_resnet50_fpn_v2\n"
                             "r = torchvision.models.resnet50(); torch.save(r.state_dict(), sys.argv[1])\n"
                             "bn = sum(p.numel() for m in r.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters())\n"
                             "full = sum(p.numel() for p in retinanet_resnet50_fpn_v2(num_classes=3).parameters())\n"
                             "print(full, bn)", str(backbone)], check=True, capture_output=True, text=True)
    full, batchnorm = map(int, counts.stdout.split())
    results = run_notebook(RETINANET, tmp_path, python=python, timeout=240,
                           env={"WEIGHTS_BACKBONE": str(backbone), "MAX_STEPS": "1"})
    assert all(r["steps"] == 1 for r in results)
    # the backbone file loaded, and its batch-norm layers stay frozen: all else trains
    assert results[0]["trainable_parameters"] == full - batchnorm


@needs_vision
def test_retinanet_refuses_a_weights_file_of_another_model(tmp_path: Path) -> None:
    python = require_env("vision")
    wrong = tmp_path / "mobilenet.pth"
    subprocess.run([str(python), "-c", "import sys, torch, torchvision; "
                    "torch.save(torchvision.models.mobilenet_v3_small().state_dict(), sys.argv[1])", str(wrong)], check=True)
    message = _failing_notebook(RETINANET, tmp_path, python, {"WEIGHTS_BACKBONE": str(wrong), "MAX_STEPS": "1"})
    assert "does not fit" in message and "mobilenet.pth" in message


@needs_vision
def test_unsloth_lora_sft_trains_with_ddp_and_saves_an_adapter(tmp_path: Path) -> None:
    python = require_env("vision")
    results = run_notebook(UNSLOTH, tmp_path, python=python, timeout=240)
    assert [r["rank"] for r in results] == [0, 1] and results[0]["world_size"] == 2
    assert all(r["wrapper"] == "DistributedDataParallel" and r["steps"] == 3 for r in results)
    assert results[0]["unsloth"] == "2026.10.9"
    assert all(r["tokens_per_second"] > 0 and r["samples_per_second"] > 0 for r in results)
    losses = _same_on_every_rank(results, "losses")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").exists()
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tmp_path / "assets" / "model")
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@needs_vision
def test_unsloth_reports_a_missing_model_folder(tmp_path: Path) -> None:
    python = require_env("vision")
    missing = tmp_path / "no-such-model"
    # SMOKE=0 keeps MODEL as given; CPU workers and a small local dataset keep it quick
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    message = _failing_notebook(UNSLOTH, tmp_path, python, {
        "SMOKE": "0", "GPUS": "2", "GPU_TYPE": "cpu", "MODEL": str(missing), "DATA": str(data),
        "OUTPUT_DIR": str(tmp_path / "out"), "MAX_STEPS": "1"})
    # the rank's exception (the model loader's, naming the path) reaches the notebook
    assert any("no-such-model" in line and "Error" in line for line in message.splitlines())


def test_vision_requirements_pin_what_these_recipes_import() -> None:
    pins = {line.split("==")[0].split("[")[0] for line in (RECIPES / "envs" / "vision.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert {"torch", "torchvision", "pycocotools", "unsloth", "trl", "transformers", "ipykernel", "nbclient"} <= pins
