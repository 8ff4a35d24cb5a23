"""The pinned stager of asynchronous saves outlives each save, whatever torch's async_save does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gpufleet.checkpoint import CheckpointManager


def test_stager_survives_an_async_save_that_closes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    real_async_save = dcp.async_save
    real_stage = StateDictStager.stage
    closed = []
    staged: list[dict] = []

    def closing_stage(self, state_dict, **kwargs):  # torch 2.11's DefaultStager closes it after each copy
        out = real_stage(self, state_dict, **kwargs)
        staged.append(out)
        self.close()
        return out

    def closing_async_save(*args, **kwargs):  # torch 2.11 closes the caller's stager after a save
        response = real_async_save(*args, **kwargs)
        kwargs["async_stager"].close()
        closed.append(True)
        return response

    monkeypatch.setattr(dcp, "async_save", closing_async_save)
    monkeypatch.setattr(StateDictStager, "stage", closing_stage)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="pin"):  # no CUDA here: DCP stages without pinning
        manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer, async_save=True,
                                    pinned_staging=True, keep_last=None)
    stager = manager._stager
    saved = {}
    for step in (1, 2, 3):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step)  # a closed stager would fail here with KeyError: <class 'type'>
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    manager.wait()
    assert len(closed) == 3 and manager._stager is stager  # one stager, reused for every save
    # the host copies of the weights are the same buffers at every save (nothing re-allocated
    # or re-pinned), refreshed with the new values
    pointers = {s["model"]["weight"].untyped_storage().data_ptr() for s in staged}
    assert len(staged) == 3 and len(pointers) == 1
    assert [c.step for c in manager.checkpoints()] == [1, 2, 3]

    fresh = torch.nn.Linear(3, 2)
    loader = CheckpointManager(tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert loader.resume() == 3
    assert all(torch.equal(fresh.state_dict()[k], saved[3][k]) for k in saved[3])
    manager.close()
    assert manager._stager is None
