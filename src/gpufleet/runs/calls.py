"""Decorated calls in the run store: each ``@distributed`` attempt is a run of kind ``call``.

:class:`CallKind` is what a call records differently (:mod:`.recorder`): ``DistributedFunction``
adds a :class:`~gpufleet.runs.recorder.RunRecorder` of this kind to every call (local or Ray, warm
or cold). Each *attempt* of a call is one run in the same SQLite store as workloads
(``$GPUFLEET_HOME/runs.db``), because each attempt has its own run id, run folder, rank logs and
MLflow run: the id an error message names is the id ``gpufleet get/logs/cancel`` take. A retry's
record carries the first attempt's id as ``config.call_id``. A record holds the function's name,
where the call came from (``origin``: notebook or script path, host, user, pid), the state, the
placement (GPUs and host, or Ray nodes), the MLflow run id, the run folder and the times.

The calling process stands where a workload's supervisor does (``supervisor_pid``): a call
whose caller died is found by the CLI's liveness check, marked FAILED and its ranks stopped.
Calls have no heartbeat, so a busy caller is never taken for a hung one. ``gpufleet cancel``
only stores a cancel request for a call (it never signals the caller, which may be a notebook
kernel): the recorder reads the request once a second and cancels the run, and the caller gets
:class:`~gpufleet.errors.RunCanceledError`.

A detached call (``submit(..., detach=True)``) is one stored run under a supervisor of its own
instead (``CallKind(..., one_run=True)``, :class:`StoredCall`): its attempts are rows of that run,
as a workload's, its supervisor has a heartbeat and gets ``gpufleet cancel``'s signal.

Recording never fails a call and never holds it up for long: each write waits at most
``$GPUFLEET_REGISTRY_WAIT_S`` (0.5 s) for a busy store, then is logged and skipped; how an
attempt ended goes to ``outcome.json`` in its run folder when the store is busy, which the
next CLI read records. ``GPUFLEET_REGISTRY=0`` turns recording off.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..launch.node import envcontract
from ..states import CANCELED, PENDING, RUNNING, SUCCESS, RunState
from .recorder import RunRecorder
from .records import AttemptEnd, RunRecord

if TYPE_CHECKING:
    from ..launch.group import WorkerGroup
    from .store import RunStore


#: Seconds a record waits for a busy store before it is skipped.
DEFAULT_WAIT_S = 0.5
#: Seconds the end of an attempt waits for a busy store before it goes to the run folder's outcome file.
END_WAIT_S = 2.0
_MESSAGE_CHARS = 2000

_stores: dict[tuple[str, int], RunStore] = {}
_origin: dict[str, Any] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether calls are recorded (``GPUFLEET_REGISTRY`` is not ``0``)."""
    return os.environ.get(envcontract.REGISTRY, "1").strip().lower() not in ("0", "false", "no", "off")


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ[envcontract.REGISTRY_WAIT_S]))
    except (KeyError, ValueError):
        return DEFAULT_WAIT_S


def store() -> RunStore:
    """The run store of ``$GPUFLEET_HOME``, opened once per process (writes wait :func:`_wait_s`)."""
    from ..results import gpufleet_home
    from .store import RunStore

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
    from ..launch.kernel import interactive
    from ..launch.leasing.leases import user_name

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
    from ..secrets import mask_env_secrets

    text = mask_env_secrets(f"{type(error).__name__}: {error}", env)  # the call's exception may quote a secret
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


class CallKind:
    """A decorated call's attempts: each a run of its own, PENDING until its ranks run, canceled by request.

    ``one_run``: the call is one stored run under a supervisor of its own (a detached call): its
    attempts are rows of that run, as a workload's, and the supervisor reads the cancel request.
    """

    records_ranks = True  # where its ranks run is recorded as they do

    def __init__(self, function: Any, launcher: str, one_run: bool = False) -> None:
        self.run_per_attempt = not one_run
        self.attempt_start_state = RUNNING if one_run else PENDING
        self.watches_cancel = not one_run
        opts = function.options
        self.name = opts.name or getattr(function.func, "__name__", "run")
        self.config = {
            "function": getattr(function.func, "__qualname__", self.name),
            "module": getattr(function.func, "__module__", None),
            "launcher": launcher,
            "gpus": list(opts.gpus) if isinstance(opts.gpus, tuple) else opts.gpus,
            "gpu_type": opts.gpu_type,
            "timeout": opts.timeout,
            "max_retries": opts.max_retries,
            "remote": opts.remote if isinstance(opts.remote, str) else bool(opts.remote),
        }
        self.max_attempts = opts.max_retries + 1
        self.world_size = opts.gpus if isinstance(opts.gpus, int) else len(opts.gpus or ())  # known once it runs
        from ..tracking import tracking_enabled

        self.tracking = bool(opts.tracking) and tracking_enabled()

    def new_run(self, group: WorkerGroup, attempt: int, first_run_id: str) -> RunRecord:
        origin = call_origin()
        return RunRecord(
            id=group.run_id, experiment=self.name, state=PENDING, created_at=time.time(),
            config={**self.config, "attempt": attempt, "call_id": first_run_id},
            run_dir=str(group.run_dir.path), num_nodes=group.num_nodes or 1, world_size=group.num_ranks,
            max_attempts=self.max_attempts, tracking=self.tracking, supervisor_pid=origin["pid"],
            supervisor_started=origin["pid_started"], kind="call", origin=origin,
        )  # fmt: skip

    def stored_run(self, run_id: str, run_dir: Path, origin: dict[str, Any]) -> RunRecord:
        """The PENDING record of a call that is one stored run (``one_run``), made before its supervisor starts."""
        return RunRecord(
            id=run_id, experiment=self.name, state=PENDING, created_at=time.time(),
            config={**self.config, "call_id": run_id, "detached": True}, run_dir=str(run_dir), num_nodes=1,
            world_size=self.world_size, max_attempts=self.max_attempts, tracking=self.tracking, kind="call",
            origin=origin,
        )  # fmt: skip

    def end_of(self, group: WorkerGroup, state: RunState, error: BaseException | None,
               cancel_reason: str | None) -> AttemptEnd:  # fmt: skip
        if state == CANCELED and cancel_reason:
            return AttemptEnd(state, None, cancel_reason)  # as a workload's: the exception says the rest
        return AttemptEnd(state, 0 if state == SUCCESS else None, _message(error, group.spec.env))


@dataclass(frozen=True)
class StoredCall:
    """A call that is one stored run under a supervisor of its own (a detached call, :mod:`gpufleet.detached_run`)."""

    run_id: str
    run_dir: Path
    recorder: RunRecorder


def call_recorder(function: Any, launcher: str) -> RunRecorder:
    """The recorder of one call's attempts (nothing is recorded when ``GPUFLEET_REGISTRY=0``)."""
    return RunRecorder(CallKind(function, launcher), store if enabled() else (lambda: None), end_wait_s=END_WAIT_S)
