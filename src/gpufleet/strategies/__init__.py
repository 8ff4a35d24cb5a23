"""How the model is distributed: DDP, FSDP2 and DeepSpeed ZeRO behind one switch, and the advisor.

``prepare(model, optimizer, strategy="fsdp2", mixed_precision="bf16")`` returns a prepared
model whose small loop API is the same under every technique; ``advise(...)`` estimates the
per-GPU memory of each technique and recommends one. Importing this package does not import
torch or DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from .config import (
    PRECISIONS,
    STRATEGIES,
    DDPConfig,
    DeepSpeedConfig,
    FSDP2Config,
    StrategyConfigError,
    StrategyPlan,
    plan,
)

__all__ = [
    "prepare",
    "plan",
    "advise",
    "Advice",
    "PreparedModel",
    "DDPConfig",
    "FSDP2Config",
    "DeepSpeedConfig",
    "StrategyPlan",
    "StrategyConfigError",
    "STRATEGIES",
    "PRECISIONS",
]


def __getattr__(name: str) -> Any:
    if name == "prepare":
        from .core import prepare

        return prepare
    if name == "PreparedModel":
        from .base import PreparedModel

        return PreparedModel
    if name in ("advise", "Advice"):
        from . import advisor

        return getattr(advisor, name)
    raise AttributeError(f"module 'gpufleet.strategies' has no attribute {name!r}")
