"""Leader of one node's process group: runs the command and stops the group if the supervisor dies.

``python -m gpufleet.workload.guard -- bash -c COMMAND`` is started by the supervisor in a new
session. It waits for the command and exits with its exit code. If the supervisor goes away
(even by SIGKILL) it notices within a fraction of a second, terminates every process of its
group (the command and whatever it started), and kills those that do not stop.

The ranks torchrun starts write into files of a private folder, and the guard writes their
lines into the node's log whole, each prefixed with its rank (:mod:`gpufleet.workload.ranklines`).

Kept free of third-party imports so it starts in a few milliseconds; a Ray node runs it by
file path (``python .../workload/guard.py``), so it imports its one helper either way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

if __package__:
    from .procgroup import terminate_group
    from .ranklines import RankLines
else:  # run by path: this file's folder is the first entry of sys.path
    from procgroup import terminate_group  # type: ignore[no-redef]
    from ranklines import RankLines  # type: ignore[no-redef]

_POLL_S = 0.25
_GRACE_S = 5.0


def _stop_group() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The guard is a member of the group it stops, so it cannot see the others leave: they get
    # the whole grace period, then SIGKILL takes the guard with them.
    terminate_group(os.getpgid(0), _GRACE_S, finished=lambda: False)


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--``; returns its exit code (128 + signal when killed)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m gpufleet.workload.guard -- COMMAND...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    parent = os.getppid()
    # TERM/INT reach the whole group from the supervisor; the guard outlives the command
    # so that its exit code is reported.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    rank_lines = RankLines.for_node(os.environ, sys.stdout.fileno())
    if rank_lines is not None:  # torchrun's ranks write into files; their lines reach the log whole
        os.environ.update(rank_lines.child_env())
        rank_lines.start()
    child = subprocess.Popen(command)
    while True:
        try:
            code = child.wait(timeout=_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # the supervisor died: we were re-parented
            try:  # stderr may be a pipe to the dead parent (a Ray actor): never let that stop us
                print("gpufleet: the run's supervisor died; stopping this node", file=sys.stderr, flush=True)
            except OSError:
                pass
            if rank_lines is not None:
                rank_lines.stop()
            _stop_group()
            return 1
    if rank_lines is not None:
        rank_lines.stop()  # the ranks' last lines, then the folder goes
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
