"""Build (or check) the DeepSpeed config dict from typed options; plain Python, no DeepSpeed."""

from __future__ import annotations

from typing import Any

from .options import DeepSpeedConfig, StrategyConfigError

__all__ = ["build_deepspeed_config"]

_DEFAULT_STAGE = 2
_DEFAULT_MICRO_BATCH = 1
# Keys gpufleet fills when the user's config says "auto" (as Hugging Face's Trainer does).
_RESOLVED_AUTO = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
    "bfloat16.enabled",
}


def _auto_paths(value: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in a nested config."""
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            found += _auto_paths(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    elif isinstance(value, str) and value.strip().lower() == "auto":
        found.append(prefix)
    return found


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _num(ds: dict[str, Any], key: str) -> Any:
    value = ds.get(key)
    return None if _is_auto(value) else value


def _config_precision(ds: dict[str, Any]) -> str | None:
    """The precision a DeepSpeed config asks for (None when it does not say, or says auto)."""
    found = []
    for section, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        enabled = ds.get(section, {}).get("enabled") if isinstance(ds.get(section), dict) else None
        if enabled is True:
            found.append(name)
    if len(set(found)) > 1:
        raise StrategyConfigError("the DeepSpeed config enables both bf16 and fp16; enable only one")
    if found:
        return found[0]
    explicit_off = any(
        isinstance(ds.get(s), dict) and ds[s].get("enabled") is False for s in ("bf16", "bfloat16", "fp16")
    )
    return "no" if explicit_off else None


def _set_typed(ds: dict[str, Any], path: str, value: Any, field_name: str) -> None:
    """Put a typed option at ``path``; a different non-auto value already there is a conflict."""
    *parents, last = path.split(".")
    node = ds
    for p in parents:
        node = node.setdefault(p, {})
    current = node.get(last)
    if current is not None and not _is_auto(current) and current != value:
        raise StrategyConfigError(
            f"{path} is given twice: {current!r} in the DeepSpeed config and {value!r} as "
            f"DeepSpeedConfig.{field_name}; keep only one of them"
        )
    node[last] = value


def build_deepspeed_config(
    cfg: DeepSpeedConfig,
    mixed_precision: str | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
    has_optimizer: bool,
) -> tuple[dict[str, Any], str, int]:
    """The DeepSpeed config for ``world_size`` ranks, the precision and the accumulation steps.

    Raises:
        StrategyConfigError: conflicting batch sizes, precision or optimizer given twice,
            unresolved ``"auto"`` values, or offload options the ZeRO stage does not support.
    """
    ds = cfg.user_config()
    passed_through = cfg.config is not None

    # --- ZeRO section from typed options
    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise StrategyConfigError("zero_optimization in the DeepSpeed config must be an object")
    if cfg.zero_stage is not None:
        _set_typed(ds, "zero_optimization.stage", cfg.zero_stage, "zero_stage")
    zero.setdefault("stage", _DEFAULT_STAGE)
    stage = zero["stage"]
    if stage not in (0, 1, 2, 3):
        raise StrategyConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for field_name, key in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        device = getattr(cfg, field_name)
        if device is not None:
            _set_typed(ds, f"zero_optimization.{key}.device", device, field_name)
            if cfg.nvme_path:
                zero[key]["nvme_path"] = cfg.nvme_path
            if device == "cpu":
                zero[key].setdefault("pin_memory", True)
    if cfg.overlap_comm is not None:
        _set_typed(ds, "zero_optimization.overlap_comm", cfg.overlap_comm, "overlap_comm")
    if cfg.reduce_bucket_size is not None:
        _set_typed(ds, "zero_optimization.reduce_bucket_size", cfg.reduce_bucket_size, "reduce_bucket_size")
    if cfg.gather_16bit_weights_on_model_save is not None:
        _set_typed(
            ds,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            cfg.gather_16bit_weights_on_model_save,
            "gather_16bit_weights_on_model_save",
        )
    elif stage == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)

    def offload_device(key: str) -> str | None:
        section = zero.get(key)
        if isinstance(section, dict):
            device = section.get("device")
            return None if device in (None, "none") else device
        return None

    if offload_device("offload_param") and stage != 3:
        raise StrategyConfigError(
            f"parameter offload (offload_param) needs ZeRO stage 3, but the stage is {stage}; "
            "set zero_stage=3 or drop offload_param"
        )
    if offload_device("offload_optimizer") and stage == 0:
        raise StrategyConfigError(
            "optimizer offload (offload_optimizer) needs ZeRO stage 1, 2 or 3, but the stage is 0; "
            "set zero_stage to 1 or more, or drop offload_optimizer"
        )

    # --- precision: set in one place
    config_precision = _config_precision(ds)
    if mixed_precision is not None and config_precision is not None and config_precision != mixed_precision:
        raise StrategyConfigError(
            f"precision is given twice and they disagree: mixed_precision={mixed_precision!r} but the "
            f"DeepSpeed config asks for {config_precision!r}; set it in one place (drop the bf16/fp16 "
            "sections of the DeepSpeed config, or the mixed_precision argument)"
        )
    precision = mixed_precision or config_precision or "no"
    for section in ("bf16", "bfloat16", "fp16"):
        if isinstance(ds.get(section), dict) and _is_auto(ds[section].get("enabled")):
            ds[section]["enabled"] = (section in ("bf16", "bfloat16") and precision == "bf16") or (
                section == "fp16" and precision == "fp16"
            )
    if "bfloat16" in ds:  # DeepSpeed's old name; keep one spelling
        ds.setdefault("bf16", {}).update(ds.pop("bfloat16"))
    ds.setdefault("bf16", {})["enabled"] = precision == "bf16"
    ds.setdefault("fp16", {})["enabled"] = precision == "fp16"

    # --- batch sizes: micro x accumulation x world == global
    gas_cfg = _num(ds, "gradient_accumulation_steps")
    if gradient_accumulation_steps is not None and gas_cfg is not None and gas_cfg != gradient_accumulation_steps:
        raise StrategyConfigError(
            f"gradient_accumulation_steps is given twice: {gas_cfg} in the DeepSpeed config and "
            f"{gradient_accumulation_steps} as an argument; keep only one of them"
        )
    if cfg.micro_batch_size is not None:
        _set_typed(ds, "train_micro_batch_size_per_gpu", cfg.micro_batch_size, "micro_batch_size")
    if cfg.train_batch_size is not None:
        _set_typed(ds, "train_batch_size", cfg.train_batch_size, "train_batch_size")
    micro = _num(ds, "train_micro_batch_size_per_gpu")
    total = _num(ds, "train_batch_size")
    gas = gradient_accumulation_steps if gradient_accumulation_steps is not None else gas_cfg
    for name, value in (("train_micro_batch_size_per_gpu", micro), ("train_batch_size", total), ("gradient_accumulation_steps", gas)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise StrategyConfigError(f"{name} must be a positive integer, got {value!r}")
    if total is not None:
        if micro is not None and gas is not None:
            if total != micro * gas * world_size:
                raise StrategyConfigError(
                    f"train_batch_size={total} does not equal train_micro_batch_size_per_gpu ({micro}) x "
                    f"gradient_accumulation_steps ({gas}) x world size ({world_size}) = {micro * gas * world_size}; "
                    f"set train_batch_size to {micro * gas * world_size}, or drop it and let it be computed"
                )
        elif micro is not None:
            if total % (micro * world_size):
                raise StrategyConfigError(
                    f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu ({micro}) x "
                    f"world size ({world_size}); choose a train_batch_size that is, or set gradient_accumulation_steps"
                )
            gas = total // (micro * world_size)
        else:
            gas = gas or 1
            if total % (gas * world_size):
                raise StrategyConfigError(
                    f"train_batch_size={total} is not a multiple of gradient_accumulation_steps ({gas}) x "
                    f"world size ({world_size}); change train_batch_size or set train_micro_batch_size_per_gpu"
                )
            micro = total // (gas * world_size)
    gas = gas or 1
    micro = micro or _DEFAULT_MICRO_BATCH
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = gas
    ds["train_batch_size"] = micro * gas * world_size

    # --- gradient clipping
    if cfg.gradient_clipping is not None:
        _set_typed(ds, "gradient_clipping", float(cfg.gradient_clipping), "gradient_clipping")
    elif _is_auto(ds.get("gradient_clipping")) or "gradient_clipping" not in ds:
        # DeepSpeed's own default clips to 1.0; torch (DDP/FSDP2) clips only when asked
        ds["gradient_clipping"] = 0.0

    # --- optimizer: a torch optimizer or a DeepSpeed optimizer section, not both
    if cfg.optimizer is not None:
        _set_typed(ds, "optimizer", cfg.optimizer, "optimizer")
    if cfg.scheduler is not None:
        _set_typed(ds, "scheduler", cfg.scheduler, "scheduler")
    if has_optimizer and "optimizer" in ds:
        raise StrategyConfigError(
            "the optimizer is given twice: a torch optimizer was passed to prepare() and the DeepSpeed "
            "config has an 'optimizer' section; pass optimizer=None to use DeepSpeed's, or remove the section"
        )
    if not has_optimizer and "optimizer" not in ds:
        raise StrategyConfigError(
            "no optimizer: pass a torch optimizer to prepare(), or an 'optimizer' section "
            "(DeepSpeedConfig(optimizer={'type': 'AdamW', 'params': {'lr': 1e-4}}))"
        )
    if has_optimizer:
        ds.setdefault("zero_allow_untested_optimizer", True)
        if offload_device("offload_optimizer"):
            # a torch optimizer over CPU-offloaded state steps on the CPU (slower than
            # DeepSpeedCPUAdam, which DeepSpeed would otherwise insist on)
            ds.setdefault("zero_force_ds_cpu_optimizer", False)

    for key, value in cfg.extra.items():
        _set_typed(ds, key, value, f"extra[{key!r}]")
    ds.setdefault("steps_per_print", 10**9)  # DeepSpeed's own periodic prints off by default
    ds.setdefault("wall_clock_breakdown", False)

    left = [p for p in _auto_paths(ds) if p not in _RESOLVED_AUTO]
    if left:
        source = "the DeepSpeed config" if passed_through else "the options"
        raise StrategyConfigError(
            f"{source} still has \"auto\" values at: {', '.join(left)}. Only Hugging Face's Trainer fills "
            "those in; outside it, replace each with a number (gpufleet fills in only the batch sizes, "
            "gradient accumulation, clipping and precision)"
        )
    return ds, precision, gas
