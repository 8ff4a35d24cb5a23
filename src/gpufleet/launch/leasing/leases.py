"""GPU leases: which run uses which GPU of this machine, for every process and user on it.

A run leases its GPUs before its ranks start, and its ranks see only those
(``CUDA_VISIBLE_DEVICES``). A lease is an exclusive :func:`fcntl.flock` on one lock file per
GPU (``gpu-<uuid>.lock``) in a machine-wide folder, held by the process that runs the attempt
(the caller of a ``@distributed`` call, a workload's supervisor). The kernel drops the lock
when that process ends in any way, ``kill -9`` included, so a dead holder's GPUs are free again
without any clean-up. The holder writes who it is (run id, kind, pid, user, since) into the
lock file, which is how a waiting run, ``gpufleet ps`` and :class:`GPUUnavailableError` name it.

A run takes its GPUs all at once or not at all (taking some and waiting for the rest could
deadlock two runs). A waiting run tries again the moment a holder lets go (a thread per held lock
file blocks in a shared ``flock`` until the exclusive one is released: the hand-off takes
milliseconds, not a polling interval), and otherwise every second with jitter (for processes
outside gpufleet) until ``wait_s`` has passed. While it waits it holds a shared ``flock`` on each
wanted GPU's ``gpu-<uuid>.want`` file, which is how idle warm ranks (:mod:`gpufleet.launch.engines.local.warm`)
and :func:`wanted` know that someone waits for their GPUs.
There is no queue: the first run to find enough free GPUs gets them. GPUs on which NVML shows
compute processes outside gpufleet that use them (memory or utilisation above the thresholds of
:mod:`gpufleet.launch.leasing.gpu_processes`) are busy "outside gpufleet" and are not taken
(``GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES=1`` takes them anyway); an idle CUDA context beside a
free GPU is shown, not waited for.

The folder, its lock files and the holder records in them are :mod:`gpufleet.launch.leasing.lease_files`
(who may write there, what a planted or forged file does). The processes that use the GPUs inherit
the lock (``GpuLease.fds``), so it outlives a caller killed with SIGKILL until its ranks are gone.

One concern past 400 lines: taking, waiting for and describing leases (the want files of waiting
runs, the who-holds-what messages), kept whole so that its locking rules are read in one place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import GPUUnavailableError
from ...printable import printable
from ..gpus import GPUInfo, list_gpus
from .gpu_processes import ForeignProcess, foreign_processes
from .lease_files import (
    LEASE_DIR_ENV,
    Holder,
    LeaseDirError,
    PlantedLockError,
    lease_dir,
    lock_path,
    open_lock,
    read_holder,
    user_name,
    write_holder,
)

__all__ = [
    "LEASE_DIR_ENV", "GpuLease", "GpuRequest", "GpuUse", "Holder", "LeaseDirError", "PlantedLockError",
    "acquire", "gpu_uses", "give_back_idle", "lease_dir", "try_lease", "user_name", "want", "wanted",
]

#: Seconds between two tries of a waiting lease (jittered by +-50 %) when no holder let go
#: meanwhile; a release wakes the waiter at once.
RETRY_S = 1.0
#: A waiting run says who holds its GPUs once it has waited this long (seconds; a run that ends
#: frees its GPUs once its ranks have exited, which the next call may wait a moment for)...
REPORT_AFTER_S = 2.0
#: ...and again whenever that changes, and at least this often.
REPORT_EVERY_S = 60.0


@dataclass(frozen=True)
class GpuUse:
    """What one GPU is used by now."""

    gpu: GPUInfo
    held: bool = False
    holder: Holder | None = None
    foreign: tuple[ForeignProcess, ...] = ()
    blocked: str = ""  # why its lock file cannot be used (see PlantedLockError)
    #: Processes outside gpufleet that are idle on it (a bare CUDA context): shown, not waited for.
    beside: tuple[ForeignProcess, ...] = ()

    @property
    def free(self) -> bool:
        return not self.held and not self.foreign and not self.blocked

    def describe(self) -> str:
        what = [self.blocked] if self.blocked else []
        if self.held:
            what.append(self.holder.describe() if self.holder else "a gpufleet run whose details cannot be read")
        what.extend(p.describe() for p in self.foreign)
        what.extend(p.describe() for p in self.beside)
        return printable(f"GPU {self.gpu.index}: " + ("; ".join(what) or "free"))  # process names, too, are anyone's


@dataclass(frozen=True)
class GpuRequest:
    """What a run asks for: ``count`` GPUs (None: every free one, at least one) or the ``named`` indices.

    ``wait_s``: how long to wait for them (None: without limit, 0: not at all).
    """

    count: int | None = None
    named: tuple[int, ...] | None = None
    wait_s: float | None = None

    def wanted(self) -> str:
        if self.named is not None:
            return f"GPU{'s' if len(self.named) > 1 else ''} {', '.join(map(str, self.named))}"
        if self.count is None:
            return "every free GPU (at least one)"
        return f"{self.count} GPU{'s' if self.count > 1 else ''}"


# ------------------------------------------------------------------ leases


class GpuLease:
    """GPUs this process holds for one run, until :meth:`release` (or until the process ends)."""

    def __init__(self, gpus: list[GPUInfo], fds: list[int], holder: Holder) -> None:
        self.gpus = gpus
        self.holder = holder
        self._fds = fds
        self._lock = threading.Lock()

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def released(self) -> bool:
        return not self._fds

    @property
    def fds(self) -> tuple[int, ...]:
        """The lock descriptors, for the processes that use these GPUs to inherit (``pass_fds``).

        A flock belongs to the open file, not to one descriptor: a rank that inherited it keeps
        the GPUs leased after this process dies, however it dies, until the rank (and every
        process it forked) has exited too. :meth:`release` unlocks explicitly, for all of them.
        """
        return tuple(self._fds)

    def rename(self, holder: Holder) -> None:
        """Name another holder of these GPUs (a warm rank's next call, or its idle ranks)."""
        with self._lock:
            self.holder = holder
            for fd in self._fds:
                write_holder(fd, holder)

    def wanted(self) -> bool:
        """Whether another run waits for one of these GPUs (or ``gpufleet cancel`` asks for them)."""
        return wanted(self.gpus)

    def release(self) -> None:
        """Give the GPUs back (safe to call twice)."""
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # the next reader sees no stale holder
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for ranks that inherited the descriptor and still run
            os.close(fd)

    def __enter__(self) -> GpuLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"GpuLease(gpus={list(self.indices)}, run={self.holder.run_id!r}, released={self.released})"


def _busy(found: dict[str, tuple[ForeignProcess, ...]]) -> dict[str, tuple[ForeignProcess, ...]]:
    """Of the processes outside gpufleet, those that make their GPU busy (see :class:`ForeignProcess.busy`)."""
    busy = {uuid: tuple(p for p in procs if p.busy) for uuid, procs in found.items()}
    return {uuid: procs for uuid, procs in busy.items() if procs}


def _candidates(request: GpuRequest, gpus: Sequence[GPUInfo]) -> list[GPUInfo]:
    if request.named is None:
        return list(gpus)
    by_index = {g.index: g for g in gpus}
    missing = [i for i in request.named if i not in by_index]
    if missing:
        raise GPUUnavailableError(
            f"GPU{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} asked for by name "
            f"{'are' if len(missing) > 1 else 'is'} not visible here (visible: {sorted(by_index) or 'none'})"
        )
    return [by_index[i] for i in request.named]


def try_lease(
    request: GpuRequest, holder: Holder, gpus: Sequence[GPUInfo], folder: Path | None = None
) -> tuple[GpuLease | None, list[GpuUse]]:
    """One try: the lease when enough GPUs are free now, else None and what keeps the others busy."""
    folder = folder or lease_dir()
    candidates = _candidates(request, gpus)
    need = len(candidates) if request.named is not None else request.count
    foreign = _busy(foreign_processes(candidates))
    taken: list[tuple[GPUInfo, int]] = []
    busy: list[GpuUse] = []
    try:
        for g in candidates:
            if need is not None and len(taken) == need:
                break
            if foreign.get(g.uuid):
                busy.append(GpuUse(g, foreign=foreign[g.uuid]))
                continue
            try:
                fd = open_lock(lock_path(folder, g))
            except PlantedLockError as e:
                busy.append(GpuUse(g, blocked=str(e)))
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(GpuUse(g, held=True, holder=read_holder(fd)))
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            taken.append((g, fd))
        enough = bool(taken) if need is None else len(taken) == need
        if enough:
            for _, fd in taken:
                write_holder(fd, holder)
            lease = GpuLease([g for g, _ in taken], [fd for _, fd in taken], holder)
            taken = []
            return lease, busy
        return None, busy
    finally:
        for _, fd in taken:  # not enough: give back what was taken, all or nothing
            os.close(fd)


class _Waiting:
    """What a waiting run holds while it waits: a shared lock on each wanted GPU's ``.want`` file,
    and a thread per held lock file that sets ``released`` when its holder lets go."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.released = threading.Event()
        self._wants: dict[Path, int] = {}
        self._watched: set[Path] = set()
        self._lock = threading.Lock()

    def want(self, gpus: Sequence[GPUInfo]) -> None:
        for g in gpus:
            path = lock_path(self.folder, g, ".want")
            if path in self._wants:
                continue
            try:
                fd = open_lock(path)
            except LeaseDirError:
                continue  # an unusable want file only means idle warm ranks do not hear of this wait
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                self._wants[path] = fd
            except OSError:
                os.close(fd)

    def watch(self, path: Path) -> None:
        with self._lock:
            if path in self._watched:
                return
            self._watched.add(path)
        threading.Thread(target=self._watch, args=(path,), name="gpufleet-lease-watch", daemon=True).start()

    def _watch(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = -1
        try:
            if fd >= 0 and stat.S_ISREG(os.fstat(fd).st_mode):
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    time.sleep(random.uniform(0.005, 0.03))  # not held now: no tight loop between waiters
                except BlockingIOError:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # blocks until the holder's exclusive lock is gone
                    fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)
            with self._lock:
                self._watched.discard(path)
            self.released.set()

    def close(self) -> None:
        for fd in self._wants.values():
            os.close(fd)
        self._wants.clear()


def wanted(gpus: Sequence[GPUInfo], folder: Path | None = None) -> bool:
    """Whether a run waits for one of ``gpus`` now (it holds a shared lock on the GPU's ``.want`` file)."""
    folder = folder or lease_dir()
    for g in gpus:
        try:
            fd = os.open(lock_path(folder, g, ".want"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            pass
        finally:
            os.close(fd)
    return False


def want(gpus: Sequence[GPUInfo], seconds: float, until: Callable[[], bool]) -> bool:
    """Ask for ``gpus`` as a waiting run does, for up to ``seconds`` or until ``until()`` is true; returns ``until()``.

    ``gpufleet cancel`` of idle warm ranks uses it: they give their GPUs back when someone waits.
    """
    waiting = _Waiting(lease_dir())
    try:
        waiting.want(gpus)
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            time.sleep(0.05)
        return until()
    finally:
        waiting.close()


def give_back_idle(run_id: str, seconds: float = 15.0) -> bool | None:
    """Ask idle warm ranks that hold GPUs under ``run_id`` (holder kind ``warm``) to give them back.

    None when no GPU is held so; else whether they were given back within ``seconds``.
    """
    uses = [u for u in gpu_uses() if u.held and u.holder and u.holder.run_id == run_id and u.holder.kind == "warm"]
    if not uses:
        return None
    gpus = [u.gpu for u in uses]
    return want(gpus, seconds, until=lambda: not any(
        u.held and u.holder is not None and u.holder.run_id == run_id for u in gpu_uses(gpus)))  # fmt: skip


def waiting_message(request: GpuRequest, holder: Holder, busy: list[GpuUse], total: int, wait_s: float | None) -> str:
    """What a waiting run prints: what it wants, and who holds the GPUs it cannot have."""
    limit = "without a limit" if wait_s is None else f"up to {wait_s:g} s (gpu_wait)"
    lines = [f"gpufleet: run {holder.run_id} waits for {request.wanted()} ({len(busy)} of {total} busy), {limit}:"]
    lines += [f"  {use.describe()}" for use in busy]
    return "\n".join(lines)


def unavailable_message(request: GpuRequest, holder: Holder, busy: list[GpuUse], total: int, waited: float) -> str:
    """The :class:`GPUUnavailableError` of a run that waited in vain, naming the holders."""
    held = "; ".join(use.describe() for use in busy) or "none is held now"
    return (
        f"run {holder.run_id} could not get {request.wanted()} of this machine's {total} after waiting "
        f"{waited:.1f} s (gpu_wait): {held}. Wait longer (gpu_wait=SECONDS, None: no limit), ask for fewer "
        "GPUs, or stop one of those runs (`gpufleet ps` shows them; `gpufleet cancel RUN_ID` for your own)"
    )


def acquire(
    request: GpuRequest,
    holder: Holder,
    *,
    abort: threading.Event | None = None,
    on_wait: Callable[[str], None] | None = None,
    gpus: Sequence[GPUInfo] | None = None,
    canceled: Callable[[], BaseException] | None = None,
    report_after_s: float | None = None,
) -> GpuLease:
    """Lease the GPUs of ``request`` for ``holder``, waiting for them up to ``request.wait_s``.

    Args:
        abort: set to give up waiting; then ``canceled()`` is raised (a ``RuntimeError`` without it).
        on_wait: told who holds the GPUs once the run has waited ``report_after_s`` (default
            :data:`REPORT_AFTER_S`), when that changes and every :data:`REPORT_EVERY_S` seconds.
        gpus: the GPUs to choose from (default: :func:`~gpufleet.launch.gpus.list_gpus`).

    Raises:
        GPUUnavailableError: too few GPUs became free within ``wait_s``; it names the holders.
        LeaseDirError: the lease folder cannot be used.
    """
    gpus = list(list_gpus() if gpus is None else gpus)
    total = len(_candidates(request, gpus))
    if request.count is not None and request.named is None and request.count > len(gpus):
        raise GPUUnavailableError(f"gpus={request.count} was asked for, but this machine has {len(gpus)} visible GPU(s)")
    folder = lease_dir()
    start = time.monotonic()
    reported: tuple[Any, ...] | None = None
    reported_at = 0.0
    waiting = _Waiting(folder)
    try:
        while True:
            lease, busy = try_lease(request, holder, gpus, folder)
            if lease is not None:
                return lease
            if abort is not None and abort.is_set():
                raise canceled() if canceled else RuntimeError("canceled while waiting for GPUs")
            now = time.monotonic()
            if request.wait_s is not None and now - start >= request.wait_s:
                raise GPUUnavailableError(unavailable_message(request, holder, busy, total, now - start))
            waiting.want(_candidates(request, gpus))
            waiting.released.clear()
            for use in busy:
                if use.held:
                    waiting.watch(lock_path(folder, use.gpu))
            key = tuple((u.gpu.index, u.holder.run_id if u.holder else None, u.foreign) for u in busy)
            due = key != reported or now - reported_at >= REPORT_EVERY_S
            after = REPORT_AFTER_S if report_after_s is None else report_after_s
            if on_wait is not None and now - start >= after and due:
                reported, reported_at = key, now
                on_wait(waiting_message(request, holder, busy, total, request.wait_s))
            pause = RETRY_S * random.uniform(0.5, 1.5)
            if on_wait is not None and now - start < after:
                pause = min(pause, after - (now - start) + 0.01)  # the first message is due then
            if request.wait_s is not None:
                pause = max(0.0, min(pause, request.wait_s - (now - start)))
            deadline = now + pause
            # A release (a holder let go) ends the pause at once; an abort within 50 ms.
            while not waiting.released.is_set() and not (abort is not None and abort.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                waiting.released.wait(min(left, 0.05))
    finally:
        waiting.close()


def gpu_uses(gpus: Sequence[GPUInfo] | None = None) -> list[GpuUse]:
    """Every GPU of this machine and what uses it now (``gpufleet ps``); never takes a lease."""
    gpus = list(list_gpus() if gpus is None else gpus)
    if not gpus:
        return []
    folder = lease_dir()
    found = foreign_processes(gpus)
    foreign = _busy(found)
    uses = []
    for g in gpus:
        path = lock_path(folder, g)
        held, holder, blocked = False, None, ""
        try:
            fd = open_lock(path) if os.path.lexists(path) else -1  # -1: never leased
        except PlantedLockError as e:
            fd, blocked = -1, str(e)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                held, holder = True, read_holder(fd)
            finally:
                os.close(fd)
        beside = tuple(p for p in found.get(g.uuid, ()) if not p.busy)
        uses.append(GpuUse(g, held, holder, foreign.get(g.uuid, ()), blocked=blocked, beside=beside))
    return uses
