"""Split the replicated tensors of a state dict so that each rank stages and writes a share.

Under DDP every rank holds the same model and optimizer state. DCP already writes each
replicated tensor only once, but it decides which rank writes it after the whole state dict was
staged, so an asynchronous save copied a full replica to host memory on every rank. Handing DCP
only this rank's share of the replicated tensors (balanced by bytes, the same split on every
rank) gives the same files and metadata with ``1/world`` of the copying per rank. Sharded
tensors (``DTensor`` of FSDP2, ``ShardedTensor``) are already split and stay as they are.
"""

from __future__ import annotations

from typing import Any

__all__ = ["share_of_replicas"]


def _is_plain_tensor(value: Any) -> bool:
    import torch

    if not isinstance(value, torch.Tensor):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    if isinstance(value, DTensor):
        return False
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return True
    return not isinstance(value, ShardedTensor)


def _leaves(tree: Any, path: tuple[Any, ...], out: list[tuple[tuple[Any, ...], int]]) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            _leaves(value, (*path, key), out)
    elif _is_plain_tensor(tree):
        out.append((path, tree.numel() * tree.element_size()))


def _prune(tree: Any, path: tuple[Any, ...], drop: set[tuple[Any, ...]]) -> Any:
    if not isinstance(tree, dict):
        return tree
    return {k: _prune(v, (*path, k), drop) for k, v in tree.items() if (*path, k) not in drop}


def share_of_replicas(state: dict[str, Any], keys: tuple[str, ...], rank: int, world: int) -> tuple[dict[str, Any], int]:
    """``state`` without the plain tensors under ``keys`` that other ranks write.

    Args:
        state: the state dict handed to DCP; entries named in ``keys`` hold replicated state.
        keys: top-level entries whose plain tensors are the same on every rank.
        rank, world: this rank and the number of ranks writing.

    Returns:
        The pruned state dict (other entries and non-tensor values untouched) and the bytes of
        the plain tensors this rank keeps.
    """
    leaves: list[tuple[tuple[Any, ...], int]] = []
    for key in keys:
        if key in state:
            _leaves(state[key], (key,), leaves)
    # largest first to the least loaded rank: the same order, hence the same split, on every rank
    load = [0] * world
    owner: dict[tuple[Any, ...], int] = {}
    for index in sorted(range(len(leaves)), key=lambda i: (-leaves[i][1], i)):
        target = min(range(world), key=lambda r: (load[r], r))
        owner[leaves[index][0]] = target
        load[target] += leaves[index][1]
    drop = {path for path, r in owner.items() if r != rank}
    pruned = {k: (_prune(v, (k,), drop) if k in keys else v) for k, v in state.items()}
    return pruned, load[rank]
