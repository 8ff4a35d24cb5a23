"""The GPU lease folder, its lock files and the holder records in them (:mod:`gpufleet.launch.leasing.leases` leases through these).

The folder: ``$GPUFLEET_LEASE_DIR``, else ``<tmp>/gpufleet-gpu-leases``, created ``1777`` like
``/tmp`` itself, so every user creates lock files there and none can delete another's. Its owner
could (a sticky folder's owner may rename anything in it), so a folder that belongs to another user
(not root) is not used: ``$GPUFLEET_LEASE_DIR`` is then an error, and the default gives way to a
private folder (``$GPUFLEET_HOME/gpu-leases``, with a warning). With fake GPUs
(``GPUFLEET_FAKE_GPUS``) the default folder is ``$GPUFLEET_HOME/gpu-leases-fake``, so test
sessions do not share fake GPUs.

Lock files are ``0666`` so that any user can lock them and write their holder; one is opened
without following symlinks, without blocking (a FIFO) and used only when it is a plain file with a
single link. One that is not (a link, a folder, a socket, a FIFO, a second link, one its maker keeps
unreadable) raises :class:`PlantedLockError`, naming who made it, which makes only its GPU busy.
A holder record is anyone's writing: it is escaped when read (:func:`gpufleet.printable.printable`)
and its pid and user are checked against the process that holds the lock (``/proc/locks``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ...errors import LaunchConfigError
from ...printable import printable
from ..gpus import FAKE_GPUS_ENV, GPUInfo
from ..node import envcontract

LEASE_DIR_ENV = envcontract.LEASE_DIR
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


# ------------------------------------------------------------------ the folder and its lock files


_warned_private = False


def _private_lease_dir(shared: Path, owner: int) -> Path:
    """The user's own lease folder, used when the machine-wide one belongs to another user."""
    global _warned_private
    from ...private import private_dir
    from ...results import gpufleet_home

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
        from ...private import UnsafeStateError, check_parents

        try:
            check_parents(path, "the GPU lease folder")
        except UnsafeStateError as e:
            raise LeaseDirError(f"{e} ({LEASE_DIR_ENV})") from e
    elif os.environ.get(FAKE_GPUS_ENV):
        from ...private import private_dir
        from ...results import gpufleet_home

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


def lock_path(folder: Path, gpu: GPUInfo, suffix: str = ".lock") -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu.uuid) or f"index-{gpu.index}"
    return folder / f"gpu-{safe}{suffix}"


def open_lock(path: Path) -> int:
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


def read_holder(fd: int) -> Holder | None:
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


def write_holder(fd: int, holder: Holder) -> None:
    data = json.dumps(holder.record()).encode()
    with contextlib.suppress(OSError):  # a read-only lock file still locks; its holder is then unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
