"""Terminal views of runs: the live ``--watch`` stream, run tables, log tails.

On a terminal they use rich (a live status line under the streamed logs, tables); when the
output is a pipe or a file they print plain lines that scripts can parse. A little past 400
lines: one concern, how runs and their logs look on a terminal.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from .formats import fmt_duration, fmt_time  # noqa: F401 - also used by the other views
from .liveline import STATE_STYLE as _STATE_STYLE
from .liveline import RankProgress, render_status
from .liveness import get_run
from .store import TERMINAL_STATES, AttemptRecord, RunRecord, RunStore


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is an interactive terminal (and colours are not switched off)."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def status_line(run: RunRecord) -> str:
    """One line describing where a run stands."""
    attempt = run.attempt
    parts = [f"run {run.id}", run.state]
    if attempt:
        parts.append(f"attempt {attempt}/{run.max_attempts}")
    parts.append(fmt_duration(run.duration_s))
    if run.state in TERMINAL_STATES and run.message:
        parts.append(run.message)
    return " | ".join(parts)


# ------------------------------------------------------------------ log tailing


class LogFollower:
    """Reads new complete lines from the log files of a run as they grow."""

    def __init__(self, run: RunRecord, node: int | None = None, attempt: int | None = None) -> None:
        self.node = node
        self.attempt = attempt
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._announced: set[int] = set()
        self.run_dir = Path(run.run_dir)

    def attempt_files(self, run: RunRecord, a: AttemptRecord) -> list[tuple[str, Path]]:
        """``(prefix, path)`` of each log file of attempt ``a``: ``[node N] `` or ``[rank N] ``."""
        nodes = [self.node] if self.node is not None else range(run.log_units)
        return [(f"[{run.log_name} {n}] ", Path(a.log_dir) / f"{run.log_name}-{n}.log") for n in nodes]

    def read(self, run: RunRecord, final: bool = False) -> Iterator[tuple[str, str]]:
        """New ``(prefix, line)`` pairs; ``final`` also yields an unterminated last line.

        Each attempt's separator comes before its lines (as :func:`log_lines` writes them); an
        attempt read while it looked like the only one keeps its lines without a late separator.
        """
        if self.attempt is None and self.node is None:
            yield from self._new_lines("[setup] ", self.run_dir / "environment.log", final)
        for a in run.attempts:
            if self.attempt is not None and a.attempt != self.attempt:
                continue
            if self.attempt is None and a.attempt not in self._announced:
                self._announced.add(a.attempt)
                if has_separators(run):
                    yield "", separator(run, a)
            for prefix, path in self.attempt_files(run, a):
                yield from self._new_lines(prefix, path, final)

    def _new_lines(self, prefix: str, path: Path, final: bool) -> Iterator[tuple[str, str]]:
        """The complete lines ``path`` got since the last read (``final``: the unterminated last one too)."""
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
                self._offsets[path] = f.tell()
        except FileNotFoundError:
            return
        buf = self._partial.pop(path, b"") + data
        lines = buf.split(b"\n")
        rest = lines.pop()
        if rest and final:
            lines.append(rest)
        elif rest:
            self._partial[path] = rest
        for line in lines:
            yield prefix, line.decode("utf-8", "replace").rstrip("\r")


def has_separators(run: RunRecord) -> bool:
    """Whether a run's logs show a ``--- attempt N/M ---`` line before each attempt.

    A workload that may retry shows them from its first attempt on (a follower prints attempt 1's
    separator before its lines, not once attempt 2 has come); any run that had several attempts
    does. (A call's record is one attempt; its retries are records of their own.)
    """
    return (not run.is_call and run.max_attempts > 1) or len(run.attempts) > 1


def separator(run: RunRecord, a: AttemptRecord) -> str:
    """The line before attempt ``a``'s logs."""
    return f"--- attempt {a.attempt}/{max(run.max_attempts, len(run.attempts))} ---"


def log_lines(run: RunRecord, node: int | None = None, attempt: int | None = None,
              num_lines: int | None = None) -> Iterator[tuple[str, str]]:
    """``(prefix, line)`` of a run's logs as they are now: what :func:`follow_logs` writes of a
    finished run (the same files, prefixes and attempt separators), each file cut to its last
    ``num_lines`` lines."""
    follower = LogFollower(run, node=node, attempt=attempt)
    if attempt is None and node is None:
        yield from (("[setup] ", line) for line in tail_lines(follower.run_dir / "environment.log", num_lines))
    for a in run.attempts:
        if attempt is not None and a.attempt != attempt:
            continue
        if attempt is None and has_separators(run):
            yield "", separator(run, a)
        for prefix, path in follower.attempt_files(run, a):
            for line in tail_lines(path, num_lines):
                yield prefix, line


#: Bytes read at a time by :func:`iter_lines` and :func:`tail_lines`.
LOG_BLOCK = 1 << 16

#: A line ends at ``\n``, ``\r\n`` or a lone ``\r`` (progress bars), as ``bytes.splitlines``.
_LINE_END = re.compile(rb"\r\n|\r|\n")


def _decode(line: bytes) -> str:
    return line.rstrip(b"\r\n").decode("utf-8", "replace")


def iter_lines(path: Path, block_size: int = LOG_BLOCK) -> Iterator[str]:
    """The lines of a file, read ``block_size`` bytes at a time (nothing for a missing file)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        rest = b""
        while block := f.read(block_size):
            lines = (rest + block).splitlines(keepends=True)
            # an unterminated last line, or a last "\r" that may be the start of "\r\n", waits
            rest = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
            for line in lines:
                yield _decode(line)
        for line in rest.splitlines():
            yield _decode(line)


def tail_lines(path: Path, num_lines: int | None, block_size: int = LOG_BLOCK) -> list[str]:
    """The last ``num_lines`` lines of a file (all of them for None).

    Reads blocks backwards from the end until it holds more than ``num_lines`` line ends, so
    memory follows the size of those lines, not of the file.
    """
    if num_lines is None:
        return list(iter_lines(path, block_size))
    if num_lines <= 0:
        return []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    with f:
        pos = f.seek(0, os.SEEK_END)
        blocks: list[bytes] = []
        ends = 0
        while pos > 0 and ends <= num_lines:
            size = min(block_size, pos)
            pos -= size
            f.seek(pos)
            block = f.read(size)
            ends += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
            if blocks and block.endswith(b"\r") and blocks[-1].startswith(b"\n"):
                ends -= 1  # one "\r\n", cut in two by the blocks
            blocks.append(block)
    data = b"".join(reversed(blocks))
    if pos > 0:  # the first line read may be cut: keep what follows its end
        first_end = _LINE_END.search(data)
        data = data[first_end.end():] if first_end else b""
    return [_decode(line) for line in data.splitlines()[-num_lines:]]


# ------------------------------------------------------------------ watch


def watch(
    store: RunStore,
    run_id: str,
    out: IO[str] | None = None,
    status_out: IO[str] | None = None,
    poll_s: float = 0.25,
    node: int | None = None,
    mlflow_shown: set[str] | None = None,
) -> RunRecord:
    """Stream a run's logs with its status until it ends; returns the final record.

    Each attempt's MLflow run is shown once it is known (those in ``mlflow_shown`` were already).
    """
    out = out or sys.stdout
    status_out = status_out or sys.stderr
    run = get_run(store, run_id)
    follower = LogFollower(run, node=node)
    shown = set(mlflow_shown or ())
    if is_terminal(status_out) and status_out is sys.stderr and out is sys.stdout and is_terminal(out):
        return _watch_rich(store, run, follower, poll_s, shown)
    last_status = ""

    def emit_status(r: RunRecord) -> None:
        nonlocal last_status
        key = f"{r.state}/{r.attempt}"
        if key != last_status:
            last_status = key
            status_out.write(f"gpufleet: {status_line(r)}\n")
            status_out.flush()
        for line in _new_mlflow_lines(r, shown):
            status_out.write(f"gpufleet: {line}\n")
            status_out.flush()

    emit_status(run)
    while True:
        done = run.state in TERMINAL_STATES
        for prefix, line in follower.read(run, final=done):
            out.write(prefix + line + "\n")
        out.flush()
        emit_status(run)
        if done:
            return run
        time.sleep(poll_s)
        run = _still_there(store, run)


def _still_there(store: RunStore, run: RunRecord) -> RunRecord:
    """The run's record again; a clear error (no traceback) when its row was deleted meanwhile."""
    from .store import RunNotFoundError

    try:
        return get_run(store, run.id)
    except RunNotFoundError:
        raise RunNotFoundError(
            f"run {run.id} was removed from the run store while it was followed; what it wrote is in {run.run_dir}"
        ) from None


def _watch_rich(store: RunStore, run: RunRecord, follower: LogFollower, poll_s: float,
                shown: set[str] | None = None) -> RunRecord:  # fmt: skip
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console()
    progress = RankProgress()

    def render(r: RunRecord) -> object:
        return render_status(r, progress)

    with Live(render(run), console=console, refresh_per_second=8, transient=False) as live:
        while True:
            done = run.state in TERMINAL_STATES
            for prefix, line in follower.read(run, final=done):
                live.console.print(Text(prefix, style="dim") + Text(line), soft_wrap=True)
            for line in _new_mlflow_lines(run, shown if shown is not None else set()):
                live.console.print(Text(line, style="dim"), soft_wrap=True)
            live.update(render(run))
            if done:
                return run
            time.sleep(poll_s)
            run = _still_there(store, run)


def follow_logs(
    store: RunStore,
    run_id: str,
    write: Callable[[str, str], None],
    node: int | None = None,
    attempt: int | None = None,
    poll_s: float = 0.25,
    status_line: bool = False,
) -> RunRecord:
    """Call ``write(prefix, line)`` for each new log line until the run ends.

    With ``status_line`` (a terminal), a live status line of the run stays under the lines
    (rich's ``Live``; ``write`` then goes through its redirected ``sys.stdout``).
    """
    run = get_run(store, run_id)
    follower = LogFollower(run, node=node, attempt=attempt)
    live = None
    if status_line:
        from rich.console import Console
        from rich.live import Live

        progress = RankProgress()
        live = Live(render_status(run, progress), console=Console(), refresh_per_second=8, transient=True)  # type: ignore[arg-type]
        live.start()
    try:
        while True:
            done = run.state in TERMINAL_STATES
            for prefix, line in follower.read(run, final=done):
                write(prefix, line)
            if live is not None:
                live.update(render_status(run, progress))  # type: ignore[arg-type]
            if done:
                return run
            time.sleep(poll_s)
            run = _still_there(store, run)
    finally:
        if live is not None:
            live.stop()


# ------------------------------------------------------------------ tables


def runs_table(runs: list[RunRecord], out: IO[str] | None = None) -> None:
    """Print runs as a table (rich on a terminal, tab-separated lines otherwise)."""
    out = out or sys.stdout
    headers = ["ID", "STATE", "KIND", "NAME", "NODES", "WORLD", "TRIES", "CREATED", "TIME"]
    rows = [
        [
            r.id,
            r.state,
            r.kind,
            r.experiment,
            str(r.num_nodes),
            str(r.world_size),
            f"{r.attempt}/{r.max_attempts}",
            fmt_time(r.created_at)[5:],  # MM-dd HH:MM:SS
            fmt_duration(r.duration_s),
        ]
        for r in runs
    ]
    if is_terminal(out):
        from rich.console import Console
        from rich.table import Table

        table = Table(box=None, header_style="bold")
        id_width = max((len(r[0]) for r in rows), default=2)
        for h in headers:
            # ids are what users copy: never cut or wrapped
            table.add_column(h, no_wrap=h in ("ID", "STATE", "CREATED"), min_width=id_width if h == "ID" else None)
        for row in rows:
            table.add_row(*row[:1], f"[{_STATE_STYLE.get(row[1], '')}]{row[1]}[/]", *row[2:])
        Console(file=out).print(table)
        return
    out.write("\t".join(headers) + "\n")
    for row in rows:
        out.write("\t".join(row) + "\n")


def run_details(run: RunRecord, out: IO[str] | None = None) -> None:
    """Print one run's details: state, times, config summary, attempts and log paths."""
    out = out or sys.stdout
    if run.is_call:
        from .ps import call_details

        call_details(run, out)
        return
    c = run.config.get("compute", {})
    lines = [
        ("id", run.id),
        ("state", run.state),
        ("experiment", run.experiment),
        ("compute", f"{run.num_nodes} node(s) x {c.get('accelerator_type')} (world size {run.world_size})"
                    + (", command run once as a Ray driver" if c.get("ray_driver") else "")
                    + (", on Slurm" if c.get("cluster") == "slurm" else "")),
        ("created", fmt_time(run.created_at)),
        ("started", fmt_time(run.started_at)),
        ("ended", fmt_time(run.ended_at)),
        ("duration", fmt_duration(run.duration_s)),
        ("attempts", f"{run.attempt}/{run.max_attempts}"),
        ("exit code", "-" if run.exit_code is None else str(run.exit_code)),
        ("message", run.message or "-"),
        ("idempotency key", run.idempotency_key or "-"),
        ("code version", _code_version(run)),
        ("run dir", run.run_dir),
        ("workload", run.workload_path or "-"),
        ("supervisor pid", "-" if run.supervisor_pid is None else str(run.supervisor_pid)),
    ]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        out.write(f"{k:<{width}}  {v}\n")
    for a in run.attempts:
        out.write(
            f"attempt {a.attempt}: {a.state}  started {fmt_time(a.started_at)}  "
            f"ended {fmt_time(a.ended_at)}  exit code {'-' if a.exit_code is None else a.exit_code}  "
            f"mlflow run {a.mlflow_run_id or '-'}\n"
        )
        if a.mlflow_run_id:
            out.write(f"  mlflow: {_mlflow_link(run, a.mlflow_run_id)}\n")
        if a.message:
            out.write(f"  {a.message}\n")
        jobs = sorted({str(n["slurm_job_id"]) for n in (a.nodes or []) if n.get("slurm_job_id")})
        if jobs:
            out.write(f"  slurm job {', '.join(jobs)}\n")
        for n in range(run.command_nodes):
            out.write(f"  node {n} log: {Path(a.log_dir) / f'node-{n}.log'}\n")


# ------------------------------------------------------------------ code version and MLflow


def _code_version(run: RunRecord) -> str:
    from ..codeversion import describe

    return describe(run.config.get("code_version"))


def _mlflow_link(run: RunRecord, mlflow_run_id: str) -> str:
    """How to open one of the run's MLflow runs (its store as recorded at submission, else this shell's)."""
    from ..tracking.links import run_link

    where = run.config.get("mlflow_tracking") or {}
    uri = where.get("tracking_uri")
    if not uri:
        from ..tracking.runs import default_tracking_uri

        uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    return run_link(uri, mlflow_run_id, where.get("experiment_id"))


def mlflow_links(run: RunRecord, first: dict[str, object] | None = None) -> list[dict[str, object]]:
    """``{"attempt", "run_id", "link"}`` of each attempt's MLflow run (``first``: the first one, before its attempt started)."""
    out: list[dict[str, object]] = [
        {"attempt": a.attempt, "run_id": a.mlflow_run_id, "link": _mlflow_link(run, a.mlflow_run_id)}
        for a in run.attempts
        if a.mlflow_run_id
    ]
    if first is not None and not any(o["run_id"] == first.get("run_id") for o in out):
        out.insert(0, dict(first))
    return out


def _new_mlflow_lines(run: RunRecord, shown: set[str]) -> list[str]:
    """A line for each attempt's MLflow run not shown yet (recorded in ``shown``)."""
    lines = []
    for a in run.attempts:
        if a.mlflow_run_id and a.mlflow_run_id not in shown:
            shown.add(a.mlflow_run_id)
            lines.append(f"attempt {a.attempt}: MLflow run {a.mlflow_run_id}: {_mlflow_link(run, a.mlflow_run_id)}")
    return lines
