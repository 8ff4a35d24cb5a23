"""FSDP2 under ``recovery="replace"``: each rank's shard, and a copy of its neighbour's, in host memory.

An FSDP2 rank holds the only copy of its shard of the model and optimizer, so the rank that dies
takes its shard with it; no survivor can hand it over as under DDP. Every ``replica_every`` steps
(``CheckpointManager(replica_every=...)``), at that step's end, each rank:

1. copies its own local shards of the model and optimizer, the scheduler's and ``stateful``
   objects' state, its RNG states and its data-loader position to host memory (the only pause of
   the training loop: a device-to-host copy);
2. hands the copy to a thread that sends it to the next rank (``(r + 1) % W``) and receives the
   previous rank's, over a gloo group of its own, while training goes on.

Each rank keeps the last two of both. When a rank dies, the ranks agree on the newest step S that
every survivor holds its own copy of and the dead rank's next neighbour holds the dead rank's copy
of; that neighbour sends it to the replacement; every rank restores its copy of S into the model
and optimizer it built again, and the loop goes on from S: at most ``replica_every`` steps are
trained again, and the run goes on as an uninterrupted run resumed from step S would.
"""

from __future__ import annotations

import threading
from typing import Any

from .rank_state import capture_rank_state

__all__ = ["ShardCopies", "filled", "snapshot"]

#: How many steps apart the copies are refreshed by default.
DEFAULT_REPLICA_EVERY = 5


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(value: Any) -> Any:
    """``value`` with every tensor a host copy of this rank's part of it."""
    import torch

    if _is_dtensor(value):
        return value.to_local().detach().to("cpu", copy=True)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def snapshot(state: dict[str, Any], kept: Any, rank: int, world_size: int) -> dict[str, Any]:
    """``state`` (the live objects' state dicts) on the host, with this rank's RNG and loader position."""
    copy = _local(state)
    copy["rank_state"] = capture_rank_state(rank, world_size, save_rng=kept.save_rng, dataloader=kept.dataloader)
    return copy


def _fill(live: Any, saved: Any) -> Any:
    """``live`` (a state dict of the rebuilt objects) holding ``saved``'s values: a sharded tensor's
    local part copied in place, anything else taken as saved."""
    import torch

    if _is_dtensor(live):
        live.to_local().copy_(saved)
        return live
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(live.device)
    if isinstance(live, dict) and isinstance(saved, dict):
        return {k: _fill(live[k], v) if k in live else v for k, v in saved.items()}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        return type(saved)(_fill(a, b) for a, b in zip(live, saved, strict=True))
    return saved


def filled(manager: Any, state: dict[str, Any]) -> dict[str, Any]:
    """A :func:`snapshot` (this rank's, or the dead rank's from its neighbour) as state dicts of the
    manager's rebuilt model and optimizer, their sharded tensors holding the copy's local parts,
    ready for ``set_state_dict`` (``in_memory._apply``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out = dict(state)
    if manager.optimizers:
        model_sd, optim_sd = get_state_dict(manager.model, manager.optimizers)  # the optimizer's state made
        out["model"], out["optimizer"] = _fill(model_sd, state["model"]), _fill(optim_sd, state["optimizer"])
    else:
        out["model"] = _fill(get_model_state_dict(manager.model), state["model"])
    return out


class ShardCopies:
    """This rank's copies (module docstring): ``own[S]`` and ``peer[S]`` (the previous rank's), the last two."""

    def __init__(self, every: int) -> None:
        import torch.distributed as dist

        self.every = every
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # its own: the exchange runs beside the training's collectives
        self.own: dict[int, dict[str, Any]] = {}
        self.peer: dict[int, dict[str, Any]] = {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def refresh(self, step: int, kept: Any, state: dict[str, Any]) -> None:
        """At the end of step ``step``: copy this rank's ``state`` (model, optimizer, scheduler, ``stateful``),
        and send it to the next rank meanwhile."""
        self.wait()
        copy = snapshot(state, kept, self.rank, self.world_size)
        self.own[step] = copy
        self._thread = threading.Thread(target=self._exchange, args=(step, copy), name="gpufleet-shard-copy",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        for old in [s for s in self.own if s < step - self.every]:
            del self.own[old]

    def _exchange(self, step: int, copy: dict[str, Any]) -> None:
        import torch.distributed as dist

        following, before = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        received: list[Any] = [None]
        try:
            if self.rank % 2 == 0:  # even ranks send first, odd ones receive first: no ring waits on itself
                dist.send_object_list([copy], dst=following, group=self.group)
                dist.recv_object_list(received, src=before, group=self.group)
            else:
                dist.recv_object_list(received, src=before, group=self.group)
                dist.send_object_list([copy], dst=following, group=self.group)
        except Exception as e:  # noqa: BLE001 - a lost peer: this step's copy is not complete
            self.error = e
            return
        self.peer[step] = received[0]
        for old in [s for s in self.peer if s < step - self.every]:
            del self.peer[old]

    def wait(self) -> None:
        """The exchange in flight, done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def held(self) -> dict[str, list[int]]:
        """The steps this rank holds its own copy of, and its previous rank's (an exchange counts once done)."""
        return {"own": sorted(self.own), "peer": sorted(self.peer)}
