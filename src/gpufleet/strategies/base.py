"""The prepared model: one small loop API shared by DDP, FSDP2 and DeepSpeed.

A training loop written against :class:`PreparedModel` runs unchanged under every technique::

    for x, y in loader:
        loss = loss_fn(prepared(x), y)
        prepared.backward(loss)
        prepared.clip_grad_norm(1.0)
        prepared.step()
        prepared.zero_grad()

With ``gradient_accumulation_steps=N``, ``backward`` scales the loss by ``1/N``, gradients are
synchronised only on every N-th micro-step, and ``clip_grad_norm``/``step``/``zero_grad`` act
only on those steps (DeepSpeed's own semantics, applied to all three).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..launch.progress import note_optimizer_step
from .config import StrategyPlan

logger = logging.getLogger(__name__)

__all__ = ["PreparedModel", "TorchPreparedModel"]


class PreparedModel:
    """A model and optimizer prepared for one technique, with a loop API common to all.

    Attributes:
        model: the wrapped model (``DistributedDataParallel``, the ``fully_shard``-ed module,
            or the ``DeepSpeedEngine``).
        optimizer: the optimizer to use (DeepSpeed: its ZeRO optimizer).
        plan: the resolved options.
        device: this rank's ``torch.device``.
    """

    def __init__(self, model: Any, optimizer: Any, plan: StrategyPlan, device: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self.device = device
        self.micro_step = 0
        self._stepped = False

    # -- facts
    @property
    def strategy(self) -> str:
        """``"ddp"``, ``"fsdp2"`` or ``"deepspeed"``."""
        return self.plan.strategy

    @property
    def mixed_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"``."""
        return self.plan.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.plan.gradient_accumulation_steps

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window (gradients sync, step runs)."""
        return (self.micro_step + 1) % self.gradient_accumulation_steps == 0

    @property
    def optimizer_stepped(self) -> bool:
        """True when the last :meth:`step` updated the parameters (step your LR scheduler then)."""
        return self._stepped

    # -- the loop
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with this technique's precision and synchronisation."""
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (see :meth:`__call__`)."""
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> PreparedModel:
        """Put the model in training (or eval) mode."""
        self.model.train(mode)
        return self

    def eval(self) -> PreparedModel:
        """Put the model in eval mode."""
        return self.train(False)

    def parameters(self) -> Iterator[Any]:
        """The wrapped model's parameters (sharded under FSDP2 and ZeRO-3)."""
        return self.model.parameters()

    def backward(self, loss: Any) -> None:
        """Back-propagate ``loss`` (scaled by ``1/gradient_accumulation_steps``)."""
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        """Clip the global gradient norm on an accumulation boundary; returns the norm before clipping."""
        raise NotImplementedError

    def step(self) -> None:
        """Update the parameters on an accumulation boundary; count the micro-step."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Clear the gradients at the start of an accumulation window (a no-op inside one)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation for the forward/backward inside (manual accumulation)."""
        yield

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Skip gradient synchronisation inside unless this micro-step ends the window.

        Needed only when the loop calls ``prepared.model(...)`` directly instead of
        ``prepared(...)`` (which does this by itself).
        """
        if self.is_accumulation_boundary:
            yield
        else:
            with self.no_sync():
                yield

    # -- getting the model back
    def unwrap(self) -> Any:
        """The user's ``nn.Module`` inside the wrapper (its parameters stay sharded under FSDP2/ZeRO-3)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The full (unsharded) model state dict on CPU, on every rank. A collective: call it on all ranks."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(strategy={self.strategy!r}, mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )


class TorchPreparedModel(PreparedModel):
    """Shared loop of the torch-native techniques (DDP, FSDP2): torch optimizer, optional scaler."""

    def __init__(self, model: Any, optimizer: Any, plan: StrategyPlan, device: Any, scaler: Any = None) -> None:
        super().__init__(model, optimizer, plan, device)
        self.scaler = scaler
        self._unscaled = False

    def _require_optimizer(self) -> Any:
        if self.optimizer is None:
            raise RuntimeError("prepare() was given no optimizer; pass one to use step()/zero_grad()/clip_grad_norm()")
        return self.optimizer

    def _set_grad_sync(self, enabled: bool) -> None:
        """Turn gradient synchronisation on/off for the next backward (FSDP2 overrides)."""

    def backward(self, loss: Any) -> None:
        self._set_grad_sync(self.is_accumulation_boundary)
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def _grad_params(self) -> list[Any]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        if not self.is_accumulation_boundary:
            return None
        import torch

        optimizer = self._require_optimizer()
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True
        norm = torch.nn.utils.clip_grad_norm_(self._grad_params(), max_norm, norm_type=norm_type)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def step(self) -> None:
        boundary = self.is_accumulation_boundary
        if boundary:
            note_optimizer_step()  # a step for the hang watchdog and for faults given step=N
            optimizer = self._require_optimizer()
            if self.scaler is not None:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
            self._unscaled = False
        self._stepped = boundary
        self.micro_step += 1

    def zero_grad(self) -> None:
        if self.micro_step % self.gradient_accumulation_steps == 0:
            self._require_optimizer().zero_grad(set_to_none=True)
