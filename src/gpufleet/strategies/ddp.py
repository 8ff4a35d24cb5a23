"""DDP: ``torch.nn.parallel.DistributedDataParallel`` with autocast mixed precision."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from .base import TorchPreparedModel
from .config import DDPConfig, StrategyConfigError, StrategyPlan
from .precision import autocast_context, make_grad_scaler

logger = logging.getLogger(__name__)

__all__ = ["DDPPreparedModel", "prepare_ddp"]


class DDPPreparedModel(TorchPreparedModel):
    """A model wrapped in ``DistributedDataParallel``; forward runs under ``torch.autocast``.

    With a single rank there is nothing to synchronise and the model is left unwrapped.
    """

    @property
    def _is_ddp(self) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(self.model, DistributedDataParallel)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        skip_sync = self._is_ddp and not self.is_accumulation_boundary
        sync = self.model.no_sync() if skip_sync else contextlib.nullcontext()
        with sync, autocast_context(self.mixed_precision, self.device):
            return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.model.no_sync() if self._is_ddp else contextlib.nullcontext():
            yield

    def unwrap(self) -> Any:
        return self.model.module if self._is_ddp else self.model

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().cpu().clone() for k, v in self.unwrap().state_dict().items()}


def prepare_ddp(model: Any, optimizer: Any, plan: StrategyPlan, device: Any) -> DDPPreparedModel:
    """Move ``model`` to ``device`` and wrap it in ``DistributedDataParallel``."""
    from torch.nn.parallel import DistributedDataParallel

    cfg: DDPConfig = plan.config
    model.to(device)
    if cfg.compile:
        from .compiling import compile_modules
        from .fsdp import find_block_classes

        try:
            block_classes = find_block_classes(model)
            blocks = [m for m in model.modules() if isinstance(m, block_classes)]
        except StrategyConfigError:
            blocks = []  # no transformer blocks: compile the model as one
        compile_modules(model, blocks, cfg.compile)
    kwargs: dict[str, Any] = {
        "static_graph": cfg.static_graph,
        "find_unused_parameters": cfg.find_unused_parameters,
        "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
    }
    if not cfg.broadcast_buffers:  # only when asked: newer torch renames the option
        kwargs["broadcast_buffers"] = False
    if cfg.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = cfg.bucket_cap_mb
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        logger.info("one rank: the model is not wrapped in DDP")
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, **kwargs)
        if cfg.comm_hook == "bf16" and device.type != "cuda":
            raise StrategyConfigError(
                f"comm_hook='bf16' needs NCCL on CUDA GPUs (this rank runs on {device.type}); use comm_hook='fp16' or None"
            )
        if cfg.comm_hook is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[cfg.comm_hook]
            wrapped.register_comm_hook(state=None, hook=hook)
            kwargs["comm_hook"] = hook.__name__
        logger.info("DDP ready: %s", kwargs)
    return DDPPreparedModel(wrapped, optimizer, plan, device, make_grad_scaler(plan.mixed_precision, device))
