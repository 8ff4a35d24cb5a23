"""An FSDP2 shard copy's host format (checkpoint/shard_copy.py): every tensor in its dtype's flat
buffer, the structure around them kept, read back equal whatever the tensors' layout."""

from __future__ import annotations

import torch

from gpufleet.checkpoint.shard_copy import _pack


def test_a_copy_holds_every_tensor_in_one_buffer_per_dtype_and_reads_back_equal() -> None:
    weight = torch.randn(3, 5)
    state = {
        "model": {"w": weight.t(), "b": torch.randn(5), "empty": torch.zeros(0, 4)},  # a transposed view
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "count": torch.arange(4)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "stateful": {"mask": torch.tensor([True, False]), "name": "x", "pairs": (1, torch.ones(2))},
    }  # fmt: skip
    copy = _pack(state)
    assert sorted(map(str, copy.flat)) == ["torch.bool", "torch.float32", "torch.int64"]
    assert copy.flat[torch.float32].numel() == 15 + 5 + 0 + 1 + 2
    back = copy.state()
    assert back["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}] and back["stateful"]["name"] == "x"
    for got, want in [(back["model"]["w"], weight.t()), (back["model"]["b"], state["model"]["b"]),
                      (back["model"]["empty"], torch.zeros(0, 4)), (back["optimizer"]["state"][0]["step"], torch.tensor(7.0)),
                      (back["optimizer"]["state"][0]["count"], torch.arange(4)),
                      (back["stateful"]["mask"], torch.tensor([True, False])), (back["stateful"]["pairs"][1], torch.ones(2))]:  # fmt: skip
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    weight.add_(1.0)  # training goes on: the copy keeps the step it was taken at
    assert not torch.equal(copy.state()["model"]["w"], weight.t())
    assert isinstance(copy.state()["stateful"]["pairs"], tuple)
