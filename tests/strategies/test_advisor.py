"""Advisor: known answers from the memory formulas, model inputs, and the ``advise`` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpufleet.cli import main
from gpufleet.strategies import StrategyConfigError, advise
from gpufleet.strategies.advisor import GIB, optimizer_state_bytes, parse_count, parse_memory

P7B = 7_000_000_000


def test_adam_state_of_a_7b_model_in_fp32_and_bf16_mixed_precision():
    # fp32: two fp32 moments = 8 bytes/param = 56e9 bytes, all of it on each GPU under DDP
    fp32 = advise(model_params="7B", gpus=1, gpu_memory="1000GB", precision="no")
    assert fp32.estimates["ddp"].optimizer_gib == pytest.approx(8 * P7B / GIB, rel=1e-3)
    # bf16 mixed precision under ZeRO: fp32 master weights + two moments = 12 bytes/param
    bf16 = advise(model_params="7B", gpus=1, gpu_memory="1000GB", precision="bf16")
    assert bf16.estimates["zero1"].optimizer_gib == pytest.approx(12 * P7B / GIB + 4 * P7B / GIB, rel=1e-3)
    # ... and the classic ZeRO paper's 16 bytes/param of model states (2 + 2 + 12) before buffers
    z = bf16.estimates["zero1"]
    assert z.params_gib + z.grads_gib == pytest.approx(4 * P7B / GIB, rel=1e-3)
    assert optimizer_state_bytes("adamw") == 8 and optimizer_state_bytes("sgd") == 4


def test_7b_on_8x80gb_is_not_advised_ddp():
    advice = advise(model_params="7B", gpus=8, gpu_memory="80GB", seq_len=4096, micro_batch=1)
    assert not advice.estimates["ddp"].fits
    assert advice.recommendation == "fsdp2"
    assert "DDP needs" in advice.reason


def test_sharding_divides_model_states_by_the_gpu_count():
    one = advise(model_params="7B", gpus=1, gpu_memory="1000GB")
    eight = advise(model_params="7B", gpus=8, gpu_memory="1000GB")
    for name in ("params_gib", "grads_gib", "optimizer_gib"):
        assert getattr(eight.estimates["fsdp2"], name) == pytest.approx(getattr(one.estimates["fsdp2"], name) / 8, rel=1e-3)
    assert eight.estimates["zero3"].total_gib < eight.estimates["zero2"].total_gib < eight.estimates["zero1"].total_gib
    assert eight.estimates["zero3_offload"].cpu_gib > 0 and eight.estimates["zero3_offload"].params_gib == 0


def test_small_model_is_advised_ddp_and_huge_model_offload_or_nothing():
    assert advise(model_params="350M", gpus=2, gpu_memory="80GB", seq_len=1024, micro_batch=8).recommendation == "ddp"
    big = advise(model_params="70B", gpus=2, gpu_memory="80GB", seq_len=1024)
    assert big.recommendation == "zero3_offload"
    nothing = advise(model_params="405B", gpus=1, gpu_memory="24GB", seq_len=8192, micro_batch=8)
    assert nothing.recommendation == "none" and "nothing fits" in nothing.reason


def test_activation_checkpointing_is_tried_when_activations_do_not_fit():
    advice = advise(model_params="7B", gpus=8, gpu_memory="40GB", seq_len=8192, micro_batch=2, num_layers=32, hidden_size=4096)
    assert advice.activation_checkpointing is True
    assert advice.recommendation == "fsdp2"
    fixed = advise(model_params="7B", gpus=8, gpu_memory="40GB", seq_len=8192, micro_batch=2, num_layers=32, hidden_size=4096, activation_checkpointing=False)
    assert fixed.activation_checkpointing is False and fixed.recommendation != "fsdp2"


def test_activations_grow_with_sequence_and_batch():
    a = advise(model_params="1.3B", gpus=2, seq_len=1024, micro_batch=1).estimates["ddp"].activations_gib
    b = advise(model_params="1.3B", gpus=2, seq_len=2048, micro_batch=2).estimates["ddp"].activations_gib
    assert b == pytest.approx(4 * a, rel=1e-6)
    assert advise(model_params="1.3B").estimates["ddp"].activations_gib == 0


def test_a_plain_pytorch_language_model_gives_its_vocabulary_and_compile_drops_the_fp32_logits():
    import torch

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class TinyGPT(torch.nn.Module):  # no ``config`` attribute: the shape comes from the modules
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(5000, 64), torch.nn.Embedding(1024, 64)
            self.blocks = torch.nn.ModuleList(Block(64) for _ in range(3))
            self.head = torch.nn.Linear(64, 5000, bias=False)

    eager = advise(TinyGPT(), gpus=2, seq_len=1024, micro_batch=8)
    assert (eager.model.num_layers, eager.model.hidden_size, eager.model.vocab_size) == (3, 64, 5000)
    assert "vocab_size" not in eager.model.guessed
    compiled = advise(TinyGPT(), gpus=2, seq_len=1024, micro_batch=8, compiled=True)
    saved = (eager.estimates["ddp"].activations_gib - compiled.estimates["ddp"].activations_gib) * GIB
    assert saved == pytest.approx(6 * 1024 * 8 * 5000, rel=1e-2)  # 10 -> 4 bytes per logit (GiB rounded to 3 places)


def test_an_nn_module_and_a_hugging_face_config_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg)
    expected = sum(p.numel() for p in model.parameters())
    from_module = advise(model, gpus=2, seq_len=128)
    assert from_module.model.num_params == expected
    assert (from_module.model.num_layers, from_module.model.hidden_size, from_module.model.vocab_size) == (3, 64, 1000)
    assert from_module.model.guessed == ()
    cfg.save_pretrained(tmp_path)
    from_dir = advise(str(tmp_path), gpus=2, seq_len=128)
    assert from_dir.model.num_params == expected
    from_json = advise(str(tmp_path / "config.json"), gpus=2, seq_len=128)
    assert from_json.model.block_params == from_module.model.block_params


@pytest.mark.parametrize(
    ("text", "value"), [("7B", 7e9), ("350M", 350e6), ("1.5b", 1.5e9), ("7e9", 7e9), (1000, 1000)]
)
def test_parse_count(text, value):
    assert parse_count(text) == int(value)


def test_parse_memory():
    assert parse_memory("80GB") == 80 * GIB
    assert parse_memory("141GiB") == 141 * GIB
    assert parse_memory("24576MB") == 24 * GIB


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(model_params="seven billion"), "cannot read a parameter count"),
        (dict(model_params="7B", gpu_memory="lots"), "cannot read a memory size"),
        (dict(model_params="7B", optimizer="adagrad9"), "unknown optimizer"),
        (dict(model_params="7B", gpus=0), "gpus must be a positive integer"),
        (dict(), "say which model"),
        (dict(model="/no/such/model"), "neither a folder nor a file"),
    ],
)
def test_bad_inputs_say_what_is_wrong(kwargs, message):
    with pytest.raises(StrategyConfigError, match=message):
        advise(**kwargs)


def test_cli_json_has_a_top_level_recommendation(capsys):
    rc = main(["advise", "--model-params", "7B", "--gpus", "8", "--gpu-memory", "80GB", "--seq-len", "4096", "-o", "json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"] == "fsdp2"
    assert set(data["estimates"]) == {"ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload"}
    assert data["inputs"]["gpus"] == 8 and data["estimates"]["ddp"]["fits"] is False


def test_cli_table_in_a_terminal():
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", "advise", "--model-params", "7B", "--gpus", "8", "--gpu-memory", "80GB"],
        capture_output=True, text=True, check=True,
    ).stdout
    for label in ("DDP", "FSDP2", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3+offload", "recommendation: fsdp2"):
        assert label in out
    # the unit the size was read in is printed: GB means GiB, as on GPU labels
    assert "--gpu-memory 80GB read as 80 GiB" in " ".join(out.split())


def test_cli_bad_input_exits_2_with_the_reason(capsys):
    assert main(["advise", "--model-params", "7B", "--gpu-memory", "eighty"]) == 2
    assert "cannot read a memory size" in capsys.readouterr().err


def test_cli_needs_a_model(capsys):
    with pytest.raises(SystemExit) as info:
        main(["advise", "--gpus", "8"])
    assert info.value.code == 2
