"""The state of the last step every rank completed, kept in memory, for a rank replaced in place.

With ``recovery="replace"`` a :class:`~gpufleet.checkpoint.CheckpointManager` whose loop runs over
:meth:`~gpufleet.checkpoint.CheckpointManager.steps` keeps, in each rank:

- its live model (unwrapped from DDP), optimizers, scheduler and ``stateful`` objects: their
  state *is* the end of the last completed step as long as no optimizer step ran since that
  step's end, which an optimizer hook counts;
- at each step's end (a *boundary*), its RNG states and data-loader position: in memory (the last
  two) and in a small file of the private run folder, which is all a dead rank leaves behind.

When a rank dies, the survivors run the function again in the same process
(:mod:`gpufleet.launch.replace`) and the replacement runs it from the top; each builds its
model, optimizer and loader again and calls ``resume()``, which comes here (:func:`join`):

1. every rank says which boundary it holds; R is the lowest, and the source is the lowest
   surviving rank whose live state is R's (no optimizer step since);
2. the source broadcasts model, optimizer, scheduler and ``stateful`` state (metadata as one
   object, tensors one by one) into every rank's new objects;
3. each rank restores its own RNG states and loader position of boundary R: a survivor from
   memory, the replacement from its predecessor's file;
4. ``resume()`` returns R: the loop re-runs step R+1 exactly as it ran before; when the
   replacement reaches that step's end it tells the launcher (:func:`replace.report_back`: the
   step R, the steps trained again, the time), which records the recovery.

An FSDP2 model takes another way (:mod:`gpufleet.checkpoint.shard_copy`): no survivor holds the
dead rank's shard, so each rank keeps a copy of its neighbour's every ``replica_every`` steps, and
every rank goes back to the newest such step.

Anything that does not fit (no source, a rank without boundary R, no shard copy every rank holds,
a DeepSpeed engine) raises :class:`RecoveryError` on every rank alike: the attempt then fails as
it would have, and the run's retries restart the group from its newest checkpoint.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..launch import replace
from ..launch.node import envcontract
from . import ddp_buckets
from .errors import CheckpointError
from .rank_state import apply_rank_state, capture_rank_state, save_atomic

__all__ = ["RecoveryError", "Kept", "join", "joining", "track"]


class RecoveryError(CheckpointError):
    """A rank could not be replaced in place; the run falls back to a whole-group retry."""


@dataclass
class Kept:
    """One rank's live training objects and its last boundaries (module docstring)."""

    generation: int
    model: Any
    optimizers: list[Any]
    scheduler: Any
    stateful: dict[str, Any]
    dataloader: Any
    save_rng: bool
    #: The last step whose end this rank reached, and the optimizer steps counted then.
    boundary: int | None = None
    steps_at_boundary: int = 0
    optimizer_steps: int = 0
    #: Boundary step -> {"rng": ..., "dataloader": ...}: the last two.
    snapshots: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: An FSDP2 model's copies of this rank's and its neighbour's shards (:mod:`.shard_copy`).
    copies: Any = None
    #: The DDP wrapper (weakly: the old group must not outlive it) and the buckets it rebuilt (:mod:`.ddp_buckets`).
    wrapper: Any = None
    buckets: list[list[int]] | None = None

    @property
    def clean(self) -> bool:
        """No optimizer step since the last boundary: the live state is that boundary's."""
        return self.boundary is not None and self.optimizer_steps == self.steps_at_boundary

    def count_step(self, *_: Any) -> None:
        self.optimizer_steps += 1


_current: Kept | None = None  # this generation's
_previous: Kept | None = None  # a survivor's, from the generation its lost peer ended
_joined = 0  # the last generation this process joined
_report: tuple[int, int] | None = None  # the replacement's (R, steps lost), told once it completes step R + 1


def _unwrap(model: Any) -> Any:
    """The module under DDP (whose wrapper holds the process group); anything else as it is."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def track(model: Any, optimizers: list[Any], scheduler: Any, stateful: dict[str, Any], dataloader: Any,
          save_rng: bool, replica_every: int = 5) -> Kept | None:  # fmt: skip
    """Keep a new manager's objects for a replacement (None when the call does not replace ranks); an
    FSDP2 model's shards are also copied to the next rank every ``replica_every`` steps."""
    global _current, _previous
    if not replace.enabled() or model is None or _is_deepspeed(model):
        return None
    generation = replace.generation()
    if _current is not None and _current.generation < generation:
        _previous = _current  # the survivor's state of the step its peer died in
    kept = Kept(generation, _unwrap(model), list(optimizers), scheduler, dict(stateful), dataloader, save_rng)
    if ddp_buckets.is_ddp(model):
        kept.wrapper = weakref.ref(model)
        kept.buckets = _previous.buckets if _previous is not None else None  # the same function's model
    for opt in kept.optimizers:
        opt.register_step_post_hook(kept.count_step)
    if _is_sharded(model):
        from .shard_copy import ShardCopies

        kept.copies = ShardCopies(replica_every)  # a collective: every rank's manager makes its group
    _current = kept
    return kept


def _boundary_file(rank: int) -> Path | None:
    folder = os.environ.get(envcontract.RUN_DIR)
    return Path(folder) / f"boundary-{rank}.pt" if folder else None


def mark_boundary(kept: Kept, step: int, rank: int, world_size: int) -> None:
    """The end of step ``step`` (``start - 1`` before the first): remember this rank's own state of it."""
    global _report
    if _report is not None and step > _report[0]:  # the replacement's first step after the join
        resumed, lost = _report
        _report = None
        replace.report_back(resumed, lost)
    snapshot = capture_rank_state(rank, world_size, save_rng=kept.save_rng, dataloader=kept.dataloader)
    kept.boundary, kept.steps_at_boundary = step, kept.optimizer_steps
    kept.snapshots[step] = snapshot
    for old in [s for s in kept.snapshots if s < step - 1]:
        del kept.snapshots[old]
    target = _boundary_file(rank)
    if target is not None:  # what a replacement of this rank starts from
        save_atomic({**snapshot, "step": step}, target)
    if kept.copies is not None and kept.copies.due(step):
        kept.copies.refresh(step, kept, _state_of(kept))
    if kept.buckets is None and kept.wrapper is not None:
        wrapper = kept.wrapper()
        kept.buckets = ddp_buckets.layout_of(wrapper) if wrapper is not None else None


def joining() -> bool:
    """Whether ``resume()`` must join a new generation of the group (this process has not yet)."""
    return replace.enabled() and replace.generation() > _joined


def _file_boundary(rank: int) -> dict[str, Any] | None:
    """The boundary the dead predecessor of this rank left in its file, if any."""
    import torch

    target = _boundary_file(rank)
    if target is None or not target.is_file():
        return None
    # our own file in the run's private folder: RNG states are Python objects, not only tensors
    state = torch.load(target, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("rank") != rank or not isinstance(state.get("step"), int):
        return None
    return state


def join(manager: Any) -> int:
    """Join the new generation: every rank ends with the state of boundary R; returns R (module docstring)."""
    global _previous, _joined, _report
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    previous, _previous = _previous, None
    if _is_sharded(manager.model):
        target, lost = _join_sharded(manager, previous, rank, world)
        if previous is None:
            _report = (target, lost)
        _joined = replace.generation()
        return target
    own: dict[int, dict[str, Any]] = {}
    if previous is not None:  # a survivor
        own = dict(previous.snapshots)
        mine = {"boundaries": sorted(own), "source": previous.boundary if previous.clean else None,
                "buckets": previous.buckets}
    else:  # the replacement
        left = _file_boundary(rank)
        if left is not None:
            own = {left["step"]: left}
        mine = {"boundaries": sorted(own), "source": None, "buckets": None}
    mine["unsupported"] = "a DeepSpeed engine's state is not handed over in place" if manager.deepspeed else None
    said: list[Any] = [None] * world
    dist.all_gather_object(said, mine)
    target, source, problem = _plan(said)
    if problem is not None:
        _joined = replace.generation()
        raise _cannot(problem)
    assert source is not None
    if previous is None:  # the replacement: it tells the launcher once it completes the next step
        _report = (target, max(max(s["boundaries"]) for s in said) - target)
    state = _state_of(previous) if rank == source else None
    del previous
    state = _broadcast_state(state, source)
    _apply(manager, state)
    if ddp_buckets.is_ddp(manager.model):  # the run's buckets, so that the sums add up in the same order
        layout = next((s["buckets"] for s in said if s["buckets"]), None)
        why_not = ddp_buckets.lay_out(manager.model, layout)
        if why_not is None and _current is not None:
            _current.buckets = layout
        elif why_not is not None and rank == source:
            print(f"gpufleet: rank {rank}: DDP's buckets start as a new wrapper's, not as the run's: {why_not}; "
                  "the parameters may differ from an uninterrupted run's in their last bits", file=sys.stderr,
                  flush=True)  # fmt: skip
    apply_rank_state(own[target], _boundary_file(rank) or Path("."), world, world,
                     save_rng=manager.save_rng, dataloader=manager.dataloader)  # fmt: skip
    _joined = replace.generation()
    return target


def _cannot(problem: str) -> RecoveryError:
    return RecoveryError(f"the lost rank could not be replaced in place: {problem}. The attempt fails; with "
                         "max_retries >= 1 the run restarts every rank from the newest checkpoint "
                         "(docs/recovery.md says what a replacement needs)")  # fmt: skip


def _join_sharded(manager: Any, previous: Kept | None, rank: int, world: int) -> tuple[int, int]:
    """An FSDP2 model's join (:mod:`.shard_copy`): (S, the steps past S some rank had completed)."""
    global _joined
    import torch.distributed as dist

    from .shard_copy import filled, recv_copy, send_copy

    copies = previous.copies if previous is not None else None
    mine = {**(copies.held() if copies is not None else {"own": [], "peer": []}),
            "replacement": previous is None, "last": previous.boundary if previous is not None else None}  # fmt: skip
    said: list[Any] = [None] * world
    dist.all_gather_object(said, mine)
    lost = [r for r, s in enumerate(said) if s["replacement"]]
    holder = (lost[0] + 1) % world if len(lost) == 1 else None
    steps = set(said[holder]["peer"]) if holder is not None else set()
    for r, s in enumerate(said):
        if r not in lost:
            steps &= set(s["own"])
    if not steps:
        _joined = replace.generation()
        raise _cannot("no step's shard copies are held by every rank (the dead rank's next rank copies its "
                      "shard every replica_every steps; it died before the first copy, or its neighbour "
                      "died too)" if len(lost) == 1 else "more than one rank has no shard copy")  # fmt: skip
    target = max(steps)
    dead = lost[0]
    group = _current.copies.group if _current is not None and _current.copies is not None else None  # gloo
    if rank == holder:
        assert copies is not None
        send_copy(copies.peer[target], dead, group)
    if rank == dead:
        copy = recv_copy(holder, group)
    else:
        assert copies is not None
        copy = copies.own[target]
    _apply(manager, filled(manager, copy))
    apply_rank_state(copy.skeleton["rank_state"], manager.root, world, world, save_rng=manager.save_rng,
                     dataloader=manager.dataloader)  # fmt: skip
    last = max((s["last"] for s in said if s["last"] is not None), default=target)
    return target, max(0, last - target)


def _plan(said: list[dict[str, Any]]) -> tuple[int, int | None, str | None]:
    """(R, source rank, None) from what every rank said, or (.., .., the reason it cannot be done)."""
    unsupported = [s["unsupported"] for s in said if s["unsupported"]]
    if unsupported:
        return -1, None, unsupported[0]
    missing = [r for r, s in enumerate(said) if not s["boundaries"]]
    if missing:
        return -1, None, (f"rank {missing[0]} holds no completed step (the loop must run over "
                          "CheckpointManager.steps(...) for a rank to be replaced in place)")  # fmt: skip
    target = min(max(s["boundaries"]) for s in said)
    sources = [r for r, s in enumerate(said) if s["source"] == target]
    if not sources:
        return target, None, f"no surviving rank holds the model and optimizer of step {target}'s end"
    lacking = [r for r, s in enumerate(said) if target not in s["boundaries"]]
    if lacking:
        return target, None, f"rank {lacking[0]} holds no data position and RNG state of step {target}'s end"
    return target, sources[0], None


def _is_deepspeed(model: Any) -> bool:
    from .deepspeed_engine import is_deepspeed_engine

    return bool(is_deepspeed_engine(model))


def _is_sharded(model: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return model is not None and any(isinstance(p, DTensor) for p in _unwrap(model).parameters())


def _state_of(kept: Kept) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict[str, Any] = {}
    if kept.optimizers:
        state["model"], state["optimizer"] = get_state_dict(kept.model, kept.optimizers)
    else:
        state["model"] = get_model_state_dict(kept.model)
    if kept.scheduler is not None:
        state["scheduler"] = kept.scheduler.state_dict()
    state["stateful"] = {name: obj.state_dict() for name, obj in kept.stateful.items()}
    return state


@dataclass(frozen=True)
class _Tensor:
    """A tensor's place in a broadcast state: what a receiving rank allocates."""

    index: int
    shape: tuple[int, ...]
    dtype: Any
    on_gpu: bool


def _broadcast_state(state: dict[str, Any] | None, source: int) -> dict[str, Any]:
    """``state`` of rank ``source`` on every rank: its structure as one object, its tensors one by one."""
    import torch
    import torch.distributed as dist

    from .. import runtime

    tensors: list[Any] = []

    def skeleton(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _Tensor(len(tensors) - 1, tuple(value.shape), value.dtype, value.device.type == "cuda")
        if isinstance(value, dict):
            return {k: skeleton(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(skeleton(v) for v in value)
        return value

    box = [skeleton(state) if state is not None else None]
    dist.broadcast_object_list(box, src=source)
    shape = box[0]
    nccl = "nccl" in str(dist.get_backend())
    device = runtime.device()
    received: dict[int, Any] = {}

    def fill(value: Any) -> Any:
        if isinstance(value, _Tensor):
            home = device if value.on_gpu else torch.device("cpu")
            wire = device if nccl else torch.device("cpu")
            if dist.get_rank() == source:
                t = tensors[value.index].detach().to(wire).contiguous()
            else:
                t = torch.empty(value.shape, dtype=value.dtype, device=wire)
            dist.broadcast(t, src=source)
            received[value.index] = t.to(home)
            return received[value.index]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(shape)  # type: ignore[no-any-return]


def _apply(manager: Any, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if manager.optimizers:
        set_state_dict(manager.model, manager.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
    else:
        set_model_state_dict(manager.model, state["model"])
    if manager.scheduler is not None and "scheduler" in state:
        manager.scheduler.load_state_dict(state["scheduler"])
    for name, obj in manager.stateful.items():
        if name in state.get("stateful", {}):
            obj.load_state_dict(state["stateful"][name])
