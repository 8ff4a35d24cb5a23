"""Tracking for ``@distributed`` calls: one MLflow run per attempt, as a controller callback."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

from ..launch.controller import ControllerCallback
from ..launch.group import WorkerGroup
from .runs import TrackedRun, caller_active_run, start_tracked_run

#: ``(tracking URI, experiment id)`` whose UI this process has shown in full (later runs there get a short line).
_TOLD: set[tuple[str, str | None]] = set()
_MAX_ITEMS = 50  # longer lists/dicts among the arguments are logged as their type only


def _plain(value: Any, depth: int = 0) -> Any:
    """A value MLflow can show as a parameter: scalars and small containers as they are, else the type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if depth < 3 and isinstance(value, Mapping) and len(value) <= _MAX_ITEMS:
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= _MAX_ITEMS:
        return [_plain(v, depth + 1) for v in value]
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__}>"


def call_parameters(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments (defaults included) as ``args.<name>`` parameters.

    Numbers, strings, paths and small lists/dicts of them are logged as they are (dicts become
    ``args.<name>.<key>``); anything else (a tensor, a dataset, a model) as its type name.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            values.update({str(k): _plain(v) for k, v in value.items()})
        else:
            values[name] = _plain(list(value) if kind is inspect.Parameter.VAR_POSITIONAL else value)
    return {f"args.{name}": value for name, value in values.items()}


def code_folder(func: Any) -> str:
    """The folder whose git version a call records: its function's source file's, else the current one (notebooks)."""
    module = sys.modules.get(getattr(func, "__module__", "") or "")
    file = getattr(module, "__file__", None)  # a notebook's __main__ has none
    return os.path.dirname(os.path.abspath(file)) if file else os.getcwd()


def local_store_warning(uri: str, hosts: list[str]) -> str | None:
    """Why a file-based tracking store does not suit a Ray cluster of several hosts, or None."""
    is_file = uri.startswith(("sqlite:", "file:")) or ("://" not in uri and not uri.startswith("databricks"))
    if len(hosts) < 2 or not is_file:
        return None
    shown = ", ".join(hosts[:4]) + (", ..." if len(hosts) > 4 else "")
    return (
        f"the MLflow tracking store {uri} is a file on this machine, but the Ray cluster spans "
        f"{len(hosts)} hosts ({shown}): what ranks on other hosts log goes to a file there, not to "
        "this run. Set MLFLOW_TRACKING_URI to an MLflow server every node reaches (for example "
        "http://<host>:5000), or pass tracking=False."
    )


class TrackingCallback(ControllerCallback):
    """One MLflow run per attempt of a ``@distributed`` call, local or on Ray.

    It opens the attempt's MLflow run and gives every rank ``MLFLOW_RUN_ID``,
    ``MLFLOW_TRACKING_URI`` and the experiment before the call runs: for local ranks in a thread
    while they start (they wait for it before loading the call), elsewhere before the ranks
    start. When the attempt ends it
    uploads the per-rank logs (and the error, for a failure or timeout) and sets the run's
    final status. A local group's size is known before it starts; a Ray group's once it has
    checked the cluster, and its number of nodes once the ranks are placed (logged at the end).

    Args:
        launcher: ``"local"`` or ``"ray"``, recorded as the ``gpufleet.launcher`` tag.
        function_name: the decorated function's qualified name.
        gpus: the ``gpus`` setting of the call.
        gpu_type: the ``gpu_type`` setting of the call.
        experiment_name: the MLflow experiment, or None for the default one.
        max_retries: the call's ``max_retries``.
        timeout: the call's timeout in seconds, or None.
        arguments: the call's arguments as parameters (:func:`call_parameters`), or None.
        run_name: the MLflow run's name (later attempts: ``<name>-attempt-<n>``); None: the run id.
        code_folder: a folder whose git commit, branch and dirty flag are tagged (``gpufleet.git.*``).

    When each attempt's run opens, one line on stderr gives its id and where to see it
    (:func:`gpufleet.tracking.links.run_line`).
    """

    def __init__(
        self, *, launcher: str, function_name: str, gpus: int | None, gpu_type: str | None,
        experiment_name: str | None, max_retries: int, timeout: float | None,
        arguments: Mapping[str, Any] | None = None, run_name: str | None = None, code_folder: str | None = None,
    ) -> None:
        self._launcher = launcher
        self._function_name = function_name
        self._gpus = gpus
        self._gpu_type = gpu_type
        self._experiment_name = experiment_name
        self._max_retries = max_retries
        self._timeout = timeout
        self._arguments = dict(arguments or {})
        self._run_name = run_name
        self._code_folder = code_folder
        self._code_tags: dict[str, str] | None = None
        self._attempts = 0
        self._tracked: dict[int, TrackedRun] = {}
        self._opening: dict[int, threading.Thread] = {}
        self._started: dict[int, threading.Event] = {}

    def before_start(self, group: WorkerGroup, attempt: int) -> None:
        params: dict[str, Any] = {
            "gpufleet.function": self._function_name,
            "gpufleet.gpus": self._gpus,
            "gpufleet.gpu_type": self._gpu_type,
        }
        params.update({
            "gpufleet.attempt": attempt, "gpufleet.max_retries": self._max_retries, "gpufleet.timeout_s": self._timeout,
        })
        params.update(self._arguments)
        self._attempts += 1
        run_name = group.run_id
        if self._run_name:
            run_name = self._run_name if self._attempts == 1 else f"{self._run_name}-attempt-{self._attempts}"
        active = caller_active_run()  # MLflow keeps it per thread: read it here, in the caller's
        if not group.takes_late_env:
            self._open(group, attempt, run_name, params, active)
            return
        # The ranks start now and wait for the run's environment before the call: importing
        # MLflow and opening its store (about 2 s on a small machine) overlaps their own start.
        group.defer_env()
        self._started[attempt] = threading.Event()  # set once the group has started (its size is final then)
        opening = threading.Thread(
            target=self._open, args=(group, attempt, run_name, params, active),
            name=f"gpufleet-mlflow-{group.run_id}", daemon=True,
        )
        self._opening[attempt] = opening
        opening.start()

    def _open(self, group: WorkerGroup, attempt: int, run_name: str, params: dict[str, Any], active: Any) -> None:
        """Open the attempt's MLflow run and give its environment to the ranks (released even on failure);
        then log the parameters and start the system metrics, while the call runs."""
        env: dict[str, str] = {}
        tracked: TrackedRun | None = None
        try:
            if self._code_tags is None:  # once per call
                from ..codeversion import code_version, mlflow_tags

                self._code_tags = mlflow_tags(code_version(self._code_folder)) if self._code_folder else {}
            tracked = start_tracked_run(
                self._experiment_name,
                run_name,
                system_metrics=False,
                tags={
                    "gpufleet.run_id": group.run_id,
                    "gpufleet.run_dir": str(group.run_dir.path),
                    "gpufleet.function": self._function_name,
                    "gpufleet.launcher": self._launcher,
                    "gpufleet.attempt": str(attempt),  # a tag and a parameter, as a workload's
                    **self._code_tags,
                },
                active_run=active,
            )
            if tracked.enabled:
                self._tracked[attempt] = tracked
                env = tracked.env()
                group.mlflow_run_id = tracked.run_id
                self._say_where(tracked)
        except Exception as e:  # noqa: BLE001 - tracking trouble never stops a call
            warnings.warn(f"MLflow tracking is off for run {group.run_id}: {e}", RuntimeWarning, stacklevel=1)
        finally:
            if group.env_deferred:
                group.release_env(env)
            else:
                group.add_env(env)
        if tracked is not None and tracked.enabled:
            tracked.log_params(params)  # a failure is a warning: see TrackedRun
            started = self._started.get(attempt)
            if started is not None:  # the ranks run now; their number is known once the GPUs are leased
                started.wait()
                tracked.log_params({"gpufleet.world_size": group.num_ranks, "gpufleet.num_nodes": 1})
            if self._launcher == "local":  # on Ray each node samples itself (launch/ray_actor.py)
                tracked.start_system_metrics()

    @staticmethod
    def _say_where(tracked: TrackedRun) -> None:
        """One line on stderr: the run's id and where to see it; the UI command or address in full
        only the first time this process opens a run in that store and experiment."""
        from .links import run_line

        try:
            where = (str(tracked.tracking_uri), tracked.experiment_id)
            if where in _TOLD:
                line = f"MLflow run {tracked.run_id} (experiment {tracked.experiment_name}, as above)"
            else:
                line = run_line(tracked.tracking_uri, str(tracked.run_id), tracked.experiment_id, tracked.experiment_name)
                _TOLD.add(where)
            sys.stderr.write(f"gpufleet: {line}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stream never stops the call
            pass

    def _opened(self, attempt: int) -> TrackedRun | None:
        """The attempt's run, once its opening (in a thread while the ranks start) is done."""
        opening = self._opening.pop(attempt, None)
        if opening is not None:
            opening.join()
        return self._tracked.get(attempt)

    def after_start(self, group: WorkerGroup, attempt: int) -> None:
        started = self._started.get(attempt)
        if started is not None:  # the opening thread logs the size
            started.set()
            return
        tracked = self._opened(attempt)
        if tracked is None:
            return
        if self._launcher == "local":  # a warm group: its GPUs are leased in start() too
            tracked.log_params({"gpufleet.world_size": group.num_ranks, "gpufleet.num_nodes": 1})
            return
        tracked.log_params({"gpufleet.world_size": group.num_ranks})
        problem = local_store_warning(tracked.tracking_uri or "", getattr(group, "cluster_hosts", []))
        if problem:
            warnings.warn(problem, RuntimeWarning, stacklevel=2)

    def on_end(self, group: WorkerGroup, attempt: int, state: str, error: BaseException | None) -> None:
        started = self._started.pop(attempt, None)
        if started is not None:
            started.set()  # a group that never started: the opening thread must not wait for it
        self._opened(attempt)
        tracked = self._tracked.pop(attempt, None)
        if tracked is None:
            return
        if self._launcher != "local" and group.num_nodes is not None:  # Ray: known once the ranks were placed
            tracked.log_params({"gpufleet.num_nodes": group.num_nodes})
        tracked.log_artifacts(sorted(group.run_dir.path.glob("rank-*.log")), "logs")
        if error is not None and state in ("FAILED", "TIMEDOUT"):  # root cause, remote traceback, other ranks
            from ..secrets import mask_env_secrets

            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            tracked.log_text(mask_env_secrets(text, group.spec.env), "error.txt")  # it may quote a secret
        tracked.end(state)
