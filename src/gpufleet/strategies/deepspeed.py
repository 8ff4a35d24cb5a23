"""DeepSpeed ZeRO 1/2/3 (+ offload) through ``deepspeed.initialize``."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..launch.progress import note_optimizer_step, section
from .base import PreparedModel
from .config import StrategyConfigError, StrategyPlan
from .precision import torch_dtype

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedPreparedModel", "prepare_deepspeed"]


def import_deepspeed() -> Any:
    """Import DeepSpeed (selecting its CPU accelerator when there is no GPU)."""
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    except ImportError as e:
        raise ImportError("strategy='deepspeed' needs DeepSpeed: pip install 'gpufleet[deepspeed]'") from e
    return deepspeed


class DeepSpeedPreparedModel(PreparedModel):
    """A ``DeepSpeedEngine``: DeepSpeed scales, accumulates, clips and zeroes gradients itself."""

    def _cast_inputs(self, value: Any) -> Any:
        import torch

        if isinstance(value, torch.Tensor):
            return value.to(self._dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self._cast_inputs(v) for k, v in value.items()}
        return value

    @property
    def _dtype(self) -> Any:
        return torch_dtype(self.mixed_precision)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # DeepSpeed keeps bf16/fp16 weights on the module: floating inputs must match them
        if self.mixed_precision != "no":
            args, kwargs = self._cast_inputs(args), self._cast_inputs(kwargs)
        return self.model(*args, **kwargs)

    @property
    def is_accumulation_boundary(self) -> bool:
        return bool(self.model.is_gradient_accumulation_boundary())

    def backward(self, loss: Any) -> None:
        self.model.backward(loss)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        configured = float(self.model.gradient_clipping() or 0.0)
        if configured != float(max_norm) or norm_type != 2.0:
            raise StrategyConfigError(
                f"DeepSpeed clips gradients inside step() to the configured gradient_clipping "
                f"({configured or 'not set'}), not to {max_norm} (norm {norm_type}); pass "
                f"DeepSpeedConfig(gradient_clipping={max_norm}) to prepare() so both agree"
            )
        norm = self.model.get_global_grad_norm()  # of the last step; DeepSpeed clips in step()
        return None if norm is None else float(norm)

    def step(self) -> None:
        boundary = self.is_accumulation_boundary
        self.model.step()
        if boundary:
            note_optimizer_step()  # a step for the hang watchdog and for faults given step=N
        self._stepped = boundary
        self.micro_step += 1

    def zero_grad(self) -> None:
        """A no-op: DeepSpeed clears the gradients itself after each optimizer step."""

    def unwrap(self) -> Any:
        return self.model.module

    def state_dict(self) -> dict[str, Any]:
        deepspeed = import_deepspeed()
        module = self.unwrap()
        if self.model.zero_optimization_stage() == 3:
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def prepare_deepspeed(model: Any, optimizer: Any, plan: StrategyPlan, device: Any) -> DeepSpeedPreparedModel:
    """Create the ``DeepSpeedEngine`` for ``model`` with the resolved config."""
    deepspeed = import_deepspeed()
    import torch.distributed as dist

    config = plan.deepspeed_config
    assert config is not None
    if dist.is_initialized() and config["train_batch_size"] != (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * dist.get_world_size()
    ):
        raise StrategyConfigError("internal: the DeepSpeed config was resolved for another world size")
    kwargs: dict[str, Any] = {"model": model, "config": config}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    else:
        kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    # a long phase, never taken for a hang: on a new machine DeepSpeed builds its ops here (its
    # shared-memory op on CPU, a minute or more), one rank compiling while the others wait for it
    with section("deepspeed.initialize"):
        engine, ds_optimizer, _, _ = deepspeed.initialize(**kwargs)
    logger.info(
        "DeepSpeed ready: ZeRO stage %s, precision %s, train_batch_size %s",
        engine.zero_optimization_stage(),
        plan.mixed_precision,
        config["train_batch_size"],
    )
    return DeepSpeedPreparedModel(engine, ds_optimizer, plan, engine.device)
