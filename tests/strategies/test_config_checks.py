"""Conflict checks run before launch (plain Python), and FSDP2's block detection."""

from __future__ import annotations

import json

import pytest

from gpufleet.strategies import (
    DDPConfig,
    DeepSpeedConfig,
    FSDP2Config,
    StrategyConfigError,
    plan,
)


def test_plan_defaults_and_strategy_from_config_type():
    p = plan(world_size=4)
    assert (p.strategy, p.mixed_precision, p.gradient_accumulation_steps) == ("ddp", "no", 1)
    assert plan(config=FSDP2Config(activation_checkpointing=True)).strategy == "fsdp2"
    assert plan(config=DeepSpeedConfig(zero_stage=3), world_size=2).strategy == "deepspeed"


def test_generated_deepspeed_config():
    p = plan("deepspeed", "bf16", 4, world_size=8, zero_stage=3, offload_optimizer="cpu", offload_param="cpu", micro_batch_size=2)
    ds = p.deepspeed_config
    assert ds["train_batch_size"] == 2 * 4 * 8
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["gradient_clipping"] == 0.0  # DeepSpeed would clip to 1.0 by default; torch does not
    assert ds["zero_force_ds_cpu_optimizer"] is False  # a torch optimizer may step offloaded state


def test_user_json_is_passed_through_and_auto_batch_values_filled(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "contiguous_gradients": True},
    }))
    p = plan("deepspeed", "bf16", 2, world_size=2, config=DeepSpeedConfig(config=str(path), micro_batch_size=3))
    ds = p.deepspeed_config
    assert ds["train_batch_size"] == 12 and ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["contiguous_gradients"] is True  # the user's own keys survive


def test_precision_taken_from_the_user_config_when_not_given():
    p = plan("deepspeed", None, world_size=2, config=DeepSpeedConfig(config={"fp16": {"enabled": True}}))
    assert p.mixed_precision == "fp16"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # micro x accumulation x world != train_batch_size
        (dict(strategy="deepspeed", gradient_accumulation_steps=2, world_size=4,
              config=DeepSpeedConfig(micro_batch_size=2, train_batch_size=32)),
         "set train_batch_size to 16"),
        (dict(strategy="deepspeed", world_size=3, config=DeepSpeedConfig(config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})),
         "not a multiple"),
        # "auto" that only the HF Trainer resolves
        (dict(strategy="deepspeed", world_size=2, has_optimizer=False,
              config=DeepSpeedConfig(config={"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})),
         "optimizer.params.lr"),
        # precision given twice, and they disagree
        (dict(strategy="deepspeed", mixed_precision="fp16", world_size=2, config=DeepSpeedConfig(config={"bf16": {"enabled": True}})),
         "precision is given twice"),
        (dict(strategy="deepspeed", world_size=2, config=DeepSpeedConfig(config={"bf16": {"enabled": True}, "fp16": {"enabled": True}})),
         "both bf16 and fp16"),
        # the same option in the typed config and in the user's dict
        (dict(strategy="deepspeed", world_size=2, config=DeepSpeedConfig(zero_stage=3, config={"zero_optimization": {"stage": 2}})),
         "zero_optimization.stage is given twice"),
        (dict(strategy="deepspeed", gradient_accumulation_steps=4, world_size=2, config=DeepSpeedConfig(config={"gradient_accumulation_steps": 2})),
         "gradient_accumulation_steps is given twice"),
        # offload options the stage cannot do
        (dict(strategy="deepspeed", world_size=2, config=DeepSpeedConfig(zero_stage=2, offload_param="cpu")),
         "needs ZeRO stage 3"),
        (dict(strategy="deepspeed", world_size=2, config=DeepSpeedConfig(zero_stage=0, offload_optimizer="cpu")),
         "needs ZeRO stage 1, 2 or 3"),
        # optimizer twice / none
        (dict(strategy="deepspeed", world_size=2, config=DeepSpeedConfig(optimizer={"type": "AdamW", "params": {"lr": 1e-3}})),
         "optimizer is given twice"),
        (dict(strategy="deepspeed", world_size=2, has_optimizer=False), "no optimizer"),
        # plain wrong values
        (dict(strategy="horovod"), "strategy must be one of ddp, fsdp2, deepspeed"),
        (dict(mixed_precision="int8"), "mixed_precision must be one of bf16, fp16, no"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be a positive integer"),
        (dict(strategy="fsdp2", reshard_after_forward=True, no_such_option=1), "unknown fsdp2 option(s) no_such_option"),
        (dict(strategy="ddp", config=FSDP2Config()), "strategy='ddp' takes a DDPConfig"),
        (dict(strategy="deepspeed", world_size=2, compile=True), "call prepared.model.compile() after prepare()"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_conflicts_are_rejected_with_what_to_change(kwargs, expected):
    with pytest.raises(StrategyConfigError) as info:
        plan(**kwargs)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: DeepSpeedConfig(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (lambda: DeepSpeedConfig(offload_param="gpu"), "'cpu', 'nvme' or None"),
        (lambda: DeepSpeedConfig(micro_batch_size=0), "micro_batch_size must be a positive integer"),
        (lambda: FSDP2Config(reshard_after_forward=1), "reshard_after_forward must be True, False or an int > 1"),
        (lambda: FSDP2Config(reduce_dtype="fp8"), "reduce_dtype"),
        (lambda: DDPConfig(static_graph=True, find_unused_parameters=True), "Set only static_graph=True"),
        (lambda: DDPConfig(bucket_cap_mb=-1), "bucket_cap_mb"),
        (lambda: DDPConfig(comm_hook="int8"), "comm_hook must be 'bf16', 'fp16' or None"),
        (lambda: DDPConfig(compile="max-autotune"), "{'mode': 'max-autotune'}"),
        (lambda: FSDP2Config(compile={1: "x"}), "FSDP2Config.compile must be True, False or a dict"),
    ],
)
def test_typed_configs_check_their_values(make, expected):
    with pytest.raises(StrategyConfigError, match=None) as info:
        make()
    assert expected in str(info.value)


def test_missing_json_file_is_named(tmp_path):
    with pytest.raises(StrategyConfigError, match="does not exist"):
        plan("deepspeed", world_size=1, config=DeepSpeedConfig(config=str(tmp_path / "nope.json")))


def test_importing_strategies_stays_light():
    import subprocess
    import sys

    code = "import sys, gpufleet.strategies as s; s.plan('deepspeed', world_size=2); s.DDPConfig(); print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- FSDP2 block detection (torch, no process group needed)


def test_blocks_found_in_a_module_list():
    from gpufleet.strategies.fsdp import find_block_classes
    from tests.strategies.models import Block, TinyNet

    assert find_block_classes(TinyNet()) == (Block,)
    assert find_block_classes(TinyNet(), ("Block",)) == (Block,)
    assert find_block_classes(TinyNet(), (Block,)) == (Block,)


def test_blocks_found_from_hugging_face_no_split_modules():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpufleet.strategies.fsdp import find_block_classes

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    classes = find_block_classes(LlamaForCausalLM(cfg))
    assert [c.__name__ for c in classes] == ["LlamaDecoderLayer"]


def test_unknown_block_name_lists_the_model_classes():
    from gpufleet.strategies.fsdp import find_block_classes
    from tests.strategies.models import TinyNet

    with pytest.raises(StrategyConfigError, match=r"'Decoder'.*Block, LayerNorm, Linear"):
        find_block_classes(TinyNet(), ("Decoder",))


def test_model_without_blocks_asks_for_their_name():
    import torch.nn as nn

    from gpufleet.strategies.fsdp import find_block_classes

    with pytest.raises(StrategyConfigError, match="block_classes"):
        find_block_classes(nn.Sequential(nn.Linear(2, 2)))
