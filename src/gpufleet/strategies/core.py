"""``prepare``: the one switch between DDP, FSDP2 and DeepSpeed."""

from __future__ import annotations

import logging
from typing import Any

from .base import PreparedModel
from .config import StrategyConfigError, plan

logger = logging.getLogger(__name__)

__all__ = ["prepare"]


def prepare(
    model: Any,
    optimizer: Any = None,
    strategy: str | None = None,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    config: Any = None,
    **options: Any,
) -> PreparedModel:
    """Prepare ``model`` (and ``optimizer``) for DDP, FSDP2 or DeepSpeed ZeRO.

    Call it inside every rank, after :func:`gpufleet.runtime.setup` (it calls ``setup()`` itself
    when no process group exists yet).

    Args:
        model: the ``nn.Module`` (on CPU or already on this rank's device).
        optimizer: a torch optimizer built over ``model.parameters()``, or a callable that
            builds one from an iterable of parameters. ``None`` is allowed for DeepSpeed when its
            config has an ``optimizer`` section.
        strategy: ``"ddp"``, ``"fsdp2"`` or ``"deepspeed"`` (``None``: from ``config``'s type,
            else ``"ddp"``).
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``"no"``; set here and nowhere else.
        gradient_accumulation_steps: micro-steps per optimizer step (default 1).
        config: a :class:`DDPConfig`, :class:`FSDP2Config` or :class:`DeepSpeedConfig`.
        **options: fields of the strategy's config, e.g. ``zero_stage=3`` or
            ``activation_checkpointing=True``.

    Returns:
        A :class:`PreparedModel` with the loop API (``prepared(x)``, ``backward``,
        ``clip_grad_norm``, ``step``, ``zero_grad``, ``no_sync``/``accumulate``, ``unwrap``,
        ``state_dict``).

    Raises:
        StrategyConfigError: wrong or contradicting options (the message says what to change).
    """
    import torch.distributed as dist
    import torch.nn as nn

    from .. import runtime

    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() takes a torch.nn.Module, got a {type(model).__name__}")
    if optimizer is not None and callable(optimizer) and not hasattr(optimizer, "param_groups"):
        optimizer = optimizer(model.parameters())
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer must be a torch optimizer or a callable building one, got a {type(optimizer).__name__}")
    device = runtime.setup() if not dist.is_initialized() else runtime.device()
    resolved = plan(
        strategy,
        mixed_precision,
        gradient_accumulation_steps,
        world_size=dist.get_world_size(),
        config=config,
        has_optimizer=optimizer is not None,
        **options,
    )
    if resolved.strategy == "deepspeed" and resolved.mixed_precision == "fp16" and device.type == "cpu":
        raise StrategyConfigError("DeepSpeed has no fp16 on CPU; use mixed_precision='bf16' or 'no' there")
    if resolved.strategy == "ddp":
        from .ddp import prepare_ddp

        return prepare_ddp(model, optimizer, resolved, device)
    if resolved.strategy == "fsdp2":
        from .fsdp import prepare_fsdp2

        return prepare_fsdp2(model, optimizer, resolved, device)
    from .deepspeed import prepare_deepspeed

    return prepare_deepspeed(model, optimizer, resolved, device)
