"""Local worker group: one fresh interpreter per rank on this machine (never fork)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....errors import RankFailure
from ....results import ERROR, OK, RunDir, read_outcome
from ... import failures
from ...group import GroupStatus, Replacement, WorkerGroup, reap_later
from ...leasing.leases import GpuLease, GpuRequest
from ...logstream import LogConfig, Pump, RankLog, failure_text
from ...node import envcontract
from ...proctree import run_processes
from ...progress import PROGRESS_INTERVAL_ENV, read_progress, request_stacks
from ...spec import (
    LATE_ENV_VAR,
    PARENT_PID_ENV,
    LaunchSpec,
    Rendezvous,
    default_threads,
    local_slots,
    package_parent,
)
from ...store import Notice, Recovered, host, notice_key, recovered_key
from ...worker import LOOPBACK_STORE_ENV
from ..base import Unit
from .engine import LocalEngine
from .spares import Spares

__all__ = ["LocalPlacement", "LocalWorkerGroup"]

logger = logging.getLogger(__name__)

_reapers: set[threading.Thread] = set()  # not daemons: the interpreter waits for them at exit


@dataclass(frozen=True)
class LocalPlacement:
    """Where local ranks run: GPU indices (one per rank) or CPU processes."""

    use_gpus: bool
    gpu_indices: tuple[int, ...] = ()
    master_addr: str = "127.0.0.1"
    #: Lease the GPUs at start (:mod:`gpufleet.launch.leasing.leases`); ``gpu_indices`` become the leased ones.
    gpu_request: GpuRequest | None = None


class LocalWorkerGroup(WorkerGroup):
    """The ranks of one attempt as child processes of this one.

    Each rank is a unit of the local engine (:class:`~gpufleet.launch.engines.local.engine.LocalEngine`,
    which leases the GPUs and starts ``python -m gpufleet.launch.worker RUN_DIR RANK`` in its own
    process group); its outcome file in the run directory says how it ended, its exit code says
    how it died.
    """

    takes_late_env = True  # each rank waits for the file before it loads the call

    def __init__(self, spec: LaunchSpec, run_dir: RunDir, placement: LocalPlacement, logs: LogConfig,
                 grace_period_s: float = 5.0) -> None:  # fmt: skip
        super().__init__(spec, run_dir)
        self.placement = placement
        self._logs = logs
        self._grace_period_s = grace_period_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[Pump] = []
        self._results: dict[int, dict[str, Any]] = {}
        self._failures: dict[int, RankFailure] = {}
        self._closed = False
        self._progress: dict[int, dict[str, Any]] = {}
        self._progress_read = 0.0
        self.rendezvous: Rendezvous | None = None
        #: With ``recovery="replace"`` this process hosts the store (a rank that dies takes none of it).
        self.replaces_ranks = spec.env.get(envcontract.RECOVERY) == "replace"
        self._store: Any = None
        self._generation = 0
        self._rejoining: set[int] = set()  # generations whose replacement has not said it is back
        self.spares: Spares | None = None
        self.replacements: dict[int, int] = {}
        self.engine = LocalEngine(spec.run_id, placement.gpu_request if placement.use_gpus else None,
                                  placement.gpu_indices if placement.use_gpus else (), holder="call")  # fmt: skip

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def lease(self) -> GpuLease | None:
        """The GPUs this group's ranks hold (None on the CPU, and once given back)."""
        return self.engine.lease

    def _place(self) -> Rendezvous:
        """Lease the GPUs (waiting for them); the placement then names them, and with ``gpus=None``
        the world size is the number of GPUs the lease got."""
        self.engine.cancel_event = self.abort
        rendezvous = Rendezvous(*self.engine.rendezvous(1))
        if self.engine.lease is not None:
            self.placement = dataclasses.replace(self.placement, gpu_indices=self.engine.gpu_indices)
            if len(self.engine.gpu_indices) != self.spec.world_size:
                self.spec = dataclasses.replace(self.spec, world_size=len(self.engine.gpu_indices))
        return rendezvous

    # -- starting -------------------------------------------------------------------------
    def _env(self, rank: int, rendezvous: Rendezvous) -> dict[str, str]:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.rank_env(local_slots(spec.world_size)[rank], rendezvous))
        env["PYTHONPATH"] = os.pathsep.join(p for p in [package_parent(), env.get("PYTHONPATH", "")] if p)
        env[envcontract.RUN_DIR] = str(self.run_dir.path)
        env[PARENT_PID_ENV] = str(os.getpid())
        if self.env_deferred:
            env[LATE_ENV_VAR] = str(self.run_dir.late_env)
        env.update(self.engine.gpu_env())  # the placed GPUs only, in NVML's order
        env.update(default_threads(env, spec.world_size))
        if self.placement.master_addr == "127.0.0.1":
            # The rendezvous store listens on loopback only (rank 0 hosts it for the others, as
            # torchrun's agent does, or this process does, see launch/store.py), and so do gloo's
            # connections between the ranks.
            if self.replaces_ranks:
                env[LOOPBACK_STORE_ENV] = "0"
            env.setdefault(LOOPBACK_STORE_ENV, "1")  # "0" from a caller that puts another server on MASTER_PORT
            if env[LOOPBACK_STORE_ENV] == "1" or self.replaces_ranks:
                env[envcontract.TORCHELASTIC_USE_AGENT_STORE] = "True"
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return env

    def start(self) -> None:
        assert self.spec.payload is not None, "a local worker group runs a payload"
        self.rendezvous = self._place()  # waits for free GPUs; the ranks see only the leased ones
        self.spec.payload.write(self.run_dir.payload)
        try:
            for rank in range(self.spec.world_size):
                proc = self._start_rank(rank, {})
                self._procs.append(proc)
                self._pumps.append(Pump(proc, RankLog(rank, self.run_dir.log(rank), self._logs)))
            if self.replaces_ranks:  # after the start: the ranks' clients wait for it while they import torch
                self._store = host(self.rendezvous.port, self.spec.world_size)
                self._start_spares()
        except BaseException:
            self.engine.stop_processes(self._procs + (self.spares.procs if self.spares else []), 0.5)
            raise
        logger.debug("run %s: %d ranks on port %d", self.run_id, len(self._procs), self.rendezvous.port)

    def _start_rank(self, rank: int, extra: dict[str, str]) -> subprocess.Popen[bytes]:
        assert self.rendezvous is not None
        unit = Unit(rank, {**self._env(rank, self.rendezvous), **extra}, run_dir=str(self.run_dir.path))
        return self.engine.start(unit).popen

    # -- replacing a rank in place --------------------------------------------------------
    def _start_spares(self) -> None:
        count = int(self.spec.env.get(envcontract.SPARES) or 0)
        if count:
            assert self.rendezvous is not None
            rendezvous = self.rendezvous
            self.spares = Spares(count, self.spec.world_size, self.run_dir, lambda: self._env(0, rendezvous),
                                 lambda unit: self.engine.start(unit).popen,
                                 lambda procs: self.engine.stop_processes(procs, 0.0))  # fmt: skip
            self.spares.start()

    def replace(self, rank: int, cause: str) -> Replacement:
        """A new process takes rank ``rank`` in the group's next generation (a warm spare, if one is
        alive, else one started now); the survivors hear of it through the store
        (:mod:`gpufleet.launch.replace`) and join that generation beside it.

        The process is started first: when none can be (the system refuses a new process, the run
        folder is gone), the error is raised with nothing changed, and the controller falls back
        to ending the attempt (:meth:`gpufleet.launch.controller.Controller._replaced`)."""
        assert self._store is not None and self.rendezvous is not None
        generation = self._generation + 1
        incarnation = self.replacements.get(rank, 0) + 2
        log = RankLog(rank, self.run_dir.log(rank), self._logs)
        try:
            spare = None
            if self.spares is not None:
                env = self._env(rank, self.rendezvous)
                spare = self.spares.take(self._store, rank, generation, incarnation, env, log)
            if spare is not None:
                proc, pump = spare.proc, spare.pump
            else:
                extra = {envcontract.GENERATION: str(generation), envcontract.INCARNATION: str(incarnation)}
                proc = self._start_rank(rank, extra)
                pump = Pump(proc, log)
        except BaseException:
            log.close()
            raise
        self._failures.pop(rank, None)
        self.replacements[rank] = incarnation - 1
        notice = Notice("replace", self._generation, rank, cause)
        self._generation = generation
        self._store.set(notice_key(notice.generation), notice.to_bytes())  # the survivors leave the old group now
        self._pumps[rank].close()  # the dead process's last lines
        self._rejoining.add(generation)
        self._procs[rank] = proc
        self._pumps[rank] = pump
        return Replacement(proc.pid, warm=spare is not None)

    def refuse_replacement(self, rank: int, cause: str, reason: str) -> None:
        if self._store is not None:
            notice = Notice("stop", self._generation, rank, cause, reason)
            self._store.set(notice_key(notice.generation), notice.to_bytes())

    def recovered(self) -> list[Recovered]:
        back: list[Recovered] = []
        for generation in sorted(self._rejoining):
            key = recovered_key(generation)
            try:
                if not self._store.check([key]):
                    continue
                report = Recovered.parse(self._store.get(key))
            except Exception as e:  # noqa: BLE001 - a report that is not one: the recovery stays unreported
                logger.warning("run %s: the recovery report of generation %d is unreadable: %s", self.run_id,
                               generation, e)  # fmt: skip
                self._rejoining.discard(generation)
                continue
            self._rejoining.discard(generation)
            if report.generation == generation:
                back.append(report)
        if back and self.spares is not None:
            self.spares.start()  # the next spare, now that the recovery no longer needs the cores
        return back

    # -- watching -------------------------------------------------------------------------
    def _known(self, rank: int) -> bool:
        return rank in self._results or rank in self._failures

    def _take_outcome(self, rank: int) -> bool:
        rec = read_outcome(self.run_dir.outcome(rank))
        if rec is None:
            return False
        if rec["status"] == ERROR:
            failure = self._failures[rank] = failures.failure_from_outcome(rank, rec, self.run_dir.log(rank))
            log = self._pumps[rank].log if rank < len(self._pumps) else None
            if log is not None:  # `gpufleet logs` shows why the rank failed
                log.end_with(failure_text(rank, failure.exc_type, failure.traceback))
        elif rec["status"] == OK:
            self._results[rank] = rec
        return True

    def _collect(self) -> bool:
        """Record outcomes of ranks that finished since the last look; True if any did."""
        news = False
        for rank, proc in enumerate(self._procs):
            if self._known(rank):
                continue
            code = proc.poll()
            # A rank that returned may still be exiting (interpreter shutdown with torch loaded
            # takes ~0.5 s); close() lets it finish after the results are back.
            if self._take_outcome(rank):
                news = True
            elif code is not None:
                self._pumps[rank].join(1.0)  # the last lines before the exit belong in the log tail
                self._failures[rank] = failures.failure_from_exit(rank, code, self.run_dir.log(rank))
                news = True
        return news

    def _status(self) -> GroupStatus:
        return GroupStatus(
            self.spec.world_size, dict(self._results), dict(self._failures), progress=dict(self._progress)
        )

    def _read_progress(self) -> None:
        """Take the ranks' progress files, at most once a second (only written when progress is watched)."""
        now = time.monotonic()
        if now - self._progress_read < 1.0 or PROGRESS_INTERVAL_ENV not in self.spec.env:
            return
        self._progress_read = now
        for rank in range(self.spec.world_size):
            record = read_progress(self.run_dir.path, rank)
            if record is not None:
                self._progress[rank] = record

    def poll(self, wait_s: float) -> GroupStatus:
        if not self._collect() and wait_s > 0:
            time.sleep(wait_s)
        self._read_progress()
        return self._status()

    def _stacks_dir(self) -> Path:
        return self.run_dir.path

    def stacks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Every live rank's threads, dumped by faulthandler into ``stacks-R.txt`` on SIGUSR2."""
        got: dict[int, str] = {}
        for rank, proc in enumerate(self._procs):
            # only a rank whose stack handler is in place (its progress file exists): before
            # that, SIGUSR2 would end it
            if proc.poll() is None and (self.run_dir.path / f"progress-{rank}.json").exists():
                text = request_stacks(proc.pid, self._stacks_dir() / f"stacks-{rank}.txt", timeout_s)
                if text:
                    got[rank] = text
        return got

    # -- stopping -------------------------------------------------------------------------
    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        if self.spares is not None:
            self.spares.close()
        alive = [p for p in self._procs if p.poll() is None]
        if dump_stacks and alive:
            for p in alive:
                try:
                    os.kill(p.pid, signal.SIGUSR1)  # faulthandler prints every thread's stack
                except ProcessLookupError:
                    pass
            self._wait_for_quiet_logs(3.0)
        t_stop = time.time()
        try:
            self.engine.stop_processes(self._procs, grace_period_s)
        except KeyboardInterrupt:  # a second Ctrl-C: no more grace
            self.engine.stop_processes(self._procs, 0.0)
            raise
        finally:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is None:
                    proc.wait()
                if not self._known(rank) and not self._take_outcome(rank):
                    self._failures[rank] = failures.stopped(rank, reason, t_stop, self.run_dir.log(rank))
        return self._status()

    def _wait_for_quiet_logs(self, limit_s: float, quiet_s: float = 0.3) -> None:
        """Wait until no rank's log grew for ``quiet_s`` (the stack dumps are in), at most ``limit_s``."""
        def sizes() -> list[int]:
            return [self.run_dir.log(r).stat().st_size if self.run_dir.log(r).exists() else 0
                    for r in range(len(self._procs))]  # fmt: skip

        deadline = time.monotonic() + limit_s
        last, since = sizes(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = sizes()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def close(self, succeeded: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self.spares is not None:
            self.spares.close()  # before the store: a spare waiting in it ends now, not with an error
        self._store = None  # its server thread ends with it
        if succeeded:
            # Every rank returned: the results go back now, and a reaper waits for the ranks to
            # finish exiting (atexit handlers, flushes), then stops any stray child.
            reap_later(_reapers, self.run_id, self._reap)
        else:
            for pump in self._pumps:
                pump.close()
            self.engine.release(self.pids)
        for path in [self.run_dir.payload] + [self.run_dir.outcome(r) for r in range(len(self._procs))]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _reap(self) -> None:
        try:
            deadline = time.monotonic() + max(10.0, self._grace_period_s)
            while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                time.sleep(0.02)
            if any(p.poll() is None for p in self._procs) or run_processes(self.run_id):
                logger.warning("run %s: stopping processes still running after every rank returned", self.run_id)
                self.engine.stop_processes(self._procs, self._grace_period_s)
            self.engine.release(self.pids)  # the ranks are gone: a waiting run takes the GPUs now
            for pump in self._pumps:
                pump.close()
        finally:
            self.engine.release(self.pids)
