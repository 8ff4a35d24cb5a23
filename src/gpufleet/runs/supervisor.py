"""The supervisor of a stored run: one process core for a workload run and a detached call.

``gpufleet run`` and ``submit(..., detach=True)`` both store a PENDING run and start its
supervisor (:func:`start_supervisor`: ``python -m MODULE RUN_ID --home HOME``, a new session,
``GPUFLEET_RUN_ID`` in its environment, its output in the run folder's ``supervisor.log``). What
a supervisor runs is its :class:`SupervisedRun` (a workload's node commands, a call's ranks);
everything else is this module's, written once for both:

- its files are private (umask 077);
- its SIGTERM and SIGINT handlers are in place before it marks the run RUNNING (``gpufleet
  cancel`` signals only RUNNING runs, :mod:`.cancel`); a signal only sets an event, which a
  thread hands to the controller (:meth:`Supervisor.forward_cancel`) with the one reason
  (:func:`~gpufleet.runs.cancel.signal_reason`);
- a heartbeat every :data:`~gpufleet.runs.store.HEARTBEAT_S` seconds in the store and in the
  run folder's alive file (what the CLI's liveness check reads: a supervisor that died or hangs
  is found, its run ended FAILED); the beat reads the stored cancel request (a PENDING run's
  cancel is read once more as it starts), and a run whose record was removed stops and says why;
- the end: ``outcome.json`` in the run folder first (no lock can stop that), then the store,
  retried for :data:`FINISH_WAIT_S`; each write waits ``GPUFLEET_SUPERVISOR_STORE_WAIT_S`` (600 s)
  for a busy store; the last line of the log says how it ended; the exit code is 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from ..launch.node import envcontract
from ..private import private_file_opener
from ..states import CANCEL_REASON, CANCELED, FAILED, RunState
from .cancel import signal_reason
from .liveness import process_start_time
from .records import touch_alive, write_run_outcome
from .store import HEARTBEAT_S, RunNotFoundError, RunStore, StoreError, store_wait_s

if TYPE_CHECKING:
    from ..launch.controller import Controller

#: Seconds a supervisor waits for a locked run store in one write (``GPUFLEET_SUPERVISOR_STORE_WAIT_S``).
STORE_WAIT_S = 600.0
#: Seconds a supervisor keeps trying to record a run's outcome in the store (at least).
FINISH_WAIT_S = 600.0
LOG_FILE = "supervisor.log"


def start_supervisor(module: str, run_id: str, home: Path, run_dir: Path,
                     handoff_follows: bool = False) -> subprocess.Popen[bytes]:  # fmt: skip
    """Start ``python -m MODULE RUN_ID --home HOME``, the detached supervisor of a stored run.

    It outlives the calling process (a new session: no terminal signal reaches it). With
    ``handoff_follows`` its stdin is a pipe the caller writes once (a workload's secrets and
    MLflow run, :mod:`gpufleet.workload.handoff`); else /dev/null.
    """
    log = open(run_dir / LOG_FILE, "ab", opener=private_file_opener)  # noqa: SIM115 - the child holds it
    env = dict(os.environ)
    env[envcontract.RUN_ID] = run_id  # its own processes are the run's (stacks, the liveness check's stop)
    argv = [sys.executable, "-m", module, run_id, "--home", str(home)]
    try:
        return subprocess.Popen(
            argv + (["--handoff-stdin"] if handoff_follows else []),
            stdin=subprocess.PIPE if handoff_follows else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
    finally:
        log.close()


class SupervisedRun(Protocol):
    """What one kind of stored run does under its supervisor."""

    def run(self) -> tuple[RunState, int | None, str | None]:
        """Run every attempt to the run's end: its state, exit code and message (a cancel: the supervisor's
        :attr:`~Supervisor.cancel_event` is set, handed to the controller by :meth:`Supervisor.forward_cancel`)."""
        ...

    def ended(self, state: RunState) -> None:
        """The run ended in ``state`` (also when it never started): what is left to close."""
        ...


class Supervisor:
    """Supervises one stored run to its end and records it (module docstring)."""

    def __init__(self, run_id: str, home: str | None) -> None:
        self.log: IO[str] = sys.stderr
        self.store_wait_s = store_wait_s(STORE_WAIT_S, envcontract.SUPERVISOR_STORE_WAIT_S)
        self.store = RunStore(home, wait_s=self.store_wait_s, on_busy=self._on_busy)
        self.run = self.store.get(run_id)
        self.run_dir = Path(self.run.run_dir)
        self.cancel_event = threading.Event()
        self.cancel_reason = CANCEL_REASON
        self._stop_heartbeat = threading.Event()

    def _on_busy(self, message: str) -> None:
        self.log.write(f"gpufleet: {message}\n")
        self.log.flush()

    # -- signals and heartbeat

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.cancel_reason = signal_reason(signum)
        self.cancel_event.set()

    def _heartbeat_loop(self) -> None:
        store = self.store.with_wait(HEARTBEAT_S)  # a beat that waited longer would come late
        store.on_busy = None
        while not self._stop_heartbeat.wait(HEARTBEAT_S):
            try:
                touch_alive(self.run_dir)  # what liveness sees while the store is busy
            except OSError as e:
                self.log.write(f"gpufleet: could not touch the alive file: {e}\n")
            try:
                _, cancel = store.heartbeat(self.run.id)
                if cancel:
                    self.cancel_event.set()
            except RunNotFoundError as e:  # nobody could see, cancel or record it any more: stop
                self.cancel_reason = (f"stopped: {e} (its record was removed), so it could no longer be listed, "
                                      f"canceled or recorded")  # fmt: skip
                self.log.write(f"gpufleet: {self.cancel_reason}\n")
                self.log.flush()
                self.cancel_event.set()
                return
            except Exception as e:  # a locked database must not kill the run
                self.log.write(f"gpufleet: heartbeat failed: {e}\n")
            self.log.flush()

    def forward_cancel(self, controller: Controller) -> None:
        """Hand a cancel (a signal, the store's request) to ``controller`` from a thread, outside the signal handler."""

        def forward() -> None:
            self.cancel_event.wait()
            controller.cancel(self.cancel_reason)

        threading.Thread(target=forward, name="gpufleet-forward-cancel", daemon=True).start()

    # -- the run

    def main(self, payload: SupervisedRun) -> int:
        """Supervise the run to its end; returns 0 (the outcome is in the store)."""
        # before the run is RUNNING: `gpufleet cancel` signals only RUNNING runs
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        pid = os.getpid()
        with contextlib.suppress(OSError):
            touch_alive(self.run_dir)
        if not self.store.mark_running(self.run.id, pid, process_start_time(pid)):
            payload.ended(CANCELED)
            return 0  # canceled (or marked failed) before it started
        if self.store.heartbeat(self.run.id)[1]:
            self.cancel_event.set()  # canceled before it started: the request waited in the store
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        try:
            state, code, message = payload.run()
        except Exception as e:
            traceback.print_exc(file=self.log)
            state, code, message = FAILED, None, f"run failed: {e}"
        finally:
            self._stop_heartbeat.set()
        payload.ended(state)
        self.finish(state, code, message)
        return 0

    def finish(self, state: RunState, code: int | None, message: str | None) -> None:
        """Record the outcome: in the run folder first (no lock can stop that), then in the store.

        The store is retried for :data:`FINISH_WAIT_S` (or ``store_wait_s`` if longer); a CLI
        read records the outcome file in the store if the supervisor could not.
        """
        try:
            write_run_outcome(self.run_dir, state, code, message)
        except OSError as e:
            self.log.write(f"gpufleet: could not write the outcome file: {e}\n")
        deadline = time.monotonic() + max(self.store_wait_s, FINISH_WAIT_S)
        while True:
            try:
                self.store.finish_run(self.run.id, state, exit_code=code, message=message)
                break
            except StoreError as e:
                if time.monotonic() >= deadline:
                    self.log.write(f"gpufleet: could not record the outcome in the run store ({e}); it is in "
                                   f"{self.run_dir / 'outcome.json'}, which the next CLI read records\n")  # fmt: skip
                    break
                self.log.write(f"gpufleet: could not record the outcome in the run store yet ({e}); retrying\n")
                self.log.flush()
                time.sleep(1.0)
        self.log.write(f"gpufleet: run {self.run.id} finished: {state}\n")
        self.log.flush()


def supervise(prog: str, make_run: Callable[[Supervisor, argparse.Namespace], SupervisedRun],
              argv: list[str] | None = None, handoff: bool = False) -> int:  # fmt: skip
    """The entry of a supervisor process: ``prog RUN_ID --home HOME [--handoff-stdin]``."""
    os.umask(0o077)  # everything the supervisor and the run's processes create is the user's alone
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("run_id")
    parser.add_argument("--home", default=None)
    if handoff:
        parser.add_argument("--handoff-stdin", action="store_true", help="read secrets and the MLflow run from stdin")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    supervisor = Supervisor(args.run_id, args.home)
    return supervisor.main(make_run(supervisor, args))
