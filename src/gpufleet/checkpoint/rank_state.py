"""Each rank's own file in a checkpoint: its RNG states and its data loader's position."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .rng import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

__all__ = ["RANK_STATE_NAME", "capture_rank_state", "save_atomic", "write_rank_state", "read_rank_state", "apply_rank_state", "load_rank_state"]

RANK_STATE_NAME = "gpufleet-rank-{rank}.pt"


def capture_rank_state(rank: int, world_size: int, *, save_rng: bool, dataloader: Any) -> dict[str, Any]:
    """This rank's own state now: its RNG states and its data loader's position."""
    state: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if save_rng:
        state["rng"] = capture_rng_state()
    if dataloader is not None:
        state["dataloader"] = dataloader.state_dict()
    return state


def save_atomic(state: dict[str, Any], target: Path) -> None:
    """``torch.save`` into ``target`` through a temporary file: a reader never sees half of it."""
    import torch

    tmp = target.with_name(f".{target.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)


def write_rank_state(path: Path, rank: int, world_size: int, *, save_rng: bool, dataloader: Any) -> None:
    """Write this rank's file into the checkpoint folder ``path`` (atomically)."""
    state = capture_rank_state(rank, world_size, save_rng=save_rng, dataloader=dataloader)
    save_atomic(state, path / RANK_STATE_NAME.format(rank=rank))


def read_rank_state(path: Path, rank: int, world_size: int, saved_world_size: int) -> dict[str, Any] | None:
    """This rank's file of checkpoint ``path``, read but not applied; None when the checkpoint
    was saved by another number of ranks (the per-rank states then have no owner).

    Raises:
        CheckpointError: this rank's file is missing.
        Exception: it cannot be read (e.g. truncated).
    """
    if saved_world_size != world_size:
        return None
    import torch

    file = path / RANK_STATE_NAME.format(rank=rank)
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint {path} is incomplete")
    # Our own file: RNG states and loader positions are Python objects, not only tensors.
    state = torch.load(file, map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not this rank's state")
    return state


def apply_rank_state(
    state: dict[str, Any] | None,
    path: Path,
    world_size: int,
    saved_world_size: int,
    *,
    save_rng: bool,
    dataloader: Any,
) -> None:
    """Restore the data-loader position and the RNG states (last) read by :func:`read_rank_state`.

    With ``state`` None (another number of ranks saved ``path``) nothing is restored, with a warning.
    """
    if state is None:
        logger.warning(
            "%s was saved by %d ranks and is loaded by %d: model, optimizer and scheduler are "
            "restored, but the per-rank RNG states and data-loader positions are not",
            path, saved_world_size, world_size,
        )
        return
    if dataloader is not None:
        if "dataloader" in state:
            dataloader.load_state_dict(state["dataloader"])
        else:
            logger.warning("%s holds no data-loader position; the loader starts from its beginning", path)
    if save_rng and "rng" in state:
        restore_rng_state(state["rng"])  # last: loading above must not move the generators


def load_rank_state(
    path: Path, rank: int, world_size: int, saved_world_size: int, *, save_rng: bool, dataloader: Any
) -> None:
    """Restore this rank's data-loader position and RNG states from ``path``
    (:func:`read_rank_state`, then :func:`apply_rank_state`).

    Raises:
        CheckpointError: this rank's file is missing.
    """
    state = read_rank_state(path, rank, world_size, saved_world_size)
    apply_rank_state(state, path, world_size, saved_world_size, save_rng=save_rng, dataloader=dataloader)
