"""The settings of a distributed function, checked once, for every launcher."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import LaunchConfigError

__all__ = ["LaunchOptions", "make_options"]


#: The shortest hang watchdog (seconds): ranks write their progress every 0.2 s at the most often.
MIN_HANG_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class LaunchOptions:
    """Settings of a distributed function (what ``@distributed(...)`` was given)."""

    gpus: int | None = None
    gpu_type: str | None = None
    remote: bool | str = False
    timeout: float | None = 10800
    log_ranks: str | tuple[int, ...] = (0,)
    stream_logs: bool = True
    stream_stderr: bool = True
    env: dict[str, str] = field(default_factory=dict)
    runs_dir: str | None = None
    grace_period_s: float = 5.0
    max_retries: int = 0
    fast_exit: bool = True
    name: str | None = None
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)
    tracking: bool = True
    experiment_name: str | None = None
    hang_timeout: float | None = 600.0
    faults: tuple[Any, ...] = ()
    keep_warm: float | bool | None = None
    #: Seconds to wait for free GPUs (see :mod:`gpufleet.launch.leasing.leases`); None: 300 in a notebook, else the timeout.
    gpu_wait: float | None = None
    #: Variables of every rank read at each launch: ``{"NAME": {"env": "VAR"} | {"file": "PATH"}}`` (:mod:`gpufleet.secrets`).
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The MLflow run's name (default: the run id; later attempts get ``-attempt-<n>``).
    run_name: str | None = None
    #: With ``remote="slurm"``: ``nodes`` and the job's sbatch options (partition, account, qos, constraint, time, ...).
    slurm: dict[str, Any] = field(default_factory=dict)
    #: The live view of a blocking call (:mod:`gpufleet.live`): None/True where it can be shown, False: off.
    live: bool | None = None
    #: What a rank's death costs: "restart" every rank (from the newest checkpoint, with ``max_retries``)
    #: or "replace" that rank in place (docs/recovery.md).
    recovery: str = "restart"
    #: With ``recovery="replace"``: processes kept ready (imports done) to take a dead rank's place.
    spares: int = 0

    def check(self) -> None:
        """Reject wrong settings with a message that says what is allowed."""
        from .launch.leasing.gpu_requests import check_gpu_settings

        check_gpu_settings(self.gpus, self.gpu_wait, self.remote)
        if self.gpu_type is not None and (not isinstance(self.gpu_type, str) or not self.gpu_type.strip()):
            raise LaunchConfigError(f"gpu_type must be a GPU model such as 'H100', or 'cpu', got {self.gpu_type!r}")
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout) or self.timeout <= 0
        ):
            raise LaunchConfigError(
                f"timeout must be a positive, finite number of seconds, or None for no limit; got {self.timeout!r}"
            )
        if self.log_ranks != "all" and not (
            isinstance(self.log_ranks, tuple) and all(isinstance(r, int) and r >= 0 for r in self.log_ranks)
        ):
            raise LaunchConfigError(f"log_ranks must be 'all' or a list of rank numbers, got {self.log_ranks!r}")
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise LaunchConfigError("env must be a dict of str to str (environment variables for every rank)")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise LaunchConfigError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if (
            isinstance(self.grace_period_s, bool) or not isinstance(self.grace_period_s, (int, float))
            or not math.isfinite(self.grace_period_s) or self.grace_period_s < 0
        ):  # nan would skip the wait before SIGKILL, inf would never stop a rank that ignores SIGTERM
            raise LaunchConfigError(
                f"grace_period_s must be a finite number of seconds >= 0 (how long SIGTERM may take before "
                f"SIGKILL), got {self.grace_period_s!r}"
            )
        if not isinstance(self.tracking, bool):
            raise LaunchConfigError(f"tracking must be True or False, got {self.tracking!r}")
        if self.experiment_name is not None and (
            not isinstance(self.experiment_name, str) or not self.experiment_name.strip()
        ):
            raise LaunchConfigError(
                f"experiment_name must be a non-empty string (an MLflow experiment) or None, got {self.experiment_name!r}"
            )
        if self.hang_timeout is not None and (
            isinstance(self.hang_timeout, bool) or not isinstance(self.hang_timeout, (int, float))
            or not math.isfinite(self.hang_timeout) or self.hang_timeout < MIN_HANG_TIMEOUT_S
        ):  # ranks report progress every 0.2-2 s: a shorter watchdog would call every rank hung
            raise LaunchConfigError(
                f"hang_timeout must be a number of seconds without progress of at least {MIN_HANG_TIMEOUT_S:g}, "
                f"or None to turn the hang watchdog off; got {self.hang_timeout!r}"
            )
        from .faults import check_fit, parse_faults

        # a fault that could never fire is refused now, not in the ranks: a rank the run does not
        # have (when gpus says how many), an attempt it never makes
        ranks = len(self.gpus) if isinstance(self.gpus, tuple) else self.gpus if isinstance(self.gpus, int) else None
        check_fit(parse_faults(self.faults), ranks, self.max_retries + 1)
        if self.keep_warm is not None and not isinstance(self.keep_warm, bool) and (
            not isinstance(self.keep_warm, (int, float)) or not math.isfinite(self.keep_warm) or self.keep_warm < 0
        ):
            raise LaunchConfigError(
                f"keep_warm must be True (keep idle ranks 600 s), False, a number of seconds >= 0, or None "
                f"(on in a notebook, off elsewhere); got {self.keep_warm!r}"
            )
        from .secrets import source_problems

        if not isinstance(self.secrets, dict):
            raise LaunchConfigError(f"secrets must be a dict of NAME to {{'env': VAR}} or {{'file': PATH}}, got {self.secrets!r}")
        problems = [p for name, source in self.secrets.items() for p in source_problems(name, source)]
        if problems:
            raise LaunchConfigError("secrets: " + "; ".join(problems))
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name.strip()):
            raise LaunchConfigError(f"run_name must be a non-empty string (the MLflow run's name) or None, got {self.run_name!r}")
        if self.live is not None and not isinstance(self.live, bool):
            raise LaunchConfigError(f"live must be True, False or None (the live panel / status line), got {self.live!r}")
        if self.recovery not in ("restart", "replace"):
            raise LaunchConfigError(f"recovery must be 'restart' (every rank restarts after a rank's death) or "
                                    f"'replace' (the dead rank is replaced in place), got {self.recovery!r}")  # fmt: skip
        if self.recovery == "replace" and self.remote:
            raise LaunchConfigError("recovery='replace' replaces ranks on this machine only for now; on Ray or Slurm "
                                    "use recovery='restart' with max_retries")  # fmt: skip
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or not 0 <= self.spares <= 8:
            raise LaunchConfigError(f"spares must be a whole number from 0 to 8 (processes kept ready to replace a "
                                    f"dead rank), got {self.spares!r}")  # fmt: skip
        if self.spares and self.recovery != "replace":
            raise LaunchConfigError(f"spares={self.spares} keeps processes ready to replace a dead rank in place: it "
                                    "needs recovery='replace' (or drop spares)")  # fmt: skip
        if self.recovery == "replace" and self.keep_warm:
            raise LaunchConfigError("recovery='replace' starts its ranks fresh for each call: drop keep_warm "
                                    "(or set keep_warm=False)")  # fmt: skip
        if not isinstance(self.remote, (bool, str)):
            raise LaunchConfigError(f"remote must be False, True, 'slurm' or a Ray address string, got {self.remote!r}")
        if not isinstance(self.slurm, dict):
            raise LaunchConfigError(f"slurm must be a dict of sbatch settings (partition=..., nodes=...), got {self.slurm!r}")
        if self.slurm and self.remote != "slurm":
            raise LaunchConfigError("slurm=... settings are for remote='slurm'; set remote='slurm' or drop them")
        if self.remote == "slurm":
            from .launch.engines.slurm.job import slurm_options

            slurm_options(self.slurm, also=("nodes",))


_OPTION_NAMES = {f for f in LaunchOptions.__dataclass_fields__}


def make_options(base: LaunchOptions | None = None, **settings: Any) -> LaunchOptions:
    """Checked options: ``base`` (or the defaults) with ``settings`` replaced.

    The decorator and ``with_overrides`` both come here, so a wrong setting gets the same
    :class:`LaunchConfigError` from either.
    """
    unknown = sorted(set(settings) - _OPTION_NAMES)
    if unknown:
        raise LaunchConfigError(
            f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(_OPTION_NAMES))}"
        )
    if "log_ranks" in settings and settings["log_ranks"] != "all":
        value = settings["log_ranks"]
        settings["log_ranks"] = tuple(value) if isinstance(value, (list, tuple, set, range)) else value
    if isinstance(settings.get("gpus"), (list, range)):
        settings["gpus"] = tuple(settings["gpus"])  # named GPUs
    if "faults" in settings:
        from .faults import parse_faults

        settings["faults"] = parse_faults(settings["faults"])
    opts = replace(base, **settings) if base is not None else LaunchOptions(**settings)
    opts.check()
    if isinstance(settings.get("env"), dict):
        from .tracking.runs import looks_secret

        for name in settings["env"]:
            if looks_secret(name):
                warnings.warn(
                    f"env[{name!r}] looks like a secret: pass it with secrets={{{name!r}: {{'env': {name!r}}}}} "
                    "(read at launch, never stored or logged) rather than env",
                    UserWarning,
                    stacklevel=3,
                )
    return opts
