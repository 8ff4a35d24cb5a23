"""The notebook recipes that run in the project's own environment, executed in smoke mode (2 CPU workers)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.recipes.nb import run_notebook

pytestmark = pytest.mark.slow


def _same_on_every_rank(results: list[dict], key: str) -> float:
    values = {round(r[key], 6) for r in results}
    assert len(values) == 1, f"{key} differs between ranks: {values}"
    return values.pop()


def test_trl_lora_sft_ddp_trains_and_saves_an_adapter(tmp_path: Path) -> None:
    results = run_notebook("trl-lora-sft-ddp/trl_lora_sft_ddp.ipynb", tmp_path)
    assert [r["rank"] for r in results] == [0, 1] and results[0]["world_size"] == 2
    assert all(r["steps"] == 4 and r["wrapper"] == "DistributedDataParallel" for r in results)
    assert math.isfinite(_same_on_every_rank(results, "train_loss"))
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    # the adapter loads back onto the tiny GPT-OSS the notebook built
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "gpt_oss"


def test_trl_lora_sft_moe_trains_an_adapter(tmp_path: Path) -> None:
    results = run_notebook("trl-lora-sft-fsdp2-moe/trl_lora_sft_fsdp2_moe.ipynb", tmp_path)
    assert len(results) == 2 and all(r["steps"] == 4 for r in results)
    assert math.isfinite(_same_on_every_rank(results, "train_loss"))
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_trl_full_sft_zero3_partitions_and_saves_full_weights(tmp_path: Path) -> None:
    results = run_notebook(
        "trl-full-sft-zero3/trl_full_sft_zero3.ipynb", tmp_path, env={"TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}
    )
    assert all(r["wrapper"] == "DeepSpeedEngine" and r["zero_stage"] == 3 and r["steps"] == 4 for r in results)
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    original = AutoModelForCausalLM.from_pretrained(str(tmp_path / "assets" / "model"))
    # full SFT changed the weights, and they were gathered whole (not empty ZeRO-3 shards)
    w_new, w_old = saved.model.embed_tokens.weight, original.model.embed_tokens.weight
    assert w_new.shape == w_old.shape and not torch.equal(w_new, w_old)


def test_lightning_two_tower_learns_the_ratings(tmp_path: Path) -> None:
    results = run_notebook("lightning-two-tower/lightning_two_tower.ipynb", tmp_path)
    assert [r["world_size"] for r in results] == [2, 2] and results[0]["strategy"] == "DDPStrategy"
    assert results[0]["epochs"] == 4
    # the generated table has a learnable preference: validation accuracy far above chance
    assert _same_on_every_rank(results, "val_accuracy") > 0.75
    assert Path(results[0]["checkpoint"]).exists()


def test_fsdp2_transformer_resumes_from_its_dcp_checkpoint(tmp_path: Path) -> None:
    results = run_notebook("pytorch-fsdp2-transformer/pytorch_fsdp2_transformer.ipynb", tmp_path, env={"MAX_STEPS": "6"})
    first, second = results["first"], results["second"]
    assert all(r["strategy"] == "fsdp2" for r in first + second)
    assert [r["resumed_from"] for r in first] == [0, 0]
    assert [r["resumed_from"] for r in second] == [3, 3]
    assert second[0]["checkpoints"][-1] == "step-6"
    assert second[0]["last_loss"] < first[0]["first_loss"]
    ckpt = tmp_path / "out" / "checkpoints" / "step-6"
    assert ckpt.is_dir() and any(ckpt.rglob("*.distcp"))
