"""One recorder of runs in the run store, for decorated calls and workloads alike.

:class:`RunRecorder` is the :class:`~gpufleet.launch.controller.ControllerCallback` that writes
what the controller does to the run store: an attempt's row as it starts, where its ranks or
nodes run, the hang watchdog's note, and how it ended. What differs between the two kinds of run
is data of a :class:`RunKind`, not code of its own:

- a call's attempt is a run of its own (its own id, folder, logs; ``config.call_id`` names the
  first attempt's id), so its row is made as the attempt starts and finished as it ends; a
  workload's attempts are rows of the one run its supervisor made and finishes;
- the attempt's first state (a call's attempt is PENDING until its ranks run; a workload's
  supervisor is already RUNNING);
- how an attempt's end reads in the store (:meth:`RunKind.end_of`); a canceled attempt of either
  kind says why it was stopped, the controller's cancel reason (``states.CANCEL_REASON``, "canceled
  by the user", for ``gpufleet cancel``, a handle's ``cancel()`` and a SIGTERM to a supervisor);
- who watches the stored cancel request: a call's caller may be a notebook kernel that no
  signal should reach, so the recorder reads the request once a second and cancels the
  controller; a workload's supervisor gets a signal and reads the request itself.

A write never fails a run: an error is logged and skipped. How long a write waits for a busy
store is the store's own bound (:meth:`~gpufleet.runs.store.RunStore.with_wait`): a call's
writes wait half a second and its end two, then the end goes to ``outcome.json`` in its run
folder, which the next CLI read records; a workload's supervisor waits as long as it takes.
Attempts are numbered from 1 everywhere: the hook's ``attempt`` is the number stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, Protocol

from ..launch.controller import ControllerCallback
from ..states import CANCEL_REASON, RUNNING, RunState
from .records import AttemptEnd, AttemptRecord, RunRecord

if TYPE_CHECKING:
    from ..launch.controller import Controller
    from ..launch.group import WorkerGroup
    from ..launch.recoveries import Recovery
    from .store import RunStore

logger = logging.getLogger(__name__)

#: Seconds between two reads of a running call's record (a cancel request).
POLL_S = 1.0


class RunKind(Protocol):
    """What one kind of run (``call`` or ``workload``) records differently (module docstring)."""

    #: Each attempt is a run of its own: its row is made as it starts and finished as it ends.
    run_per_attempt: bool
    #: The state of an attempt's row when it is made.
    attempt_start_state: RunState
    #: The recorder reads the stored cancel request and cancels the controller.
    watches_cancel: bool
    #: Where the ranks run (their pids and logs, the GPUs or nodes) is recorded once they do (a call's; a
    #: workload's node group describes its nodes as they start).
    records_ranks: bool

    def new_run(self, group: WorkerGroup, attempt: int, first_run_id: str) -> RunRecord:
        """The run row of an attempt (used when ``run_per_attempt``)."""
        ...

    def end_of(self, group: WorkerGroup, state: RunState, error: BaseException | None,
               cancel_reason: str | None) -> AttemptEnd:  # fmt: skip
        """How an attempt that the controller ended in ``state`` with ``error`` reads in the store.

        ``cancel_reason`` is why the run was stopped (the controller's): a canceled attempt's message.
        """
        ...


class RunRecorder(ControllerCallback):
    """Records each attempt of one run (a call's or a workload's) in the run store.

    Args:
        kind: what this kind of run records differently.
        store: the run store, or a function that opens it when the first attempt starts (None, or
            an error: nothing is recorded, and the run goes on).
        run_id: the stored run whose attempts these are (a workload's); None when each attempt is
            a run of its own.
        log: where a retry is announced (a workload's supervisor log), if anywhere.
        max_attempts: the run's attempts at most, shown in that announcement.
        end_wait_s: how long the end of an attempt waits for a busy store at least.

    Attributes:
        ends: how each attempt that ended did, by attempt number.
    """

    def __init__(self, kind: RunKind, store: RunStore | Callable[[], RunStore | None], *, run_id: str | None = None,
                 log: IO[str] | None = None, max_attempts: int | None = None, end_wait_s: float = 0.0) -> None:  # fmt: skip
        self.kind = kind
        self._open_store = store if callable(store) else (lambda: store)
        self._store: RunStore | None = None
        self._opened = False
        self._run_id = run_id
        self._log = log
        self._max_attempts = max_attempts
        self._end_wait_s = end_wait_s
        self._controller: Controller | None = None
        self._first_run_id: str | None = None
        self._recorded: set[tuple[str, int]] = set()
        self._stops: dict[int, threading.Event] = {}
        self._recoveries: dict[int, dict[int, dict[str, Any]]] = {}  # attempt -> number -> record
        self.ends: dict[int, AttemptEnd] = {}

    # -- plumbing -----------------------------------------------------------------------
    def attach(self, controller: Controller) -> None:
        self._controller = controller

    def _db(self) -> RunStore | None:
        if not self._opened:
            self._opened = True
            try:
                self._store = self._open_store()
            except Exception as e:  # an unusable store never stops a run
                logger.warning("runs are not recorded in the run store: %s", e)
        return self._store

    def _try(self, run_id: str, what: str, fn: Callable[[], Any]) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # a busy or broken store never fails the run
            logger.warning("run %s: %s was not recorded in the run store: %s", run_id, what, e)
            return False

    def _run_of(self, group: WorkerGroup) -> str:
        return self._run_id or group.run_id

    def _recording(self, group: WorkerGroup, attempt: int) -> RunStore | None:
        return self._store if (self._run_of(group), attempt) in self._recorded else None

    # -- hooks --------------------------------------------------------------------------
    def before_start(self, group: WorkerGroup, attempt: int) -> None:
        previous = self.ends.get(attempt - 1)
        if previous is not None and self._log is not None:
            of = f"/{self._max_attempts}" if self._max_attempts else ""
            self._log.write(f"gpufleet: attempt {attempt - 1} ended {previous.state}; retrying ({attempt}{of})\n")
            self._log.flush()
        db = self._db()
        if db is None:
            return
        run_id = self._run_of(group)
        self._first_run_id = self._first_run_id or run_id
        record = self.kind.new_run(group, attempt, self._first_run_id) if self.kind.run_per_attempt else None
        row = AttemptRecord(run_id=run_id, attempt=attempt, state=self.kind.attempt_start_state, started_at=time.time(),
                            log_dir=str(group.run_dir.path))  # fmt: skip

        def create() -> None:
            if record is not None:
                db.create_run(record)
            db.start_attempt(row)

        if not self._try(run_id, "the attempt", create):
            return
        self._recorded.add((run_id, attempt))
        if self.kind.watches_cancel:
            stop = self._stops[attempt] = threading.Event()
            threading.Thread(target=self._watch_cancel, args=(db, group, attempt, stop),
                             name=f"gpufleet-registry-{run_id}", daemon=True).start()  # fmt: skip

    def after_start(self, group: WorkerGroup, attempt: int) -> None:
        db = self._recording(group, attempt)
        if db is None:
            return
        fields: dict[str, Any] = {}
        describe = getattr(group, "describe_nodes", None)
        if describe is not None:  # a workload's nodes: host, pid, log
            fields["nodes"] = describe()
        if group.mlflow_run_id and not (self.kind.run_per_attempt and group.starts_at_once):
            fields["mlflow_run_id"] = group.mlflow_run_id  # (a call whose ranks run at once records it in on_running)
        if fields:
            self._try(self._run_of(group), "the start", lambda: db.update_attempt(self._run_of(group), attempt, **fields))

    def on_running(self, group: WorkerGroup, attempt: int) -> None:
        """Where a call's ranks run, and a run of its own attempt is RUNNING: told by the controller, so that
        an attempt that ends within a poll of its start (a short call on Slurm or Ray) has its placement too."""
        db = self._recording(group, attempt)
        if db is None or not self.kind.records_ranks:
            return  # a workload's supervisor made its run RUNNING, and its attempt row is
        from .calls import placement_of

        now = time.time()
        run_id = self._run_of(group)
        nodes = [{"node_rank": r, "rank": r, "pid": pid, "log_path": str(group.log_path(r))}
                 for r, pid in enumerate(group.pids)]  # fmt: skip
        # a run of its own attempt starts RUNNING now; a run of attempts (its supervisor's) already is
        started = {"state": RUNNING, "started_at": now} if self.kind.run_per_attempt else {}

        def mark() -> None:
            db.update_run(run_id, world_size=group.num_ranks, num_nodes=group.num_nodes or 1,
                          placement=placement_of(group), **started)  # fmt: skip
            db.update_attempt(run_id, attempt, state=RUNNING, nodes=nodes, mlflow_run_id=group.mlflow_run_id,
                              **({"started_at": now} if started else {}))  # fmt: skip

        self._try(run_id, "the start", mark)

    def on_end(self, group: WorkerGroup, attempt: int, state: RunState, error: BaseException | None) -> None:
        stop = self._stops.pop(attempt, None)
        if stop is not None:
            stop.set()
        controller = self._controller
        end = self.kind.end_of(group, state, error, controller.cancel_reason if controller is not None else None)
        self.ends[attempt] = end
        db = self._recording(group, attempt)
        if db is None:
            return
        db = db.with_wait(max(db.wait_s, self._end_wait_s))
        run_id = self._run_of(group)
        if not self.kind.run_per_attempt:
            mlflow = {"mlflow_run_id": group.mlflow_run_id} if group.mlflow_run_id else {}  # also for a failed start
            self._try(run_id, "the attempt's end", lambda: db.update_attempt(
                run_id, attempt, state=end.state, ended_at=time.time(), exit_code=end.exit_code, message=end.message,
                **mlflow))
            return
        if group.mlflow_run_id:  # a local call's MLflow run opens while its ranks start
            self._try(run_id, "the MLflow run",
                      lambda: db.update_attempt(run_id, attempt, mlflow_run_id=group.mlflow_run_id))  # fmt: skip
        if not self._try(run_id, "the end", lambda: db.finish_run(run_id, end.state, message=end.message)):
            from .records import write_run_outcome

            try:  # the next CLI read records it (gpufleet.runs.liveness.settle)
                write_run_outcome(group.run_dir.path, end.state, None, end.message)
            except OSError as e:
                logger.warning("run %s: could not write its outcome file either: %s", run_id, e)

    def on_watch(self, group: WorkerGroup, attempt: int, note: str | None) -> None:
        """The hang watchdog's note (a busy rank while the others wait) is the running run's message."""
        db = self._recording(group, attempt)
        if db is not None:
            run_id = self._run_of(group)
            self._try(run_id, "the watchdog's note", lambda: db.update_run(run_id, message=note))

    def on_recovery(self, group: WorkerGroup, attempt: int, recovery: Recovery) -> None:
        """A lost rank's recovery in place (or its refusal): the attempt's ``recoveries``, as they stand."""
        self._recoveries.setdefault(attempt, {})[recovery.number] = recovery.to_dict()
        db = self._recording(group, attempt)
        if db is not None:
            run_id = self._run_of(group)
            rows = [self._recoveries[attempt][n] for n in sorted(self._recoveries[attempt])]
            self._try(run_id, "the recovery", lambda: db.update_attempt(run_id, attempt, recoveries=rows))

    # -- the caller's watch on its record ------------------------------------------------
    def _watch_cancel(self, db: RunStore, group: WorkerGroup, attempt: int, stop: threading.Event) -> None:
        """Cancel the run when its record asks for it; record its MLflow run once it is open (a local
        call's opens while its ranks start)."""
        reader = db.with_wait(min(db.wait_s, 0.2))
        run_id = self._run_of(group)
        mlflow_run_id = group.mlflow_run_id
        while not stop.wait(POLL_S):
            controller = self._controller
            running = controller is not None and controller.group is group and controller.state == RUNNING
            if group.mlflow_run_id and group.mlflow_run_id != mlflow_run_id and running:
                mlflow_run_id = group.mlflow_run_id
                self._try(run_id, "the MLflow run",
                          lambda m=mlflow_run_id: db.update_attempt(run_id, attempt, mlflow_run_id=m))  # fmt: skip
            try:
                run = reader.get(run_id)
            except Exception:  # noqa: BLE001 - busy: the next look
                continue
            if run.cancel_requested and controller is not None:
                logger.info("run %s: %s", run_id, CANCEL_REASON)
                controller.cancel(CANCEL_REASON)
                return

