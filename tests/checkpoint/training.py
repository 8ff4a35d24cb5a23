"""A small, fully seeded training job run on every rank by the checkpoint tests."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

NUM_FEATURES = 4


def make_data(directory: Path, num_files: int = 6, per_file: int = 5) -> int:
    """Write ``num_files`` .pt files of rows ``[sample_id, x..., y]``; returns the sample count."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1234)
    sample_id = 0
    for f in range(num_files):
        n = per_file + f % 2  # files of different sizes
        ids = torch.arange(sample_id, sample_id + n, dtype=torch.float32).unsqueeze(1)
        x = torch.randn(n, NUM_FEATURES, generator=gen)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=gen)
        torch.save(torch.cat([ids, x, y], dim=1), directory / f"part-{f:03d}.pt")
        sample_id += n
    return sample_id


def build_model(seed: int = 0, hidden: int = 16) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # uses torch's RNG: resume must restore it
        torch.nn.Linear(hidden, 1),
    )


def wrap(model: Any, strategy: str) -> Any:
    """Wrap the model for ``strategy``: "ddp", "fsdp2" or "none"."""
    import torch.distributed as dist

    if strategy == "ddp" and dist.get_world_size() > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        return fully_shard(model)
    return model


def full_params(model: Any) -> dict[str, Any]:
    """Full (unsharded) CPU copies of the parameters, keyed by unwrapped names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone().cpu() for k, v in sd.items()}


def full_optim_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer's full state (exp_avg etc. per parameter name)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {
        name: {k: v.clone().cpu() for k, v in st.items() if hasattr(v, "clone")}
        for name, st in osd["state"].items()
    }


def train_step(model: Any, optimizer: Any, scheduler: Any, batch: Any) -> dict[str, Any]:
    """One step on ``batch`` (rows ``[sample_id, x..., y]``), with noise from every RNG a loop
    uses (torch, NumPy, Python: resume must restore them all); its loss and sample ids."""
    import numpy as np
    import torch

    ids, x, y = batch[:, 0], batch[:, 1:-1], batch[:, -1:]
    x = x + 0.01 * torch.randn_like(x) + float(np.random.normal(0, 0.01)) + random.uniform(-0.01, 0.01)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return {"loss": loss.item(), "ids": ids.long().tolist()}


def train(
    ckpt_dir: str,
    data_dir: str,
    total_steps: int,
    *,
    save_every: int = 0,
    stop_after: int | None = None,
    kill_after_stop: bool = False,
    kill_only_on_attempt: str | None = None,
    async_save: bool = False,
    strategy: str = "ddp",
    num_workers: int = 1,
    keep_last: int | None = 3,
    record_dir: str | None = None,
    tag: str = "run",
) -> dict[str, Any]:
    """Train from the newest checkpoint (if any) up to ``total_steps``.

    Returns (per rank) the steps run with their loss and sample ids, the step resumed
    from, and the final full parameters. With ``stop_after`` it stops after saving that
    step; ``kill_after_stop`` then SIGKILLs this rank (records are written to
    ``record_dir`` first).
    """
    import numpy as np
    import torch
    import torch.distributed as dist

    from gpufleet import runtime
    from gpufleet.checkpoint import CheckpointManager
    from gpufleet.data import FileDataset, TimedDataLoader

    runtime.setup()
    rank = dist.get_rank()
    model = wrap(build_model(), strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    dataset = FileDataset(data_dir, pattern="*.pt", cache_dir=Path(ckpt_dir).parent / f"cache-{tag}", seed=7)
    loader = TimedDataLoader(dataset, batch_size=2, num_workers=num_workers)
    manager = CheckpointManager(
        ckpt_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataloader=loader,
        keep_last=keep_last,
        async_save=async_save,
    )
    # Every RNG the loop uses is seeded per rank here and restored by resume().
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    resumed = manager.resume()
    start = resumed or 0
    records: list[dict[str, Any]] = []
    it = iter(loader)
    for step in range(start + 1, total_steps + 1):
        try:
            batch = next(it)
        except StopIteration:  # a new epoch
            it = iter(loader)
            batch = next(it)
        records.append({"step": step, **train_step(model, optimizer, scheduler, batch)})
        if save_every and step % save_every == 0:
            manager.save(step)
        if stop_after is not None and step == stop_after:
            manager.save(step)
            manager.wait()
            kill = kill_after_stop and (
                kill_only_on_attempt is None or os.environ.get("GPUFLEET_ATTEMPT") == kill_only_on_attempt
            )
            if kill:
                if record_dir:
                    Path(record_dir, f"{tag}-rank{rank}.json").write_text(json.dumps(records))
                # Every rank has its records written, and rank 0 the checkpoint's completion marker,
                # before any rank dies: the launcher stops the survivors about 1 s after the first
                # death, which a loaded machine could otherwise hit before rank 0 is done.
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            break
    manager.close()
    return {
        "rank": rank,
        "resumed": resumed,
        "records": records,
        "params": full_params(model),
        "attempt": os.environ.get("GPUFLEET_ATTEMPT"),
        "wait_stats": loader.wait_stats(),
    }


def train_and_die_in_save(ckpt_dir: str, data_dir: str, total_steps: int, *, die_at_step: int, dying_rank: int = 1, **kwargs: Any) -> dict[str, Any]:
    """Like :func:`train`, but ``dying_rank`` SIGKILLs itself in the middle of saving
    ``die_at_step``: after writing its shard, before the checkpoint's metadata exists."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    original = fs.FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        future = original(self, plan, planner)
        if dist.get_rank() == dying_rank and Path(str(self.path)).name == f"step-{die_at_step}":
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    fs.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    return train(ckpt_dir, data_dir, total_steps, **kwargs)


def train_fixed_batches(ckpt_dir: str, strategy: str, train_steps: int) -> dict[str, Any]:
    """Resume (if possible), report what was loaded, train ``train_steps`` steps on a fixed
    batch (the same on every rank) and save; every rank returns full copies of the states."""
    import torch
    import torch.distributed as dist

    from gpufleet import runtime
    from gpufleet.checkpoint import CheckpointManager

    runtime.setup()
    model = wrap(build_model(), strategy)
    model.eval()  # no dropout: the same batch gives the same update on any number of ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    manager = CheckpointManager(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler)
    resumed = manager.resume() or 0
    loaded = {
        "params": full_params(model),
        "optim": full_optim_state(model, optimizer),
        "lr": scheduler.get_last_lr(),
    }
    gen = torch.Generator().manual_seed(5)
    for _ in range(train_steps):
        x = torch.randn(8, NUM_FEATURES, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    manager.save(resumed + train_steps)
    manager.close()
    final = {"params": full_params(model), "optim": full_optim_state(model, optimizer), "lr": scheduler.get_last_lr()}
    tensors = [*final["params"].values(), *(t for s in final["optim"].values() for t in s.values())]
    return {
        "world_size": dist.get_world_size(),
        "resumed": resumed,
        "tensor_bytes": manager.last_save["tensor_bytes"],
        "full_state_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "loaded": loaded,
        "final": final,
    }


def train_deepspeed(ckpt_dir: str, save_at: int, total_steps: int) -> dict[str, Any]:
    """A ZeRO-2 DeepSpeed engine on CPU behind the same manager: resume, train, save at ``save_at``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from gpufleet import runtime
    from gpufleet.checkpoint import CheckpointManager

    runtime.setup()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)  # a torch optimizer: no op to compile
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    manager = CheckpointManager(ckpt_dir, model=engine, scheduler=scheduler)
    torch.manual_seed(10 + dist.get_rank())
    resumed = manager.resume() or 0
    losses, saved_params = {}, None
    for step in range(resumed + 1, total_steps + 1):
        x = torch.randn(4, NUM_FEATURES)  # from the restored RNG
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        scheduler.step()
        losses[step] = loss.item()
        if step == save_at:
            manager.save(step)
            saved_params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {
        "resumed": resumed,
        "skipped": [(s.step, s.reason) for s in manager.last_resume["skipped"]],
        "losses": losses,
        "saved_params": saved_params,
        "lr": scheduler.get_last_lr(),
    }


def _fixed_setup(ckpt_dir: str, strategy: str) -> tuple[Any, Any, Any, Any]:
    import torch

    from gpufleet.checkpoint import CheckpointManager

    model = wrap(build_model(), strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    manager = CheckpointManager(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, keep_last=None)
    return model, optimizer, scheduler, manager


def save_at_steps(ckpt_dir: str, steps: list[int], strategy: str = "ddp") -> dict[str, Any]:
    """Train on fixed batches from a fresh start and save at each of ``steps``; every rank
    returns, per saved step, the full state it saved and its torch RNG state."""
    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    runtime.setup()
    model, optimizer, scheduler, manager = _fixed_setup(ckpt_dir, strategy)
    torch.manual_seed(100 + dist.get_rank())  # dropout draws from it: per rank, restored by resume
    gen = torch.Generator().manual_seed(5)
    saved = {}
    for step in range(1, max(steps) + 1):
        x = torch.randn(8, NUM_FEATURES, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step in steps:
            saved[step] = {
                "params": full_params(model),
                "optim": full_optim_state(model, optimizer),
                "lr": scheduler.get_last_lr(),
                "rng": torch.get_rng_state(),
            }
            manager.save(step)
    manager.close()
    return saved


def resume_and_report(ckpt_dir: str, strategy: str = "ddp") -> dict[str, Any]:
    """Resume into freshly built objects; every rank returns the step, the checkpoints skipped,
    the checkpoint warnings it logged and the full state it loaded."""
    from gpufleet import runtime

    runtime.setup()
    return _resume_into_fresh_objects(ckpt_dir, strategy)


def resume_each_and_report(ckpt_dirs: list[str], strategy: str = "ddp") -> list[dict[str, Any]]:
    """:func:`resume_and_report` for each folder in turn, in one launch (one report per folder)."""
    from gpufleet import runtime

    runtime.setup()
    return [_resume_into_fresh_objects(d, strategy) for d in ckpt_dirs]


def _resume_into_fresh_objects(ckpt_dir: str, strategy: str) -> dict[str, Any]:
    import logging

    import torch

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("gpufleet.checkpoint").addHandler(handler)
    model, optimizer, scheduler, manager = _fixed_setup(ckpt_dir, strategy)
    torch.manual_seed(999)  # not the saved state: resume must restore it
    resumed = manager.resume()
    logging.getLogger("gpufleet.checkpoint").removeHandler(handler)
    return {
        "resumed": resumed,
        "skipped": [(s.step, s.path.name, s.reason) for s in manager.last_resume["skipped"]],
        "warnings": warnings,
        "params": full_params(model),
        "optim": full_optim_state(model, optimizer),
        "lr": scheduler.get_last_lr(),
        "rng": torch.get_rng_state(),
    }


def train_replaceable(ckpt_dir: str, data_dir: str, total_steps: int, record_dir: str, *, num_workers: int = 0,
                      raise_at: int | None = None, use_steps: bool = True, strategy: str = "ddp",
                      replica_every: int = 5, hidden: int = 16, save_every: int = 0) -> dict[str, Any]:  # fmt: skip
    """The loop of docs/recovery.md: like :func:`train`, over ``manager.steps(...)``; each step's
    record (step, loss, sample ids, pid) is appended to ``record_dir/rank{R}.jsonl`` as it ends, since
    a rank replaced in place runs this function again. ``raise_at``: rank 1 raises at that step;
    ``use_steps=False``: a plain ``range`` loop, which tells gpufleet nothing of where steps end;
    ``strategy``: "ddp" or "fsdp2" (whose shards are copied to the next rank every ``replica_every`` steps);
    ``hidden``: the model's width; ``save_every``: a checkpoint every that many steps (0: none)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from gpufleet import runtime
    from gpufleet.checkpoint import CheckpointManager
    from gpufleet.data import FileDataset, TimedDataLoader

    runtime.setup()
    rank = dist.get_rank()
    model = wrap(build_model(hidden=hidden), strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    dataset = FileDataset(data_dir, pattern="*.pt", cache_dir=Path(ckpt_dir).parent / "cache", seed=7)
    loader = TimedDataLoader(dataset, batch_size=2, num_workers=num_workers)
    manager = CheckpointManager(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                                replica_every=replica_every)  # fmt: skip
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    resumed = manager.resume()
    start = resumed or 0
    it = iter(loader)
    with open(Path(record_dir) / f"rank{rank}.jsonl", "a") as out:
        for step in manager.steps(start + 1, total_steps + 1) if use_steps else range(start + 1, total_steps + 1):
            try:
                batch = next(it)
            except StopIteration:  # a new epoch
                it = iter(loader)
                batch = next(it)
            if raise_at == step and rank == 1:
                raise ValueError(f"a bug at step {step}")
            record = {"step": step, **train_step(model, optimizer, scheduler, batch), "pid": os.getpid()}
            out.write(json.dumps(record) + "\n")
            out.flush()
            if save_every and step % save_every == 0:
                manager.save(step)
    manager.close()
    return {"rank": rank, "params": full_params(model), "pid": os.getpid(), "attempt": os.environ.get("GPUFLEET_ATTEMPT")}


def read_records(record_dir: str, rank: int) -> list[dict[str, Any]]:
    """The records :func:`train_replaceable` appended for ``rank``, in order."""
    lines = (Path(record_dir) / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
