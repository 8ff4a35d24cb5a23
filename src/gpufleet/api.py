"""The ``@distributed`` decorator and the :class:`DistributedFunction` it returns.

One concern past 400 lines: the public surface of a call (checking its arguments and
settings, building its launch spec and worker group, ``distributed``/``submit``/``with_overrides``/
``to_workload``/``shutdown`` and the :class:`RunHandle`); what each step does lives elsewhere.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import LaunchConfigError, PayloadPicklingError
from .handles import RunHandle, from_ranks
from .options import LaunchOptions, make_options

if TYPE_CHECKING:
    from .launch.controller import Controller
    from .launch.group import WorkerGroup
    from .runs.calls import StoredCall

logger = logging.getLogger(__name__)

__all__ = ["distributed", "DistributedFunction", "LaunchOptions"]


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
        self._warm_keys: set[Any] = set()
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
        return DistributedFunction(self.func, make_options(self.options, **settings))

    def to_workload(self, path: str | os.PathLike[str], /, *args: Any, **kwargs: Any) -> Any:
        """Write this call as a workload YAML (plus its entry script and call) that ``gpufleet run -f`` runs.

        Same placement and per-rank results (in the run's ``results/results.pkl``); see
        :mod:`gpufleet.workload.export`. Returns the YAML file's path.
        """
        from .workload.export import export_call

        return export_call(self, path, args, kwargs)

    # -- launching ----------------------------------------------------------------------
    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as e:
            name = getattr(self.func, "__name__", "function")
            raise TypeError(f"{name}{self._signature}: {e}; nothing was launched") from None

    def _pickle_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        """The pickled call, and the source of the code it sends by value (for remote tracebacks)."""
        import io

        from .launch.tracebacks import dumps_call

        for where, value in [*((f"positional argument {i}", a) for i, a in enumerate(args)),
                             *((f"argument {k!r}", v) for k, v in kwargs.items())]:  # fmt: skip
            if isinstance(value, io.IOBase):
                # cloudpickle would send a copy of a read-mode file's contents as a StringIO,
                # silently: not the file, its position or its later writes
                raise PayloadPicklingError(
                    f"cannot send the call to the workers: {where} is an open file ({_describe(value)}). "
                    "Pass its path and open it inside the function; nothing was launched."
                )

        try:
            return dumps_call((self.func, args, kwargs))
        except Exception as e:
            what = _find_unpicklable(self.func, args, kwargs)
            raise PayloadPicklingError(
                f"cannot send the call to the workers: {what}. Pass data the workers can rebuild "
                "(paths, configs, tensors) and create handles such as open files, locks or "
                "clients inside the function; nothing was launched."
            ) from e

    def _controller(self, args: tuple[Any, ...], kwargs: dict[str, Any], live: bool = False, *,
                    stored: StoredCall | None = None) -> Controller:  # fmt: skip
        """The controller of one call: its launch spec, its worker group, its tracking and (``live``) its live view.

        ``stored``: the call is one stored run under a supervisor (a detached call): every attempt has its
        id, attempt N's folder is ``attempts/N`` of its folder, and its recorder records them.
        """
        from .faults import faults_env
        from .launch.controller import Controller
        from .launch.logstream import LogConfig
        from .launch.node import envcontract
        from .launch.policy import RetryPolicy
        from .launch.progress import watchdog_env
        from .launch.spec import LaunchSpec, Payload
        from .results import RunDir, new_run_id

        self._bind(args, kwargs)
        opts = self.options
        remote = opts.remote
        if remote is True:
            remote = os.environ.get("RAY_ADDRESS", "")
            if not remote:
                raise LaunchConfigError(
                    "remote=True needs a Ray cluster address in RAY_ADDRESS; or pass remote='ray://host:10001'"
                )
        call, sources = self._pickle_call(args, kwargs)
        payload = Payload(call, tuple(p for p in sys.path if p), opts.fast_exit, sources)
        from .secrets import read_secrets, secret_env

        secrets = read_secrets(opts.secrets)  # read at each launch; only the ranks' environment holds them
        from .live import choose_view, live_env

        view = choose_view(opts.live) if live else None
        env = {**live_env(view, watchdog_env(opts.hang_timeout)), **opts.env, **secret_env(secrets)}
        if opts.recovery == "replace":
            env[envcontract.RECOVERY] = "replace"
            env[envcontract.SPARES] = str(opts.spares)
        name = opts.name or getattr(self.func, "__name__", "run")

        def attempt_run(attempt: int) -> tuple[str, Callable[[str], RunDir]]:
            """The id of an attempt's run and how its folder is made."""
            if stored is not None:
                return stored.run_id, lambda _: RunDir.create(stored.run_dir / "attempts", str(attempt))
            return new_run_id(name), lambda run_id: RunDir.create(opts.runs_dir, run_id)

        logs = LogConfig(enabled=opts.stream_logs, full_ranks=opts.log_ranks, stderr=opts.stream_stderr,
                         secrets=tuple(secrets.values()))  # fmt: skip
        make_group: Callable[[int], WorkerGroup]
        launcher = "slurm" if remote == "slurm" else "ray" if remote else "local"
        if remote == "slurm":
            from .launch.engines.slurm.group import SlurmWorkerGroup, slurm_placement

            slurm = slurm_placement(opts.gpus, opts.gpu_type, opts.slurm)

            def make_group(attempt: int) -> WorkerGroup:
                attempt_env = {**faults_env(opts.faults, attempt), **env}
                run_id, run_dir = attempt_run(attempt)
                spec = LaunchSpec(run_id, slurm.world_size, slurm.num_nodes, slurm.use_gpus,
                                  attempt=attempt, env=attempt_env, payload=payload)  # fmt: skip
                return SlurmWorkerGroup(spec, run_dir(run_id), slurm, logs)
        elif remote:
            from .launch.engines.ray.group import RayPlacement, RayWorkerGroup

            ray_placement = RayPlacement(str(remote), opts.gpus, opts.gpu_type, dict(opts.ray_init_kwargs))

            def make_group(attempt: int) -> WorkerGroup:
                attempt_env = {**faults_env(opts.faults, attempt), **env}
                run_id, run_dir = attempt_run(attempt)
                spec = LaunchSpec(run_id, 0, attempt=attempt, env=attempt_env, payload=payload)
                return RayWorkerGroup(spec, run_dir(run_id), ray_placement, logs)
        else:
            from .launch.engines.local.group import LocalPlacement, LocalWorkerGroup
            from .launch.gpus import resolve_local
            from .launch.leasing.gpu_requests import call_gpu_request

            found = resolve_local(opts.gpus, opts.gpu_type)
            if opts.recovery == "replace" and found.use_gpus:
                raise LaunchConfigError(
                    "recovery='replace' replaces ranks of CPU workers (gloo) for now: on GPUs a survivor blocked "
                    "in an NCCL collective must have its communicator aborted first, which gpufleet does not do "
                    "yet. Use recovery='restart' with max_retries (every rank restarts from the newest checkpoint)"
                )
            from .faults import check_fit

            check_fit(opts.faults, found.num_workers, None)  # gpus=None: every GPU here, known now
            lease = call_gpu_request(opts.gpus, opts.gpu_wait, opts.timeout, found.use_gpus)  # GPUs taken at start
            placement = LocalPlacement(found.use_gpus, tuple(found.gpu_indices), gpu_request=lease)

            from .launch.engines.local.warm import WarmWorkerGroup, resolve_keep_warm

            keep_warm = 0 if opts.recovery == "replace" else resolve_keep_warm(opts.keep_warm)
            warm_key = self._warm_key(found.num_workers, placement)

            def make_group(attempt: int) -> WorkerGroup:
                run_id, make_dir = attempt_run(attempt)
                spec = LaunchSpec(
                    run_id, found.num_workers, use_gpus=found.use_gpus, attempt=attempt,
                    env={**faults_env(opts.faults, attempt), **env}, payload=payload,
                )
                run_dir = make_dir(run_id)
                if keep_warm > 0:
                    self._warm_keys.add(warm_key)
                    return WarmWorkerGroup(spec, run_dir, placement, logs, opts.grace_period_s, warm_key, keep_warm)
                return LocalWorkerGroup(spec, run_dir, placement, logs, opts.grace_period_s)

        from .runs.calls import call_recorder

        recorder = call_recorder(self, launcher) if stored is None else stored.recorder
        callbacks: list[Any] = [recorder]  # the run store's records
        if view is not None:  # first among the hooks: its summary shows before tracking closes the run
            from .live.observer import LiveObserver

            callbacks.insert(0, LiveObserver(view))
        from .tracking import tracking_enabled

        if opts.tracking and tracking_enabled():  # one MLflow run per attempt; MLflow is imported only then
            from .tracking.launch import CallTracking, RunTracking, call_parameters, code_folder

            callbacks.append(RunTracking(
                CallTracking(
                    launcher=launcher,
                    function_name=getattr(self.func, "__qualname__", name),
                    gpus=opts.gpus, gpu_type=opts.gpu_type, experiment_name=opts.experiment_name,
                    max_retries=opts.max_retries, timeout=opts.timeout,
                    arguments=call_parameters(self._signature, args, kwargs),
                    run_name=opts.run_name, code_folder=code_folder(self.func),
                )
            ))
        return Controller(
            make_group, timeout_s=opts.timeout, grace_period_s=opts.grace_period_s,
            policy=RetryPolicy.for_call(opts.max_retries, opts.recovery), callbacks=callbacks, hang_timeout_s=opts.hang_timeout,
        )

    def _warm_key(self, num_workers: int, placement: Any) -> tuple[Any, ...]:
        """What warm ranks must share with this call to serve it: placement, environment, interpreter, code."""
        stamp = None
        module = sys.modules.get(getattr(self.func, "__module__", "") or "")
        file = getattr(module, "__file__", None)
        if module is not None and module.__name__ != "__main__" and file and os.path.exists(file):
            stamp = (file, os.stat(file).st_mtime_ns)  # an edited source file gets fresh ranks
        opts = self.options
        return (num_workers, placement, tuple(sorted(opts.env.items())), sys.executable, stamp,
                opts.runs_dir, opts.hang_timeout is None)  # fmt: skip

    def shutdown(self) -> int:
        """Stop the idle warm ranks this function used, now (see ``keep_warm``); returns how many sets."""
        from .launch.engines.local.warm import POOL

        return POOL.shutdown(set(self._warm_keys))

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
        controller = self._controller(args, kwargs, live=True)
        controller.start()
        try:
            return controller.run()
        except Exception as e:
            if from_ranks(e):
                raise e.with_traceback(None) from e.__cause__  # one gpufleet frame between caller and ranks
            raise

    def submit(self, *args: Any, detach: bool = False, **kwargs: Any) -> Any:
        """Start the run and return at once with a :class:`RunHandle`.

        A program that ends while the run goes on stops it, saying so on stderr. With
        ``detach=True`` the run goes to a supervisor process of its own instead and outlives
        this one (:class:`~gpufleet.handles.StoredRunHandle`; ``gpufleet logs RUN_ID --follow``).
        ``detach`` is not passed to the function.
        """
        if detach:
            from .detach import submit_detached

            return submit_detached(self, args, kwargs)
        controller = self._controller(args, kwargs)
        group = controller.start()

        def target() -> None:
            try:
                controller.run()
            except BaseException:  # noqa: BLE001 - kept for result()
                pass

        threading.Thread(target=target, name=f"gpufleet-{group.run_id}", daemon=True).start()
        return RunHandle(controller)


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
        gpus: number of worker processes, one per GPU, taken from the GPUs free on this machine
            (leased: :mod:`gpufleet.launch.leasing.leases`); a list of GPU indices names them; ``None`` =
            every free GPU. Too few free: the call waits up to ``gpu_wait`` seconds (option;
            default 300 in a notebook, else the timeout), then raises ``GPUUnavailableError``.
        gpu_type: GPU model that must be present (``"H100"``, ``"a100"``, ...), or ``"cpu"``
            for CPU worker processes using gloo.
        remote: ``False`` runs here; a Ray address (or ``True`` with ``RAY_ADDRESS`` set)
            runs the ranks on that Ray cluster.
        timeout: seconds for the whole call, ``None`` for no limit.
        **options: ``log_ranks`` ("all" or ranks streamed in full, default ``[0]``),
            ``stream_logs``, ``stream_stderr``, ``env`` (extra environment for every rank),
            ``runs_dir``, ``grace_period_s``, ``max_retries``, ``name``, ``ray_init_kwargs``,
            ``tracking`` (one MLflow run per call/attempt, default True; also off with
            ``GPUFLEET_TRACKING=0``), ``experiment_name`` (the MLflow experiment),
            ``hang_timeout`` (seconds without progress before the hang watchdog stops the call
            with a diagnosis, default 600; None: off; a clear steady-state hang is called sooner,
            after a limit learned from the steps, see docs/hangs.md), ``faults`` (faults to inject on purpose,
            e.g. ``["kill:rank=1:step=30"]``; see :mod:`gpufleet.faults`), ``keep_warm``
            (seconds idle ranks stay ready for the next call; True = 600, False = off; default:
            on in a notebook, off in scripts; local runs only), ``secrets`` (variables of every
            rank read at each launch, ``{"HF_TOKEN": {"env": "HF_TOKEN"}}`` or ``{"file":
            PATH}``: never stored, masked in the logs), ``run_name`` (the MLflow run's name),
            ``live`` (``.distributed()`` shows a live panel in a notebook cell and a status line
            in a terminal; False: off, as with ``GPUFLEET_LIVE=0``; see :mod:`gpufleet.live`),
            ``recovery`` (``"replace"``: a rank whose process dies is replaced in place while the
            others keep their processes and go on from the last step every rank completed;
            default ``"restart"``; see docs/recovery.md), ``spares`` (with ``recovery="replace"``:
            processes kept ready, imports done, to take a dead rank's place; default 0: a new
            process starts cold).

    Works bare (``@distributed``) and with arguments (``@distributed(gpus=2)``).
    """
    opts = make_options(gpus=gpus, gpu_type=gpu_type, remote=remote, timeout=timeout, **options)
    if func is not None:
        return DistributedFunction(func, opts)
    return lambda f: DistributedFunction(f, opts)
