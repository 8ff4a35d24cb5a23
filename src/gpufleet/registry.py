"""The run registry of calls: every ``@distributed`` attempt in the run store, beside workloads.

:class:`CallRecorder` is a :class:`~gpufleet.launch.controller.ControllerCallback` that
``DistributedFunction`` adds to every call (local or Ray, warm or cold). Each *attempt* of a
call is one run of kind ``call`` in the same SQLite store as workloads (``$GPUFLEET_HOME/runs.db``),
because each attempt has its own run id, run folder, rank logs and MLflow run: the id an error
message names is the id ``gpufleet get/logs/cancel`` take. A retry's record carries the first
attempt's id as ``config.call_id``. A record holds the function's name, where the call came from
(``origin``: notebook or script path, host, user, pid), the state, the placement (GPUs and host, or
Ray nodes), the MLflow run id, the run folder and the times.

The calling process stands where a workload's supervisor does (``supervisor_pid``): a call
whose caller died is found by the CLI's liveness check, marked FAILED and its ranks stopped.
Calls have no heartbeat, so a busy caller is never taken for a hung one. ``gpufleet cancel``
only stores a cancel request for a call (it never signals the caller, which may be a notebook
kernel): a light thread of the caller reads the request once a second and cancels the run,
and the caller gets :class:`~gpufleet.errors.RunCanceledError`.

Recording never fails a call and never holds it up for long: each write waits at most
``$GPUFLEET_REGISTRY_WAIT_S`` (0.5 s) for a busy store, then is logged and skipped; how an
attempt ended goes to ``outcome.json`` in its run folder when the store is busy, which the
next CLI read records. ``GPUFLEET_REGISTRY=0`` turns recording off.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .launch.controller import ControllerCallback
from .states import CANCELED, PENDING, RUNNING, RunState

if TYPE_CHECKING:
    from .launch.controller import Controller
    from .launch.group import WorkerGroup
    from .runs.store import RunStore

logger = logging.getLogger(__name__)

REGISTRY_ENV = "GPUFLEET_REGISTRY"
WAIT_ENV = "GPUFLEET_REGISTRY_WAIT_S"
#: Seconds a record waits for a busy store before it is skipped.
DEFAULT_WAIT_S = 0.5
#: Seconds between two reads of a running call's record (a cancel request, its state).
POLL_S = 1.0
#: Seconds the end of an attempt waits for a busy store before it goes to the run folder's outcome file.
END_WAIT_S = 2.0
#: The reason a call canceled from the CLI gives.
CANCEL_REASON = "canceled with `gpufleet cancel`"
_MESSAGE_CHARS = 2000

_stores: dict[tuple[str, int], RunStore] = {}
_origin: dict[str, Any] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether calls are recorded (``GPUFLEET_REGISTRY`` is not ``0``)."""
    return os.environ.get(REGISTRY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ[WAIT_ENV]))
    except (KeyError, ValueError):
        return DEFAULT_WAIT_S


def store() -> RunStore:
    """The run store of ``$GPUFLEET_HOME``, opened once per process (writes wait :func:`_wait_s`)."""
    from .results import gpufleet_home
    from .runs.store import RunStore

    key = (str(gpufleet_home()), os.getpid())
    with _lock:
        found = _stores.get(key)
        if found is None:
            found = _stores[key] = RunStore(wait_s=_wait_s())
        return found


def notebook_path() -> str | None:
    """The path of the notebook this kernel runs, where the front end tells it (Jupyter, VS Code)."""
    for name in ("JPY_SESSION_NAME", "__session__"):
        value = os.environ.get(name)
        if value:
            return value
    try:
        ipython = sys.modules["IPython"].get_ipython()
        value = ipython.user_ns.get("__vsc_ipynb_file__") if ipython is not None else None
        return str(value) if value else None
    except Exception:  # noqa: BLE001
        return None


def call_origin() -> dict[str, Any]:
    """Where calls of this process come from: ``kind`` (notebook / script / interactive), ``path``, host, user, pid."""
    from .launch.kernel import interactive
    from .launch.leases import user_name

    with _lock:
        if _origin.get("pid") == os.getpid():
            return dict(_origin)
    if interactive():
        kind, path = "notebook", notebook_path() or "(a notebook or IPython session)"
    else:
        main = sys.modules.get("__main__")
        file = getattr(main, "__file__", None)
        if file:
            kind, path = "script", os.path.abspath(file)
        elif sys.argv and sys.argv[0] == "-c":
            kind, path = "script", "python -c"
        else:
            kind, path = "interactive", "(an interactive interpreter)"
    try:
        import psutil

        started: float | None = psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        started = None
    found = {"kind": kind, "path": path, "host": socket.gethostname(), "user": user_name(), "pid": os.getpid(),
             "pid_started": started, "cwd": os.getcwd(), "python": sys.executable}  # fmt: skip
    with _lock:
        _origin.clear()
        _origin.update(found)
    return dict(found)


def adopt_origin(origin: dict[str, Any]) -> None:
    """Record this process's calls as coming from ``origin`` (a detached supervisor's caller), with its own pid."""
    try:
        import psutil

        started: float | None = psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        started = None
    with _lock:
        _origin.clear()
        _origin.update({**origin, "pid": os.getpid(), "pid_started": started})


def placement_of(group: WorkerGroup) -> dict[str, Any]:
    """What a started group got: this host's GPUs (or CPU processes), or Ray nodes."""
    placement = getattr(group, "placement", None)
    if getattr(placement, "use_gpus", None) is not None and hasattr(placement, "gpu_indices"):  # a local group
        lease = getattr(group, "lease", None)
        out: dict[str, Any] = {"host": socket.gethostname(), "device": "gpu" if placement.use_gpus else "cpu",
                               "gpus": list(placement.gpu_indices) if placement.use_gpus else []}  # fmt: skip
        if lease is not None and lease.gpus:
            out["gpu_name"] = lease.gpus[0].name
        return out
    out = {"nodes": group.num_nodes, "hosts": list(getattr(group, "cluster_hosts", []) or [])}
    if getattr(group, "slurm_job_id", None):
        out["slurm_job_id"] = group.slurm_job_id  # type: ignore[attr-defined]
    return out


def _message(error: BaseException | None, env: Mapping[str, str]) -> str | None:
    if error is None:
        return None
    from .secrets import mask_env_secrets

    text = mask_env_secrets(f"{type(error).__name__}: {error}", env)  # the call's exception may quote a secret
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


class CallRecorder(ControllerCallback):
    """Records each attempt of one call in the run store, and cancels it on a stored cancel request."""

    def __init__(self, function: Any, launcher: str) -> None:
        opts = function.options
        self._name = opts.name or getattr(function.func, "__name__", "run")
        self._config = {
            "function": getattr(function.func, "__qualname__", self._name),
            "module": getattr(function.func, "__module__", None),
            "launcher": launcher,
            "gpus": list(opts.gpus) if isinstance(opts.gpus, tuple) else opts.gpus,
            "gpu_type": opts.gpu_type,
            "timeout": opts.timeout,
            "max_retries": opts.max_retries,
            "remote": opts.remote if isinstance(opts.remote, str) else bool(opts.remote),
        }
        self._max_attempts = opts.max_retries + 1
        from .tracking import tracking_enabled

        self._tracking = bool(opts.tracking) and tracking_enabled()
        self._enabled = enabled()
        self._store: RunStore | None = None
        self._controller: Controller | None = None
        self._call_id: str | None = None
        self._stops: dict[int, threading.Event] = {}
        self._recorded: set[str] = set()

    # -- plumbing -----------------------------------------------------------------------
    def attach(self, controller: Controller) -> None:
        self._controller = controller

    def _open(self) -> RunStore | None:
        if not self._enabled:
            return None
        if self._store is None:
            try:
                self._store = store()
            except Exception as e:  # an unusable store never stops a call
                self._enabled = False
                logger.warning("calls are not recorded in the run store: %s", e)
        return self._store

    def _try(self, run_id: str, what: str, fn: Any) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # a busy or broken store never fails the call
            logger.warning("run %s: %s was not recorded in the run store: %s", run_id, what, e)
            return False

    # -- hooks --------------------------------------------------------------------------
    def before_start(self, group: WorkerGroup, attempt: int) -> None:
        db = self._open()
        if db is None:
            return
        from .runs.records import AttemptRecord, RunRecord

        run_id = group.run_id
        self._call_id = self._call_id or run_id
        origin = call_origin()
        now = time.time()
        record = RunRecord(
            id=run_id, experiment=self._name, state=PENDING, created_at=now,
            config={**self._config, "attempt": attempt, "call_id": self._call_id},
            run_dir=str(group.run_dir.path), num_nodes=group.num_nodes or 1, world_size=group.num_ranks,
            max_attempts=self._max_attempts, tracking=self._tracking, supervisor_pid=origin["pid"],
            supervisor_started=origin["pid_started"], kind="call", origin=origin,
        )  # fmt: skip
        first = AttemptRecord(run_id=run_id, attempt=attempt, state=PENDING, started_at=now,
                              log_dir=str(group.run_dir.path))  # fmt: skip

        def create() -> None:
            db.create_run(record)
            db.start_attempt(first)

        if self._try(run_id, "the call", create):
            self._recorded.add(run_id)
            stop = self._stops[attempt] = threading.Event()
            threading.Thread(target=self._poll, args=(db, group, stop), name=f"gpufleet-registry-{run_id}",
                             daemon=True).start()  # fmt: skip

    def after_start(self, group: WorkerGroup, attempt: int) -> None:
        if group.run_id not in self._recorded or self._store is None:
            return
        if not group.starts_at_once and group.mlflow_run_id:
            db = self._store
            self._try(group.run_id, "the MLflow run",
                      lambda: db.update_attempt(group.run_id, attempt, mlflow_run_id=group.mlflow_run_id))  # fmt: skip

    def on_running(self, group: WorkerGroup, attempt: int) -> None:
        """RUNNING, with where the ranks run: told by the controller, so that a call that ends within a
        poll of its start (a short call on Slurm or Ray) has its placement recorded too."""
        if group.run_id not in self._recorded or self._store is None:
            return
        self._mark_running(self._store, group)

    def _mark_running(self, db: RunStore, group: WorkerGroup) -> None:
        now = time.time()
        pids = group.pids
        nodes = [{"node_rank": r, "rank": r, "pid": pid, "log_path": str(group.log_path(r))} for r, pid in enumerate(pids)]
        attempt = int(getattr(group.spec, "attempt", 1))

        def mark() -> None:
            db.update_run(group.run_id, state=RUNNING, started_at=now, world_size=group.num_ranks,
                          num_nodes=group.num_nodes or 1, placement=placement_of(group))  # fmt: skip
            db.update_attempt(group.run_id, attempt, state=RUNNING, started_at=now, nodes=nodes,
                              mlflow_run_id=group.mlflow_run_id)  # fmt: skip

        self._try(group.run_id, "the start", mark)

    def on_end(self, group: WorkerGroup, attempt: int, state: RunState, error: BaseException | None) -> None:
        stop = self._stops.pop(attempt, None)
        if stop is not None:
            stop.set()
        if group.run_id not in self._recorded or self._store is None:
            return
        if isinstance(error, KeyboardInterrupt):
            state = CANCELED
        message = _message(error, group.spec.env)
        if state == CANCELED and isinstance(error, KeyboardInterrupt):
            message = "interrupted (KeyboardInterrupt) in the calling process"
        db = self._store.with_wait(max(self._store.wait_s, END_WAIT_S))
        if group.mlflow_run_id:  # a local call's MLflow run opens while its ranks start
            self._try(group.run_id, "the MLflow run",
                      lambda: db.update_attempt(group.run_id, attempt, mlflow_run_id=group.mlflow_run_id))  # fmt: skip
        if not self._try(group.run_id, "the end", lambda: db.finish_run(group.run_id, state, message=message)):
            from .runs.records import write_run_outcome

            try:  # the next CLI read records it (gpufleet.runs.liveness.settle)
                write_run_outcome(group.run_dir.path, state, None, message)
            except OSError as e:
                logger.warning("run %s: could not write its outcome file either: %s", group.run_id, e)

    def on_watch(self, group: WorkerGroup, attempt: int, note: str | None) -> None:
        """The hang watchdog's note (a busy rank while the others wait) is the running call's message."""
        if group.run_id in self._recorded and self._store is not None:
            db = self._store
            self._try(group.run_id, "the watchdog's note", lambda: db.update_run(group.run_id, message=note))

    # -- the caller's watch on its record ------------------------------------------------
    def _poll(self, db: RunStore, group: WorkerGroup, stop: threading.Event) -> None:
        """Cancel the call when its record asks for it; record a call's MLflow run once it is open (it
        opens while the ranks start)."""
        reader = db.with_wait(min(db.wait_s, 0.2))
        mlflow_run_id = group.mlflow_run_id
        while not stop.wait(POLL_S):
            running = self._controller is not None and self._controller.group is group and self._controller.state == RUNNING
            if group.mlflow_run_id and group.mlflow_run_id != mlflow_run_id and running:
                mlflow_run_id = group.mlflow_run_id
                attempt = int(getattr(group.spec, "attempt", 1))
                self._try(group.run_id, "the MLflow run",
                          lambda a=attempt, m=mlflow_run_id: db.update_attempt(group.run_id, a, mlflow_run_id=m))  # fmt: skip
            try:
                run = reader.get(group.run_id)
            except Exception:  # noqa: BLE001 - busy: the next look
                continue
            if run.cancel_requested and self._controller is not None:
                logger.info("run %s: %s", group.run_id, CANCEL_REASON)
                self._controller.cancel(CANCEL_REASON)
                return
