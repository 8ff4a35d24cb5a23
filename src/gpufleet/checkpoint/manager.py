"""The checkpoint manager: save and resume training state with ``torch.distributed.checkpoint``.

Every rank writes its own shard of the model and optimizer in parallel (DCP), plus a small
file of its own state (RNG states and data-loader position). Rank 0 writes the completion
marker last. Old complete checkpoints beyond ``keep_last`` are deleted; torn ones are kept
aside and never loaded. ``resume`` falls back from a complete checkpoint that does not load
(damaged after its save) to the next older one, the ranks agreeing on each try. A DeepSpeed
engine is saved with its own ``save_checkpoint`` into the same ``step-N`` layout.

This module holds the manager's flow (collectives, DCP save and load, completion, resume);
the DeepSpeed engine's format, the asynchronous-save machinery and the per-rank file live in
``deepspeed_engine``, ``async_save`` and ``rank_state``.

One concern past 400 lines: the save and resume protocol across ranks (collective decisions,
complete markers, fallback to an older checkpoint); staging, DeepSpeed and integrity checks
live in their own modules.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..launch.progress import section
from . import ddp_buckets, in_memory, layout
from .async_save import PendingSave, make_stager
from .deepspeed_engine import check_engine_options, is_deepspeed_engine, load_engine, save_engine
from .errors import CheckpointError
from .export import export_checkpoint
from .integrity import (
    SkippedCheckpoint,
    check_dcp_shards,
    check_files,
    describe,
    file_sizes,
    merge_reasons,
)
from .rank_state import apply_rank_state, read_rank_state, write_rank_state
from .torch_dist import import_torch_dist, quiet_single_process

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "CheckpointError", "SkippedCheckpoint"]

_TORN = "torn (its save never finished)"


@dataclass(frozen=True)
class _LoadPlan:
    """What the checks before a load read: the format, the saving world size, this rank's file."""

    format: str
    saved_world_size: int
    rank_state: dict[str, Any] | None
    #: The DDP bucket layout the saving run had rebuilt (:mod:`.ddp_buckets`), if the marker names one.
    buckets: list[list[int]] | None = None


def _check_root(root: Path) -> None:
    """Refuse a checkpoint root that is a file, or lies under one."""
    for p in (root, *root.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == root else f"lies under {p}, which is a file"
                raise CheckpointError(f"the checkpoint folder {root} {what}, not a folder; give root= a folder path")
            return


class CheckpointManager:
    """Save and resume the whole training state in ``<root>/step-N`` folders.

    Create one on every rank, after the model and optimizer are wrapped (DDP, FSDP2) or after
    ``deepspeed.initialize``; with a process group initialised the constructor is a
    collective call. Then ``start = manager.resume() or 0`` before the loop and
    ``manager.save(step)`` every so often inside it.

    What a checkpoint holds: the model and optimizer (through
    ``torch.distributed.checkpoint.state_dict``, so DDP, FSDP2 and plain modules share one
    format and a checkpoint loads onto another number of ranks or from DDP into FSDP2 and
    back), the LR scheduler, any extra ``stateful`` objects, the step, and per rank the RNG
    states (Python, NumPy, torch, CUDA) and the data loader's position.

    Args:
        root: folder of the checkpoints (shared by all ranks, e.g. a network file system
            for several nodes).
        model: the model (plain, DDP, FSDP2), or a DeepSpeed engine (anything with
            ``save_checkpoint``/``load_checkpoint``), which is then saved with its own format.
        optimizer: an optimizer or a list of them (not with a DeepSpeed engine: the engine
            holds its optimizer).
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        dataloader: the data loader or dataset whose position is saved per rank, e.g. a
            :class:`gpufleet.data.TimedDataLoader`.
        stateful: more objects with ``state_dict``/``load_state_dict`` whose state is the same
            on every rank (saved once).
        keep_last: number of complete checkpoints kept; older complete ones are deleted after
            each save. ``None`` keeps all.
        async_save: write in the background (``dcp.async_save``): ``save`` returns once the
            state is copied to host memory; the next ``save`` (or :meth:`wait`) waits for the
            previous one. Uses a gloo process group of its own, so the training's own
            collectives never share a group with the background writer.
        process_group: group for the checkpoint's collectives (a CPU-capable one for
            asynchronous saves); by default the default group, or a new gloo group when saving
            asynchronously or when the default group has no CPU backend.
        save_rng: save and restore the RNG states.
        pinned_staging: with ``async_save``, stage GPU tensors into pinned host buffers that
            are reused from one save to the next (DCP's ``DefaultStager``), which makes the
            stall of an asynchronous save a fast device-to-host copy. Default: on when CUDA is
            available.
        replica_every: with ``recovery="replace"`` and an FSDP2 model, every this many steps each
            rank copies its shard to the host memory of the next rank; a replaced rank costs at
            most this many steps (:mod:`gpufleet.checkpoint.shard_copy`).

    Attributes:
        last_save: about the last ``save``: step, whether asynchronous, seconds blocked, ...
        last_resume: about the last ``resume``: ``step`` loaded (None: none) and ``skipped``,
            the :class:`SkippedCheckpoint` s passed over before it, newest first.

    Raises:
        ValueError: a wrong argument (the message says which).
        CheckpointError: ``root`` (or a folder on its way) is a file, or it cannot be created.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        dataloader: Any = None,
        stateful: Mapping[str, Any] | None = None,
        keep_last: int | None = 3,
        async_save: bool = False,
        process_group: Any = None,
        save_rng: bool = True,
        pinned_staging: bool | None = None,
        replica_every: int = 5,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)) or str(root) == "":
            raise ValueError(f"root must be a folder path, got {root!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an integer >= 1 or None (keep all), got {keep_last!r}")
        if isinstance(replica_every, bool) or not isinstance(replica_every, int) or replica_every < 1:
            raise ValueError(f"replica_every must be an integer >= 1 (steps between two copies of an FSDP2 shard "
                             f"on the next rank), got {replica_every!r}")  # fmt: skip
        self.root = Path(root).expanduser().absolute()
        _check_root(self.root)  # on every rank, before any collective
        self.model = model
        self.deepspeed = model is not None and is_deepspeed_engine(model)
        optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]
        if optimizers and model is None:
            raise ValueError("an optimizer is saved together with its model: pass model= as well")
        if self.deepspeed:
            check_engine_options(optimizers, async_save)
        for name, obj in {"scheduler": scheduler, "dataloader": dataloader, **dict(stateful or {})}.items():
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"{name} must have state_dict() and load_state_dict(), got {type(obj).__name__}")
        self.optimizers = optimizers
        self.scheduler = scheduler
        self.dataloader = dataloader
        self.stateful = dict(stateful or {})
        self.keep_last = keep_last
        self.async_save = async_save
        self.save_rng = save_rng
        self.last_save: dict[str, Any] = {}
        self.last_resume: dict[str, Any] = {}
        self._pending: PendingSave | None = None

        dist = import_torch_dist()
        self._dist_on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist_on else 0
        self.world_size = dist.get_world_size() if self._dist_on else 1
        self._pg = process_group
        if self._dist_on and process_group is None:
            default_has_cpu = "gloo" in str(dist.get_backend())
            if async_save or not default_has_cpu:
                self._pg = dist.new_group(backend="gloo")
        self._stager: Any = None
        if async_save:
            self._stager = make_stager(pinned_staging)
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # no permission, a read-only file system, a file on the way
                raise CheckpointError(f"the checkpoint folder {self.root} cannot be created: {e.strerror or e}; choose "
                                      "a folder you can write to (root=)") from None  # fmt: skip
        self._kept = in_memory.track(model, optimizers, scheduler, self.stateful, dataloader, save_rng, replica_every)
        self._ddp_buckets: list[list[int]] | None = None  # read on the training thread, at a save (:mod:`.ddp_buckets`)
        from .preemption import watch_termination

        watch_termination()  # in a Slurm workload, a preemption's SIGTERM becomes a checkpoint (save_if_preempted)

    # -- queries --------------------------------------------------------------------------
    def checkpoints(self) -> list[layout.CheckpointInfo]:
        """Every ``step-N`` folder under the root, oldest first, torn ones included."""
        return layout.list_checkpoints(self.root)

    def latest(self) -> layout.CheckpointInfo | None:
        """The newest complete checkpoint, or None."""
        return layout.latest_complete(self.root)

    # -- collectives ----------------------------------------------------------------------
    def _barrier(self) -> None:
        if not self._dist_on:
            return
        if self._pg is not None:
            import_torch_dist().barrier(group=self._pg)
        else:
            from .. import runtime

            runtime.barrier()

    def _broadcast(self, value: Any) -> Any:
        if not self._dist_on:
            return value
        dist = import_torch_dist()
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    # -- saving ---------------------------------------------------------------------------
    def _dcp_state(self) -> dict[str, Any]:
        """The state dict handed to DCP (targets to fill when loading)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state: dict[str, Any] = {}
        if self.model is not None:
            if self.optimizers:
                state["model"], state["optimizer"] = get_state_dict(self.model, self.optimizers)
            else:
                state["model"] = get_model_state_dict(self.model)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        for name, obj in self.stateful.items():
            state[f"stateful.{name}"] = obj
        return state

    def _write_rank_state(self, path: Path) -> None:
        write_rank_state(path, self.rank, self.world_size, save_rng=self.save_rng, dataloader=self.dataloader)

    def _prepare_dir(self, path: Path) -> None:
        if self.rank == 0 and path.exists():
            logger.warning("replacing the existing folder %s", path)
            layout.remove_checkpoint(path)
        self._barrier()
        path.mkdir(parents=True, exist_ok=True)

    def save(self, step: int) -> Path:
        """Save the training state as checkpoint ``step`` (call on every rank).

        ``step`` should count the optimizer steps done, so ``resume()`` returns the step to
        continue from. With ``async_save`` this returns once the state is staged in host
        memory and the files are written in the background; a previous asynchronous save is
        waited for first.

        Returns:
            The checkpoint's folder.

        Raises:
            CheckpointError: the previous asynchronous save failed.
        """
        with section("checkpoint save"):  # a long phase: never taken for a hang
            return self._save(step)

    def _save(self, step: int) -> Path:
        path = layout.step_dir(self.root, step)
        self.wait()
        started = time.perf_counter()
        self._prepare_dir(path)
        if self._ddp_buckets is None and ddp_buckets.is_ddp(self.model):  # here: never beside the training
            self._ddp_buckets = ddp_buckets.layout_of(self.model)
        if self.deepspeed:
            save_engine(self.model, self.root, path, step, self.scheduler, self.stateful)
            self._write_rank_state(path)
            self._barrier()
            self._finish(step, path, started, is_async=False)
            return path
        import torch.distributed.checkpoint as dcp

        self._write_rank_state(path)
        state = self._dcp_state()
        state, staged_bytes = self._own_share(state)
        if self.async_save:
            with quiet_single_process():
                response = dcp.async_save(
                    state,
                    checkpoint_id=str(path),
                    process_group=self._pg,
                    async_stager=self._stager,
                    no_dist=not self._dist_on,
                )
            future = getattr(response, "upload_completion", response)
            self.last_save = {
                "step": step, "async": True, "blocked_s": time.perf_counter() - started, "tensor_bytes": staged_bytes,
            }
            self._pending = PendingSave(
                step, path, future, lambda: self._finish(step, path, started, is_async=True)
            )
        else:
            with quiet_single_process():
                dcp.save(state, checkpoint_id=str(path), process_group=self._pg, no_dist=not self._dist_on)
            self._finish(step, path, started, is_async=False)
            self.last_save["tensor_bytes"] = staged_bytes
        return path

    def _own_share(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """This rank's share of the replicated (DDP / plain) model and optimizer tensors."""
        from .replicas import share_of_replicas

        if not self._dist_on:
            return share_of_replicas(state, ("model", "optimizer"), 0, 1)
        import torch.distributed as dist

        return share_of_replicas(state, ("model", "optimizer"), dist.get_rank(self._pg), dist.get_world_size(self._pg))

    def _finish(self, step: int, path: Path, started: float, *, is_async: bool) -> None:
        """Mark the checkpoint complete (rank 0) and prune old ones; every rank's data is written."""
        elapsed = time.perf_counter() - started
        if not is_async:
            self.last_save = {"step": step, "async": False, "blocked_s": elapsed}
        self.last_save["total_s"] = elapsed
        if self.rank != 0:
            return
        marker = {
            "step": step,
            "format": "deepspeed" if self.deepspeed else "dcp",
            "world_size": self.world_size,
            "async": is_async,
            "files": file_sizes(path),
        }
        if self._ddp_buckets is not None:  # a resumed run's new wrapper sums its first step's gradients as this run did
            marker["ddp_buckets"] = self._ddp_buckets
        layout.write_marker(path, marker)
        logger.info("checkpoint of step %d complete in %s (%.2f s)", step, path, elapsed)
        if self.keep_last is not None:
            layout.prune(self.root, self.keep_last)

    def save_if_preempted(self, step: int) -> bool:
        """Save checkpoint ``step`` (and wait for it) if the scheduler asked the job to stop; call every step.

        Under Slurm, gpufleet asks for a signal before the job's time limit, and a preemption's
        ``SIGTERM`` does not end a rank that has a manager (:mod:`gpufleet.checkpoint.preemption`);
        from then on this saves once and returns True, and the loop should end: the run is
        resubmitted and :meth:`resume` continues from this step. Elsewhere it returns False at once
        (no collective).
        """
        from .preemption import preemption_requested

        if not preemption_requested(self._pg):
            return False
        self.save(step)
        self.wait()
        logger.warning("checkpoint of step %d saved because the scheduler is ending the job", step)
        return True

    def wait(self) -> None:
        """Wait for an asynchronous save in flight (no-op when none).

        Raises:
            CheckpointError: that save failed.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()

    def close(self) -> None:
        """Wait for a save in flight and free staging buffers; call before the process group is destroyed."""
        self.wait()
        if self._stager is not None:
            self._stager.release()
            self._stager = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """``range(start, stop)`` for the training loop, telling gpufleet where each step ends.

        ``for step in ckpt.steps(start + 1, total_steps + 1):`` counts each step for the live
        view, the hang watchdog and injected faults (a fault ``step=N`` fires as step N begins).
        With ``recovery="replace"`` each step's end is also what a rank replaced in place
        continues from (:mod:`gpufleet.checkpoint.in_memory`): this rank's RNG states and
        data-loader position are kept then (in memory, and in a small file of the run folder).
        """
        from ..launch import progress

        for step in range(start, stop):
            if self._kept is not None:
                in_memory.mark_boundary(self._kept, step - 1, self.rank, self.world_size)
            progress.note_reported_step(step)
            yield step
        if self._kept is not None and stop > start:
            in_memory.mark_boundary(self._kept, stop - 1, self.rank, self.world_size)

    # -- loading --------------------------------------------------------------------------
    def resume(self) -> int | None:
        """Load the newest checkpoint that loads (call on every rank).

        Checkpoints are tried newest first. A torn one (its save never finished) is skipped;
        so is a complete one that does not load on some rank (a shard missing or truncated,
        unreadable metadata, a read error): every rank agrees on the outcome of each try, and
        the next older one is loaded into the same objects, overwriting whatever the failed
        try had put there. Each skip is logged as a warning on rank 0 and recorded in
        :attr:`last_resume` (``{"step": ..., "skipped": [SkippedCheckpoint, ...]}``).

        Returns:
            Its step, or None when there is no complete checkpoint (a fresh start).

        Raises:
            CheckpointError: there are complete checkpoints but none loads; the message lists
                each checkpoint tried and why it was skipped. The model and optimizer may then
                hold part of a checkpoint: build them again before starting without one.
        """
        if in_memory.joining():  # a rank was replaced in place: the last completed step, from a peer
            with section("recovery join"):
                return in_memory.join(self)
        with section("checkpoint resume"):  # a long phase: never taken for a hang
            return self._resume()

    def _resume(self) -> int | None:
        self.wait()
        listing = None
        if self.rank == 0:
            listing = [(c.step, c.complete) for c in reversed(self.checkpoints())]
        listing = self._broadcast(listing)
        skipped: list[SkippedCheckpoint] = []
        self.last_resume = {"step": None, "skipped": skipped}
        tried = False
        for step, complete in listing:
            path = layout.step_dir(self.root, step)
            if complete:
                tried = True
                reason = self._try_load(step)
                if reason is None:
                    self.last_resume["step"] = step
                    if self.rank == 0:
                        logger.info("resumed from %s", path)
                    return step
            else:
                reason = _TORN
            skipped.append(SkippedCheckpoint(step, path, reason))
            if self.rank == 0 and complete:
                logger.warning("skipping checkpoint %s in %s, which does not load: %s", path.name, self.root, reason)
            elif self.rank == 0:
                logger.warning("skipping torn (incomplete) checkpoint %s in %s", path.name, self.root)
        if tried:
            tried_list = "\n".join(f"  {s.path.name}: {s.reason}" for s in skipped)
            raise CheckpointError(f"no checkpoint in {self.root} loads; tried, newest first:\n{tried_list}")
        logger.info("no complete checkpoint in %s: starting fresh", self.root)
        return None

    def load(self, step: int) -> int:
        """Load checkpoint ``step`` (call on every rank).

        Returns:
            ``step``.

        Raises:
            CheckpointError: that checkpoint does not exist, is torn, or does not load on some
                rank (raised on every rank, with the reason).
        """
        path = layout.step_dir(self.root, step)
        reason = self._try_load(step)
        if reason is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: {reason}")
        if self.rank == 0:
            logger.info("resumed from %s", path)
        return step

    def _try_load(self, step: int) -> str | None:
        """Load checkpoint ``step`` on every rank; None, or why it failed (the same on every rank).

        First every rank checks what it can without touching the training state (the files and
        their sizes, the DCP metadata, its own per-rank file); only when that passed on every
        rank is the checkpoint loaded. Each phase ends with the ranks agreeing on its outcome,
        so no rank goes on with a checkpoint another rank could not load.
        """
        path = layout.step_dir(self.root, step)
        reason: str | None = None
        plan: _LoadPlan | None = None
        try:
            plan = self._check(step, path)
        except Exception as e:
            reason = describe(e)
        reason = self._agree(reason)
        if reason is not None or plan is None:
            return reason
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self._apply(path, plan)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            reason = describe(e)
        return self._agree(reason)

    def _check(self, step: int, path: Path) -> _LoadPlan:
        """What loading ``step`` needs, read and checked without changing any training state."""
        found = self.checkpoints()
        info = next((c for c in found if c.step == step), None)
        if info is None or not info.complete:
            state = "is torn (its save never finished)" if info is not None else "does not exist"
            have = [c.step for c in found if c.complete]
            raise CheckpointError(f"checkpoint {path} {state}; complete checkpoints: {have or 'none'}")
        marker = info.marker
        fmt = marker.get("format", "dcp")
        if fmt == "deepspeed" and not self.deepspeed:
            raise CheckpointError(f"{path} was saved by a DeepSpeed engine: pass the engine as model=")
        if fmt != "deepspeed" and self.deepspeed:
            raise CheckpointError(f"{path} is a DCP checkpoint and cannot be loaded into a DeepSpeed engine")
        check_files(path, marker)
        if fmt != "deepspeed":
            check_dcp_shards(path)
        saved_world_size = int(marker.get("world_size", 0))
        rank_state = read_rank_state(path, self.rank, self.world_size, saved_world_size)
        return _LoadPlan(fmt, saved_world_size, rank_state, ddp_buckets.parse(marker.get("ddp_buckets")))

    def _apply(self, path: Path, plan: _LoadPlan) -> None:
        """Load checkpoint ``path`` into the training state (collective through DCP or DeepSpeed)."""
        if plan.format == "deepspeed":
            load_engine(self.model, self.root, path, self.scheduler, self.stateful)
        else:
            self._load_dcp(path)
            if ddp_buckets.is_ddp(self.model):  # the same answer on every rank: they read the same marker
                why_not = ddp_buckets.lay_out(self.model, plan.buckets)
                if why_not is not None:
                    logger.debug("DDP's buckets start as a new wrapper's: %s", why_not)
        apply_rank_state(
            plan.rank_state, path, self.world_size, plan.saved_world_size,
            save_rng=self.save_rng, dataloader=self.dataloader,
        )

    def _agree(self, reason: str | None) -> str | None:
        """Every rank's outcome, merged: None when it succeeded everywhere, else the reason(s)."""
        if not self._dist_on:
            return reason
        dist = import_torch_dist()
        reasons: list[str | None] = [None] * dist.get_world_size(self._pg)
        dist.all_gather_object(reasons, reason, group=self._pg)
        return merge_reasons(reasons)

    def _load_dcp(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._dcp_state()
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), process_group=self._pg, no_dist=not self._dist_on)
        if self.model is not None:
            if self.optimizers:
                set_state_dict(
                    self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
                )
            else:
                set_model_state_dict(self.model, state["model"])

    # -- export ---------------------------------------------------------------------------
    def export(
        self,
        out_dir: str | os.PathLike[str],
        *,
        step: int | None = None,
        model: Any = None,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write a checkpoint's model weights to one folder for inference (rank 0 writes).

        Call on every rank of a run (the others wait) or in a plain process. See
        :func:`gpufleet.checkpoint.export_checkpoint` for the formats.

        Args:
            out_dir: the folder to write.
            step: which checkpoint; the newest complete one by default.
            model: an unwrapped model to load the weights into first; a Hugging Face
                ``PreTrainedModel`` is then written with ``save_pretrained``.
            dtype: cast floating-point weights to this dtype (e.g. ``torch.bfloat16``).

        Returns:
            ``out_dir``.
        """
        self.wait()
        if step is None:
            latest = self.latest()
            if latest is None:
                raise CheckpointError(f"no complete checkpoint in {self.root} to export")
            step = latest.step
        out = Path(out_dir)
        if self.rank == 0:
            export_checkpoint(layout.step_dir(self.root, step), out, model=model, dtype=dtype)
        self._barrier()
        return out

