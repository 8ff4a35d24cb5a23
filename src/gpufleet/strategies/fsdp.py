"""FSDP2: ``fully_shard`` on each transformer block and on the root, with ``MixedPrecisionPolicy``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from .base import TorchPreparedModel
from .config import FSDP2Config, StrategyConfigError, StrategyPlan
from .precision import make_grad_scaler, torch_dtype

logger = logging.getLogger(__name__)

__all__ = ["FSDP2PreparedModel", "find_block_classes", "prepare_fsdp2"]


def _class_matches(cls: type, wanted: Any) -> bool:
    if isinstance(wanted, type):
        return issubclass(cls, wanted)
    return wanted in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")


def find_block_classes(model: Any, names: tuple[Any, ...] | None = None) -> tuple[type, ...]:
    """The classes of the modules to shard one by one (the transformer blocks).

    Args:
        model: the ``nn.Module``.
        names: class names or classes given by the user; ``None`` finds them: a Hugging Face
            model's ``_no_split_modules``, else the class of the children of the largest
            ``nn.ModuleList`` whose children share one class.

    Raises:
        StrategyConfigError: a named class is not in the model, or no blocks were found.
    """
    import torch.nn as nn

    present = {type(m) for m in model.modules()}
    if names is not None:
        found: list[type] = []
        for wanted in names:
            matches = [c for c in present if _class_matches(c, wanted)]
            if not matches:
                available = sorted({c.__name__ for c in present})
                raise StrategyConfigError(
                    f"FSDP2Config.block_classes names {getattr(wanted, '__name__', wanted)!r}, which is not a "
                    f"module class of this model; its classes are: {', '.join(available)}"
                )
            found += matches
        return tuple(dict.fromkeys(found))
    no_split = getattr(model, "_no_split_modules", None)
    if no_split:
        found = [c for c in present if c.__name__ in set(no_split)]
        if found:
            return tuple(found)
    best: tuple[int, type] | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(child) for child in module}
            if len(classes) == 1:
                size = sum(p.numel() for p in module.parameters())
                if best is None or size > best[0]:
                    best = (size, classes.pop())
    if best is None:
        raise StrategyConfigError(
            f"could not find the transformer blocks of {type(model).__name__} (no _no_split_modules and no "
            "nn.ModuleList of same-class blocks); name them with FSDP2Config(block_classes=('MyBlock',))"
        )
    return (best[1],)


class FSDP2PreparedModel(TorchPreparedModel):
    """A model sharded with ``fully_shard``; mixed precision comes from ``MixedPrecisionPolicy``."""

    def _set_grad_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def backward(self, loss: Any) -> None:
        super().backward(loss)
        self.model.set_requires_gradient_sync(True)

    def unwrap(self) -> Any:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in full.items()}


def _swap_optimizer_params(optimizer: Any, before: dict[str, Any], after: dict[str, Any]) -> None:
    """Point the optimizer at the sharded parameters that replaced the originals."""
    if any(optimizer.state.values()):
        raise StrategyConfigError(
            "the optimizer already has state (it has stepped); prepare the model before the first "
            "step, or load the optimizer state after prepare()"
        )
    name_of = {id(p): n for n, p in before.items()}
    for group in optimizer.param_groups:
        swapped = []
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None:
                raise StrategyConfigError(
                    "the optimizer holds a tensor that is not a parameter of the model; build the "
                    "optimizer over model.parameters()"
                )
            swapped.append(after[name])
        group["params"] = swapped


def prepare_fsdp2(model: Any, optimizer: Any, plan: StrategyPlan, device: Any) -> FSDP2PreparedModel:
    """Apply ``fully_shard`` per block (with optional activation checkpointing), then on the root."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cfg: FSDP2Config = plan.config
    block_classes = find_block_classes(model, cfg.block_classes)
    before = dict(model.named_parameters())
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if plan.mixed_precision != "no":
        reduce = torch.float32 if cfg.reduce_dtype == "fp32" else torch.bfloat16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch_dtype(plan.mixed_precision), reduce_dtype=reduce)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    blocks = [m for m in model.modules() if isinstance(m, block_classes)]
    if cfg.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)
    if cfg.compile:
        from .compiling import compile_modules

        compile_modules(model, blocks, cfg.compile)
    for block in blocks:
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    # the root's parameters (embeddings, head) are needed right away in backward: keep them
    fully_shard(model, reshard_after_forward=False, **kwargs)
    logger.info(
        "FSDP2 ready: %d %s block(s) sharded, %s",
        len(blocks),
        "/".join(c.__name__ for c in block_classes),
        {k: v for k, v in kwargs.items() if k != "mesh"},
    )
    if optimizer is not None:
        after = dict(model.named_parameters())
        _swap_optimizer_params(optimizer, before, after)
    scaler = make_grad_scaler(plan.mixed_precision, device, sharded=True)
    return FSDP2PreparedModel(model, optimizer, plan, device, scaler)
