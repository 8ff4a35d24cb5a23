"""Mixed precision in one place: dtypes, autocast contexts and gradient scalers per technique."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["torch_dtype", "autocast_context", "make_grad_scaler"]


def torch_dtype(precision: str) -> Any:
    """The compute dtype of ``bf16``/``fp16``/``no``: ``torch.bfloat16``, ``float16``, ``float32``."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[precision]


def autocast_context(precision: str, device: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device``'s type (a null context for ``no``)."""
    if precision == "no":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device.type, dtype=torch_dtype(precision))


def make_grad_scaler(precision: str, device: Any, sharded: bool = False) -> Any:
    """A gradient scaler for ``fp16`` (``None`` otherwise); ``sharded`` for FSDP2's sharded grads."""
    if precision != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    import torch

    return torch.amp.GradScaler(device.type)
