"""Export of a checkpoint to one folder for inference: safetensors, and the HF layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpufleet.checkpoint import CheckpointManager, export_checkpoint


def test_export_writes_full_weights_as_safetensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    manager = CheckpointManager(tmp_path / "ckpt", model=model, optimizer=torch.optim.AdamW(model.parameters()))
    manager.save(7)
    out = manager.export(tmp_path / "export", dtype=torch.bfloat16)
    weights = load_file(out / "model.safetensors")
    assert weights.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], value.to(torch.bfloat16))


def test_export_of_a_hf_model_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    manager = CheckpointManager(tmp_path / "ckpt", model=model)
    manager.save(3)

    out = manager.export(tmp_path / "hf", model=transformers.LlamaForCausalLM(config))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_export_refuses_a_torn_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt", model=torch.nn.Linear(2, 2))
    path = manager.save(1)
    (path / "COMPLETE.json").unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        export_checkpoint(path, tmp_path / "out")
