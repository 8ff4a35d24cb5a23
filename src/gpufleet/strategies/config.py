"""Check and resolve a choice of parallelism technique before any training: :func:`plan`.

Everything here is plain Python (no torch, no DeepSpeed), so a configuration can be checked
in the process that launches the run, before a single worker starts: :func:`plan` resolves
the options for a given world size and raises :class:`StrategyConfigError` with a message that
says what to change. The typed options themselves are in :mod:`.options` (re-exported here);
the DeepSpeed config dict is built by :mod:`.deepspeed_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .deepspeed_config import build_deepspeed_config
from .options import DDPConfig, DeepSpeedConfig, FSDP2Config, StrategyConfigError

__all__ = [
    "STRATEGIES",
    "PRECISIONS",
    "StrategyConfigError",
    "DDPConfig",
    "FSDP2Config",
    "DeepSpeedConfig",
    "StrategyPlan",
    "plan",
]

STRATEGIES = ("ddp", "fsdp2", "deepspeed")
PRECISIONS = ("bf16", "fp16", "no")
_PRECISION_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "16": "fp16",
    "no": "no",
    "fp32": "no",
    "float32": "no",
    "32": "no",
}

_CONFIG_TYPES: dict[str, type] = {"ddp": DDPConfig, "fsdp2": FSDP2Config, "deepspeed": DeepSpeedConfig}


@dataclass(frozen=True)
class StrategyPlan:
    """A checked, resolved choice of technique: what :func:`prepare` will do.

    Attributes:
        strategy: ``"ddp"``, ``"fsdp2"`` or ``"deepspeed"``.
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``"no"``.
        gradient_accumulation_steps: micro-steps per optimizer step.
        world_size: number of ranks the plan was checked for.
        config: the typed options of the technique.
        deepspeed_config: the full DeepSpeed config dict (DeepSpeed only).
    """

    strategy: str
    mixed_precision: str
    gradient_accumulation_steps: int
    world_size: int
    config: Any
    deepspeed_config: dict[str, Any] | None = None


def normalize_precision(value: str | None) -> str | None:
    """Map ``bf16``/``bfloat16``/``fp16``/``float16``/``no``/``fp32`` to bf16, fp16 or no."""
    if value is None:
        return None
    key = str(value).strip().lower()
    if key not in _PRECISION_ALIASES:
        raise StrategyConfigError(f"mixed_precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return _PRECISION_ALIASES[key]


def make_config(strategy: str, config: Any = None, **options: Any) -> Any:
    """The typed config of ``strategy``: ``config`` updated with ``options`` (field names)."""
    cls = _CONFIG_TYPES[strategy]
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise StrategyConfigError(
            f"strategy={strategy!r} takes a {cls.__name__}, got a {type(config).__name__}; "
            f"pass the config of the strategy you chose"
        )
    if options:
        if strategy == "deepspeed" and "compile" in options:
            raise StrategyConfigError(
                "compile is an option of ddp and fsdp2; a DeepSpeed engine compiles itself: call "
                "prepared.model.compile() after prepare()"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise StrategyConfigError(
                f"unknown {strategy} option(s) {', '.join(unknown)}; {cls.__name__} has: {', '.join(sorted(known))}"
            )
        config = replace(config, **options)
    return config


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def plan(
    strategy: str | None = None,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    world_size: int = 1,
    config: Any = None,
    has_optimizer: bool = True,
    **options: Any,
) -> StrategyPlan:
    """Check and resolve a choice of technique for ``world_size`` ranks, without torch.

    Call it in the launching process to catch a wrong configuration before any worker starts;
    :func:`gpufleet.strategies.prepare` runs the same checks inside the workers.

    Args:
        strategy: ``"ddp"``, ``"fsdp2"`` or ``"deepspeed"``; ``None`` takes it from the type of
            ``config``, else ``"ddp"``.
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``"no"``; ``None`` means the DeepSpeed
            config's setting when one is passed through, else ``"no"``.
        gradient_accumulation_steps: micro-steps per optimizer step (``None``: from the
            DeepSpeed config, else 1).
        world_size: number of ranks.
        config: a :class:`DDPConfig`, :class:`FSDP2Config` or :class:`DeepSpeedConfig`.
        has_optimizer: whether a torch optimizer will be given to ``prepare``.
        **options: fields of the strategy's config, as a shortcut.

    Raises:
        StrategyConfigError: a value is wrong or two settings contradict; the message says
            what to change.
    """
    if strategy is None:
        inferred = [name for name, cls in _CONFIG_TYPES.items() if isinstance(config, cls)]
        strategy = inferred[0] if inferred else "ddp"
    strategy = str(strategy).lower()
    if strategy == "fsdp":
        strategy = "fsdp2"
    if strategy not in STRATEGIES:
        raise StrategyConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    _check_int("world_size", world_size)
    precision = normalize_precision(mixed_precision)
    if gradient_accumulation_steps is not None:
        _check_int("gradient_accumulation_steps", gradient_accumulation_steps)
    cfg = make_config(strategy, config, **options)
    if strategy != "deepspeed":
        return StrategyPlan(strategy, precision or "no", gradient_accumulation_steps or 1, world_size, cfg)
    ds, precision, gas = build_deepspeed_config(cfg, precision, gradient_accumulation_steps, world_size, has_optimizer)
    return StrategyPlan(strategy, precision, gas, world_size, cfg, ds)
