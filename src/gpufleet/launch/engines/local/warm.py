"""Warm worker groups: a notebook's next call reuses the ranks of its last one.

A :class:`WarmWorkerGroup` is the local worker group of one call (its own run id, run folder,
logs, outcome files, tracking), whose ranks come from a pool of warm ranks kept by this process:
interpreters that already imported what the last call imported, hold their CUDA context and keep
their process group (:mod:`gpufleet.launch.engines.local.warm_worker`). Ranks are reused only for the same
placement and environment (GPUs, world size, the call's ``env``, the Python executable, the
function's source file when it is imported rather than shipped by value); anything else starts
fresh ranks, stopping idle ones that hold the same GPUs. Each call starts from a cold rank's
process state (:mod:`gpufleet.launch.engines.local.warm_state`); a rank that cannot put its state back says so
with its end-of-job mark and is replaced. Any failure, timeout or Ctrl-C discards the ranks; a
cancel interrupts the call in every rank and keeps them when all come back within the grace
period. Ranks idle past ``keep_warm`` seconds, or whose GPUs another run waits for, are stopped,
and so are all of them when the calling process ends (ranks also end themselves, their helpers
and their control folder when their caller dies; a control folder left anyway goes at the next
start). Idle ranks are named ``warm`` in their GPU lease, under their last call's run id, which
``gpufleet cancel`` takes to free them.

One concern past 400 lines: the life of warm ranks in the caller (the pool, the group that serves
one call on them, their control folders), kept whole so that who may stop or reuse them is read
in one place.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ....results import RunDir
from ... import failures
from ...group import GroupStatus
from ...kernel import interactive
from ...leasing.leases import Holder
from ...logstream import LogConfig, RankLog
from ...proctree import stop_tree
from ...spec import LaunchSpec, Rendezvous
from .group import LocalPlacement, LocalWorkerGroup
from .warm_worker import JOB_END, OWNER_LOCK, REPLACE_SUFFIX

logger = logging.getLogger(__name__)

#: ``keep_warm=True`` keeps idle ranks this long (seconds).
DEFAULT_KEEP_WARM_S = 600.0
#: How often idle ranks are checked: past ``keep_warm``, or another run waits for their GPUs.
REAP_EVERY_S = 0.25
#: The holder kind idle warm ranks are named with in their GPU lease.
WARM_KIND = "warm"
_CONTROL_PREFIX = "gpufleet-warm-"
_OWNER_LOCK = OWNER_LOCK
_END = (JOB_END + "\n").encode()
_END_REPLACE = (JOB_END + REPLACE_SUFFIX + "\n").encode()


def resolve_keep_warm(value: float | bool | None) -> float:
    """Seconds idle ranks stay ready: None -> on in an interactive kernel, off elsewhere."""
    if value is None:
        return DEFAULT_KEEP_WARM_S if interactive() else 0.0
    if value is True:
        return DEFAULT_KEEP_WARM_S
    if value is False:
        return 0.0
    return float(value)


class _Pump:
    """Copies a warm rank's output into the log of the call it currently serves."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._log: RankLog | None = None
        self._lock = threading.Lock()
        self._ends = {False: threading.Event(), True: threading.Event()}
        #: The rank said, with its end-of-job mark, that it cannot serve another call.
        self.replace = False
        for pipe, is_stderr in ((proc.stdout, False), (proc.stderr, True)):
            threading.Thread(target=self._pump, args=(pipe, is_stderr), daemon=True).start()

    @property
    def log(self) -> RankLog | None:
        """The log of the call served now."""
        return self._log

    def serve(self, log: RankLog) -> None:
        with self._lock:
            self._log = log
            for event in self._ends.values():
                event.clear()

    def _pump(self, pipe: IO[bytes], is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            end = line.endswith(_END) or line.endswith(_END_REPLACE)
            if end:  # at the end of a line: the call may have left a partial line before it
                if line.endswith(_END_REPLACE):
                    self.replace = True
                line = line[: line.rindex(JOB_END.encode())]
                line = line + b"\n" if line else line
            with self._lock:
                log = self._log
            if log is not None and line:
                log.write(line, is_stderr)
            if end:
                self._ends[is_stderr].set()
        pipe.close()
        self._ends[is_stderr].set()

    def join(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the output of a rank that exited."""
        self.wait_for_end(timeout_s)

    def ended(self) -> bool:
        """Whether the rank marked the end of its job on both streams."""
        return all(e.is_set() for e in self._ends.values())

    def wait_for_end(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self._ends.values())

    def close(self) -> None:
        with self._lock:
            log, self._log = self._log, None
        if log is not None:
            log.close()


@dataclass(eq=False)
class WarmRanks:
    """Live warm ranks of one placement, and whether a call is using them."""

    key: Hashable
    gpu_indices: tuple[int, ...]
    procs: list[subprocess.Popen[bytes]]
    pumps: list[_Pump]
    control_dir: Path
    rendezvous: Rendezvous
    keep_warm_s: float
    busy: bool = True
    idle_since: float = field(default_factory=time.monotonic)
    calls: int = 0
    #: The GPU lease of these ranks (:mod:`gpufleet.launch.leasing.leases`), held while they live, idle or not.
    lease: Any = None
    #: A descriptor of ``control_dir/owner.lock``, ``flock``ed while this process lives (see :func:`sweep_control_dirs`).
    owner_fd: int = -1

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def send(self, rank: int, job: dict[str, Any]) -> None:
        stdin = self.procs[rank].stdin
        assert stdin is not None
        stdin.write((json.dumps(job) + "\n").encode())
        stdin.flush()

    def stop(self, grace_period_s: float = 2.0) -> None:
        for p in self.procs:
            try:
                if p.stdin:
                    p.stdin.close()  # a warm rank ends when its job pipe closes
            except OSError:
                pass
        stop_tree(self.procs, grace_period_s)
        for pump in self.pumps:
            pump.close()
        shutil.rmtree(self.control_dir, ignore_errors=True)
        if self.owner_fd >= 0:
            os.close(self.owner_fd)
            self.owner_fd = -1
        if self.lease is not None:
            self.lease.release()

    def name_holder(self, run_id: str, kind: str) -> None:
        """Say in the GPU lease who these ranks serve now: a call, or nobody (``warm``: idle, given back on demand)."""
        if self.lease is not None:
            self.lease.rename(Holder(run_id, kind))


class WarmPool:
    """This process's warm ranks, one set per placement key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[Hashable, WarmRanks] = {}
        self._reaper: threading.Thread | None = None

    def take(self, key: Hashable, gpu_indices: tuple[int, ...]) -> WarmRanks | None:
        """The idle, live ranks of ``key`` (now busy), or None; stops idle ranks that hold the same GPUs."""
        with self._lock:
            ranks = self._ranks.get(key)
            if ranks is not None and not ranks.busy and ranks.alive():
                ranks.busy = True
                return ranks
            if ranks is not None and not ranks.busy:
                self._ranks.pop(key)
                ranks.stop(0.5)
            clash = [r for r in self._ranks.values()
                     if not r.busy and set(r.gpu_indices) & set(gpu_indices)]  # fmt: skip
            for r in clash:
                self._ranks.pop(r.key)
                r.stop(0.5)
        return None

    def add(self, ranks: WarmRanks) -> None:
        with self._lock:
            old = self._ranks.get(ranks.key)
            if old is not None and old is not ranks and not old.busy:
                old.stop(0.5)
            self._ranks[ranks.key] = ranks
        self._start_reaper()

    def release(self, ranks: WarmRanks, run_id: str) -> None:
        """The call ended well: the ranks wait for the next one (their GPUs named as idle warm ranks of ``run_id``)."""
        ranks.name_holder(run_id, WARM_KIND)
        with self._lock:
            ranks.busy = False
            ranks.idle_since = time.monotonic()
            ranks.calls += 1

    def discard(self, ranks: WarmRanks) -> None:
        with self._lock:
            if self._ranks.get(ranks.key) is ranks:
                self._ranks.pop(ranks.key)

    def shutdown(self, keys: set[Hashable] | None = None) -> int:
        """Stop idle ranks (of ``keys``, or all); returns how many sets were stopped."""
        with self._lock:
            chosen = [r for k, r in self._ranks.items() if (keys is None or k in keys) and not r.busy]
            for r in chosen:
                self._ranks.pop(r.key)
        for r in chosen:
            r.stop(1.0)
        return len(chosen)

    def _start_reaper(self) -> None:
        if self._reaper is not None and self._reaper.is_alive():
            return
        self._reaper = threading.Thread(target=self._reap, name="gpufleet-warm-reaper", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        """Stop idle ranks past their ``keep_warm``, and idle ranks whose GPUs another run waits for."""
        while True:
            time.sleep(REAP_EVERY_S)
            now = time.monotonic()
            with self._lock:
                idle = [r for r in self._ranks.values() if not r.busy]
            wanted = [r for r in idle if r.lease is not None and _wanted(r)]
            with self._lock:
                expired = [r for r in idle if now - r.idle_since > r.keep_warm_s or r in wanted]
                expired = [r for r in expired if not r.busy and self._ranks.get(r.key) is r]
                for r in expired:
                    self._ranks.pop(r.key)
                    r.busy = True  # taken by nobody: being stopped
                empty = not self._ranks
            for r in expired:
                if r in wanted:
                    logger.info("stopping idle warm ranks: another run waits for their GPUs")
                else:
                    logger.info("stopping warm ranks idle for %.0f s", r.keep_warm_s)
                r.stop(1.0)
            if empty:
                return

    def live(self) -> list[WarmRanks]:
        with self._lock:
            return list(self._ranks.values())


def _wanted(ranks: WarmRanks) -> bool:
    try:
        return bool(ranks.lease.wanted())
    except Exception:  # noqa: BLE001 - the lease folder cannot be read: keep them until keep_warm
        return False


POOL = WarmPool()
atexit.register(POOL.shutdown)


def sweep_control_dirs(runs_dir: Path) -> int:
    """Remove the control folders of warm ranks whose caller is gone (a kernel killed with SIGKILL); returns how many.

    A live caller holds an ``flock`` on its folder's ``owner.lock``; a folder without one is left
    alone for a minute (its caller may be creating it).
    """
    removed = 0
    try:
        entries = list(os.scandir(runs_dir))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(_CONTROL_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            fd = os.open(path / _OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > 60:
                    shutil.rmtree(path, ignore_errors=True)
                    removed += 1
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its caller lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def shutdown_workers() -> int:
    """Stop every idle warm rank of this process now; returns how many groups of ranks were stopped."""
    return POOL.shutdown()


class WarmWorkerGroup(LocalWorkerGroup):
    """One call on warm ranks: its own run id, folder, logs and outcomes; the ranks outlive it on success."""

    takes_late_env = False  # a warm rank takes each call's environment with the call

    def __init__(self, spec: LaunchSpec, run_dir: RunDir, placement: LocalPlacement, logs: LogConfig,
                 grace_period_s: float, key: Hashable, keep_warm_s: float) -> None:  # fmt: skip
        super().__init__(spec, run_dir, placement, logs, grace_period_s)
        self._key = key
        self._keep_warm_s = keep_warm_s
        self.warm: WarmRanks | None = None
        self.reused = False
        self._kept = False  # a cancel the ranks came back from: they stay warm

    def _stacks_dir(self) -> Path:
        return self.warm.control_dir if self.warm else self.run_dir.path

    def _spawn(self, rendezvous: Rendezvous) -> WarmRanks:
        sweep_control_dirs(self.run_dir.path.parent)
        control = Path(tempfile.mkdtemp(prefix=_CONTROL_PREFIX, dir=self.run_dir.path.parent))
        owner = os.open(control / _OWNER_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(owner, fcntl.LOCK_EX)  # dropped by the kernel when this process ends, however it ends
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(self.spec.world_size):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gpufleet.launch.engines.local.warm_worker", str(control), str(rank)],
                    env=self._env(rank, rendezvous), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                    pass_fds=self.engine.pass_fds,  # the lease, held while they live
                ))  # fmt: skip
        except BaseException:
            stop_tree(procs, 0.5)
            os.close(owner)
            shutil.rmtree(control, ignore_errors=True)
            raise
        ranks = WarmRanks(self._key, self.placement.gpu_indices, procs, [_Pump(p) for p in procs], control,
                          rendezvous, self._keep_warm_s, owner_fd=owner)  # fmt: skip
        POOL.add(ranks)
        return ranks

    def start(self) -> None:
        assert self.spec.payload is not None, "a warm worker group runs a payload"
        self.spec.payload.write(self.run_dir.payload)
        ranks = POOL.take(self._key, self.placement.gpu_indices)
        self.reused = ranks is not None
        if ranks is not None:  # they keep the GPUs they leased when they were started
            ranks.name_holder(self.run_id, "call")
            self.placement = dataclasses.replace(self.placement, gpu_indices=ranks.gpu_indices)
            if len(ranks.procs) != self.spec.world_size:  # gpus=None: as many as were free then
                self.spec = dataclasses.replace(self.spec, world_size=len(ranks.procs))
        else:
            rendezvous = self._place()  # new ranks lease their GPUs first; the ranks then hold the lease
            try:
                ranks = self._spawn(rendezvous)
            except BaseException:
                self.engine.release()
                raise
            ranks.lease = self.engine.take_lease()
        self.warm = ranks
        self.rendezvous = self.warm.rendezvous
        self._procs = self.warm.procs
        self._pumps = self.warm.pumps  # type: ignore[assignment]
        for rank, pump in enumerate(self.warm.pumps):
            pump.serve(RankLog(rank, self.run_dir.log(rank), self._logs))
        try:
            for rank in range(self.spec.world_size):
                self.warm.send(rank, {"run_dir": str(self.run_dir.path), "env": self._job_env(rank), "cwd": os.getcwd()})
        except OSError:  # a rank died while idle: the poll reports it
            pass
        logger.debug("run %s on %s warm ranks", self.run_id, "reused" if self.reused else "new")

    def _job_env(self, rank: int) -> dict[str, str]:
        """This call's whole environment for a rank (run id, folder, attempt, tracking, faults included)."""
        assert self.warm is not None
        return self._env(rank, self.warm.rendezvous)

    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        if self.abort.is_set() and not dump_stacks and self.warm is not None and self._interrupt(grace_period_s):
            t_stop = time.time()  # a cancel that every rank came back from: the ranks stay warm
            self._kept = True
            for rank in range(self.spec.world_size):
                if rank not in self._results:  # interrupted (or failed before): stopped by the cancel
                    self._failures[rank] = failures.stopped(rank, reason, t_stop, self.run_dir.log(rank))
            return self._status()
        if self.warm is not None:
            POOL.discard(self.warm)  # a stopped call leaves no warm ranks behind
        status = super().stop(reason, grace_period_s, dump_stacks)
        if self.warm is not None:
            self.warm.stop(0.0)
        return status

    def _interrupt(self, grace_period_s: float) -> bool:
        """A cancel: interrupt the call in every rank (``KeyboardInterrupt``, as Ctrl-C would); True when
        every rank came back from it within the grace period (at most 5 s), ready for the next call.

        A rank that does not come back (stuck in a collective its peer left, or ignoring SIGINT) is
        stopped with the others as for any stop.
        """
        warm = self.warm
        assert warm is not None
        if not warm.alive():
            return False
        for proc, pump in zip(warm.procs, warm.pumps, strict=True):
            if not pump.ended():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
        limit = max(0.0, min(grace_period_s, 5.0))
        deadline = time.monotonic() + limit
        came_back = all(p.wait_for_end(max(0.0, deadline - time.monotonic())) for p in warm.pumps)
        return came_back and warm.alive() and not any(p.replace for p in warm.pumps)

    def close(self, succeeded: bool) -> None:
        if self._closed:
            return
        self._closed = True
        warm = self.warm
        if warm is not None and self._kept:
            for pump in warm.pumps:
                pump.close()
            POOL.release(warm, self.run_id)
        elif (warm is not None and succeeded and all(p.wait_for_end(10.0) for p in warm.pumps) and warm.alive()
                and not any(p.replace for p in warm.pumps)):  # fmt: skip
            for pump in warm.pumps:
                pump.close()
            POOL.release(warm, self.run_id)
        elif warm is not None:
            POOL.discard(warm)
            warm.stop(1.0)
        for path in [self.run_dir.payload] + [self.run_dir.outcome(r) for r in range(self.spec.world_size)]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
