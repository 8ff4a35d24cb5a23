"""gpufleet's state stays the user's own: folders 0700, files 0600, and no folder someone else controls.

gpufleet unpickles what it finds in run folders (outcome files) and runs code from snapshots, so a
folder another user owns or may write to would let that user run code as the caller. Every
state folder is checked before anything is read from it: it must be a folder, owned by the
current user and not writable by group or others. A folder of ours that others may read (made
by an older version, or by hand) is tightened to 0700 on the spot.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import GpufleetError

__all__ = ["UnsafeStateError", "private_dir", "private_file_opener"]


class UnsafeStateError(GpufleetError, PermissionError):
    """A state folder is not safe to use: someone else owns it or may write to it, or it is no folder."""


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def private_dir(path: str | os.PathLike[str], what: str = "gpufleet's state folder") -> Path:
    """Create ``path`` (0700) or check an existing one; returns it.

    Raises:
        UnsafeStateError: ``path`` is a file, belongs to another user, or group/others may
            write to it; or it cannot be written. Nothing was read from it.
    """
    p = Path(path)
    try:
        p.mkdir(parents=True, mode=0o700)
        os.chmod(p, 0o700)  # mkdir's mode is filtered by the umask
        return p
    except FileExistsError:
        pass
    except NotADirectoryError as e:
        raise UnsafeStateError(f"{what} {p} cannot be created: a part of its path is a file ({e}). Set GPUFLEET_HOME "
                               "(or runs_dir) to a folder.") from e  # fmt: skip
    except PermissionError as e:
        raise UnsafeStateError(f"{what} {p} cannot be created: {e.strerror}. Set GPUFLEET_HOME (or runs_dir) to a "
                               "folder you can write to.") from e  # fmt: skip
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        st = p.stat()
        if st.st_uid != os.geteuid():
            raise UnsafeStateError(
                f"{what} {p} is a link to a folder owned by {_owner_name(st.st_uid)}, not by you; gpufleet reads "
                "pickled results from it, so that user could run code as you. Use a folder of your own."
            )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStateError(f"{what} {p} is not a folder. Set GPUFLEET_HOME (or runs_dir) to a folder.")
    if st.st_uid != os.geteuid():
        raise UnsafeStateError(
            f"{what} {p} is owned by {_owner_name(st.st_uid)}, not by you ({_owner_name(os.geteuid())}); gpufleet "
            "reads pickled results and code from it, so that user could run code as you. Use a folder of your "
            "own (GPUFLEET_HOME, runs_dir)."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStateError(
            f"{what} {p} may be written by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); gpufleet reads pickled results and code from it. Make it "
            f"private (chmod 700 {p}) or use another folder."
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(p, 0o700)  # ours, but readable by others: run logs and secrets live here
    if not os.access(p, os.W_OK | os.X_OK):
        raise UnsafeStateError(f"{what} {p} is read-only for you. Set GPUFLEET_HOME (or runs_dir) to a folder you "
                               "can write to.")  # fmt: skip
    return p


def private_file_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that creates files 0600 (``open(p, "ab", opener=private_file_opener)``)."""
    return os.open(path, flags, 0o600)
