"""Local launcher: one fresh interpreter per rank on this machine, watched until the end."""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import RankFailure
from ..results import RunDir, new_run_id, read_outcome
from ..states import CANCELED, FAILED, PENDING, RUNNING, SUCCESS, TERMINAL_STATES, TIMEDOUT
from .outcomes import LogConfig, RankGroupRun, as_original_exception, echo_line
from .ports import find_free_port
from .proctree import popen_in_own_group, run_processes, stop_process_tree
from .worker import PARENT_PID_ENV

__all__ = [
    "CANCELED", "FAILED", "PENDING", "RUNNING", "SUCCESS", "TERMINAL_STATES", "TIMEDOUT",
    "LocalLaunchSpec", "LocalRun", "LogConfig", "as_original_exception", "launch_local",
]

logger = logging.getLogger(__name__)

_POLL_S = 0.02
_FAILURE_SETTLE_S = 1.0


@dataclass
class LocalLaunchSpec:
    """Everything the local launcher needs, as a typed object."""

    num_workers: int
    use_gpus: bool
    gpu_indices: tuple[int, ...] = ()
    timeout_s: float | None = None
    call_timeout_s: float | None = None  # the whole call's timeout when timeout_s is what a retry has left
    grace_period_s: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    runs_dir: str | None = None
    name: str = "run"
    logs: LogConfig = field(default_factory=LogConfig)
    master_addr: str = "127.0.0.1"
    fast_exit: bool = True


_active: weakref.WeakSet[LocalRun] = weakref.WeakSet()
_reapers: set[threading.Thread] = set()  # not daemons: the interpreter waits for them at exit


@atexit.register
def _stop_active_runs() -> None:
    for run in list(_active):
        run.cancel("the calling process is exiting", grace_period_s=1.0)


class _LogPump:
    """Copies one rank's stdout and stderr into its log file and, filtered, to the caller."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes], log_path: Path, logs: LogConfig):
        self.rank = rank
        self._file = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._logs = logs
        self._out: IO[str] = sys.stdout
        self._err: IO[str] = sys.stderr
        self.threads = [
            threading.Thread(target=self._pump, args=(proc.stdout, False), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, True), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, pipe: IO[bytes], is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            with self._lock:
                if not self._file.closed:
                    self._file.write(line)
            echo_line(self._logs, self.rank, is_stderr, line, self._out, self._err)
        pipe.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.join(1.0)
        with self._lock:
            self._file.close()


def _kill_tree(procs: Sequence[subprocess.Popen[bytes]], grace_period_s: float, run_id: str) -> None:
    """Stop every process of the run: TERM, grace period, KILL.

    Reaches each rank's process group (DataLoader workers), descendants of ranks that have
    already exited, and children that left the group with setsid: all of them carry the
    run's id in their environment.
    """
    stop_process_tree(procs, grace_period_s, lambda: run_processes(run_id), poll_s=_POLL_S)


class LocalRun(RankGroupRun):
    """One launched group of local worker processes.

    ``start()`` spawns the ranks; ``wait()`` watches them until every rank has an outcome,
    then returns the results in global-rank order or raises the root-cause error.
    """

    def __init__(self, spec: LocalLaunchSpec, call_bytes: bytes) -> None:
        super().__init__(spec.timeout_s, spec.grace_period_s, spec.call_timeout_s)
        self.spec = spec
        self.run_id = new_run_id(spec.name)
        self.run_dir = RunDir.create(spec.runs_dir, self.run_id)
        self._call_bytes = call_bytes
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[_LogPump] = []
        self.master_port = 0

    @property
    def num_ranks(self) -> int:
        """How many ranks the run has."""
        return self.spec.num_workers

    @property
    def num_nodes(self) -> int:
        """How many nodes the ranks run on: this machine only."""
        return 1

    def add_env(self, env: dict[str, str]) -> None:
        """Add ``env`` to every rank's environment; only before :meth:`start`."""
        self.spec.env.update(env)

    # -- starting -----------------------------------------------------------------------
    def _worker_env(self, rank: int) -> dict[str, str]:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.env)
        package_parent = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [package_parent, env.get("PYTHONPATH", "")] if p
        )
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.num_workers),
            LOCAL_WORLD_SIZE=str(spec.num_workers),
            NODE_RANK="0",
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(spec.num_workers),
            NUM_NODES="1",
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(self.master_port),
            TORCHELASTIC_RUN_ID=self.run_id,
            PYTHONUNBUFFERED="1",
            GPUFLEET_RUN_ID=self.run_id,
            GPUFLEET_RUN_DIR=str(self.run_dir.path),
        )
        env[PARENT_PID_ENV] = str(os.getpid())
        if spec.use_gpus:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # same order as NVML's indices
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.num_workers))
        return env

    def start(self) -> LocalRun:
        """Write the payload and spawn every rank (fresh interpreters, never fork)."""
        payload = {
            "call": self._call_bytes,
            "sys_path": [p for p in sys.path if p],
            "fast_exit": self.spec.fast_exit,
        }
        self.run_dir.payload.write_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        self._call_bytes = b""
        self.master_port = find_free_port(self.spec.master_addr)
        _active.add(self)
        try:
            for rank in range(self.spec.num_workers):
                proc = popen_in_own_group(
                    [sys.executable, "-m", "gpufleet.launch.worker", str(self.run_dir.path), str(rank)],
                    env=self._worker_env(rank),
                )
                self._procs.append(proc)
                self._pumps.append(_LogPump(rank, proc, self.run_dir.log(rank), self.spec.logs))
        except BaseException:
            _kill_tree(self._procs, 0.5, self.run_id)
            raise
        self._started = time.monotonic()
        self.status = RUNNING
        logger.debug("run %s: %d ranks on port %d", self.run_id, len(self._procs), self.master_port)
        return self

    # -- watching -----------------------------------------------------------------------
    def _failure_from_exit(self, rank: int, code: int) -> RankFailure:
        self._pumps[rank].join(1.0)  # the last lines before the exit belong in the log tail
        return super()._failure_from_exit(rank, code)

    def _collect(self) -> None:
        """Record outcomes of ranks that finished or wrote an outcome since the last look."""
        for rank, proc in enumerate(self._procs):
            if self._known(rank):
                continue
            code = proc.poll()
            # A rank that returned may still be exiting (interpreter shutdown with torch
            # loaded takes ~0.5 s); the reaper waits for that after the results are back.
            if self._take_outcome(rank, read_outcome(self.run_dir.outcome(rank))) is None and code is not None:
                self._failures[rank] = self._failure_from_exit(rank, code)

    def _stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> None:
        """Stop every rank still running; ranks without an outcome are marked STOPPED."""
        alive = [p for p in self._procs if p.poll() is None]
        if dump_stacks and alive:
            for p in alive:
                try:
                    os.kill(p.pid, signal.SIGUSR1)  # faulthandler prints every thread's stack
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        t_stop = time.time()
        try:
            _kill_tree(self._procs, grace_period_s, self.run_id)
        except KeyboardInterrupt:  # a second Ctrl-C: no more grace
            _kill_tree(self._procs, 0.0, self.run_id)
            raise
        finally:
            self._collect_after_stop(reason, t_stop)

    def _collect_after_stop(self, reason: str, t_stop: float) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.poll() is None:
                proc.wait()
            if self._known(rank):
                continue
            if self._take_outcome(rank, read_outcome(self.run_dir.outcome(rank))) is None:
                self._mark_stopped(rank, reason, t_stop)

    def _watch(self) -> None:
        spec = self.spec
        deadline = None if spec.timeout_s is None else self._started + spec.timeout_s
        while True:
            if self._stop_reason is not None:
                self._finish_canceled()
                return
            self._collect()
            if self._failures:
                # Let the other ranks report for a moment: the same error on several ranks
                # is then grouped, and a secondary error does not hide the root cause.
                settle_until = time.monotonic() + _FAILURE_SETTLE_S
                while time.monotonic() < settle_until and len(self._done) + len(self._failures) < len(self._procs):
                    time.sleep(_POLL_S)
                    self._collect()
                self._finish_failed()
                return
            if len(self._done) == len(self._procs):
                self._finalize(SUCCESS)
                return
            if deadline is not None and time.monotonic() > deadline:
                self._finish_timeout()
                return
            time.sleep(_POLL_S)

    # -- finishing ----------------------------------------------------------------------
    def _close(self, status: str) -> None:
        if status == SUCCESS:
            # Every rank returned: hand back the results now and let a reaper wait for the
            # ranks to finish exiting (atexit handlers, flushes), then stop any stray child.
            reaper = threading.Thread(target=self._reap, name=f"gpufleet-reap-{self.run_id}")
            _reapers.add(reaper)
            reaper.start()
        else:
            for pump in self._pumps:
                pump.close()
        _active.discard(self)

    def _after_finalize(self) -> None:
        for path in [self.run_dir.payload] + [self.run_dir.outcome(r) for r in range(len(self._procs))]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _reap(self) -> None:
        try:
            deadline = time.monotonic() + max(10.0, self.spec.grace_period_s)
            while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if any(p.poll() is None for p in self._procs) or run_processes(self.run_id):
                logger.warning("run %s: stopping processes still running after every rank returned", self.run_id)
                _kill_tree(self._procs, self.spec.grace_period_s, self.run_id)
            for pump in self._pumps:
                pump.close()
        finally:
            _reapers.discard(threading.current_thread())

    # -- inspection ---------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [p.pid for p in self._procs]


def launch_local(
    spec: LocalLaunchSpec, call_bytes: bytes, on_start: Callable[[LocalRun], None] | None = None
) -> list[Any]:
    """Start a local run and wait for it (blocking)."""
    run = LocalRun(spec, call_bytes).start()
    if on_start:
        on_start(run)
    return run.wait()
