"""Each rank's share of the replicated state: disjoint, complete, balanced, the same on every rank."""

from __future__ import annotations

import torch

from gpufleet.checkpoint.replicas import share_of_replicas


def _state() -> dict:
    model = {f"layer{i}.weight": torch.zeros(10 * (i + 1)) for i in range(6)}
    optimizer = {
        "state": {name: {"exp_avg": torch.zeros_like(t), "step": torch.tensor(3.0)} for name, t in model.items()},
        "param_groups": [{"lr": 0.1, "params": list(model)}],
    }
    return {"model": model, "optimizer": optimizer, "scheduler": object(), "stateful.sampler": {"epoch": 2}}


def _tensor_paths(tree: dict, prefix: tuple = ()) -> set[tuple]:
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _tensor_paths(value, (*prefix, key))
        elif isinstance(value, torch.Tensor):
            out.add((*prefix, key))
    return out


def test_every_replicated_tensor_goes_to_exactly_one_rank_and_the_rest_stays() -> None:
    state = _state()
    everything = _tensor_paths({k: state[k] for k in ("model", "optimizer")})
    for world in (2, 3):
        shares = [share_of_replicas(state, ("model", "optimizer"), rank, world) for rank in range(world)]
        paths = [_tensor_paths({k: s[k] for k in ("model", "optimizer")}) for s, _ in shares]
        assert set().union(*paths) == everything  # nothing lost
        assert sum(len(p) for p in paths) == len(everything)  # nothing written twice
        total = sum(t.numel() * t.element_size() for t in state["model"].values())
        total += sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values())
        sizes = [size for _, size in shares]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 60 * 4  # within the largest tensor (60 floats) of even
        for pruned, _ in shares:
            assert pruned["scheduler"] is state["scheduler"] and pruned["stateful.sampler"] == {"epoch": 2}
            assert pruned["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # non-tensors on every rank
    # one rank keeps everything, untouched
    whole, size = share_of_replicas(state, ("model", "optimizer"), 0, 1)
    assert _tensor_paths(whole) == _tensor_paths(state) and size == sum(sizes)
