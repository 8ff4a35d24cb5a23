"""Typed options of each parallelism technique (DDP, FSDP2, DeepSpeed ZeRO) and their checks.

Each option class checks its own fields when it is built and raises
:class:`StrategyConfigError`; plain Python (no torch, no DeepSpeed). Checks that need more
than one class, or the world size, are in :mod:`.config`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import GpufleetError

__all__ = ["StrategyConfigError", "DDPConfig", "FSDP2Config", "DeepSpeedConfig"]

_OFFLOAD_DEVICES = ("cpu", "nvme")


class StrategyConfigError(GpufleetError, ValueError):
    """A parallelism option is wrong or contradicts another; raised before training starts."""


def _check_compile(owner: str, value: Any) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise StrategyConfigError(
            f"{owner}.compile must be True, False or a dict of torch.compile keyword arguments "
            f"(e.g. {{'mode': 'max-autotune'}}), got {value!r}"
        )


@dataclass(frozen=True)
class DDPConfig:
    """Options of ``torch.nn.parallel.DistributedDataParallel``.

    Attributes:
        bucket_cap_mb: size of the gradient all-reduce buckets (MiB). ``None`` keeps torch's
            default (25); larger buckets help big models on fast links.
        static_graph: tell DDP the set of used parameters never changes between iterations
            (enables its graph optimisations and works with activation checkpointing).
        find_unused_parameters: allow parameters that get no gradient in some iterations.
        gradient_as_bucket_view: gradients are views into the buckets (saves one copy of the
            gradients' memory).
        broadcast_buffers: broadcast module buffers (e.g. BatchNorm statistics) from rank 0 at
            every forward.
        comm_hook: ``"bf16"`` or ``"fp16"`` all-reduces the gradients in 16 bits (torch's
            ``bf16_compress_hook`` / ``fp16_compress_hook``: half the traffic, the average is
            rounded to 16 bits before it is cast back); ``None`` (default) keeps them fp32.
        compile: ``torch.compile`` each transformer block (found as for FSDP2; the whole model
            when it has no blocks). ``True`` uses torch's defaults; a dict is passed to
            ``torch.compile`` as keyword arguments, e.g. ``{"mode": "max-autotune"}``. Blocks
            are compiled one by one so that gradient communication still overlaps backward.
    """

    bucket_cap_mb: float | None = None
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool = True
    comm_hook: str | None = None
    compile: bool | dict[str, Any] = False

    def __post_init__(self) -> None:
        _check_compile("DDPConfig", self.compile)
        if self.comm_hook not in (None, "bf16", "fp16"):
            raise StrategyConfigError(f"DDPConfig.comm_hook must be 'bf16', 'fp16' or None, got {self.comm_hook!r}")
        if self.bucket_cap_mb is not None and not (
            isinstance(self.bucket_cap_mb, (int, float)) and self.bucket_cap_mb > 0
        ):
            raise StrategyConfigError(f"DDPConfig.bucket_cap_mb must be a positive number of MiB or None, got {self.bucket_cap_mb!r}")
        if self.static_graph and self.find_unused_parameters:
            raise StrategyConfigError(
                "DDPConfig: static_graph=True and find_unused_parameters=True are redundant and "
                "slow; a static graph already knows the unused parameters. Set only static_graph=True."
            )


@dataclass(frozen=True)
class FSDP2Config:
    """Options of FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Attributes:
        block_classes: names (or classes) of the modules to shard one by one, usually the
            transformer blocks. ``None`` finds them: a Hugging Face model's
            ``_no_split_modules``, else the class of the blocks in the largest
            ``nn.ModuleList``.
        reshard_after_forward: free the gathered parameters after each block's forward
            (``True``, least memory), keep them until backward (``False``, fewer all-gathers),
            or reshard to a smaller group of this many ranks (an ``int``).
        activation_checkpointing: recompute each block's activations in backward instead of
            keeping them (less memory, about a third more compute).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
        reduce_dtype: dtype of the gradient reduce-scatter: ``"fp32"`` (default, exact
            averaging) or ``"bf16"`` (half the traffic).
        compile: ``torch.compile`` each block that is sharded one by one. ``True`` uses torch's
            defaults; a dict is passed to ``torch.compile`` as keyword arguments, e.g.
            ``{"mode": "max-autotune"}``. Compiling block by block keeps the all-gathers and
            reduce-scatters overlapping compute.
    """

    block_classes: tuple[Any, ...] | None = None
    reshard_after_forward: bool | int = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reduce_dtype: str = "fp32"
    compile: bool | dict[str, Any] = False

    def __post_init__(self) -> None:
        _check_compile("FSDP2Config", self.compile)
        if self.block_classes is not None:
            value = self.block_classes
            if isinstance(value, (str, type)):
                value = (value,)
            object.__setattr__(self, "block_classes", tuple(value))
            if not self.block_classes:
                raise StrategyConfigError("FSDP2Config.block_classes is empty; name at least one module class, or pass None to find the blocks automatically")
        r = self.reshard_after_forward
        if not isinstance(r, bool) and not (isinstance(r, int) and r > 1):
            raise StrategyConfigError(f"FSDP2Config.reshard_after_forward must be True, False or an int > 1 (ranks to reshard to), got {r!r}")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise StrategyConfigError(f"FSDP2Config.reduce_dtype must be 'fp32' or 'bf16', got {self.reduce_dtype!r}")


@dataclass(frozen=True)
class DeepSpeedConfig:
    """Options of DeepSpeed ZeRO; they generate the DeepSpeed config (or check a given one).

    Typed fields left at ``None`` take the value of ``config`` (a user dict or JSON file passed
    through) when one is given, else a default. A typed field that contradicts ``config`` is an
    error: say it once.

    Attributes:
        zero_stage: ZeRO stage 0 (plain data parallel), 1 (optimizer state sharded),
            2 (+ gradients) or 3 (+ parameters). Default 2.
        offload_optimizer: ``"cpu"`` or ``"nvme"`` to keep optimizer state off the GPU.
        offload_param: ``"cpu"`` or ``"nvme"`` to keep parameters off the GPU (ZeRO-3 only).
        nvme_path: folder for NVMe offload.
        micro_batch_size: samples per GPU per forward (``train_micro_batch_size_per_gpu``).
            Default 1; it only sizes DeepSpeed's own data loader and throughput logs, since your
            loop feeds the batches.
        train_batch_size: global batch; must equal micro batch x accumulation x world size.
        gradient_clipping: clip the global gradient norm to this value inside ``step()``.
        optimizer: DeepSpeed ``optimizer`` section (``{"type": "AdamW", "params": {...}}``),
            used when ``prepare`` gets no torch optimizer.
        scheduler: DeepSpeed ``scheduler`` section.
        overlap_comm: overlap gradient reduction with backward.
        reduce_bucket_size: elements per gradient reduce bucket.
        gather_16bit_weights_on_model_save: under ZeRO-3, gather the full weights when a
            full state dict is asked for.
        config: a DeepSpeed config dict, or the path of a JSON file, passed through.
        extra: more top-level keys merged into the generated config.
    """

    zero_stage: int | None = None
    offload_optimizer: str | None = None
    offload_param: str | None = None
    nvme_path: str | None = None
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    gradient_clipping: float | None = None
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    overlap_comm: bool | None = None
    reduce_bucket_size: int | None = None
    gather_16bit_weights_on_model_save: bool | None = None
    config: dict[str, Any] | str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise StrategyConfigError(f"DeepSpeedConfig.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name in ("offload_optimizer", "offload_param"):
            value = getattr(self, name)
            if value is not None and value not in _OFFLOAD_DEVICES:
                raise StrategyConfigError(f"DeepSpeedConfig.{name} must be 'cpu', 'nvme' or None, got {value!r}")
        for name in ("micro_batch_size", "train_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise StrategyConfigError(f"DeepSpeedConfig.{name} must be a positive integer, got {value!r}")
        if self.gradient_clipping is not None and not (
            isinstance(self.gradient_clipping, (int, float)) and self.gradient_clipping >= 0
        ):
            raise StrategyConfigError(f"DeepSpeedConfig.gradient_clipping must be a number >= 0, got {self.gradient_clipping!r}")
        if self.config is not None and not isinstance(self.config, (dict, str, os.PathLike)):
            raise StrategyConfigError("DeepSpeedConfig.config must be a dict or the path of a DeepSpeed JSON file")

    def user_config(self) -> dict[str, Any]:
        """The user's DeepSpeed config (a copy), read from the JSON file when a path was given."""
        if self.config is None:
            return {}
        if isinstance(self.config, dict):
            return json.loads(json.dumps(self.config))
        path = os.fspath(self.config)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError as e:
            raise StrategyConfigError(f"DeepSpeed config file {path!r} does not exist") from e
        except json.JSONDecodeError as e:
            raise StrategyConfigError(f"DeepSpeed config file {path!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise StrategyConfigError(f"DeepSpeed config file {path!r} must hold a JSON object")
        return data
