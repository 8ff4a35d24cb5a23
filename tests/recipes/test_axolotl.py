"""The Axolotl QLoRA recipe, in the separate ``axolotl`` environment.

bitsandbytes 4-bit needs CUDA, so on CPU the real QLoRA config is checked by Axolotl's own
loader and the notebook trains plain LoRA of a tiny OLMo-2 on 2 CPU workers; the 4-bit path
runs on GPUs (recipes/run_gpu_smoke.sh).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.recipes.nb import RECIPES, REPO, require_env, run_notebook

pytestmark = pytest.mark.slow
needs_axolotl = pytest.mark.recipe_env("axolotl")

RECIPE = RECIPES / "axolotl-qlora-ddp"
CONFIG = RECIPE / "olmo2_7b_qlora.yml"


def _tiny_olmo2(python: Path, out: Path) -> Path:
    code = f"import sys; sys.path.insert(0, {str(RECIPES)!r}); from _smoke import make_tiny_causal_lm; make_tiny_causal_lm('olmo2', sys.argv[1])"
    subprocess.run([str(python), "-c", code, str(out)], check=True, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


def _validate(python: Path, config: Path, model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), str(RECIPE / "validate_config.py"), str(config), "--base-model", str(model),
         "--output-dir", str(tmp_path / "validate")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")},
    )


@needs_axolotl
def test_the_real_qlora_config_passes_axolotls_loader_and_a_broken_one_does_not(tmp_path: Path) -> None:
    python = require_env("axolotl")
    model = _tiny_olmo2(python, tmp_path / "olmo2")  # stands in for allenai/OLMo-2-1124-7B (no hub here)
    proc = _validate(python, CONFIG, model, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("VALID ", 1)[1].splitlines()[0])
    assert summary["adapter"] == "qlora" and summary["load_in_4bit"] is True
    assert summary["model_config_type"] == "olmo2" and summary["optimizer"] == "paged_adamw_8bit"
    # QLoRA without 4-bit base weights is rejected by Axolotl's schema, with its reason
    broken = tmp_path / "broken.yml"
    broken.write_text(CONFIG.read_text().replace("load_in_4bit: true", "load_in_4bit: false"))
    proc = _validate(python, broken, model, tmp_path)
    assert proc.returncode == 1
    assert "INVALID" in proc.stderr and "Require cfg.load_in_4bit to be True for qlora" in proc.stderr


@needs_axolotl
def test_notebook_trains_lora_with_ddp_on_two_cpu_workers(tmp_path: Path) -> None:
    python = require_env("axolotl")
    results = run_notebook("axolotl-qlora-ddp/axolotl_qlora_ddp.ipynb", tmp_path, python=python, timeout=240)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:  # Axolotl's trainer itself ran data-parallel over both workers
        assert r["world_size"] == r["trainer_world_size"] == 2
        assert r["wrapper"] == "DistributedDataParallel" and r["distributed_type"] == "MULTI_CPU"
        assert r["adapter"] == "lora" and r["load_in_4bit"] is False and r["model_type"] == "olmo2"
        assert r["steps"] == 3 and math.isfinite(r["train_loss"])
    # gradients were all-reduced: both replicas saw the same gradient norms and hold the same adapter
    assert results[0]["grad_norms"] == results[1]["grad_norms"] and len(results[0]["grad_norms"]) == 3
    assert results[0]["trainable_checksum"] == pytest.approx(results[1]["trainable_checksum"], rel=1e-9)
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").exists()
    ran = (out / "config.yml").read_text()
    assert "base_model: " + str(tmp_path / "assets" / "model") in ran and "max_steps: 3" in ran


def test_axolotl_requirements_pin_the_stack() -> None:
    pins = {line.split("==")[0] for line in (RECIPES / "envs" / "axolotl.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert {"torch", "axolotl", "nbclient", "ipykernel"} <= pins
