"""Checkpoint folders in one process: completion, keep-last-K, torn folders, errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gpufleet.checkpoint import (
    CheckpointError,
    CheckpointManager,
    latest_complete,
    list_checkpoints,
)


def _manager(root: Path, **kwargs: object) -> tuple[CheckpointManager, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return CheckpointManager(root, model=model, optimizer=optimizer, **kwargs), model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 3)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _tear(path: Path) -> None:
    """Make a torn copy: the data without the completion marker."""
    (path / "COMPLETE.json").unlink()


def test_keep_last_deletes_only_complete_old_checkpoints(tmp_path: Path) -> None:
    manager, model, optimizer = _manager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _step(model, optimizer)
        manager.save(step)
    shutil.copytree(tmp_path / "step-3", tmp_path / "step-0")
    _tear(tmp_path / "step-0")  # an old torn folder
    for step in (4, 5, 6):
        _step(model, optimizer)
        manager.save(step)
    found = {c.step: c.complete for c in list_checkpoints(tmp_path)}
    assert found == {0: False, 5: True, 6: True}


def test_resume_skips_a_newer_torn_checkpoint_and_restores_weights(tmp_path: Path) -> None:
    manager, model, optimizer = _manager(tmp_path)
    _step(model, optimizer)
    manager.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)
    manager.save(2)
    _tear(tmp_path / "step-2")
    assert latest_complete(tmp_path).step == 1

    fresh, fresh_model, _ = _manager(tmp_path)
    assert fresh.resume() == 1
    for name, value in fresh_model.state_dict().items():
        assert torch.equal(value, saved[name])
    with pytest.raises(CheckpointError, match="torn"):
        fresh.load(2)
    with pytest.raises(CheckpointError, match="does not exist"):
        fresh.load(7)


def test_resume_on_an_empty_folder_starts_fresh(tmp_path: Path) -> None:
    manager, _, _ = _manager(tmp_path / "nothing-yet")
    assert manager.resume() is None


def test_async_save_completes_in_the_background_and_the_next_save_waits(tmp_path: Path) -> None:
    manager, model, optimizer = _manager(tmp_path, async_save=True, keep_last=None)
    for step in (1, 2, 3):
        _step(model, optimizer)
        manager.save(step)
        assert manager.last_save["async"] and manager.last_save["step"] == step
    manager.wait()
    assert [c.step for c in list_checkpoints(tmp_path) if c.complete] == [1, 2, 3]


def test_wrong_arguments_are_refused_with_a_reason(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, model=model, keep_last=0)
    with pytest.raises(ValueError, match="model="):
        CheckpointManager(tmp_path, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="scheduler must have state_dict"):
        CheckpointManager(tmp_path, model=model, scheduler=object())
    manager = CheckpointManager(tmp_path, model=model)
    with pytest.raises(ValueError, match="step"):
        manager.save(-1)
