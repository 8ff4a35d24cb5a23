"""Checkpoints of a DeepSpeed engine: saved with the engine's own ``save_checkpoint`` into the
manager's ``step-N`` layout, with the scheduler and extra state in its client state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import CheckpointError

__all__ = ["is_deepspeed_engine", "check_engine_options", "save_engine", "load_engine"]

_SCHEDULER_KEY = "gpufleet_scheduler"
_STATEFUL_PREFIX = "gpufleet_stateful."


def is_deepspeed_engine(obj: Any) -> bool:
    """True for an object that checkpoints itself like a DeepSpeed engine."""
    return callable(getattr(obj, "save_checkpoint", None)) and callable(getattr(obj, "load_checkpoint", None))


def check_engine_options(optimizers: Sequence[Any], async_save: bool) -> None:
    """Refuse the manager options a DeepSpeed engine does not take.

    Raises:
        ValueError: an optimizer was given, or ``async_save`` asked for.
    """
    if optimizers:
        raise ValueError(
            "a DeepSpeed engine saves its own optimizer: pass the engine as model= and no optimizer="
        )
    if async_save:
        raise ValueError(
            "async_save is not available for a DeepSpeed engine; use async_save=False (DeepSpeed "
            "has its own asynchronous checkpoint engines, configured in its config)"
        )


def save_engine(
    engine: Any, root: Path, path: Path, step: int, scheduler: Any, stateful: Mapping[str, Any]
) -> None:
    """Save the engine (model, optimizer, its own scheduler) plus ours into ``path`` under ``root``."""
    client_state: dict[str, Any] = {"gpufleet_step": step}
    if scheduler is not None:
        client_state[_SCHEDULER_KEY] = scheduler.state_dict()
    for name, obj in stateful.items():
        client_state[f"{_STATEFUL_PREFIX}{name}"] = obj.state_dict()
    engine.save_checkpoint(str(root), tag=path.name, client_state=client_state, save_latest=False)


def load_engine(engine: Any, root: Path, path: Path, scheduler: Any, stateful: Mapping[str, Any]) -> None:
    """Load the checkpoint in ``path`` into the engine, the scheduler and the stateful objects.

    Raises:
        CheckpointError: DeepSpeed could not load it.
    """
    load_path, client_state = engine.load_checkpoint(str(root), tag=path.name)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load the checkpoint in {path}")
    client_state = client_state or {}
    if scheduler is not None and _SCHEDULER_KEY in client_state:
        scheduler.load_state_dict(client_state[_SCHEDULER_KEY])
    for name, obj in stateful.items():
        key = f"{_STATEFUL_PREFIX}{name}"
        if key in client_state:
            obj.load_state_dict(client_state[key])
