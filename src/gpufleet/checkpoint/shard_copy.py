"""FSDP2 under ``recovery="replace"``: each rank's shard, and a copy of its neighbour's, in host memory.

An FSDP2 rank holds the only copy of its shard of the model and optimizer, so the rank that dies
takes its shard with it; no survivor can hand it over as under DDP. Every ``replica_every`` steps
(``CheckpointManager(replica_every=...)``), at that step's end, each rank:

1. copies its own local shards of the model and optimizer, the scheduler's and ``stateful``
   objects' state, its RNG states and its data-loader position to host memory (the only pause of
   the training loop: a device-to-host copy). The tensors are copied into one flat buffer per
   dtype (:class:`Copy`), the rest is a small structure that names each tensor's place in them;
2. hands the copy to a thread that sends it to the next rank (``(r + 1) % W``) and receives the
   previous rank's, over a gloo group of its own, while training goes on: the structure pickled,
   the buffers as they are (no serialization of the tensors: pickling 24 MB and reading it back
   cost 30-80 ms of a core, the copy itself 2-7 ms).

Each rank keeps the last two of both. When a rank dies, the ranks agree on the newest step S that
every survivor holds its own copy of and the dead rank's next neighbour holds the dead rank's copy
of; that neighbour sends it to the replacement; every rank restores its copy of S into the model
and optimizer it built again, and the loop goes on from S: at most ``replica_every`` steps are
trained again, and the run goes on as an uninterrupted run resumed from step S would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .rank_state import capture_rank_state

__all__ = ["Copy", "ShardCopies", "filled", "recv_copy", "send_copy", "snapshot"]

#: How many steps apart the copies are refreshed by default.
DEFAULT_REPLICA_EVERY = 5


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a :class:`Copy`: its dtype's buffer, where it starts there, its shape."""

    dtype: Any
    offset: int
    shape: tuple[int, ...]


@dataclass
class Copy:
    """One rank's state of one step on the host: each tensor in a flat buffer of its dtype, the
    structure around them (with a :class:`_Slot` in each tensor's place) as it is."""

    skeleton: dict[str, Any]
    flat: dict[Any, Any]

    def state(self) -> dict[str, Any]:
        """The state as it was copied, each tensor a view of its buffer."""

        def unpack(value: Any) -> Any:
            if isinstance(value, _Slot):
                size = 1
                for n in value.shape:
                    size *= n
                return self.flat[value.dtype][value.offset:value.offset + size].view(value.shape)
            if isinstance(value, dict):
                return {k: unpack(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(unpack(v) for v in value)
            return value

        return unpack(self.skeleton)  # type: ignore[no-any-return]


def _pack(state: dict[str, Any]) -> Copy:
    """``state`` on the host, every tensor (a sharded one: this rank's part) copied into its dtype's buffer."""
    import torch

    tensors: list[tuple[Any, _Slot]] = []
    sizes: dict[Any, int] = {}

    def place(value: Any) -> Any:
        if _is_dtensor(value):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            slot = _Slot(value.dtype, sizes.get(value.dtype, 0), tuple(value.shape))
            sizes[value.dtype] = slot.offset + value.numel()
            tensors.append((value, slot))
            return slot
        if isinstance(value, dict):
            return {k: place(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(place(v) for v in value)
        return value

    skeleton = place(state)
    flat = {dtype: torch.empty(size, dtype=dtype) for dtype, size in sizes.items()}
    for tensor, slot in tensors:
        flat[slot.dtype][slot.offset:slot.offset + tensor.numel()].view(slot.shape).copy_(tensor.detach())
    return Copy(skeleton, flat)


def snapshot(state: dict[str, Any], kept: Any, rank: int, world_size: int) -> Copy:
    """``state`` (the live objects' state dicts) on the host, with this rank's RNG and loader position."""
    copy = _pack(state)
    copy.skeleton["rank_state"] = capture_rank_state(rank, world_size, save_rng=kept.save_rng,
                                                     dataloader=kept.dataloader)  # fmt: skip
    return copy


def send_copy(copy: Copy, dst: int, group: Any) -> None:
    """Send ``copy`` to rank ``dst``: the structure and the buffers' sizes pickled, then each buffer."""
    import torch.distributed as dist

    order = sorted(copy.flat, key=str)
    dist.send_object_list([(copy.skeleton, [(dtype, copy.flat[dtype].numel()) for dtype in order])], dst=dst,
                          group=group)  # fmt: skip
    for dtype in order:
        dist.send(copy.flat[dtype], dst=dst, group=group)


def recv_copy(src: int, group: Any) -> Copy:
    """The :class:`Copy` rank ``src`` sends with :func:`send_copy`."""
    import torch
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    skeleton, sizes = box[0]
    flat = {}
    for dtype, size in sizes:
        flat[dtype] = torch.empty(size, dtype=dtype)
        dist.recv(flat[dtype], src=src, group=group)
    return Copy(skeleton, flat)


def _fill(live: Any, saved: Any) -> Any:
    """``live`` (a state dict of the rebuilt objects) holding ``saved``'s values: a sharded tensor's
    local part copied in place, anything else taken as saved."""
    import torch

    if _is_dtensor(live):
        live.to_local().copy_(saved)
        return live
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(live.device, copy=True)  # never the copy's own buffer: training would change it
    if isinstance(live, dict) and isinstance(saved, dict):
        return {k: _fill(live[k], v) if k in live else v for k, v in saved.items()}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        return type(saved)(_fill(a, b) for a, b in zip(live, saved, strict=True))
    return saved


def filled(manager: Any, copy: Copy) -> dict[str, Any]:
    """A :func:`snapshot` (this rank's, or the dead rank's from its neighbour) as state dicts of the
    manager's rebuilt model and optimizer, their sharded tensors holding the copy's local parts,
    ready for ``set_state_dict`` (``in_memory._apply``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state = copy.state()
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
        self.own: dict[int, Copy] = {}
        self.peer: dict[int, Copy] = {}
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

    def _exchange(self, step: int, copy: Copy) -> None:
        following, before = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        try:
            if self.rank % 2 == 0:  # even ranks send first, odd ones receive first: no ring waits on itself
                send_copy(copy, following, self.group)
                received = recv_copy(before, self.group)
            else:
                received = recv_copy(before, self.group)
                send_copy(copy, following, self.group)
        except Exception as e:  # noqa: BLE001 - a lost peer: this step's copy is not complete
            self.error = e
            return
        self.peer[step] = received
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
