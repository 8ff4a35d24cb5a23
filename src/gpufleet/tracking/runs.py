"""MLflow runs for gpufleet calls and workload attempts (:func:`start_tracked_run`).

MLflow is imported only inside :func:`start_tracked_run` and the methods of a run, so this
module is safe to import from ``gpufleet``'s light paths. When MLflow is not installed a
tracked run degrades to a disabled one with a single warning, and the call still runs.

One concern past 400 lines: one MLflow run's life (opening it in the right store and
experiment, parameters with secrets masked, artifacts, status, system metrics).
"""

from __future__ import annotations

import atexit
import getpass
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import GpufleetError
from ..launch.node import envcontract
from ..results import gpufleet_home
from .bounds import TrackingStalledError, bounded, unreachable

logger = logging.getLogger(__name__)

TRACKING_ENV = envcontract.TRACKING
DEFAULT_EXPERIMENT = "gpufleet"
INSTALL_HINT = "pip install 'gpufleet[mlflow]'"

# gpufleet run states -> MLflow run statuses (TIMEDOUT keeps its name in the gpufleet.status tag).
MLFLOW_STATUS = {"SUCCESS": "FINISHED", "FAILED": "FAILED", "CANCELED": "KILLED", "TIMEDOUT": "FAILED"}

# MLflow's limits (mlflow.utils.validation); kept here so that no import of MLflow is needed.
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_PARAMS_PER_BATCH = 100
_KEY_CHARS = re.compile(r"[^/\w.\- :]")

_warned_missing = False
_open_runs: weakref.WeakSet[TrackedRun] = weakref.WeakSet()


def tracking_enabled() -> bool:
    """False when ``$GPUFLEET_TRACKING`` switches tracking off (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get(TRACKING_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def default_tracking_uri() -> str:
    """The store used when no MLflow tracking URI is set: ``sqlite:///$GPUFLEET_HOME/mlflow.db``."""
    return "sqlite:///" + str((gpufleet_home() / "mlflow.db").absolute())


def default_artifact_root() -> Path:
    """Where runs in the default store keep their artifacts: ``$GPUFLEET_HOME/mlartifacts``."""
    return (gpufleet_home() / "mlartifacts").absolute()


#: Words of a parameter name that mark its value as a secret (``api_key``, ``HF_TOKEN``, ``db.password``).
SECRET_WORDS = frozenset({
    "token", "secret", "password", "passwd", "pwd", "passphrase", "key", "apikey", "credential",
    "credentials", "auth", "cookie",
})
MASK = "***"


def looks_secret(name: str) -> bool:
    """Whether a parameter or variable name says its value is a secret.

    The name's last dotted part is split into words at ``_``, ``-`` and case changes; one of
    :data:`SECRET_WORDS` among them marks it (``api_key``, ``HF_TOKEN``, ``dbPassword``).
    """
    last = str(name).rsplit(".", 1)[-1]
    words = re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", last)
    return any(w.lower() in SECRET_WORDS for w in words)


def redact(config: Mapping[str, Any], _inside_env: bool = False) -> dict[str, Any]:
    """A copy of ``config`` with the values of secret-looking names, and every ``env_variables`` value, masked."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if _inside_env or looks_secret(str(key)):
            out[key] = MASK
        elif isinstance(value, Mapping):
            out[key] = redact(value, _inside_env=str(key) == "env_variables")
        else:
            out[key] = value
    return out


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested mappings into ``a.b.c`` keys with string values within MLflow's limits.

    Lists and other values become their JSON text; keys lose characters MLflow refuses; keys
    and values are truncated to MLflow's maximum lengths. Values of secret-looking names and of
    ``env_variables`` are masked (:func:`redact`): they never reach the tracking store.
    """
    if not prefix:
        params = redact(params)
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=name + "."))
            continue
        if isinstance(value, str):
            text = value
        elif value is None or isinstance(value, (bool, int, float)):
            text = str(value)
        else:
            try:
                text = json.dumps(value, default=str)
            except (TypeError, ValueError):
                text = str(value)
        flat[_KEY_CHARS.sub("_", name)[:MAX_KEY_LENGTH]] = text[:MAX_PARAM_VALUE_LENGTH]
    return flat


def yield_cpu_to_training() -> None:
    """Give the calling thread a lower CPU priority (nice +10), where the system allows it.

    For tracking's background threads (importing MLflow, attaching a run, sampling) that run
    beside starting ranks: on a machine with few cores they would otherwise slow the ranks' own
    start. On Linux the nice value belongs to the thread, so the rest of the process keeps its
    priority; threads it starts inherit the lower one.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except OSError:
        pass


def tracking_env(run_id: str, tracking_uri: str, experiment_id: str | None, experiment_name: str | None) -> dict[str, str]:
    """What a rank or node needs to log into run ``run_id`` (``MLFLOW_RUN_ID``, ...); no MLflow import."""
    env = {
        "MLFLOW_RUN_ID": run_id,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "MLFLOW_EXPERIMENT_ID": str(experiment_id),
    }
    if experiment_name:
        env["MLFLOW_EXPERIMENT_NAME"] = experiment_name
    return env


def _import_mlflow() -> Any | None:
    """``mlflow``, or None after one warning that names the extra to install."""
    global _warned_missing
    try:
        import mlflow
    except ImportError as e:
        if not _warned_missing:
            _warned_missing = True
            message = (
                f"MLflow is not installed ({e}); runs are not tracked. Install it with "
                f"{INSTALL_HINT}, or switch tracking off with tracking=False or {TRACKING_ENV}=0."
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return None
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_skip_last_collection)  # runs after the handlers registered later (MLflow's own)
    return mlflow


_exit_hook = False


def _skip_last_collection() -> None:
    """At exit, spare the interpreter its last walk over every object (0.6-0.8 s once MLflow is loaded).

    MLflow with its SQL store brings some hundred thousand objects (SQLAlchemy, alembic,
    pandas); the final garbage collection of a normal exit visits each of them. Freezing them
    here, once every exit handler has run, makes the exit as fast as without MLflow. Objects
    are still freed when the last reference goes; only reference cycles left at exit are not
    collected, which Python does not promise at exit anyway.
    """
    import gc

    gc.freeze()


class TrackedRun:
    """One MLflow run opened by gpufleet; a context manager that ends the run on exit.

    A disabled run (tracking off, or MLflow missing) has ``run_id`` None and every method
    does nothing, so callers never branch on it.

    Attributes:
        run_id: the MLflow run id, or None when disabled.
        experiment_id: the MLflow experiment id, or None when disabled.
        tracking_uri: the MLflow tracking URI, or None when disabled.
        parent_run_id: the run this one is nested under, if any.
    """

    def __init__(
        self,
        client: Any = None,
        run_id: str | None = None,
        experiment_id: str | None = None,
        experiment_name: str | None = None,
        tracking_uri: str | None = None,
        parent_run_id: str | None = None,
    ) -> None:
        self._client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.experiment_name = experiment_name
        self.tracking_uri = tracking_uri
        self.parent_run_id = parent_run_id
        self._sampler: Any = None
        self._status: str | None = None
        self._ended = False
        self._stalled = False
        self._lock = threading.Lock()
        if run_id is not None:
            _open_runs.add(self)

    @property
    def enabled(self) -> bool:
        """True when this run is recorded in MLflow."""
        return self.run_id is not None

    def __repr__(self) -> str:
        return f"TrackedRun(run_id={self.run_id!r}, experiment_id={self.experiment_id!r})"

    def env(self) -> dict[str, str]:
        """Environment for every rank: ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI``, the experiment.

        Empty when disabled.
        """
        if self.run_id is None:
            return {}
        return tracking_env(self.run_id, str(self.tracking_uri), self.experiment_id, self.experiment_name)

    def _safely(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run an MLflow call; a tracking failure is logged, never raised into training.

        Each call is bounded (:func:`~gpufleet.tracking.bounds.bounded`); once one stalled, the
        store is taken as gone and later calls of this run are skipped, so no caller waits twice.
        """
        if self.run_id is None:
            return
        if self._stalled:
            logger.debug("MLflow run %s: not trying to %s: the store stopped answering", self.run_id, what)
            return
        try:
            bounded(lambda: fn(*args, **kwargs), what)
        except TrackingStalledError as e:
            self._stalled = True
            logger.warning("MLflow run %s: %s; its later records are skipped", self.run_id, e)
        except Exception as e:  # noqa: BLE001
            logger.warning("MLflow run %s: could not %s: %s", self.run_id, what, e)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log parameters (nested mappings flattened to ``a.b`` keys, within MLflow's limits)."""
        if self.run_id is None:
            return
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten_params(params).items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._safely("log parameters", self._client.log_batch, self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

    def log_config(self, config: Mapping[str, Any], artifact_file: str = "config.yaml") -> None:
        """Log a resolved configuration: as a YAML artifact and as flattened parameters (secrets masked)."""
        if self.run_id is None:
            return
        import yaml

        text = yaml.safe_dump(json.loads(json.dumps(redact(config), default=str)), sort_keys=False)
        self._safely("log the configuration", self._client.log_text, self.run_id, text, artifact_file)
        self.log_params(config)

    def log_artifacts(self, paths: Iterable[str | os.PathLike[str]], artifact_path: str | None = "logs") -> None:
        """Upload files or folders (e.g. per-rank log files) under ``artifact_path``; missing ones are skipped."""
        if self.run_id is None:
            return
        for p in paths:
            path = Path(p)
            if path.is_dir():
                self._safely(f"log {path}", self._client.log_artifacts, self.run_id, str(path), artifact_path)
            elif path.is_file():
                self._safely(f"log {path}", self._client.log_artifact, self.run_id, str(path), artifact_path)
            else:
                logger.debug("not logging %s: it does not exist", path)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Save ``text`` as the artifact ``artifact_file``."""
        self._safely(f"log {artifact_file}", self._client.log_text, self.run_id, text, artifact_file)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set tags on the run."""
        if self.run_id is None or not tags:
            return
        from mlflow.entities import RunTag

        items = [RunTag(str(k), str(v)) for k, v in tags.items()]
        self._safely("set tags", self._client.log_batch, self.run_id, tags=items)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log metrics at ``step``, now."""
        if self.run_id is None or not metrics:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(str(k), float(v), now, step) for k, v in metrics.items()]
        self._safely("log metrics", self._client.log_batch, self.run_id, metrics=items)

    def set_status(self, status: str) -> None:
        """Record the outcome to set when the run ends: SUCCESS, FAILED, CANCELED or TIMEDOUT."""
        key = status.upper()
        if key not in MLFLOW_STATUS:
            raise ValueError(f"status must be one of {', '.join(MLFLOW_STATUS)}, got {status!r}")
        self._status = key

    def start_system_metrics(self, interval_s: float | None = None, node_id: str | None = None) -> None:
        """Start sampling this node's GPU/CPU/RAM into the run (``system/...`` metrics)."""
        if self.run_id is None or self._sampler is not None:
            return
        try:
            from .system_metrics import SystemMetricsSampler

            sampler = SystemMetricsSampler(self.run_id, str(self.tracking_uri), interval_s, node_id)
            sampler.start()
        except Exception as e:  # noqa: BLE001 - metrics must never stop a run
            logger.warning("system metrics are not logged for MLflow run %s: %s", self.run_id, e)
            return
        self._sampler = sampler

    def end(self, status: str | None = None) -> None:
        """Stop the system metrics and mark the run terminated (once; later calls do nothing)."""
        if status is not None:
            self.set_status(status)
        with self._lock:
            if self._ended or self.run_id is None:
                self._ended = True
                return
            self._ended = True
        _open_runs.discard(self)
        if self._sampler is not None:
            self._safely("stop the system metrics", self._sampler.stop)
        final = self._status or "SUCCESS"
        self._safely("record the status", self._client.set_tag, self.run_id, "gpufleet.status", final)
        self._safely(
            "end the run",
            self._client.set_terminated,
            self.run_id,
            MLFLOW_STATUS[final],
            int(time.time() * 1000),
        )
        self._safely("keep its artifacts private", self._private_artifacts)

    def _private_artifacts(self) -> None:
        """Its artifacts in gpufleet's default store, the user's alone (see :func:`.store.make_artifacts_private`)."""
        from .store import make_artifacts_private

        make_artifacts_private(self._client.get_run(self.run_id).info.artifact_uri)

    def release(self) -> None:
        """Hand the run over to another process: this one forgets it without ending it (see :func:`attach_tracked_run`)."""
        with self._lock:
            self._ended = True
        _open_runs.discard(self)
        if self._sampler is not None:
            self._safely("stop the system metrics", self._sampler.stop)
            self._sampler = None

    def __enter__(self) -> TrackedRun:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._status is None and exc_type is not None:
            self._status = "CANCELED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        self.end()


@atexit.register
def _end_open_runs() -> None:
    for run in list(_open_runs):
        try:
            bounded(lambda run=run: run.end("CANCELED"), "end a run at exit", timeout_s=5.0)
        except Exception:  # noqa: BLE001 - the store is gone: the process still exits
            pass


def _resolve_uri(mlflow: Any, has_active_run: bool) -> tuple[str, bool]:
    """The tracking URI to use and whether it is gpufleet's default store."""
    if has_active_run:
        return mlflow.get_tracking_uri(), False
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

        uri_set = is_tracking_uri_set()
    except ImportError:
        uri_set = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    if uri_set:
        return mlflow.get_tracking_uri(), False
    return default_tracking_uri(), True


def _artifact_root(uri: str, in_default_store: bool) -> Path | None:
    """Where a new experiment keeps its artifacts: next to a local SQLite database.

    MLflow's own default for a SQLite store is ``./mlruns`` in the current directory, which
    scatters artifact folders over every directory a notebook or script runs from. Other stores
    (servers, Databricks) keep their own default.
    """
    if in_default_store:
        return default_artifact_root()
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].split("?", 1)[0]
        if path and path != ":memory:":
            return Path(path).absolute().parent / "mlartifacts"
    return None


def _get_or_create_experiment(client: Any, name: str, root: Path | None) -> Any:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp
    location = None
    if root is not None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100] or "experiment"
        location = (root / safe).as_uri()
    try:
        client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created by a concurrent call in the meantime
        pass
    exp = client.get_experiment_by_name(name)
    if exp is None:
        raise RuntimeError(f"could not create the MLflow experiment {name!r}")
    return exp


def _chosen_experiment(parent_experiment_id: str | None) -> str | None:
    """An experiment id chosen by the caller's MLflow set-up (active run, env, set_experiment)."""
    if parent_experiment_id:
        return parent_experiment_id
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    try:
        from mlflow.tracking import fluent

        active_id = fluent._active_experiment_id  # set by mlflow.set_experiment()
    except (ImportError, AttributeError):
        active_id = None
    return str(active_id) if active_id else None


_LOOK_UP: Any = object()  # start_tracked_run's active_run: ask MLflow in this thread


def caller_active_run() -> Any:
    """The calling thread's active MLflow run, or None (also when MLflow was never imported here).

    Read it in the caller's thread before opening a run in another one: MLflow keeps the active
    run per thread. Without MLflow imported there can be no active run to read.
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        return mlflow.active_run()
    except Exception:  # noqa: BLE001 - a half-imported or broken MLflow: no parent
        return None


def start_tracked_run(
    experiment_name: str | None,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    enabled: bool = True,
    tags: Mapping[str, Any] | None = None,
    *,
    system_metrics: bool = True,
    system_metrics_interval_s: float | None = None,
    node_id: str | None = None,
    active_run: Any = _LOOK_UP,
) -> TrackedRun:
    """Open an MLflow run for a call or workload attempt and start its system metrics.

    Use it as a context manager (``with start_tracked_run(...) as run:``) or call
    :meth:`TrackedRun.end` yourself. Pass ``run.env()`` to every rank.

    Args:
        experiment_name: MLflow experiment (created when missing). None: the active run's
            experiment, else ``$MLFLOW_EXPERIMENT_ID`` / ``$MLFLOW_EXPERIMENT_NAME`` /
            ``mlflow.set_experiment``, else ``"gpufleet"``.
        run_name: the MLflow run's name (gpufleet uses its own run id).
        params: parameters to log (nested mappings flattened to ``a.b`` keys).
        enabled: False returns a disabled run without importing MLflow; so does
            ``$GPUFLEET_TRACKING=0``.
        tags: extra tags for the run.
        system_metrics: sample this node's GPU/CPU/RAM into ``system/...`` metrics.
        system_metrics_interval_s: seconds between samples (default
            ``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` or 10).
        node_id: in multi-node runs, a name for this node in the system metric names.
        active_run: the caller's active MLflow run (or None), when this runs in another thread
            than the caller's (MLflow keeps the active run per thread): see :func:`caller_active_run`.

    Returns:
        The run. Nested under the caller's active MLflow run (or the run in
        ``$MLFLOW_RUN_ID``) when there is one. The tracking URI is MLflow's when one is set
        (``$MLFLOW_TRACKING_URI`` or ``mlflow.set_tracking_uri``), else
        ``sqlite:///$GPUFLEET_HOME/mlflow.db`` with artifacts under ``$GPUFLEET_HOME/mlartifacts``.
        A disabled run when tracking is off, MLflow is missing (one warning naming
        ``pip install 'gpufleet[mlflow]'``) or the tracking store cannot be reached (a warning).
    """
    if not enabled or not tracking_enabled():
        return TrackedRun()
    mlflow = _import_mlflow()
    if mlflow is None:
        return TrackedRun()
    try:
        active = mlflow.active_run() if active_run is _LOOK_UP else active_run
        run = _bounded_open(lambda: _open_run(mlflow, experiment_name, run_name, params or {}, tags or {}, active))
    except Exception as e:  # noqa: BLE001 - a broken tracking store must not stop training
        message = f"MLflow tracking is off for {run_name!r}: could not open a run: {e}; the run goes on untracked"
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return TrackedRun()
    if system_metrics:
        run.start_system_metrics(system_metrics_interval_s, node_id)
    return run


class TrackingUnreachableError(GpufleetError, ConnectionError):
    """The tracking server refused, did not answer or cannot be resolved (see :func:`~gpufleet.tracking.bounds.unreachable`)."""


def _bounded_open(open_run: Any) -> TrackedRun:
    """``open_run()`` within the tracking wait; a run that opens only after it was given up is ended at once."""
    given_up = threading.Event()

    def opening() -> TrackedRun:
        run: TrackedRun = open_run()
        if given_up.is_set():  # nobody logs into it: do not leave it RUNNING
            run.end("FAILED")
        return run

    try:
        return bounded(opening, "open a run")
    except TrackingStalledError:
        given_up.set()
        raise


def _open_run(
    mlflow: Any, experiment_name: str | None, run_name: str, params: Mapping[str, Any], tags: Mapping[str, Any],
    active: Any,
) -> TrackedRun:
    from mlflow import MlflowClient
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_USER

    uri, in_default_store = _resolve_uri(mlflow, active is not None)
    problem = unreachable(uri)
    if problem:
        raise TrackingUnreachableError(problem)
    if in_default_store:
        from .store import ensure_default_store

        ensure_default_store(Path(uri.removeprefix("sqlite:///")), default_artifact_root())
    from .store import quiet_store_creation

    with quiet_store_creation():  # a new SQLite store of the user's: no table-creation lines on stderr
        client = MlflowClient(tracking_uri=uri)

    parent_id: str | None = None
    parent_experiment_id: str | None = None
    if active is not None:
        parent_id, parent_experiment_id = active.info.run_id, active.info.experiment_id
    elif os.environ.get("MLFLOW_RUN_ID"):  # launched inside a tracked run (e.g. a workload)
        try:
            parent = client.get_run(os.environ["MLFLOW_RUN_ID"])
            parent_id, parent_experiment_id = parent.info.run_id, parent.info.experiment_id
        except Exception as e:  # noqa: BLE001
            logger.debug("MLFLOW_RUN_ID=%s is not a run of %s: %s", os.environ["MLFLOW_RUN_ID"], uri, e)

    if experiment_name:
        experiment = _get_or_create_experiment(client, experiment_name, _artifact_root(uri, in_default_store))
    else:
        chosen = _chosen_experiment(parent_experiment_id)
        if chosen is not None:
            experiment = client.get_experiment(chosen)
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            experiment = _get_or_create_experiment(client, name, _artifact_root(uri, in_default_store))

    all_tags: dict[str, str] = {str(k): str(v) for k, v in tags.items()}
    try:
        all_tags.setdefault(MLFLOW_USER, getpass.getuser())
    except Exception:  # noqa: BLE001 - no user name in some containers
        pass
    if parent_id:
        all_tags[MLFLOW_PARENT_RUN_ID] = parent_id
    info = client.create_run(experiment.experiment_id, run_name=run_name, tags=all_tags).info
    run = TrackedRun(
        client=client,
        run_id=info.run_id,
        experiment_id=info.experiment_id,
        experiment_name=experiment.name,
        tracking_uri=uri,
        parent_run_id=parent_id,
    )
    if params:
        run.log_params(params)
    logger.debug("MLflow run %s in experiment %s at %s", info.run_id, experiment.name, uri)
    return run


def attach_tracked_run(
    run_id: str, tracking_uri: str, experiment_id: str | None = None, experiment_name: str | None = None,
    *, system_metrics: bool = True, system_metrics_interval_s: float | None = None, node_id: str | None = None,
) -> TrackedRun:
    """A run that another process opened (and :meth:`TrackedRun.release`d), to log into and end here.

    A disabled run when MLflow is missing or the run cannot be found (a warning).
    """
    mlflow = _import_mlflow()
    if mlflow is None:
        return TrackedRun()
    try:
        from mlflow import MlflowClient

        problem = unreachable(tracking_uri)
        if problem:
            raise TrackingUnreachableError(problem)
        client = MlflowClient(tracking_uri=tracking_uri)
        bounded(lambda: client.get_run(run_id), "find the run")
    except Exception as e:  # noqa: BLE001 - a broken tracking store must not stop training
        message = f"MLflow tracking is off: could not find the run {run_id} at {tracking_uri}: {e}; the run goes on untracked"
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return TrackedRun()
    run = TrackedRun(client, run_id, experiment_id, experiment_name, tracking_uri)
    if system_metrics:
        run.start_system_metrics(system_metrics_interval_s, node_id)
    return run
