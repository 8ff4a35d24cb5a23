"""One MLflow run per attempt, for calls and workloads alike, as one controller callback.

:class:`RunTracking` opens each attempt's MLflow run, gives every rank ``MLFLOW_RUN_ID``,
``MLFLOW_TRACKING_URI`` and the experiment before the attempt's code runs, and ends the run with
its logs and status. A group that takes its environment late (local ranks) starts at once and
the run opens in a thread meanwhile (the ranks wait for it before they load the call: importing
MLflow and opening its store overlap their start); a run that was opened already (a workload's
first attempt, opened by ``gpufleet run``) reaches the ranks at once and is attached in a thread.
What a kind of run tracks differently (its name, parameters, tags, what it logs once open, once
started and at its end, and where a problem is told) is its :class:`TrackingProfile`:
:class:`CallTracking` here, ``WorkloadTracking`` in :mod:`gpufleet.workload.attempts`.
Tracking never changes a run's outcome and never stops it.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

from ..launch.controller import ControllerCallback
from ..launch.group import WorkerGroup
from ..launch.recoveries import RECOVERED, REPLACING, Recovery
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


class TrackingProfile(Protocol):
    """What one kind of run tracks differently (module docstring)."""

    #: The MLflow experiment, or None for the default one.
    experiment_name: str | None
    #: Whether an open run nests under the caller's active MLflow run.
    nests: bool

    def run_name(self, group: WorkerGroup, attempt: int) -> str:
        """The attempt's MLflow run name."""
        ...

    def params(self, group: WorkerGroup, attempt: int) -> dict[str, Any]:
        """Parameters logged once the run is open (``gpufleet.attempt`` among them)."""
        ...

    def tags(self, group: WorkerGroup, attempt: int) -> dict[str, Any]:
        """Tags the run opens with (computed in the opening thread: the code version takes a while)."""
        ...

    def handed_over(self, attempt: int) -> dict[str, Any] | None:
        """A run opened already for this attempt (``run_id``, ``tracking_uri``, ...), or None."""
        ...

    def system_metrics(self, group: WorkerGroup) -> bool:
        """Whether this process samples the machine's GPUs/CPU into the run (on Ray each node samples itself)."""
        ...

    def opened(self, tracked: TrackedRun, group: WorkerGroup, attempt: int) -> None:
        """The run is open and its environment given to the ranks."""
        ...

    def started(self, tracked: TrackedRun, group: WorkerGroup, attempt: int) -> None:
        """The group started: its size is final."""
        ...

    def ended(self, tracked: TrackedRun, group: WorkerGroup, attempt: int, state: str,
              error: BaseException | None) -> str:  # fmt: skip
        """Log what the attempt left (logs, the error); returns the run's status."""
        ...

    def warn(self, text: str) -> None:
        """Tell of a tracking problem (the run goes on untracked, or partly tracked)."""
        ...


class RunTracking(ControllerCallback):
    """One MLflow run per attempt of a call or a workload (module docstring)."""

    def __init__(self, profile: TrackingProfile) -> None:
        self.profile = profile
        self._tracked: dict[int, TrackedRun] = {}
        self._opening: dict[int, threading.Thread] = {}
        self._started: dict[int, threading.Event] = {}
        self._recording: dict[int, list[threading.Thread]] = {}

    def before_start(self, group: WorkerGroup, attempt: int) -> None:
        handed = self.profile.handed_over(attempt)
        if handed:
            self._attach(group, attempt, handed)
            return
        active = caller_active_run() if self.profile.nests else None  # MLflow keeps it per thread: read it here
        if not group.takes_late_env:
            self._open(group, attempt, active, None)
            return
        group.defer_env()  # the ranks start now and wait for the run's environment before the call
        started = self._started[attempt] = threading.Event()  # set once the group has started (its size is final)
        self._in_thread(group, attempt, self._open, group, attempt, active, started)

    def _in_thread(self, group: WorkerGroup, attempt: int, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"gpufleet-mlflow-{group.run_id}", daemon=True)
        self._opening[attempt] = thread
        thread.start()

    def _open(self, group: WorkerGroup, attempt: int, active: Any, started: threading.Event | None) -> None:
        """Open the attempt's run and give its environment to the ranks (released even on failure); then
        what the profile logs, the parameters and the system metrics, while the attempt runs."""
        env: dict[str, str] = {}
        tracked: TrackedRun | None = None
        try:
            tracked = start_tracked_run(self.profile.experiment_name, self.profile.run_name(group, attempt),
                                        system_metrics=False, tags=self.profile.tags(group, attempt),
                                        active_run=active)  # fmt: skip
            if tracked.enabled:
                self._tracked[attempt] = tracked
                env = tracked.env()
                group.mlflow_run_id = tracked.run_id
        except Exception as e:  # noqa: BLE001 - tracking trouble never stops a run
            self.profile.warn(f"MLflow tracking is off for run {group.run_id}: {e}")
        finally:
            if group.env_deferred:
                group.release_env(env)
            else:
                group.add_env(env)
        if tracked is not None and tracked.enabled:
            self._while_running(tracked, group, attempt, started)

    def _attach(self, group: WorkerGroup, attempt: int, handed: dict[str, Any]) -> None:
        """A run opened already: its id reaches the ranks at once; MLflow is imported, the run attached and
        the rest logged in a thread while they start."""
        from .runs import attach_tracked_run, tracking_env, yield_cpu_to_training

        group.mlflow_run_id = handed["run_id"]
        group.add_env(tracking_env(handed["run_id"], handed["tracking_uri"], handed.get("experiment_id"),
                                   handed.get("experiment_name")))  # fmt: skip

        def attach() -> None:
            yield_cpu_to_training()  # the ranks start meanwhile and do not wait for this
            try:
                tracked = attach_tracked_run(handed["run_id"], handed["tracking_uri"], handed.get("experiment_id"),
                                             handed.get("experiment_name"), system_metrics=False)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - tracking trouble never stops a run
                self.profile.warn(f"could not attach the MLflow run {handed['run_id']}: {e}")
                return
            self._tracked[attempt] = tracked
            self._while_running(tracked, group, attempt, None)

        self._in_thread(group, attempt, attach)

    def _while_running(self, tracked: TrackedRun, group: WorkerGroup, attempt: int,
                       started: threading.Event | None) -> None:  # fmt: skip
        try:
            self.profile.opened(tracked, group, attempt)
        except Exception as e:  # noqa: BLE001
            self.profile.warn(f"could not record the run in MLflow: {e}")
        tracked.log_params(self.profile.params(group, attempt))  # a failure is a warning: see TrackedRun
        if started is not None:  # the ranks run now; their number is known once the group has started
            started.wait()
            self.profile.started(tracked, group, attempt)
        if self.profile.system_metrics(group):
            tracked.start_system_metrics()

    def _opened(self, attempt: int) -> TrackedRun | None:
        """The attempt's run, once its opening (in a thread while the ranks start) is done."""
        opening = self._opening.pop(attempt, None)
        if opening is not None:
            opening.join()
        return self._tracked.get(attempt)

    def after_start(self, group: WorkerGroup, attempt: int) -> None:
        started = self._started.get(attempt)
        if started is not None:  # the opening thread tells the profile
            started.set()
            return
        if attempt in self._opening:  # attached in a thread: it logs on its own
            return
        tracked = self._tracked.get(attempt)
        if tracked is not None:
            self.profile.started(tracked, group, attempt)

    def on_end(self, group: WorkerGroup, attempt: int, state: str, error: BaseException | None) -> None:
        started = self._started.pop(attempt, None)
        if started is not None:
            started.set()  # a group that never started: the opening thread must not wait for it
        self._opened(attempt)
        for thread in self._recording.pop(attempt, []):
            thread.join()  # each MLflow call is bounded (TrackedRun): the end waits at most that long
        tracked = self._tracked.pop(attempt, None)
        if tracked is None:
            return
        status = state
        try:
            status = self.profile.ended(tracked, group, attempt, state, error)
        except Exception as e:  # noqa: BLE001 - tracking trouble never changes the run's outcome
            self.profile.warn(f"could not record the attempt in MLflow: {e}")
        finally:
            tracked.end(status)


    def on_recovery(self, group: WorkerGroup, attempt: int, recovery: Recovery) -> None:
        """Each recovery's end (or refusal) in the attempt's MLflow run: the tag
        ``gpufleet.recovery.N`` (its line), and, once the rank is back, the metrics
        ``gpufleet.recovery.seconds_lost``, ``.steps_lost`` and ``.rank`` at step N. Logged on a
        thread of its own: the controller watches the ranks meanwhile."""
        if recovery.outcome == REPLACING:
            return  # logged once it is back, or failed

        earlier = list(self._recording.get(attempt, []))

        def record() -> None:
            for waited in [self._opening.get(attempt), *earlier]:  # the run open, and the recoveries in order
                if waited is not None:
                    waited.join()
            tracked = self._tracked.get(attempt)
            if tracked is None:
                return
            tracked.set_tags({f"gpufleet.recovery.{recovery.number}": recovery.describe(),
                              "gpufleet.recoveries": recovery.number})  # fmt: skip
            if recovery.outcome == RECOVERED:
                tracked.log_metrics({"gpufleet.recovery.seconds_lost": recovery.seconds_lost or 0.0,
                                     "gpufleet.recovery.steps_lost": recovery.steps_lost or 0,
                                     "gpufleet.recovery.rank": recovery.rank}, step=recovery.number)  # fmt: skip

        thread = threading.Thread(target=record, name=f"gpufleet-mlflow-recovery-{group.run_id}", daemon=True)
        self._recording.setdefault(attempt, []).append(thread)
        thread.start()


class CallTracking:
    """What a ``@distributed`` call's MLflow runs hold, local or on Ray.

    Args:
        launcher: ``"local"``, ``"ray"`` or ``"slurm"``, recorded as the ``gpufleet.launcher`` tag.
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
    (:func:`gpufleet.tracking.links.run_line`). A local group's size is known before it starts; a
    Ray group's once it has checked the cluster, and its number of nodes once the ranks are placed
    (logged at the end). A failed or timed-out attempt's error (root cause, remote traceback, the
    other ranks) is the artifact ``error.txt``.
    """

    nests = True

    def __init__(
        self, *, launcher: str, function_name: str, gpus: int | None, gpu_type: str | None,
        experiment_name: str | None, max_retries: int, timeout: float | None,
        arguments: Mapping[str, Any] | None = None, run_name: str | None = None, code_folder: str | None = None,
    ) -> None:  # fmt: skip
        self.launcher = launcher
        self.function_name = function_name
        self.gpus = gpus
        self.gpu_type = gpu_type
        self.experiment_name = experiment_name
        self.max_retries = max_retries
        self.timeout = timeout
        self.arguments = dict(arguments or {})
        self.name = run_name
        self.code_folder = code_folder
        self._code_tags: dict[str, str] | None = None

    def run_name(self, group: WorkerGroup, attempt: int) -> str:
        if not self.name:
            return group.run_id
        return self.name if attempt == 1 else f"{self.name}-attempt-{attempt}"

    def params(self, group: WorkerGroup, attempt: int) -> dict[str, Any]:
        return {"gpufleet.function": self.function_name, "gpufleet.gpus": self.gpus, "gpufleet.gpu_type": self.gpu_type,
                "gpufleet.attempt": attempt, "gpufleet.max_retries": self.max_retries,
                "gpufleet.timeout_s": self.timeout, **self.arguments}  # fmt: skip

    def tags(self, group: WorkerGroup, attempt: int) -> dict[str, Any]:
        if self._code_tags is None:  # once per call
            from ..codeversion import code_version, mlflow_tags

            self._code_tags = mlflow_tags(code_version(self.code_folder)) if self.code_folder else {}
        return {"gpufleet.run_id": group.run_id, "gpufleet.run_dir": str(group.run_dir.path),
                "gpufleet.function": self.function_name, "gpufleet.launcher": self.launcher,
                "gpufleet.attempt": str(attempt), **self._code_tags}  # fmt: skip

    def handed_over(self, attempt: int) -> dict[str, Any] | None:
        return None

    def system_metrics(self, group: WorkerGroup) -> bool:
        return self.launcher == "local"  # on Ray each node samples itself (launch/engines/ray/actor.py)

    def opened(self, tracked: TrackedRun, group: WorkerGroup, attempt: int) -> None:
        _say_where(tracked)

    def started(self, tracked: TrackedRun, group: WorkerGroup, attempt: int) -> None:
        if self.launcher == "local":  # a warm group: its GPUs are leased in start() too
            tracked.log_params({"gpufleet.world_size": group.num_ranks, "gpufleet.num_nodes": 1})
            return
        tracked.log_params({"gpufleet.world_size": group.num_ranks})
        problem = local_store_warning(tracked.tracking_uri or "", getattr(group, "cluster_hosts", []))
        if problem:
            self.warn(problem)

    def ended(self, tracked: TrackedRun, group: WorkerGroup, attempt: int, state: str,
              error: BaseException | None) -> str:  # fmt: skip
        if self.launcher != "local" and group.num_nodes is not None:  # Ray: known once the ranks were placed
            tracked.log_params({"gpufleet.num_nodes": group.num_nodes})
        tracked.log_artifacts(sorted(group.run_dir.path.glob("rank-*.log")), "logs")
        if error is not None and state in ("FAILED", "TIMEDOUT"):  # root cause, remote traceback, other ranks
            from ..secrets import mask_env_secrets

            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            tracked.log_text(mask_env_secrets(text, group.spec.env), "error.txt")  # it may quote a secret
        return state

    def warn(self, text: str) -> None:
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def _say_where(tracked: TrackedRun) -> None:
    """One line on stderr: the run's id and where to see it; the UI command or address in full only the
    first time this process opens a run in that store and experiment."""
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
    except Exception:  # noqa: BLE001 - a closed stream never stops the run
        pass
