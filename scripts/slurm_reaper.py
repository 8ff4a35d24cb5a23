"""The parent of a local Slurm cluster's daemons: starts them in the foreground, reaps, stops.

Run by ``scripts/slurm_local.sh start`` (standard library only, any Python 3):

    python3 slurm_reaper.py STATE_DIR -- NAME ARGV... -- NAME ARGV... ...

It makes itself a child subreaper, so the daemons' own children (``slurmstepd``, the job steps it
starts, whatever a job leaves behind) are reparented to it rather than to the machine's first
process, and reaps every one of them: no zombie outlives it. It writes its own pid to
``STATE_DIR/reaper.pid`` and each daemon's to ``STATE_DIR/NAME.pid``. On SIGTERM (``stop``) it
sends SIGTERM to the daemons, waits up to 10 s, then SIGKILLs every process left in its tree
(found through ``/proc``) and exits once all of them are reaped. If a daemon dies on its own, the
reaper records it in ``STATE_DIR/reaper.log`` and keeps the others running (``status`` names it); on
SIGUSR1 (``revive``) it starts every daemon that is not running again.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _log(state: str, message: str) -> None:
    with open(os.path.join(state, "reaper.log"), "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {message}\n")


def _descendants(root: int) -> list[int]:
    """Every process under ``root`` (by parent pid, read from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            parent[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


def _reap() -> list[int]:
    ended = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append(pid)


def main(argv: list[str]) -> int:
    state = argv[0]
    groups: list[list[str]] = []
    for arg in argv[1:]:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        _log(state, "could not become a child subreaper; orphans go to the first process")
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    revive = False

    def on_usr1(signum: int, frame: object) -> None:
        nonlocal revive
        revive = True

    signal.signal(signal.SIGUSR1, on_usr1)
    daemons: dict[int, str] = {}
    names = [g[0] for g in groups]
    log = open(os.path.join(state, "daemons.out"), "ab")  # noqa: SIM115 - for the reaper's life

    def launch(name: str, cmd: list[str]) -> None:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        daemons[proc.pid] = name
        with open(os.path.join(state, f"{name}.pid"), "w") as f:
            f.write(f"{proc.pid}\n")
        if name == "munged":  # slurm's daemons need munge's socket
            for _ in range(100):
                if os.path.exists(os.path.join(state, "munge", "munge.socket")):
                    break
                time.sleep(0.05)

    for group in groups:
        launch(group[0], group[1:])
    with open(os.path.join(state, "reaper.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    while not stopping:
        for pid in _reap():
            if pid in daemons:
                _log(state, f"{daemons.pop(pid)} (pid {pid}) exited")
        if revive:
            revive = False
            for group in groups:
                if group[0] not in daemons.values():
                    _log(state, f"starting {group[0]} again")
                    launch(group[0], group[1:])
        time.sleep(0.2)
    for pid in list(daemons):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for pid in _reap():
            daemons.pop(pid, None)
        if not daemons:
            break
        time.sleep(0.1)
    while True:  # everything left in the tree: steps, their tasks, stragglers
        left = _descendants(os.getpid())
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        if not left:
            break
        time.sleep(0.05)
    for name in [*names, "reaper"]:
        try:
            os.unlink(os.path.join(state, f"{name}.pid"))
        except FileNotFoundError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
