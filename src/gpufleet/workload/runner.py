"""Execution of a workload run: per-node command executors and the background supervisor.

The supervisor (``python -m gpufleet.workload.runner RUN_ID --home HOME``) is started
detached by ``gpufleet run``; it prepares the environment, runs each attempt's ``command``
once per node through a :class:`NodeExecutor`, enforces the timeout, retries, honours cancel
requests and writes every state change to the run store.

Node executors
--------------
A :class:`NodeExecutor` knows how to start one node's command somewhere:
:class:`LocalExecutor` runs it on this machine in its own process group. A multi-node
executor (on a Ray cluster) lives in ``gpufleet.workload.ray_executor`` and exposes
``create_executor(config: WorkloadConfig) -> NodeExecutor``; it is used when a workload spans
several nodes or names ``compute.cluster``.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import GpufleetError
from ..launch.ports import find_free_port
from .liveness import process_start_time
from .schema import WorkloadConfig
from .store import (
    CANCELED,
    FAILED,
    HEARTBEAT_S,
    RUNNING,
    SUCCESS,
    TIMEDOUT,
    AttemptRecord,
    RunStore,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.1
GRACE_PERIOD_S = 5.0
RAY_EXECUTOR_MODULE = "gpufleet.workload.ray_executor"
#: Environment variables a node never inherits from the submitting shell.
_DROPPED_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "MLFLOW_RUN_ID", "GPUFLEET_PARENT_PID")


class ExecutorUnavailableError(GpufleetError, RuntimeError):
    """The workload needs an executor (multi-node / Ray) that this installation lacks."""


@dataclass(frozen=True)
class NodeSpec:
    """What one node runs: the bash command, its environment, folder and log file."""

    node_rank: int
    command: str
    env: dict[str, str]
    cwd: str
    log_path: str


class NodeProcess(abc.ABC):
    """Handle of one node's running command."""

    node_rank: int

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The command's exit code, or None while it runs."""

    @abc.abstractmethod
    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        """Stop the command and everything it started (TERM, grace period, KILL)."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """After the command ended: stop whatever it left running."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the run store records about the node (``node_rank``, ``log_path``, pids, host)."""


class AttemptCanceled(Exception):
    """The run was canceled while an attempt was still being set up (scheduling, environment)."""


class NodeExecutor(abc.ABC):
    """Starts the per-node commands of one attempt.

    ``cancel_event`` (set by the supervisor) is checked by waits that can last long, such as
    waiting for a cluster to have room; they raise :class:`AttemptCanceled` once it is set.
    """

    cancel_event: threading.Event | None = None

    def canceled(self) -> bool:
        """Whether the run was canceled (a long wait should give up)."""
        return self.cancel_event is not None and self.cancel_event.is_set()

    @abc.abstractmethod
    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` for an attempt: node 0's address and a free port.

        ``code_dir`` is the run's code snapshot, for executors that bring it to other machines.
        """

    @abc.abstractmethod
    def start(self, node: NodeSpec) -> NodeProcess:
        """Start one node's command."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the executor holds (connections, placement groups)."""


class LocalNodeProcess(NodeProcess):
    """A node command on this machine, led by ``gpufleet.workload.guard`` in its own group."""

    def __init__(self, spec: NodeSpec) -> None:
        self.node_rank = spec.node_rank
        self.spec = spec
        log = open(spec.log_path, "ab", buffering=0)  # noqa: SIM115 - the child holds it
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gpufleet.workload.guard", "--", "bash", "-c", spec.command],
                cwd=spec.cwd,
                env=spec.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: cancel reaches every descendant
            )
        finally:
            log.close()
        self.pgid = self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        if not self._signal_group(signal.SIGTERM):
            return
        deadline = time.monotonic() + grace_period_s
        while time.monotonic() < deadline:
            bash_or_guard_done = self.popen.poll() is not None
            if bash_or_guard_done and not self._group_alive():
                return
            time.sleep(_POLL_S)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        for _ in range(100):
            if not self._group_alive():
                return
            time.sleep(0.05)

    def cleanup(self) -> None:
        if self._group_alive():
            self._signal_group(signal.SIGKILL)

    def describe(self) -> dict[str, Any]:
        return {
            "node_rank": self.node_rank,
            "host": "localhost",
            "pid": self.popen.pid,
            "pgid": self.pgid,
            "log_path": self.spec.log_path,
        }


class LocalExecutor(NodeExecutor):
    """Runs the (single) node of a workload on this machine."""

    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        if num_nodes != 1:
            raise ExecutorUnavailableError("the local executor runs exactly one node")
        return "127.0.0.1", find_free_port()

    def start(self, node: NodeSpec) -> NodeProcess:
        return LocalNodeProcess(node)


def needs_cluster(config: WorkloadConfig) -> bool:
    """Whether the workload must run on a Ray cluster (several nodes or a named cluster)."""
    return config.compute.cluster is not None or config.compute.num_nodes > 1


def create_executor(config: WorkloadConfig) -> NodeExecutor:
    """The executor for a workload: local for one node here, Ray for a cluster."""
    if not needs_cluster(config):
        return LocalExecutor()
    try:
        module = importlib.import_module(RAY_EXECUTOR_MODULE)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("gpufleet"):
            raise ExecutorUnavailableError(
                f"multi-node workloads need Ray ({e}); pip install 'gpufleet[ray]'"
            ) from e
        c = config.compute
        why = (
            f"names the cluster {c.cluster!r}"
            if c.cluster
            else f"needs {c.num_nodes} nodes ({c.num_accelerators} x {c.accelerator_type})"
        )
        raise ExecutorUnavailableError(
            f"this workload {why}, but this installation of gpufleet has no multi-node executor "
            f"({RAY_EXECUTOR_MODULE} is missing). Run it on one node: remove compute.cluster and "
            "set compute.num_accelerators to the per-node count of accelerator_type."
        ) from None
    return module.create_executor(config)


def check_executor_available(config: WorkloadConfig) -> None:
    """Raise :class:`ExecutorUnavailableError` early when the needed executor is missing."""
    if needs_cluster(config):
        create_executor(config).close()


# ------------------------------------------------------------------ supervisor


@dataclass
class AttemptOutcome:
    """How an attempt ended."""

    state: str
    exit_code: int | None = None
    message: str | None = None


def _tracked_run(config: WorkloadConfig, run_id: str, attempt: int, enabled: bool, log: IO[str]) -> Any:
    """``gpufleet.tracking.start_tracked_run`` for this attempt, or a no-op context."""
    if not enabled:
        return contextlib.nullcontext(None)
    try:
        from ..tracking import start_tracked_run
    except ImportError as e:
        log.write(f"gpufleet: tracking is not available ({e}); this attempt is not tracked\n")
        return contextlib.nullcontext(None)
    return start_tracked_run(
        experiment_name=config.experiment_name,
        run_name=f"{run_id}-attempt-{attempt}",
        params=config.parameters,
        enabled=True,
        tags={"gpufleet.run_id": run_id, "gpufleet.attempt": attempt, "gpufleet.source": "workload"},
        system_metrics=not needs_cluster(config),  # on Ray each node samples itself (launch/ray_actor.py)
    )


class Supervisor:
    """Runs every attempt of one stored run and records what happens."""

    def __init__(self, run_id: str, home: str | None) -> None:
        self.store = RunStore(home)
        self.run = self.store.get(run_id)
        self.config = WorkloadConfig.model_validate(self.run.config)
        self.run_dir = Path(self.run.run_dir)
        self.cancel_event = threading.Event()
        self.cancel_reason = "canceled by the user"
        self._stop_heartbeat = threading.Event()
        self.log: IO[str] = sys.stderr

    # -- signals and heartbeat

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.cancel_reason = f"canceled ({signal.Signals(signum).name} to the supervisor)"
        if signum == signal.SIGTERM:
            self.cancel_reason = "canceled by the user"
        self.cancel_event.set()

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(HEARTBEAT_S):
            try:
                _, cancel = self.store.heartbeat(self.run.id)
                if cancel:
                    self.cancel_event.set()
            except Exception as e:  # a locked database must not kill the run
                self.log.write(f"gpufleet: heartbeat failed: {e}\n")

    # -- the run

    def main(self) -> int:
        """Supervise the run to its end; returns 0 (the outcome is in the store)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        pid = os.getpid()
        if not self.store.mark_running(self.run.id, pid, process_start_time(pid)):
            return 0  # canceled (or marked failed) before it started
        if self.store.heartbeat(self.run.id)[1]:
            self.cancel_event.set()  # canceled while it was starting
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        try:
            state, code, message = self._run_attempts()
        except Exception as e:
            traceback.print_exc(file=self.log)
            state, code, message = FAILED, None, f"run failed: {e}"
        finally:
            self._stop_heartbeat.set()
        self.store.finish_run(self.run.id, state, exit_code=code, message=message)
        self.log.write(f"gpufleet: run {self.run.id} finished: {state}\n")
        self.log.flush()
        return 0

    def _prepare_bin_dir(self) -> str:
        deps = self.config.environment.dependencies
        if not deps:
            return os.path.dirname(sys.executable)
        from .envs import ensure_environment

        with open(self.run_dir / "environment.log", "a") as log:
            return str(ensure_environment(deps, self.store.home / "envs", log, cancel=self.cancel_event))

    def _run_attempts(self) -> tuple[str, int | None, str | None]:
        from .envs import EnvironmentSetupCanceled

        try:
            bin_dir = self._prepare_bin_dir()
        except EnvironmentSetupCanceled:
            return CANCELED, None, self.cancel_reason + " (while its environment was being built)"
        executor = create_executor(self.config)
        executor.cancel_event = self.cancel_event
        outcome = AttemptOutcome(FAILED, message="no attempt ran")
        try:
            for attempt in range(1, self.run.max_attempts + 1):
                if self.cancel_event.is_set():
                    return CANCELED, None, self.cancel_reason
                outcome = self._run_attempt(executor, attempt, bin_dir)
                if outcome.state in (SUCCESS, CANCELED):
                    break
                if attempt < self.run.max_attempts:
                    self.log.write(
                        f"gpufleet: attempt {attempt} ended {outcome.state}; retrying "
                        f"({attempt + 1}/{self.run.max_attempts})\n"
                    )
        finally:
            executor.close()
        return outcome.state, outcome.exit_code, outcome.message

    def node_env(
        self, node_rank: int, attempt: int, master: tuple[str, int], bin_dir: str, tracking_env: dict[str, str]
    ) -> dict[str, str]:
        """The per-node environment contract of SPEC section 5 (``MLFLOW_*`` from tracking)."""
        c = self.config.compute
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env.update(self.config.env_strings())
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.defpath)
        if bin_dir != os.path.dirname(sys.executable) or sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = str(Path(bin_dir).parent)
        if c.gpu_type is None:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU workers must not pick up a GPU by accident
        env.update(
            CODE_SOURCE_PATH=str(self.run_dir / "code"),
            NUM_NODES=str(c.num_nodes),
            NODE_RANK=str(node_rank),
            WORLD_SIZE=str(c.num_accelerators),
            LOCAL_WORLD_SIZE=str(c.per_node),
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            HYPERPARAMETERS_PATH=str(self.run_dir / "hyperparameters.yaml"),
            PYTHONUNBUFFERED="1",
            GPUFLEET_RUN_ID=self.run.id,
            GPUFLEET_RUN_DIR=str(self.run_dir),
            GPUFLEET_ATTEMPT=str(attempt),
            GPUFLEET_CHECKPOINT_DIR=str(self.run_dir / "checkpoints"),
        )
        env.update(tracking_env)
        return env

    def _run_attempt(self, executor: NodeExecutor, attempt: int, bin_dir: str) -> AttemptOutcome:
        log_dir = self.run_dir / "attempts" / str(attempt)
        log_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "checkpoints").mkdir(exist_ok=True)
        num_nodes = self.config.compute.num_nodes
        record = AttemptRecord(
            run_id=self.run.id, attempt=attempt, state=RUNNING, started_at=time.time(), log_dir=str(log_dir)
        )
        self.store.start_attempt(record)
        with _tracked_run(self.config, self.run.id, attempt, self.run.tracking, self.log) as tracked:
            mlflow_run_id = getattr(tracked, "run_id", None)
            tracking_env: dict[str, str] = {}
            if mlflow_run_id:
                self.store.update_attempt(self.run.id, attempt, mlflow_run_id=mlflow_run_id)
                tracking_env = tracked.env()
                try:
                    tracked.log_config(self.run.config, artifact_file="workload.yaml")
                except Exception as e:  # tracking trouble never stops the run
                    self.log.write(f"gpufleet: could not log the workload config to MLflow: {e}\n")
            try:
                master = executor.rendezvous(num_nodes, code_dir=str(self.run_dir / "code"))
            except AttemptCanceled as e:  # canceled before any node started
                outcome = AttemptOutcome(CANCELED, None, f"{self.cancel_reason} ({e})")
                self.store.update_attempt(self.run.id, attempt, state=CANCELED, ended_at=time.time(),
                                          message=outcome.message)  # fmt: skip
                if tracked is not None:
                    self._finish_tracking(tracked, outcome, [])
                return outcome
            nodes: list[NodeProcess] = []
            outcome = None
            try:
                for rank in range(self.config.compute.command_nodes):
                    spec = NodeSpec(
                        node_rank=rank,
                        command=self.config.command,
                        env=self.node_env(rank, attempt, master, bin_dir, tracking_env),
                        cwd=str(self.run_dir / "code"),
                        log_path=str(log_dir / f"node-{rank}.log"),
                    )
                    nodes.append(executor.start(spec))
                self.store.update_attempt(self.run.id, attempt, nodes=[n.describe() for n in nodes])
                outcome = self._watch(nodes)
            finally:
                if outcome is None:  # starting failed: stop what did start
                    for n in nodes:
                        n.cancel(1.0)
                for n in nodes:
                    n.cleanup()
            self.store.update_attempt(
                self.run.id, attempt, state=outcome.state, ended_at=time.time(),
                exit_code=outcome.exit_code, message=outcome.message,
            )  # fmt: skip
            if tracked is not None:
                self._finish_tracking(tracked, outcome, [Path(n.describe()["log_path"]) for n in nodes])
        return outcome

    def _finish_tracking(self, tracked: Any, outcome: AttemptOutcome, logs: list[Path]) -> None:
        try:
            tracked.log_artifacts([str(p) for p in logs if p.exists()])
            tracked.set_status(outcome.state)
        except Exception as e:  # tracking trouble never changes the run's outcome
            self.log.write(f"gpufleet: could not record the attempt in MLflow: {e}\n")

    def _watch(self, nodes: list[NodeProcess]) -> AttemptOutcome:
        timeout_min = self.config.timeout_minutes
        deadline = time.monotonic() + timeout_min * 60 if timeout_min else None
        while True:
            codes = [n.poll() for n in nodes]
            failed = [(n.node_rank, c) for n, c in zip(nodes, codes, strict=True) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                for n in nodes:
                    n.cancel(GRACE_PERIOD_S)
                return AttemptOutcome(
                    FAILED, code, f"node {rank} exited with code {code}; see `gpufleet logs {self.run.id} --node {rank}`"
                )
            if all(c == 0 for c in codes):
                return AttemptOutcome(SUCCESS, 0)
            if self.cancel_event.is_set():
                for n in nodes:
                    n.cancel(GRACE_PERIOD_S)
                return AttemptOutcome(CANCELED, None, self.cancel_reason)
            if deadline is not None and time.monotonic() > deadline:
                for n in nodes:
                    n.cancel(GRACE_PERIOD_S)
                return AttemptOutcome(
                    TIMEDOUT, None, f"the attempt ran longer than timeout_minutes={timeout_min:g} and was stopped"
                )
            self.cancel_event.wait(_POLL_S)


def start_supervisor(run_id: str, home: Path, run_dir: Path) -> subprocess.Popen[bytes]:
    """Start the detached supervisor of a run; it outlives the calling process."""
    log = open(run_dir / "supervisor.log", "ab")  # noqa: SIM115 - the child holds it
    env = dict(os.environ)
    env["GPUFLEET_RUN_ID"] = run_id
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gpufleet.workload.runner", run_id, "--home", str(home)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no terminal signals, survives the CLI
            close_fds=True,
            env=env,
        )
    finally:
        log.close()


def main(argv: list[str] | None = None) -> int:
    """Entry of the supervisor process."""
    parser = argparse.ArgumentParser(prog="python -m gpufleet.workload.runner")
    parser.add_argument("run_id")
    parser.add_argument("--home", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    supervisor = Supervisor(args.run_id, args.home)
    return supervisor.main()


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: classes such as AttemptCanceled,
    # raised by executors that import gpufleet.workload.runner, must be the ones caught here.
    from gpufleet.workload.runner import main as _main

    sys.exit(_main())
