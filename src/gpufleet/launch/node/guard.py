"""Leader of one node's process group: runs the command and stops the group if the supervisor dies.

It is also the subreaper of what the command starts (:mod:`gpufleet.launch.node.adopted`): a
daemon that double-forks out of the group stays below the guard and is stopped with it.

``python -m gpufleet.launch.node.guard -- bash -c COMMAND`` is started by the supervisor in a new
session. It waits for the command and exits with its exit code. If the supervisor goes away
(even by SIGKILL) it notices within a fraction of a second, terminates every process of its
group (the command and whatever it started), and kills those that do not stop.

When the node's environment holds secrets (their names in ``GPUFLEET_SECRETS``), the command's
output goes through the guard, which writes it on with every secret value masked as ``***``
(:class:`Masker`); otherwise the command writes to the node's log itself.

The ranks torchrun starts write into files of a private folder, and the guard writes their
lines into the node's log whole, each prefixed with its rank (:mod:`gpufleet.launch.node.ranklines`).

Kept free of third-party imports so it starts in a few milliseconds; a Ray node runs it by
file path (``python .../launch/node/guard.py``), so it imports its one helper either way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping

if __package__:
    from . import envcontract
    from .adopted import become_subreaper, stop_descendants, wait_descendants
    from .procgroup import terminate_group
    from .ranklines import RankLines
else:  # run by path: this file's folder is the first entry of sys.path
    import envcontract  # type: ignore[no-redef]
    from adopted import become_subreaper, stop_descendants, wait_descendants  # type: ignore[no-redef]
    from procgroup import terminate_group  # type: ignore[no-redef]
    from ranklines import RankLines  # type: ignore[no-redef]

_POLL_S = 0.25
_GRACE_S = 5.0
MASK = b"***"
#: Seconds the guard keeps copying output after the command exited (what it started may hold the pipe).
_DRAIN_S = 2.0
#: Seconds the ranks that outlive their launcher get to finish a preemption's checkpoint (the
#: scheduler's grace time usually ends them sooner).
_CHECKPOINT_WAIT_S = 300.0
#: The faults' ``sitecustomize`` arms them in every rank the command starts (``gpufleet/fault_boot``).
FAULT_BOOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fault_boot")


def fault_boot_env(env: Mapping[str, str]) -> dict[str, str]:
    """With faults to rehearse: ``PYTHONPATH`` with :data:`FAULT_BOOT` first, so that every rank
    arms them as it starts, also one whose code never calls into gpufleet. Otherwise nothing."""
    if not env.get(envcontract.FAULTS):
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in [FAULT_BOOT, env.get("PYTHONPATH", "")] if p)}


class Masker:
    """Masks secret values in a stream of bytes that may cut a value anywhere.

    :meth:`feed` returns what can be written now: every whole value masked, and held back only
    the end that could be the start of a value (so output is not delayed otherwise).
    """

    def __init__(self, values: list[bytes]) -> None:
        self.values = sorted({v for v in values if v}, key=len, reverse=True)
        self._held = b""

    def _partial(self, data: bytes) -> int:
        """Length of the longest end of ``data`` that is the start of a value (but not a whole one)."""
        best = 0
        for value in self.values:
            i = data.find(value[:1], max(0, len(data) - len(value) + 1))
            while i != -1 and len(data) - i > best:
                if value.startswith(data[i:]):
                    best = len(data) - i
                    break
                i = data.find(value[:1], i + 1)
        return best

    def feed(self, data: bytes) -> bytes:
        data = self._held + data
        for value in self.values:
            data = data.replace(value, MASK)
        keep = self._partial(data)
        self._held = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


def secret_values(environ: dict[str, str] | os._Environ[str]) -> list[bytes]:
    """The values of the variables named in ``GPUFLEET_SECRETS``."""
    names = [n for n in environ.get(envcontract.SECRETS, "").split(",") if n]
    return [os.fsencode(environ[n]) for n in names if environ.get(n)]


def _copy_masked(pipe: int, masker: Masker) -> None:
    """Copy the command's output to this process's stdout, masked, until the pipe closes."""
    out = sys.stdout.fileno()

    def write(data: bytes) -> None:
        while data:
            try:
                data = data[os.write(out, data) :]
            except OSError:  # the reader is gone (a dead Ray actor): keep draining the pipe
                return

    while True:
        try:
            chunk = os.read(pipe, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        write(masker.feed(chunk))
    write(masker.flush())


def _line_masker(values: list[bytes]) -> Callable[[bytes], bytes]:
    """Masks the secret values in one whole line (a rank's line, see :mod:`ranklines`)."""
    masker = Masker(values)

    def mask(line: bytes) -> bytes:
        return masker.feed(line) + masker.flush()

    return mask


def _stop_group() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The guard is a member of the group it stops, so it cannot see the others leave: they get
    # the whole grace period, then SIGKILL takes the guard with them.
    terminate_group(os.getpgid(0), _GRACE_S, finished=lambda: False)


#: Set when this guard got SIGTERM (TERM/INT reach the whole group; the guard outlives them).
_TERMINATED: list[bool] = []


def _checkpointing_for_the_scheduler() -> bool:
    """In a Slurm workload, the scheduler's SIGTERM came (to this guard, or a rank marked it), not gpufleet's cancel.

    A rank marks it only once its main thread runs Python again (not inside a collective), which
    may be after torchrun has gone: this guard's own SIGTERM says it at once.
    """
    path = os.environ.get(envcontract.PREEMPT_FILE)
    if not path or os.path.exists(os.path.join(os.path.dirname(path), "canceled.json")):
        return False
    if _TERMINATED:
        return True
    try:
        with open(path) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("signal") == "TERM"


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--``; returns its exit code (128 + signal when killed)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m gpufleet.launch.node.guard -- COMMAND...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    parent = os.getppid()
    become_subreaper()  # a daemon the command double-forks stays below the guard (launch/node/adopted.py)
    # TERM/INT reach the whole group from the supervisor; the guard outlives the command
    # so that its exit code is reported.
    signal.signal(signal.SIGTERM, lambda *_: _TERMINATED.append(True))
    signal.signal(signal.SIGINT, lambda *_: None)
    os.environ.update(fault_boot_env(os.environ))
    secrets = secret_values(os.environ)
    rank_lines = RankLines.for_node(os.environ, sys.stdout.fileno(), _line_masker(secrets) if secrets else None)
    if rank_lines is not None:  # torchrun's ranks write into files; their lines reach the log whole
        os.environ.update(rank_lines.child_env())
        rank_lines.start()
    copier = None
    if secrets:  # the output goes through the guard, which masks the values
        read_end, write_end = os.pipe()
        child = subprocess.Popen(command, stdout=write_end, stderr=write_end)
        os.close(write_end)
        copier = threading.Thread(target=_copy_masked, args=(read_end, Masker(secrets)), daemon=True)
        copier.start()
    else:
        child = subprocess.Popen(command)
    while True:
        try:
            code = child.wait(timeout=_POLL_S)
            if copier is not None:
                copier.join(_DRAIN_S)  # the last lines; a process the command left behind may hold the pipe
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
            stop_descendants(_GRACE_S)  # children that left the group (setsid) or were adopted
            _stop_group()
            return 1
    if _checkpointing_for_the_scheduler() and wait_descendants(0.0) is False:
        # torchrun ends at the scheduler's SIGTERM (a second one cuts its own wait for the ranks
        # short); its ranks are saving the preemption's checkpoint: let them end on their own
        print("gpufleet: the scheduler is ending the job; this node ends once its ranks have saved their "
              "checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        wait_descendants(_CHECKPOINT_WAIT_S)
    stop_descendants()  # what the command left running below the guard (daemons it double-forked)
    if rank_lines is not None:
        rank_lines.stop()  # the ranks' last lines, then the folder goes
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
