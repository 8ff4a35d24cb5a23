"""The FSDP recipes' training arguments, built as on GPUs: activation checkpointing only through FSDP.

Transformers' Trainer refuses ``gradient_checkpointing=True`` together with ``fsdp_config["activation_checkpointing"]``
once Accelerate has built its FSDP plugin, which it does on accelerators only, so a CPU smoke run cannot see
the clash. These tests build the real ``SFTConfig`` objects the recipes use with ``cuda=True`` (bf16, FSDP,
activation checkpointing) and check the arguments the Trainer would check.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.recipes.nb import RECIPES

pytest.importorskip("trl")

LAYERS = ["LlamaDecoderLayer"]


@pytest.fixture
def as_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let TrainingArguments accept bf16 without a GPU, and undo the env var its FSDP setup writes."""
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")


def llama_sft_config() -> Callable[..., Any]:
    """``sft_config`` of recipes/fsdp-llama31-8b-sft/train.py."""
    spec = importlib.util.spec_from_file_location("fsdp_llama31_train", RECIPES / "fsdp-llama31-8b-sft" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sft_config


def moe_sft_config() -> Callable[..., Any]:
    """``sft_config`` defined in the trl-lora-sft-fsdp2-moe notebook (the code cell that defines it, executed)."""
    notebook = json.loads((RECIPES / "trl-lora-sft-fsdp2-moe" / "trl_lora_sft_fsdp2_moe.ipynb").read_text())
    sources = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    cell = next((s for s in sources if "def sft_config(" in s), None)
    assert cell is not None, "the notebook has no code cell defining sft_config(...)"
    namespace: dict[str, Any] = {}
    exec(compile(cell, "trl_lora_sft_fsdp2_moe.ipynb", "exec"), namespace)
    return namespace["sft_config"]


def workload_parameters() -> dict[str, Any]:
    """The llama workload's real ``parameters`` block."""
    return yaml.safe_load((RECIPES / "fsdp-llama31-8b-sft" / "workload.yaml").read_text())["parameters"]


def build(recipe: str, tmp_path: Path, cuda: bool, **overrides: Any) -> Any:
    """The recipe's SFTConfig for ``cuda`` (GPU settings when True)."""
    if recipe == "fsdp-llama31-8b-sft":
        return llama_sft_config()({**workload_parameters(), **overrides}, str(tmp_path / "out"), LAYERS, cuda)
    return moe_sft_config()(str(tmp_path / "out"), 500, LAYERS, cuda, 1, 2048)


def assert_no_clash(args: Any) -> None:
    """Fail when the Trainer would refuse these arguments (both checkpointing switches on under FSDP)."""
    assert args.fsdp, "the recipe is meant to configure FSDP"
    requested = bool(args.fsdp_config.get("activation_checkpointing")) or bool(
        (args.fsdp_plugin_args or {}).get("activation_checkpointing")
    )
    assert not (args.gradient_checkpointing and requested), (
        "gradient_checkpointing and fsdp_config['activation_checkpointing'] are both on: Trainer raises "
        "'can't be set to True simultaneously' when FSDP is applied (on GPUs)"
    )


RECIPE_NAMES = ["fsdp-llama31-8b-sft", "trl-lora-sft-fsdp2-moe"]


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_gpu_arguments_checkpoint_activations_through_fsdp_only(recipe: str, tmp_path: Path, as_on_gpu: None) -> None:
    from trl import SFTConfig

    args = build(recipe, tmp_path, cuda=True)

    assert isinstance(args, SFTConfig)
    assert args.bf16 and not args.use_cpu
    assert_no_clash(args)
    assert args.gradient_checkpointing is False
    assert args.fsdp_config["activation_checkpointing"] is True, "activation checkpointing must stay on for GPUs"
    assert args.fsdp_plugin_args["activation_checkpointing"] is True  # what Accelerate's FSDP plugin receives
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    assert args.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cpu_arguments_have_no_checkpointing_clash_either(recipe: str, tmp_path: Path) -> None:
    args = build(recipe, tmp_path, cuda=False)

    assert args.use_cpu and not args.bf16
    assert_no_clash(args)
    assert args.fsdp_config["activation_checkpointing"] is False


def test_llama_workload_can_turn_activation_checkpointing_off(tmp_path: Path, as_on_gpu: None) -> None:
    args = build("fsdp-llama31-8b-sft", tmp_path, cuda=True, activation_checkpointing=False)

    assert_no_clash(args)
    assert args.fsdp_config["activation_checkpointing"] is False
    assert args.gradient_checkpointing is False
