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
wanted GPU's ``gpu-<uuid>.want`` file, which is how idle warm ranks (:mod:`gpufleet.launch.warm`)
and :func:`wanted` know that someone waits for their GPUs.
There is no queue: the first run to find enough free GPUs gets them. GPUs on which NVML shows
compute processes outside gpufleet that use them (memory or utilisation above the thresholds of
:mod:`gpufleet.launch.gpu_processes`) are busy "outside gpufleet" and are not taken
(``GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES=1`` takes them anyway); an idle CUDA context beside a
free GPU is shown, not waited for.

The folder: ``$GPUFLEET_LEASE_DIR``, else ``<tmp>/gpufleet-gpu-leases``, created
``1777`` like ``/tmp`` itself, so every user creates lock files there and none can delete
another's. Its owner could (a sticky folder's owner may rename anything in it), so a folder
that belongs to another user (not root) is not used: ``$GPUFLEET_LEASE_DIR`` is then an error,
and the default gives way to a private folder (``$GPUFLEET_HOME/gpu-leases``, with a warning:
that user's runs are then seen only through NVML). Lock files are ``0666`` so that any user can
lock them and write their holder; a lock file is opened without following symlinks, without
blocking (a FIFO) and used only when it is a plain file with a single link. One that is not (a
link, a folder, a FIFO, a second link, one its maker keeps unreadable) makes its GPU busy,
naming who made it, instead of failing every lease; only its maker or root can remove it. What a
holder record says is escaped before it is printed (:func:`gpufleet.printable.printable`), and
its pid and user are checked against the process that holds the lock (``/proc/locks``). The
processes that use the GPUs inherit the lock (``GpuLease.fds``), so it outlives a caller killed
with SIGKILL until its ranks are gone. With fake GPUs (``GPUFLEET_FAKE_GPUS``, the test override of discovery) the
default folder is ``$GPUFLEET_HOME/gpu-leases-fake``, so test sessions do not share fake GPUs.

One concern past 400 lines: the lease protocol itself (lock files, holders and their check
against the lock, waiting, the want files of waiting runs and who-holds-what messages), kept
whole so that its locking rules are read in one place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import GPUUnavailableError, LaunchConfigError
from ..printable import printable
from .gpu_processes import ForeignProcess, foreign_processes
from .gpus import FAKE_GPUS_ENV, GPUInfo, list_gpus

LEASE_DIR_ENV = "GPUFLEET_LEASE_DIR"
#: Seconds between two tries of a waiting lease (jittered by +-50 %) when no holder let go
#: meanwhile; a release wakes the waiter at once.
RETRY_S = 1.0
#: A waiting run says who holds its GPUs once it has waited this long (seconds; a run that ends
#: frees its GPUs once its ranks have exited, which the next call may wait a moment for)...
REPORT_AFTER_S = 2.0
#: ...and again whenever that changes, and at least this often.
REPORT_EVERY_S = 60.0
_MAX_INFO = 4096


class LeaseDirError(LaunchConfigError):
    """The machine-wide lease folder (or a lock file in it) cannot be used safely."""


class PlantedLockError(LeaseDirError):
    """A GPU's lock file is not a plain file of one link (or cannot be read): its GPU cannot be leased."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def user_name() -> str:
    """This process's user name, from its uid (not from $USER, which anyone can set); its uid when it has none."""
    return _user_of(os.geteuid())


def _fmt_time(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if time.time() - ts < 86400 else \
        time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))  # fmt: skip


def _fmt_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU: the run, its kind (``call`` / ``workload``), the holding process, since when."""

    run_id: str
    kind: str
    pid: int = field(default_factory=os.getpid)
    user: str = field(default_factory=user_name)
    since: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    #: What the record said that the lock itself disproves (set by the reader, never written).
    disputed: str = ""

    def describe(self) -> str:
        note = f"; {self.disputed}" if self.disputed else ""
        if self.kind == "warm":
            return (f"idle warm ranks of run {self.run_id} (pid {self.pid}, user {self.user}; given back when a run "
                    f"waits for them, or by `gpufleet cancel {self.run_id}`{note})")  # fmt: skip
        return (f"run {self.run_id} ({self.kind}, pid {self.pid}, user {self.user}, since "
                f"{_fmt_time(self.since)}, {_fmt_age(time.time() - self.since)} ago{note})")  # fmt: skip

    def record(self) -> dict[str, Any]:
        """What is written into the lock file."""
        return {k: v for k, v in asdict(self).items() if k != "disputed"}

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        try:  # any user may write a lock file: nothing in it reaches a terminal unescaped
            d = json.loads(data.decode("utf-8"))
            return cls(printable(str(d["run_id"])), printable(str(d["kind"])), int(d["pid"]), printable(str(d["user"])),
                       float(d["since"]), printable(str(d.get("host", ""))))  # fmt: skip
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None


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


# ------------------------------------------------------------------ the folder and its lock files


_warned_private = False


def _private_lease_dir(shared: Path, owner: int) -> Path:
    """The user's own lease folder, used when the machine-wide one belongs to another user."""
    global _warned_private
    from ..private import private_dir
    from ..results import gpufleet_home

    path = private_dir(private_dir(gpufleet_home()) / "gpu-leases", "the private GPU lease folder")
    if not _warned_private:
        _warned_private = True
        import warnings

        warnings.warn(
            f"the GPU lease folder {shared} belongs to {_owner(owner)}, who could rename its lock files and make "
            f"two runs share a GPU; gpufleet leases in {path} instead, so that user's runs are seen only through "
            f"NVML. An administrator can make the shared folder root's (`sudo chown root {shared}`), or set "
            f"{LEASE_DIR_ENV} to a folder root made with mode 1777.",
            RuntimeWarning,
            stacklevel=3,
        )
    return path


def lease_dir() -> Path:
    """The machine-wide lease folder, created ``1777`` when missing, checked when present.

    Raises:
        LeaseDirError: it cannot be created, is no folder, or ``$GPUFLEET_LEASE_DIR`` names a folder
            of another user (or one inside a folder others may write to).
    """
    value = os.environ.get(LEASE_DIR_ENV)
    if value:
        path = Path(value)
        from ..private import UnsafeStateError, check_parents

        try:
            check_parents(path, "the GPU lease folder")
        except UnsafeStateError as e:
            raise LeaseDirError(f"{e} ({LEASE_DIR_ENV})") from e
    elif os.environ.get(FAKE_GPUS_ENV):
        from ..private import private_dir
        from ..results import gpufleet_home

        path = private_dir(gpufleet_home()) / "gpu-leases-fake"
    else:
        path = Path(tempfile.gettempdir()) / "gpufleet-gpu-leases"
    try:
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, 0o1777)
        os.chmod(path, 0o1777)  # mkdir's mode is filtered by the umask; shared like /tmp
    except FileExistsError:
        pass
    except OSError as e:
        raise LeaseDirError(f"the GPU lease folder {path} cannot be created ({e.strerror}); set {LEASE_DIR_ENV} "
                            "to a folder every user of the GPUs can write") from e  # fmt: skip
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LeaseDirError(f"the GPU lease folder {path} is not a folder (a link or a file); remove it, or set "
                            f"{LEASE_DIR_ENV} to another folder")  # fmt: skip
    if st.st_uid not in (os.geteuid(), 0):
        if value:
            raise LeaseDirError(f"the GPU lease folder {path} ({LEASE_DIR_ENV}) belongs to {_owner(st.st_uid)}, who "
                                "could rename its lock files and make two runs share a GPU; use a folder root made "
                                "with mode 1777, or one of your own")  # fmt: skip
        return _private_lease_dir(path, st.st_uid)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise LeaseDirError(f"the GPU lease folder {path} lets others replace its files (it is writable without "
                            f"the sticky bit); `chmod 1777 {path}`")  # fmt: skip
    return path


def _planted(path: Path, what: str) -> PlantedLockError:
    try:
        maker = f", made by {_owner(os.lstat(path).st_uid)}"
    except OSError:
        maker = ""
    return PlantedLockError(f"its lock file {path} is {what}{maker}; only they or root can remove it")


def _lock_path(folder: Path, gpu: GPUInfo, suffix: str = ".lock") -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu.uuid) or f"index-{gpu.index}"
    return folder / f"gpu-{safe}{suffix}"


def _open_lock(path: Path) -> int:
    """Open (or create, 0666) a lock file, never through a link; its fd."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted there must not block the open
    fd = -1
    for _ in range(5):
        try:  # an existing file is opened without O_CREAT (fs.protected_regular refuses that for another's file)
            fd = os.open(path, os.O_RDWR | flags)
            break
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o666)
                os.fchmod(fd, 0o666)  # every user locks it and writes their holder into it
                break
            except FileExistsError:
                continue
        except PermissionError:  # someone made it read-only: it still locks
            try:
                fd = os.open(path, os.O_RDONLY | flags)
            except PermissionError as e:
                raise _planted(path, "unreadable") from e
            break
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _planted(path, "a symbolic link") from e
            if e.errno == errno.EISDIR:
                raise _planted(path, "a folder") from e
            if e.errno == errno.ENXIO:  # a socket
                raise _planted(path, "not a plain file") from e
            raise LeaseDirError(f"the GPU lock file {path} cannot be opened: {e.strerror}; the folder must be "
                                f"writable by every user of the GPUs (chmod 1777), or set {LEASE_DIR_ENV}") from e  # fmt: skip
    if fd < 0:
        raise LeaseDirError(f"the GPU lock file {path} keeps disappearing; is something deleting it?")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise _planted(path, "not a plain file" if not stat.S_ISREG(st.st_mode) else "a second link to another file")
    return fd


def _read_holder(fd: int) -> Holder | None:
    """The holder a held lock file names, checked against the lock itself.

    Any user may write any record into a lock file they hold. The kernel knows which process took
    the lock (``/proc/locks``) and that process's user: where they differ from the record, the
    real ones are shown and the record's claim is marked as such. A lock whose process is gone
    (ranks still holding an inherited lock) is shown as its record says.
    """
    try:
        holder = Holder.parse(os.pread(fd, _MAX_INFO, 0))
    except OSError:
        return None
    if holder is None:
        return None
    pid = _lock_pid(fd)
    if pid is None:
        return holder
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return holder
    user = _user_of(uid)
    if pid == holder.pid and user == holder.user:
        return holder
    claim = ", ".join(part for part, differs in ((f"pid {holder.pid}", pid != holder.pid),
                                                 (f"user {holder.user}", user != holder.user)) if differs)  # fmt: skip
    return replace(holder, pid=pid, user=user, disputed=f"its lock record claims {claim}, which the lock disproves")


def _user_of(uid: int) -> str:
    """A user's name as :func:`user_name` gives it (its uid when it has none)."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _lock_pid(fd: int) -> int | None:
    """The process that holds the exclusive ``flock`` on ``fd``'s file (``/proc/locks``), or None."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 13740 fe:00:2146508 0 EOF" (a blocked waiter's line starts "1: ->")
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "WRITE" and parts[5] == where:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


def _write_holder(fd: int, holder: Holder) -> None:
    data = json.dumps(holder.record()).encode()
    with contextlib.suppress(OSError):  # a read-only lock file still locks; its holder is then unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


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
                _write_holder(fd, holder)

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
                fd = _open_lock(_lock_path(folder, g))
            except PlantedLockError as e:
                busy.append(GpuUse(g, blocked=str(e)))
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(GpuUse(g, held=True, holder=_read_holder(fd)))
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            taken.append((g, fd))
        enough = bool(taken) if need is None else len(taken) == need
        if enough:
            for _, fd in taken:
                _write_holder(fd, holder)
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
            path = _lock_path(self.folder, g, ".want")
            if path in self._wants:
                continue
            try:
                fd = _open_lock(path)
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
            fd = os.open(_lock_path(folder, g, ".want"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
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
                    waiting.watch(_lock_path(folder, use.gpu))
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
        path = _lock_path(folder, g)
        held, holder, blocked = False, None, ""
        try:
            fd = _open_lock(path) if os.path.lexists(path) else -1  # -1: never leased
        except PlantedLockError as e:
            fd, blocked = -1, str(e)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                held, holder = True, _read_holder(fd)
            finally:
                os.close(fd)
        beside = tuple(p for p in found.get(g.uuid, ()) if not p.busy)
        uses.append(GpuUse(g, held, holder, foreign.get(g.uuid, ()), blocked=blocked, beside=beside))
    return uses
