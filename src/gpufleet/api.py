"""The ``@distributed`` decorator and the :class:`DistributedFunction` it returns."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import LaunchConfigError, PayloadPicklingError
from .states import FAILED

logger = logging.getLogger(__name__)

__all__ = ["distributed", "DistributedFunction", "RunHandle", "LaunchOptions"]


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

    def check(self) -> None:
        """Reject wrong settings with a message that says what is allowed."""
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1):
            raise LaunchConfigError(f"gpus must be a positive integer or None (every visible GPU), got {self.gpus!r}")
        if self.gpu_type is not None and (not isinstance(self.gpu_type, str) or not self.gpu_type.strip()):
            raise LaunchConfigError(f"gpu_type must be a GPU model such as 'H100', or 'cpu', got {self.gpu_type!r}")
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout <= 0
        ):
            raise LaunchConfigError(f"timeout must be a positive number of seconds or None, got {self.timeout!r}")
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
        if not isinstance(self.grace_period_s, (int, float)) or self.grace_period_s < 0:
            raise LaunchConfigError(f"grace_period_s must be >= 0, got {self.grace_period_s!r}")
        if not isinstance(self.tracking, bool):
            raise LaunchConfigError(f"tracking must be True or False, got {self.tracking!r}")
        if self.experiment_name is not None and (
            not isinstance(self.experiment_name, str) or not self.experiment_name.strip()
        ):
            raise LaunchConfigError(
                f"experiment_name must be a non-empty string (an MLflow experiment) or None, got {self.experiment_name!r}"
            )
        if not isinstance(self.remote, (bool, str)):
            raise LaunchConfigError(f"remote must be False, True or a Ray address string, got {self.remote!r}")


_OPTION_NAMES = {f for f in LaunchOptions.__dataclass_fields__}


def _make_options(**settings: Any) -> LaunchOptions:
    unknown = sorted(set(settings) - _OPTION_NAMES)
    if unknown:
        raise LaunchConfigError(
            f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(_OPTION_NAMES))}"
        )
    if "log_ranks" in settings and settings["log_ranks"] != "all":
        value = settings["log_ranks"]
        settings["log_ranks"] = tuple(value) if isinstance(value, (list, tuple, set, range)) else value
    opts = LaunchOptions(**settings)
    opts.check()
    return opts


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _find_unpicklable(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Name the object that stops the call from pickling."""
    import cloudpickle

    def fails(obj: Any) -> Exception | None:
        try:
            cloudpickle.dumps(obj)
        except Exception as e:  # noqa: BLE001
            return e
        return None

    for i, a in enumerate(args):
        if e := fails(a):
            return f"positional argument {i} (a {_describe(a)}): {e}"
    for k, v in kwargs.items():
        if e := fails(v):
            return f"argument {k!r} (a {_describe(v)}): {e}"
    if e := fails(func):
        try:
            cv = inspect.getclosurevars(func)
            for kind, names in (("closure variable", cv.nonlocals), ("global", cv.globals)):
                for name, value in names.items():
                    if inner := fails(value):
                        return f"the function's {kind} {name!r} (a {_describe(value)}): {inner}"
        except (TypeError, ValueError):
            pass
        return f"the function {getattr(func, '__qualname__', func)!r}: {e}"
    return "an object of the call (cloudpickle gave no detail)"


class RunHandle:
    """A run started by :meth:`DistributedFunction.submit`.

    Attributes:
        run_id: id of the current attempt's run.
    """

    def __init__(self, execution: _Execution) -> None:
        self._execution = execution

    @property
    def status(self) -> str:
        """PENDING, RUNNING, SUCCESS, FAILED, CANCELED or TIMEDOUT."""
        return self._execution.status

    @property
    def run_id(self) -> str:
        return self._execution.current.run_id

    @property
    def mlflow_run_id(self) -> str | None:
        """The current attempt's MLflow run id (None when tracking is off)."""
        return getattr(self._execution.current, "mlflow_run_id", None)

    @property
    def run_dir(self) -> str:
        """The current attempt's run directory (logs live here)."""
        return str(self._execution.current.run_dir.path)

    @property
    def pids(self) -> list[int]:
        """Process ids of the current attempt's ranks."""
        return self._execution.current.pids

    def done(self) -> bool:
        return self._execution.finished.is_set()

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the run; per-rank results, or the run's error raised here."""
        if not self._execution.finished.wait(timeout):
            raise TimeoutError(f"run {self.run_id} is still {self.status} after {timeout} s")
        return self._execution.outcome()

    def cancel(self) -> None:
        """Stop every rank; ``result()`` then raises :class:`~gpufleet.errors.RunCanceledError`."""
        self._execution.cancel()

    def logs(self, rank: int = 0) -> str:
        """What rank ``rank`` printed so far (stdout and stderr), from its log file."""
        return self._execution.current.logs(rank)

    def __repr__(self) -> str:
        return f"RunHandle(run_id={self.run_id!r}, status={self.status!r})"


_MIN_RETRY_S = 1.0  # a retry needs at least this much of the call's timeout left


class _Execution:
    """Runs attempts of one call (retries on failure) and remembers the outcome.

    ``timeout`` is the whole call's: a retry gets only the time the earlier attempts left, and
    no retry starts once it is spent.
    """

    def __init__(
        self, start_attempt: Callable[[int, float | None], Any], max_retries: int, timeout: float | None = None
    ) -> None:
        self._start_attempt = start_attempt
        self._max_retries = max_retries
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.attempt = 0
        self.current = start_attempt(0, None)  # the first attempt starts at once: errors surface here
        self.finished = threading.Event()
        self._result: list[Any] | None = None
        self._error: BaseException | None = None
        self._canceled = False

    @property
    def status(self) -> str:
        return self.current.status

    def run(self) -> None:
        try:
            while True:
                try:
                    self._result = self.current.wait()
                    return
                except Exception:  # a WorkerGroupError or the root cause's own exception type
                    if not self._retryable():
                        raise
                self.attempt += 1
                logger.warning("run %s failed; retry %d of %d", self.current.run_id, self.attempt, self._max_retries)
                self.current = self._start_attempt(self.attempt, self._time_left())
        except BaseException as e:
            self._error = e
            raise
        finally:
            self.finished.set()

    def _time_left(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _retryable(self) -> bool:
        """A failed attempt (not a cancel or a timeout) with retries and time left."""
        if self._canceled or self.attempt >= self._max_retries or self.current.status != FAILED:
            return False
        left = self._time_left()
        if left is not None and left < _MIN_RETRY_S:
            logger.warning(
                "run %s failed and is not retried: the call's timeout leaves %.1f s", self.current.run_id, max(left, 0.0)
            )
            return False
        return True

    def cancel(self) -> None:
        self._canceled = True
        self.current.cancel()

    def outcome(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class DistributedFunction:
    """A function that runs on every rank when launched; made by :func:`distributed`.

    Use ``.distributed(*args, **kwargs)`` (blocking; one result per rank, in global-rank
    order), ``.submit(*args, **kwargs)`` (returns a :class:`RunHandle`), ``.func`` (the
    plain function) and ``.with_overrides(...)`` (a copy with other settings).
    """

    def __init__(self, func: Callable[..., Any], options: LaunchOptions) -> None:
        if not callable(func):
            raise LaunchConfigError(f"@distributed decorates a function, got {_describe(func)}")
        self.func = func
        self.options = options
        self._signature = inspect.signature(func)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self.func, "__name__", "function")
        raise TypeError(
            f"{name} is a distributed function and is not called directly. Use "
            f"{name}.distributed(...) to run it on every worker and get one result per rank, "
            f"{name}.submit(...) to start it without waiting, or {name}.func(...) to run it "
            "in this process."
        )

    def __repr__(self) -> str:
        return f"<DistributedFunction {getattr(self.func, '__qualname__', self.func)} {self.options}>"

    def with_overrides(self, **settings: Any) -> DistributedFunction:
        """A copy with some settings replaced, e.g. ``train.with_overrides(gpus=2)``."""
        unknown = sorted(set(settings) - _OPTION_NAMES)
        if unknown:
            raise LaunchConfigError(
                f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(_OPTION_NAMES))}"
            )
        if "log_ranks" in settings and settings["log_ranks"] != "all":
            settings["log_ranks"] = tuple(settings["log_ranks"])
        opts = replace(self.options, **settings)
        opts.check()
        return DistributedFunction(self.func, opts)

    # -- launching ----------------------------------------------------------------------
    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as e:
            name = getattr(self.func, "__name__", "function")
            raise TypeError(f"{name}{self._signature}: {e}; nothing was launched") from None

    def _pickle_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        import pickle

        import cloudpickle

        try:
            return cloudpickle.dumps((self.func, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            what = _find_unpicklable(self.func, args, kwargs)
            raise PayloadPicklingError(
                f"cannot send the call to the workers: {what}. Pass data the workers can rebuild "
                "(paths, configs, tensors) and create handles such as open files, locks or "
                "clients inside the function; nothing was launched."
            ) from e

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Execution:
        self._bind(args, kwargs)
        opts = self.options
        remote = opts.remote
        if remote is True:
            remote = os.environ.get("RAY_ADDRESS", "")
            if not remote:
                raise LaunchConfigError(
                    "remote=True needs a Ray cluster address in RAY_ADDRESS; or pass remote='ray://host:10001'"
                )
        call_bytes = self._pickle_call(args, kwargs)
        name = opts.name or getattr(self.func, "__name__", "run")
        if remote:
            from .launch.ray import RayRun
            from .tracking import tracking_enabled

            track_remote = opts.tracking and tracking_enabled()

            def start_remote_attempt(attempt: int, time_left: float | None) -> Any:
                run = RayRun(opts, str(remote), call_bytes, name, attempt, time_left)
                if track_remote:  # one MLflow run per attempt; MLflow is imported only here
                    from .tracking.launch import call_parameters, start_tracked_attempt

                    return start_tracked_attempt(
                        run, launcher="ray", function_name=getattr(self.func, "__qualname__", name),
                        gpus=opts.gpus, gpu_type=opts.gpu_type, experiment_name=opts.experiment_name,
                        attempt=attempt, max_retries=opts.max_retries, timeout=opts.timeout,
                        arguments=call_parameters(self._signature, args, kwargs),
                    )
                return run.start()

            return _Execution(start_remote_attempt, opts.max_retries, opts.timeout)

        from .launch.gpus import resolve_local
        from .launch.local import LocalLaunchSpec, LocalRun, LogConfig

        placement = resolve_local(opts.gpus, opts.gpu_type)
        spec = LocalLaunchSpec(
            num_workers=placement.num_workers,
            use_gpus=placement.use_gpus,
            gpu_indices=placement.gpu_indices,
            timeout_s=opts.timeout,
            grace_period_s=opts.grace_period_s,
            env=dict(opts.env),
            runs_dir=opts.runs_dir,
            name=name,
            logs=LogConfig(enabled=opts.stream_logs, full_ranks=opts.log_ranks, stderr=opts.stream_stderr),
            fast_exit=opts.fast_exit,
        )

        from .tracking import tracking_enabled

        track = opts.tracking and tracking_enabled()

        def start_attempt(attempt: int, time_left: float | None) -> LocalRun:
            attempt_spec = replace(spec, env={**spec.env, "GPUFLEET_ATTEMPT": str(attempt)})
            if time_left is not None:  # a retry runs in what is left of the call's timeout
                attempt_spec = replace(attempt_spec, timeout_s=time_left, call_timeout_s=spec.timeout_s)
            if track:  # one MLflow run per attempt; MLflow is imported only here
                from .tracking.launch import call_parameters, start_tracked_local_run

                return start_tracked_local_run(
                    LocalRun(attempt_spec, call_bytes), function_name=getattr(self.func, "__qualname__", name),
                    gpus=opts.gpus, gpu_type=opts.gpu_type, experiment_name=opts.experiment_name,
                    attempt=attempt, max_retries=opts.max_retries, timeout=opts.timeout,
                    arguments=call_parameters(self._signature, args, kwargs),
                )
            return LocalRun(attempt_spec, call_bytes).start()

        return _Execution(start_attempt, opts.max_retries, opts.timeout)

    def distributed(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run on every rank and wait; returns each rank's return value, index = global rank.

        Raises:
            TypeError: the arguments do not fit the function's signature (nothing launched).
            PayloadPicklingError: the function or an argument cannot be pickled.
            LaunchConfigError: a setting is wrong, e.g. more GPUs than the machine has.
            Exception: the root-cause rank's own exception, with the remote traceback as
                ``__cause__`` and the other ranks' fate in its notes.
            WorkerGroupError: a rank died without an exception (signal, exit), a timeout
                (:class:`DistributedTimeoutError`) or a cancel.
        """
        execution = self._start(args, kwargs)
        try:
            execution.run()
        except KeyboardInterrupt:
            execution.cancel()
            raise
        return execution.outcome()

    def submit(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Start the run and return at once with a :class:`RunHandle`."""
        execution = self._start(args, kwargs)

        def target() -> None:
            try:
                execution.run()
            except BaseException:  # noqa: BLE001 - kept for result()
                pass

        threading.Thread(target=target, name=f"gpufleet-{execution.current.run_id}", daemon=True).start()
        return RunHandle(execution)


def distributed(
    func: Callable[..., Any] | None = None,
    *,
    gpus: int | None = None,
    gpu_type: str | None = None,
    remote: bool | str = False,
    timeout: float | None = 10800,
    **options: Any,
) -> Any:
    """Make a function run on every GPU (or CPU worker) of this machine or a Ray cluster.

    Args:
        gpus: number of worker processes, one per GPU; ``None`` = every visible GPU.
        gpu_type: GPU model that must be present (``"H100"``, ``"a100"``, ...), or ``"cpu"``
            for CPU worker processes using gloo.
        remote: ``False`` runs here; a Ray address (or ``True`` with ``RAY_ADDRESS`` set)
            runs the ranks on that Ray cluster.
        timeout: seconds for the whole call, ``None`` for no limit.
        **options: ``log_ranks`` ("all" or ranks streamed in full, default ``[0]``),
            ``stream_logs``, ``stream_stderr``, ``env`` (extra environment for every rank),
            ``runs_dir``, ``grace_period_s``, ``max_retries``, ``name``, ``ray_init_kwargs``,
            ``tracking`` (one MLflow run per call/attempt, default True; also off with
            ``GPUFLEET_TRACKING=0``), ``experiment_name`` (the MLflow experiment).

    Works bare (``@distributed``) and with arguments (``@distributed(gpus=2)``).
    """
    opts = _make_options(gpus=gpus, gpu_type=gpu_type, remote=remote, timeout=timeout, **options)
    if func is not None:
        return DistributedFunction(func, opts)
    return lambda f: DistributedFunction(f, opts)
