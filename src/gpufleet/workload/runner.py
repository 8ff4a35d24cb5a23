"""The supervisor of a workload run: environment, attempts through the controller, the run store.

The supervisor (``python -m gpufleet.workload.runner RUN_ID --home HOME``) is started
detached by ``gpufleet run``. It builds the run's environment, then a
:class:`~gpufleet.launch.controller.Controller` runs the attempts: each one is a
:class:`~gpufleet.workload.nodes.WorkloadNodeGroup` running ``command`` once per node, with
the timeout restarting per attempt, retries of failed and timed-out attempts, and cancel
requests (``gpufleet cancel``, SIGTERM) stopping every node. The run store and MLflow learn
about each attempt through the controller's callbacks (:mod:`gpufleet.workload.attempts`).

What must not touch the disk reaches the supervisor through a pipe on its stdin
(``--handoff-stdin``, one JSON document, read just before the first attempt starts, so that the
supervisor gets ready while ``gpufleet run`` still opens the MLflow run): the values of the run's
``secrets`` (kept in memory, put in every node's environment only) and the MLflow run that
``gpufleet run`` opened for the first attempt. A pipe closed before the document is whole
(``gpufleet run`` interrupted) ends the run CANCELED before anything ran.

The supervisor's files are private (umask 077). Its SIGTERM handler is in place before it
marks the run RUNNING, and ``gpufleet cancel`` signals only RUNNING runs: a run canceled
before that only has the request stored, which the supervisor reads as it starts. A busy
store never changes the outcome: the supervisor writes it to ``outcome.json`` in the run
folder first, then keeps trying the store for :data:`FINISH_WAIT_S` (each write waits
``GPUFLEET_SUPERVISOR_STORE_WAIT_S``, 600 s by default), and the CLI reads the outcome file of
a run still RUNNING in the store.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from ..launch.controller import Controller, ControllerCallback
from ..launch.engines.base import Engine
from ..launch.policy import RetryPolicy
from ..launch.spec import LaunchSpec
from ..private import UnsafeStateError, private_dir, private_file_opener
from ..results import RunDir
from ..runs.cancel import signal_reason
from ..runs.liveness import process_start_time
from ..runs.recorder import RunRecorder
from ..runs.records import touch_alive, write_run_outcome
from ..runs.store import HEARTBEAT_S, RunNotFoundError, RunStore, StoreError, store_wait_s
from ..secrets import secret_env
from ..states import CANCEL_REASON, CANCELED, FAILED, RunState
from .attempts import WorkloadKind, WorkloadTracking, workload_document
from .executors import create_executor
from .handoff import Handoff, HandoffMissing
from .nodes import GRACE_PERIOD_S, WorkloadNodeGroup, needs_cluster
from .schema import WorkloadConfig

logger = logging.getLogger(__name__)

_POLL_S = 0.1
#: Seconds the supervisor waits for a locked run store in one write (``GPUFLEET_SUPERVISOR_STORE_WAIT_S``).
STORE_WAIT_S = 600.0
STORE_WAIT_ENV = "GPUFLEET_SUPERVISOR_STORE_WAIT_S"
#: Seconds the supervisor keeps trying to record a run's outcome in the store (at least).
FINISH_WAIT_S = 600.0
#: Environment variables a node never inherits from the submitting shell.
_DROPPED_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "MLFLOW_RUN_ID", "GPUFLEET_PARENT_PID")


class Supervisor:
    """Runs every attempt of one stored run and records what happens."""

    def __init__(self, run_id: str, home: str | None, handoff: Handoff | None = None) -> None:
        self.log: IO[str] = sys.stderr
        self.store_wait_s = store_wait_s(STORE_WAIT_S, STORE_WAIT_ENV)
        self.store = RunStore(home, wait_s=self.store_wait_s, on_busy=self._on_busy)
        self.run = self.store.get(run_id)
        self.config = WorkloadConfig.model_validate(workload_document(self.run.config))
        self._handoff = handoff  # read when the first attempt is about to start
        self.secrets: dict[str, str] = {}  # in memory only
        self.mlflow_run: dict[str, Any] | None = None  # attempt 1's, opened by `gpufleet run`
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

    # -- the run

    def main(self) -> int:
        """Supervise the run to its end; returns 0 (the outcome is in the store)."""
        # before the run is RUNNING: `gpufleet cancel` signals only RUNNING runs
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        pid = os.getpid()
        with contextlib.suppress(OSError):
            touch_alive(self.run_dir)
        if not self.store.mark_running(self.run.id, pid, process_start_time(pid)):
            self._end_unused_mlflow_run(CANCELED)
            return 0  # canceled (or marked failed) before it started
        if self.store.heartbeat(self.run.id)[1]:
            self.cancel_event.set()  # canceled before it started: the request waited in the store
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        try:
            state, code, message = self._run_attempts()
        except Exception as e:
            traceback.print_exc(file=self.log)
            state, code, message = FAILED, None, f"run failed: {e}"
        finally:
            self._stop_heartbeat.set()
        self._end_unused_mlflow_run(state)
        self.finish(state, code, message)
        return 0

    def _receive(self) -> None:
        """Take the handoff of ``gpufleet run`` (waits until it is written; once).

        Raises:
            HandoffMissing: ``gpufleet run`` ended before it wrote all of it.
        """
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return
        data = handoff.read()
        self.secrets = dict(data.get("secrets") or {})
        self.mlflow_run = data.get("mlflow_run")

    def _take_mlflow_run(self) -> dict[str, Any] | None:
        """The MLflow run ``gpufleet run`` opened for the first attempt (once)."""
        with contextlib.suppress(HandoffMissing):
            self._receive()
        opened, self.mlflow_run = self.mlflow_run, None
        return opened

    def _end_unused_mlflow_run(self, state: RunState) -> None:
        """End the first attempt's MLflow run when the run ended before that attempt started."""
        opened = self._take_mlflow_run()
        if not opened:
            return
        try:
            from ..tracking.runs import attach_tracked_run

            attach_tracked_run(opened["run_id"], opened["tracking_uri"], system_metrics=False).end(str(state))
        except Exception as e:  # tracking trouble never changes the run's outcome
            self.log.write(f"gpufleet: could not end the MLflow run {opened.get('run_id')}: {e}\n")

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

    def _prepare_bin_dir(self) -> str:
        deps = self.config.environment.dependencies
        if not deps:
            return os.path.dirname(sys.executable)
        from ..launch.node.envs import ensure_environment

        envs_dir = private_dir(self.store.home / "envs", "the environments folder")
        with open(self.run_dir / "environment.log", "a", opener=private_file_opener) as log:
            return str(ensure_environment(deps, envs_dir, log, cancel=self.cancel_event, base_dir=self.run_dir / "code"))

    def _run_attempts(self) -> tuple[RunState, int | None, str | None]:
        from ..launch.node.envs import EnvironmentSetupCanceled

        if self.cancel_event.is_set():
            return CANCELED, None, self.cancel_reason + " before it started"
        try:  # the folders it runs code from are checked before anything runs
            private_dir(self.run_dir, "the run folder")
            private_dir(self.run_dir / "code", "the run's code snapshot")
        except UnsafeStateError as e:
            return FAILED, None, f"run failed: {e}"
        try:
            bin_dir = self._prepare_bin_dir()
        except EnvironmentSetupCanceled:
            return CANCELED, None, self.cancel_reason + " (while its environment was being built)"
        if self.cancel_event.is_set():
            return CANCELED, None, self.cancel_reason
        try:
            self._receive()  # `gpufleet run` opened the MLflow run while this process got ready
        except HandoffMissing as e:
            return CANCELED, None, str(e)
        executor = create_executor(self.config)
        recorder = RunRecorder(WorkloadKind(self.config.timeout_minutes), self.store,
                               run_id=self.run.id, log=self.log, max_attempts=self.run.max_attempts)  # fmt: skip
        callbacks: list[ControllerCallback] = [recorder]
        if self.run.tracking:
            from ..tracking.launch import RunTracking

            callbacks.append(RunTracking(WorkloadTracking(
                self.config, self.run, self.log,
                system_metrics=not needs_cluster(self.config),  # on Ray each node samples itself (launch/engines/ray/actor.py)
                ends=recorder.ends, handed_over=self._take_mlflow_run,
            )))  # fmt: skip
        timeout_min = self.config.timeout_minutes
        controller = Controller(
            lambda attempt: self.make_group(executor, attempt, bin_dir),
            timeout_s=timeout_min * 60 if timeout_min else None,
            grace_period_s=GRACE_PERIOD_S,
            policy=RetryPolicy.for_workload(self.run.max_attempts),
            callbacks=callbacks,
            timeout_subject="the attempt",
            hang_timeout_s=self.config.hang_timeout_minutes * 60 if self.config.hang_timeout_minutes else None,
            poll_s=_POLL_S,
        )
        forward = threading.Thread(target=self._forward_cancel, args=(controller,), daemon=True)
        forward.start()
        try:
            controller.run()
        except Exception:  # the last attempt's error: its outcome is recorded (else the supervisor broke)
            if controller.attempt not in recorder.ends:
                raise
        finally:
            executor.close()
        end = recorder.ends[controller.attempt]
        if controller.state == CANCELED and end.state != CANCELED:
            # canceled as a failed attempt ended, with attempts left: the cancel, not the failure, ended the run
            what = f"attempt {controller.attempt} ended {end.state}" + (f": {end.message}" if end.message else "")
            return CANCELED, None, f"{self.cancel_reason} before attempt {controller.attempt + 1} ({what})"
        return end.state, end.exit_code, end.message

    def _forward_cancel(self, controller: Controller) -> None:
        """Hand a cancel (a signal or the store's request) to the controller, outside the signal handler."""
        self.cancel_event.wait()
        controller.cancel(self.cancel_reason)

    def workload_env(self, bin_dir: str) -> dict[str, str]:
        """The workload's own variables of every node (the launch spec adds the node contract)."""
        env = self.config.env_strings()
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.environ.get("PATH", os.defpath))
        if bin_dir != os.path.dirname(sys.executable) or sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = str(Path(bin_dir).parent)
        env.update(
            CODE_SOURCE_PATH=str(self.run_dir / "code"),
            HYPERPARAMETERS_PATH=str(self.run_dir / "hyperparameters.yaml"),
            GPUFLEET_RUN_DIR=str(self.run_dir),
            GPUFLEET_CHECKPOINT_DIR=str(self.run_dir / "checkpoints"),
        )
        env.update(secret_env(self.secrets))  # the values, and their names for the guard that masks them
        return env

    def watch_env(self, attempt: int) -> dict[str, str]:
        """What ranks that use gpufleet need for the hang watchdog, and the faults of this attempt."""
        from ..faults import faults_env, parse_faults
        from ..launch.progress import watchdog_env

        hang = self.config.hang_timeout_minutes
        return {**watchdog_env(hang * 60 if hang else None), **faults_env(parse_faults(self.config.faults), attempt)}

    def make_group(self, executor: Engine, attempt: int, bin_dir: str) -> WorkloadNodeGroup:
        """The (not yet started) node group of attempt ``attempt``."""
        log_dir = self.run_dir / "attempts" / str(attempt)
        log_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "checkpoints").mkdir(exist_ok=True)
        c = self.config.compute
        spec = LaunchSpec(
            run_id=self.run.id,
            world_size=c.num_accelerators,
            num_nodes=c.num_nodes,
            use_gpus=c.gpu_type is not None,
            attempt=attempt,
            env={**self.workload_env(bin_dir), **self.watch_env(attempt)},
        )
        inherited = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        return WorkloadNodeGroup(
            spec, RunDir(log_dir), executor, self.config.command, str(self.run_dir / "code"),
            num_command_nodes=c.command_nodes, local_world_size=c.per_node, inherited_env=inherited,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry of the supervisor process."""
    os.umask(0o077)  # everything the supervisor and the run's commands create is the user's alone
    parser = argparse.ArgumentParser(prog="python -m gpufleet.workload.runner")
    parser.add_argument("run_id")
    parser.add_argument("--home", default=None)
    parser.add_argument("--handoff-stdin", action="store_true", help="read secrets and the MLflow run from stdin")
    args = parser.parse_args(argv)
    handoff = Handoff() if args.handoff_stdin else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    supervisor = Supervisor(args.run_id, args.home, handoff)
    return supervisor.main()


if __name__ == "__main__":
    sys.exit(main())
