"""A workload run under its supervisor: its environment, then its attempts through the controller.

The supervisor (``python -m gpufleet.workload.runner RUN_ID --home HOME``, the core in
:mod:`gpufleet.runs.supervisor`: signals, heartbeat, cancel, the outcome) is started detached by
``gpufleet run``. :class:`WorkloadRun` builds the run's environment, then a
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
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..launch.controller import Controller, ControllerCallback
from ..launch.engines.base import Engine
from ..launch.node import envcontract
from ..launch.policy import RetryPolicy
from ..launch.spec import LaunchSpec
from ..private import UnsafeStateError, private_dir, private_file_opener
from ..results import RunDir
from ..runs.recorder import RunRecorder
from ..runs.supervisor import Supervisor, supervise
from ..secrets import secret_env
from ..states import CANCELED, FAILED, RunState
from .attempts import WorkloadKind, WorkloadTracking, workload_document
from .executors import create_executor
from .handoff import Handoff, HandoffMissing
from .nodes import GRACE_PERIOD_S, WorkloadNodeGroup, needs_cluster
from .schema import WorkloadConfig

logger = logging.getLogger(__name__)

_POLL_S = 0.1
#: Environment variables a node never inherits from the submitting shell.
_DROPPED_ENV = (
    envcontract.RANK, envcontract.LOCAL_RANK, envcontract.GROUP_RANK, envcontract.ROLE_RANK, "MLFLOW_RUN_ID",
    envcontract.PARENT_PID,
)


class WorkloadRun:
    """A workload run under its supervisor: its environment, then its attempts through the controller."""

    def __init__(self, supervisor: Supervisor, handoff: Handoff | None = None) -> None:
        self.sup = supervisor
        self.config = WorkloadConfig.model_validate(workload_document(supervisor.run.config))
        self._handoff = handoff  # read when the first attempt is about to start
        self.secrets: dict[str, str] = {}  # in memory only
        self.mlflow_run: dict[str, Any] | None = None  # attempt 1's, opened by `gpufleet run`

    @property
    def run_dir(self) -> Path:
        return self.sup.run_dir

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

    def ended(self, state: RunState) -> None:
        """End the first attempt's MLflow run when the run ended before that attempt started."""
        opened = self._take_mlflow_run()
        if not opened:
            return
        try:
            from ..tracking.runs import attach_tracked_run

            attach_tracked_run(opened["run_id"], opened["tracking_uri"], system_metrics=False).end(str(state))
        except Exception as e:  # tracking trouble never changes the run's outcome
            self.sup.log.write(f"gpufleet: could not end the MLflow run {opened.get('run_id')}: {e}\n")

    def _prepare_bin_dir(self) -> str:
        deps = self.config.environment.dependencies
        if not deps:
            return os.path.dirname(sys.executable)
        from ..launch.node.envs import ensure_environment

        envs_dir = private_dir(self.sup.store.home / "envs", "the environments folder")
        with open(self.run_dir / "environment.log", "a", opener=private_file_opener) as log:
            return str(ensure_environment(deps, envs_dir, log, cancel=self.sup.cancel_event, base_dir=self.run_dir / "code"))

    def run(self) -> tuple[RunState, int | None, str | None]:
        from ..launch.node.envs import EnvironmentSetupCanceled

        if self.sup.cancel_event.is_set():
            return CANCELED, None, self.sup.cancel_reason + " before it started"
        try:  # the folders it runs code from are checked before anything runs
            private_dir(self.run_dir, "the run folder")
            private_dir(self.run_dir / "code", "the run's code snapshot")
        except UnsafeStateError as e:
            return FAILED, None, f"run failed: {e}"
        try:
            bin_dir = self._prepare_bin_dir()
        except EnvironmentSetupCanceled:
            return CANCELED, None, self.sup.cancel_reason + " (while its environment was being built)"
        if self.sup.cancel_event.is_set():
            return CANCELED, None, self.sup.cancel_reason
        try:
            self._receive()  # `gpufleet run` opened the MLflow run while this process got ready
        except HandoffMissing as e:
            return CANCELED, None, str(e)
        executor = create_executor(self.config)
        recorder = RunRecorder(WorkloadKind(self.config.timeout_minutes), self.sup.store,
                               run_id=self.sup.run.id, log=self.sup.log, max_attempts=self.sup.run.max_attempts)  # fmt: skip
        callbacks: list[ControllerCallback] = [recorder]
        if self.sup.run.tracking:
            from ..tracking.launch import RunTracking

            callbacks.append(RunTracking(WorkloadTracking(
                self.config, self.sup.run, self.sup.log,
                system_metrics=not needs_cluster(self.config),  # on Ray each node samples itself (launch/engines/ray/actor.py)
                ends=recorder.ends, handed_over=self._take_mlflow_run,
            )))  # fmt: skip
        timeout_min = self.config.timeout_minutes
        controller = Controller(
            lambda attempt: self.make_group(executor, attempt, bin_dir),
            timeout_s=timeout_min * 60 if timeout_min else None,
            grace_period_s=GRACE_PERIOD_S,
            policy=RetryPolicy.for_workload(self.sup.run.max_attempts),
            callbacks=callbacks,
            timeout_subject="the attempt",
            hang_timeout_s=self.config.hang_timeout_minutes * 60 if self.config.hang_timeout_minutes else None,
            poll_s=_POLL_S,
        )
        self.sup.forward_cancel(controller)
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
            return CANCELED, None, f"{self.sup.cancel_reason} before attempt {controller.attempt + 1} ({what})"
        return end.state, end.exit_code, end.message

    def workload_env(self, bin_dir: str) -> dict[str, str]:
        """The workload's own variables of every node (the launch spec adds the node contract)."""
        env = self.config.env_strings()
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.environ.get("PATH", os.defpath))
        if bin_dir != os.path.dirname(sys.executable) or sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = str(Path(bin_dir).parent)
        env.update({
            envcontract.CODE_SOURCE_PATH: str(self.run_dir / "code"),
            envcontract.HYPERPARAMETERS_PATH: str(self.run_dir / "hyperparameters.yaml"),
            envcontract.RUN_DIR: str(self.run_dir),
            envcontract.CHECKPOINT_DIR: str(self.run_dir / "checkpoints"),
        })
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
            run_id=self.sup.run.id,
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

    def make_run(supervisor: Supervisor, args: argparse.Namespace) -> WorkloadRun:
        return WorkloadRun(supervisor, Handoff() if args.handoff_stdin else None)

    return supervise("python -m gpufleet.workload.runner", make_run, argv, handoff=True)


if __name__ == "__main__":
    sys.exit(main())
