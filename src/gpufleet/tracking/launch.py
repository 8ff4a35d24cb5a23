"""Tracking for ``@distributed`` calls: one MLflow run per attempt, local or on Ray.

:func:`start_tracked_attempt` opens the MLflow run, puts its id into every rank's
environment, starts the run, and returns it wrapped so that, when the attempt ends, the
per-rank logs are uploaded and the final status is set. It takes either launcher's run
(:class:`~gpufleet.launch.local.LocalRun` or :class:`~gpufleet.launch.ray.RayRun`): both
take extra rank environment with ``add_env`` before their ranks start.
"""

from __future__ import annotations

import inspect
import os
import threading
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

from .runs import TrackedRun, start_tracked_run

_TERMINAL = ("SUCCESS", "FAILED", "CANCELED", "TIMEDOUT")


class TrackedAttempt:
    """A launched run (local or Ray) and its MLflow run; behaves like the run it wraps.

    Attributes:
        tracked: the :class:`~gpufleet.tracking.TrackedRun` of this attempt.
    """

    def __init__(self, run: Any, tracked: TrackedRun, *, log_num_nodes: bool = False) -> None:
        self._run = run
        self.tracked = tracked
        self._log_num_nodes = log_num_nodes
        self._finish_lock = threading.Lock()
        self._finished = False

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run id of this attempt."""
        return self.tracked.run_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    def wait(self) -> list[Any]:
        """Wait for the ranks (as the wrapped run does), then close the MLflow run."""
        try:
            result = self._run.wait()
        except BaseException as e:
            self._finish(e)
            raise
        self._finish(None)
        return result

    def _finish(self, error: BaseException | None) -> None:
        with self._finish_lock:
            if self._finished:
                return
            self._finished = True
        run = self._run
        status = run.status if run.status in _TERMINAL else "FAILED"
        if self._log_num_nodes and run.num_nodes is not None:  # Ray: known once the ranks were placed
            self.tracked.log_params({"gpufleet.num_nodes": run.num_nodes})
        self.tracked.log_artifacts(sorted(run.run_dir.path.glob("rank-*.log")), "logs")
        if error is not None and status in ("FAILED", "TIMEDOUT"):  # root cause, remote traceback, other ranks
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self.tracked.log_text(text, "error.txt")
        self.tracked.end(status)


TrackedLocalRun = TrackedAttempt  # the name it had while only local runs were tracked


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


def start_tracked_attempt(
    run: Any, *, launcher: str, function_name: str, gpus: int | None, gpu_type: str | None,
    experiment_name: str | None, attempt: int, max_retries: int, timeout: float | None,
    arguments: Mapping[str, Any] | None = None,
) -> Any:
    """Open an MLflow run for a not yet started run, start it, and wrap it.

    Every rank gets ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI`` and the experiment in its
    environment. A local run's size is known before it starts; a Ray run's number of ranks
    is known once ``start()`` has checked the cluster (its ranks start later, in ``wait()``),
    so it is logged then, and its number of nodes, known once the ranks are placed, is
    logged when the attempt ends.
    Returns the started run itself when tracking ends up disabled (MLflow missing).

    Args:
        run: a ``LocalRun`` or ``RayRun`` that has not started yet.
        launcher: ``"local"`` or ``"ray"``, recorded as the ``gpufleet.launcher`` tag.
        function_name: the decorated function's qualified name.
        gpus: the ``gpus`` setting of the call.
        gpu_type: the ``gpu_type`` setting of the call.
        experiment_name: the MLflow experiment, or None for the default one.
        attempt: the attempt number (0 for the first).
        max_retries: the call's ``max_retries``.
        timeout: the call's timeout in seconds, or None.
        arguments: the call's arguments as parameters (:func:`call_parameters`), or None.
    """
    params: dict[str, Any] = {
        "gpufleet.function": function_name,
        "gpufleet.gpus": gpus,
        "gpufleet.gpu_type": gpu_type,
    }
    if launcher == "local":
        params.update({"gpufleet.world_size": run.num_ranks, "gpufleet.num_nodes": 1})
    params.update({"gpufleet.attempt": attempt, "gpufleet.max_retries": max_retries, "gpufleet.timeout_s": timeout})
    params.update(arguments or {})
    tracked = start_tracked_run(
        experiment_name,
        run.run_id,
        params=params,
        system_metrics=launcher == "local",  # on Ray each node samples itself (launch/ray_actor.py)
        tags={
            "gpufleet.run_id": run.run_id,
            "gpufleet.run_dir": str(run.run_dir.path),
            "gpufleet.function": function_name,
            "gpufleet.launcher": launcher,
        },
    )
    if not tracked.enabled:
        return run.start()
    run.add_env(tracked.env())
    try:
        run.start()
    except BaseException:
        tracked.end("FAILED")
        raise
    if launcher == "local":
        return TrackedAttempt(run, tracked)
    tracked.log_params({"gpufleet.world_size": run.num_ranks})
    problem = local_store_warning(tracked.tracking_uri or "", run.cluster_hosts)
    if problem:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
    return TrackedAttempt(run, tracked, log_num_nodes=True)


def start_tracked_local_run(run: Any, **settings: Any) -> Any:
    """:func:`start_tracked_attempt` for a ``LocalRun``."""
    return start_tracked_attempt(run, launcher="local", **settings)
