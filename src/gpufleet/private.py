"""gpufleet's state stays the user's own: folders 0700, files 0600, and no folder someone else controls.

gpufleet unpickles what it finds in run folders (outcome files) and runs code from snapshots, so a
folder another user owns or may write to would let that user run code as the caller. Every
state folder is checked before anything is read from it: it must be a folder, owned by the
current user and not writable by group or others. A folder of ours that others may read (made
by an older version, or by hand) is tightened to 0700 on the spot.

The folder's own mode is not enough: whoever may write to one of its parents can rename it away
during a call and put a folder of their own in its place, under the same path. So every folder
on the way to it (each link followed and its own folder checked too) must belong to the user or
to root and be writable by nobody else, unless it is sticky (``/tmp``: others may not rename
what is ours there) or its group holds the user alone (a user-private group). These rules hold
until the user or root changes them, so a path checked once stays safe for the call. See
``docs/security.md``.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from pathlib import Path

from .errors import GpufleetError
from .launch.node import envcontract

__all__ = ["UnsafeStateError", "check_parents", "private_dir", "private_file_opener"]


class UnsafeStateError(GpufleetError, PermissionError):
    """A state folder is not safe to use: someone else owns it or may write to it, or it is no folder."""


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _group_is_mine_alone(gid: int) -> bool:
    """Whether nobody but the current user belongs to group ``gid`` (a user-private group)."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.geteuid()).pw_name
        if set(grp.getgrgid(gid).gr_mem) - {me}:
            return False
        return not any(u.pw_gid == gid and u.pw_uid != os.geteuid() for u in pwd.getpwall())
    except (KeyError, ImportError, OSError):
        return False


def _check_parent(folder: str, st: os.stat_result, target: Path, what: str) -> None:
    """Refuse ``folder`` (a folder on the way to ``target``) when someone else could swap what is in it."""
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise UnsafeStateError(
            f"{what} {target} lies inside {folder}, which is owned by {_owner_name(st.st_uid)}: that user can "
            f"rename {target} away during a call and put a folder of their own in its place, whose pickled results "
            f"gpufleet would read. Use a folder whose every parent is yours (or root's): set {envcontract.HOME} "
            "(or runs_dir)."
        )
    others = st.st_mode & stat.S_IWOTH
    group = st.st_mode & stat.S_IWGRP and not _group_is_mine_alone(st.st_gid)
    if (others or group) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeStateError(
            f"{what} {target} lies inside {folder}, which {'others' if others else 'its group'} may write to "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): they can rename {target} away during a call and put a folder "
            "of their own in its place, whose pickled results gpufleet would read. Use a folder whose parents only "
            f"you can write to (set {envcontract.HOME} or runs_dir), or make {folder} sticky (chmod +t, as /tmp is)."
        )


def check_parents(path: str | os.PathLike[str], what: str = "gpufleet's state folder") -> None:
    """Check every existing folder on the way to ``path`` (links followed, each link's folder too).

    Raises:
        UnsafeStateError: one of them belongs to another user (not root) or may be written by
            others (and is not sticky), so the folder at ``path`` could be swapped under it.
    """
    target = Path(os.path.abspath(path))
    parts = deque(target.parts[1:])
    current = "/"
    _check_parent(current, os.stat(current), target, what)
    links = 0
    while parts:
        name = parts.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        nxt = os.path.join(current, name)
        try:
            st = os.lstat(nxt)
        except (FileNotFoundError, NotADirectoryError):
            return  # the rest is created by us, inside a folder that was checked
        except OSError as e:  # a folder on the way we may not enter
            raise UnsafeStateError(f"{what} {target} cannot be reached: {nxt}: {e.strerror or e}. Set "
                                   f"{envcontract.HOME} (or runs_dir) to a folder of yours.") from e  # fmt: skip
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > 40:
                raise UnsafeStateError(f"{what} {target}: too many links on the way to it.")
            dest = os.readlink(nxt)
            if os.path.isabs(dest):
                current = "/"
            parts.extendleft(reversed(Path(dest).parts[1:] if os.path.isabs(dest) else Path(dest).parts))
            continue
        if not parts:
            return  # the last name, after links: the folder itself, which private_dir checks
        if not stat.S_ISDIR(st.st_mode):
            return  # mkdir names the file in its error
        current = nxt
        _check_parent(current, st, target, what)


def private_dir(path: str | os.PathLike[str], what: str = "gpufleet's state folder") -> Path:
    """Create ``path`` (0700) or check an existing one; returns it.

    Raises:
        UnsafeStateError: ``path`` is a file, belongs to another user, or group/others may
            write to it, or so may they to a folder on the way (:func:`check_parents`); or it
            cannot be created or written. Nothing was read from it.
    """
    p = Path(path)
    check_parents(p, what)
    try:
        p.mkdir(parents=True, mode=0o700)
        os.chmod(p, 0o700)  # mkdir's mode is filtered by the umask
        return p
    except FileExistsError:
        pass
    except NotADirectoryError as e:
        raise UnsafeStateError(f"{what} {p} cannot be created: a part of its path is a file ({e}). Set {envcontract.HOME} "
                               "(or runs_dir) to a folder.") from e  # fmt: skip
    except OSError as e:  # no permission, a read-only file system, ...
        raise UnsafeStateError(f"{what} {p} cannot be created: {e.strerror or e}. Set {envcontract.HOME} (or runs_dir) "
                               "to a folder you can write to.") from e  # fmt: skip
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        st = p.stat()
        if st.st_uid != os.geteuid():
            raise UnsafeStateError(
                f"{what} {p} is a link to a folder owned by {_owner_name(st.st_uid)}, not by you; gpufleet reads "
                "pickled results from it, so that user could run code as you. Use a folder of your own."
            )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStateError(f"{what} {p} is not a folder. Set {envcontract.HOME} (or runs_dir) to a folder.")
    if st.st_uid != os.geteuid():
        raise UnsafeStateError(
            f"{what} {p} is owned by {_owner_name(st.st_uid)}, not by you ({_owner_name(os.geteuid())}); gpufleet "
            "reads pickled results and code from it, so that user could run code as you. Use a folder of your "
            f"own ({envcontract.HOME}, runs_dir)."
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
        raise UnsafeStateError(f"{what} {p} is read-only for you. Set {envcontract.HOME} (or runs_dir) to a folder you "
                               "can write to.")  # fmt: skip
    return p


def private_file_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that creates files 0600 (``open(p, "ab", opener=private_file_opener)``)."""
    return os.open(path, flags, 0o600)
