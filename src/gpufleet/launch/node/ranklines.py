"""Each rank's output in a node's log as whole lines, prefixed with the rank.

The ranks of a node command (``torchrun --nproc-per-node N ...``) share the node's log: written
straight into it, a line of one rank could be cut by another's (``print`` writes the text and
the newline separately). So the node guard asks torchrun to redirect each worker's stdout and
stderr into files of a private folder (``PET_REDIRECTS=3``, ``PET_LOG_DIR``: torchrun's own
``--redirects``/``--log-dir``, read from the environment), reads those files as they grow, and
writes every complete line into the node's log with a ``[rank N] `` prefix, several lines in
one write, never a partial one. When the command ends, what is left is written (a last line
without a newline gets one) and the folder is removed; the folder of a guard killed with SIGKILL
(named after its pid) is removed by the next guard that starts on the machine.

``N`` is the global rank, ``NODE_RANK * LOCAL_WORLD_SIZE + local rank``. Commands that do not
start their ranks through torchrun (a single process, ``accelerate``, ``deepspeed``) write to
the log as before. ``GPUFLEET_RANK_PREFIX=0``, or any of ``PET_REDIRECTS``, ``PET_TEE``,
``PET_LOG_DIR`` in the node's environment, leaves torchrun's output as it is.

Standard library only: the node guard imports it, also when a Ray node runs the guard by path.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping

if __package__:
    from . import envcontract
else:  # run by path (the node guard imports it so): this file's folder is the first entry of sys.path
    import envcontract  # type: ignore[no-redef]

_STREAMS = ("stdout.log", "stderr.log")
#: Largest single write: a pipe (a Ray node's log) takes up to this much at once without interleaving.
_WRITE_MAX = 4096
#: A line longer than this is written in parts (it is not held back for ever).
_LINE_MAX = 1 << 16
_LINE_END = re.compile(rb"(\r\n|\n|\r)")  # "\r" alone: a progress bar redrawing its line


_FOLDER_PREFIX = "gpufleet-ranks-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:  # a zombie holds its pid but nothing else
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sweep_dead_folders(root: str | None = None) -> int:
    """Remove the folders of guards that died without removing theirs (SIGKILL); returns how many.

    A folder is named after its guard's pid (``gpufleet-ranks-PID-XXXX``); one whose guard is gone
    is removed (folders of other users cannot be, and are left alone). A new pid that reuses a dead
    guard's keeps its folder until that process has ended too.
    """
    root = root or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_FOLDER_PREFIX):
            continue
        pid = name[len(_FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += not os.path.exists(path)
    return removed


class RankLines:
    """Copies torchrun's per-rank output files into ``out_fd``, one whole prefixed line at a time.

    Args:
        out_fd: where the lines go (the node's log: the guard's stdout).
        first_rank: global rank of this node's local rank 0.
        mask: applied to each line before it is written (hides secret values), or None.
        poll_s: how often the files are read while the command runs.
    """

    def __init__(
        self, out_fd: int, first_rank: int = 0, mask: Callable[[bytes], bytes] | None = None, poll_s: float = 0.05
    ) -> None:
        self.out_fd = out_fd
        self.first_rank = first_rank
        self.mask = mask
        self.poll_s = poll_s
        sweep_dead_folders()
        self.folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")  # 0700
        self._files: dict[str, tuple[object, bytes, bytearray]] = {}  # path -> (file, prefix, partial line)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_node(cls, environ: Mapping[str, str], out_fd: int, mask: Callable[[bytes], bytes] | None = None) -> RankLines | None:
        """A copier for the node whose environment is ``environ``; None when turned off."""
        if environ.get(envcontract.RANK_PREFIX, "1") == "0" or any(e in environ for e in envcontract.TORCHRUN_LOG_VARS):
            return None
        try:
            first = int(environ.get(envcontract.NODE_RANK, "0")) * int(environ.get(envcontract.LOCAL_WORLD_SIZE, "1"))
        except ValueError:
            first = 0
        return cls(out_fd, first, mask)

    def child_env(self) -> dict[str, str]:
        """What the command's environment gets: torchrun's redirection of every worker into the folder."""
        return {envcontract.PET_REDIRECTS: "3", envcontract.PET_LOG_DIR: self.folder}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpufleet-rank-lines", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True) -> None:
        """Once the command has ended: copy what is left (``drain``), then remove the folder."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if drain:
            self._copy(final=True)
        for f, _, _ in self._files.values():
            f.close()  # type: ignore[attr-defined]
        self._files.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self) -> None:
        while not self._done.wait(self.poll_s):
            try:
                self._copy(final=False)
            except Exception:  # never let the copier end the guard; the final pass tries again
                pass

    def _discover(self) -> None:
        """Open the per-rank files torchrun created since the last look (``.../attempt_K/<local rank>/stdout.log``)."""
        for root, _, names in os.walk(self.folder):
            local = os.path.basename(root)
            if not local.isdigit():
                continue
            for name in names:
                path = os.path.join(root, name)
                if name in _STREAMS and path not in self._files:
                    try:
                        f = open(path, "rb")  # noqa: SIM115 - closed in stop()
                    except OSError:
                        continue
                    prefix = f"[rank {self.first_rank + int(local)}] ".encode()
                    self._files[path] = (f, prefix, bytearray())

    def _copy(self, final: bool) -> None:
        self._discover()
        out: list[bytes] = []
        for path in sorted(self._files):
            f, prefix, partial = self._files[path]
            data = f.read()  # type: ignore[attr-defined]
            if not data and not (final and partial):
                continue
            partial += data
            pieces = _LINE_END.split(bytes(partial))  # text, end, text, end, ..., rest
            rest = pieces.pop()
            if not final and pieces and pieces[-1] == b"\r" and not rest:
                rest = pieces.pop(-2) + pieces.pop()  # a "\r" at the end may be the start of "\r\n"
            if rest and (final or len(rest) > _LINE_MAX):
                pieces += [rest, b"\n"]
                rest = b""
            partial[:] = rest
            for text, end in zip(pieces[::2], pieces[1::2], strict=True):
                out.append(prefix + (self.mask(text) if self.mask else text) + end)
        self._write(out)

    def _write(self, lines: list[bytes]) -> None:
        batch = b""
        for line in lines:
            if batch and len(batch) + len(line) > _WRITE_MAX:
                self._write_all(batch)
                batch = b""
            batch += line
        if batch:
            self._write_all(batch)

    def _write_all(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self.out_fd, data) :]
            except OSError:  # the reader is gone (a dead Ray actor): drop the output
                return
