"""Stopping one process group with the standard library only: signal it, TERM, grace, KILL.

The node guard (``guard.py``) and the environment builder (``envs.py``) run by file path on
Ray nodes and must start in milliseconds, so they cannot use psutil or gpufleet's process-tree
stopper (:func:`gpufleet.launch.proctree.stop_tree`); this module is what they share. Import
it as ``gpufleet.launch.node.procgroup`` or, from a file run by path, as ``procgroup`` (its
folder is then the first entry of ``sys.path``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member."""
    return signal_group(pgid, 0)


def terminate_group(
    pgid: int, grace_period_s: float, finished: Callable[[], bool] | None = None, poll_s: float = 0.1
) -> None:
    """SIGTERM to group ``pgid``, up to ``grace_period_s`` for it to finish, then SIGKILL to what is left.

    Args:
        pgid: the process group.
        grace_period_s: how long SIGTERM may take.
        finished: says when the wait may end early (default: when the group has no member left).
        poll_s: how often ``finished`` is asked.
    """
    if not signal_group(pgid, signal.SIGTERM):
        return
    done = finished if finished is not None else (lambda: not group_alive(pgid))
    deadline = time.monotonic() + grace_period_s
    while time.monotonic() < deadline and not done():
        time.sleep(poll_s)
    signal_group(pgid, signal.SIGKILL)
