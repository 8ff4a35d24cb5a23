"""What the live view shows, read from what gpufleet already collects about a run.

A :class:`RunWatcher` reads, each time it is asked, the ranks' progress records
(``progress-R.json``, :mod:`gpufleet.launch.progress`: step, total, time), the metrics rank 0
logged (``metrics-0.jsonl``, :mod:`gpufleet.live.feed`), the last line of each rank's log, the
controller's last status (which ranks returned or failed) and, on GPUs, NVML's utilisation and
memory of the run's GPUs; on CPU ranks, each rank's CPU share and memory (psutil). It turns
them into a frozen :class:`Snapshot` that the views (:mod:`gpufleet.live.html`,
:mod:`gpufleet.live.text`) render. Everything read is bounded in size and checked for its type:
a record it does not understand (an older or newer writer, a torn line) is skipped, never
trusted. Standard library, psutil and nvidia-ml-py only.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .feed import METRICS_FILE

STARTING, RUNNING, DONE, FAILED = "starting", "running", "done", "failed"
#: How far back the steps/s of a rank are measured.
RATE_WINDOW_S = 10.0
#: Points kept per metric (older ones are thinned, every second one dropped).
MAX_POINTS = 2000
_LOG_TAIL_BYTES = 4096
_METRICS_READ_BYTES = 1 << 20
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class RankView:
    """One rank as the view shows it."""

    rank: int
    state: str = STARTING
    step: int = 0
    total: int | None = None
    rate: float | None = None  # steps per second over the last seconds
    last_line: str = ""
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    error: str = ""


@dataclass(frozen=True)
class GPUView:
    """One GPU of the run, as NVML reports it."""

    index: int
    name: str
    util_percent: float | None
    mem_used: int | None
    mem_total: int | None


@dataclass(frozen=True)
class Snapshot:
    """The run at one moment."""

    run_id: str
    attempt: int
    elapsed_s: float
    ranks: tuple[RankView, ...]
    metrics: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    gpus: tuple[GPUView, ...] = ()
    state: str = "RUNNING"  # the run's state (RUNNING until the attempt ends)
    mlflow_run_id: str | None = None
    mlflow_link: str | None = None
    message: str = ""  # the end: the error's first line

    @property
    def step(self) -> int:
        """The slowest running rank's step (what the run as a whole has done)."""
        steps = [r.step for r in self.ranks if r.state != STARTING] or [0]
        return min(steps)

    @property
    def total(self) -> int | None:
        totals = [r.total for r in self.ranks if r.total]
        return max(totals) if totals else None

    @property
    def rate(self) -> float | None:
        rates = [r.rate for r in self.ranks if r.rate is not None and r.state == RUNNING]
        return min(rates) if rates else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current speed, when the loop told its total steps."""
        total, rate = self.total, self.rate
        if total is None or not rate or self.state != "RUNNING":
            return None
        return max(0.0, (total - self.step) / rate)

    def last_metrics(self) -> dict[str, float]:
        return {name: points[-1][1] for name, points in self.metrics.items() if points}

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.ranks:
            out[r.state] = out.get(r.state, 0) + 1
        return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _read_json(path: Path, max_bytes: int = 65536) -> Mapping[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            return None
        record = json.loads(data)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def last_line(path: Path) -> str:
    """The last non-empty line of a log file, control characters removed, at most 160 characters."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _LOG_TAIL_BYTES))
            data = f.read(_LOG_TAIL_BYTES)
    except OSError:
        return ""
    for raw in reversed(re.split(rb"\r\n|\n|\r", data)):
        text = _ANSI.sub("", raw.decode("utf-8", "replace")).strip()
        if text:
            return text if len(text) <= 160 else text[:159] + "…"
    return ""


class _GPUs:
    """NVML's utilisation and memory of some GPUs (physical indices); nothing when NVML is missing."""

    def __init__(self, indices: Sequence[int]) -> None:
        self._handles: list[tuple[int, str, Any]] = []
        self._nvml: Any = None
        if not indices:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            for i in indices:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                self._handles.append((i, name.decode() if isinstance(name, bytes) else str(name), h))
        except Exception:  # noqa: BLE001 - no driver here: no GPU rows
            self.close()

    def sample(self) -> tuple[GPUView, ...]:
        out = []
        for i, name, h in self._handles:
            util = used = total = None
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                used, total = int(mem.used), int(mem.total)
            except Exception:  # noqa: BLE001
                pass
            out.append(GPUView(i, name, util, used, total))
        return tuple(out)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
        self._nvml, self._handles = None, []


class RunWatcher:
    """Reads one attempt's run folder (and what the caller knows) into :class:`Snapshot` s.

    Args:
        run_id: the attempt's run id.
        folder: its run folder (progress records, metrics, logs).
        num_ranks: how many ranks it has.
        attempt: the attempt's number, shown from the second one.
        log_path: where rank R's log is (default ``folder/rank-R.log``).
        gpu_indices: the physical GPUs of the run on this machine (NVML); empty on CPU.
        pids: the ranks' process ids on this machine, in rank order (CPU share and memory).
        clock: wall-clock time (progress records carry the ranks' ``time.time()``).
    """

    def __init__(
        self, run_id: str, folder: Path, num_ranks: int, *, attempt: int = 1,
        log_path: Callable[[int], Path] | None = None, gpu_indices: Sequence[int] = (),
        pids: Sequence[int] = (), clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.run_id = run_id
        self.folder = Path(folder)
        self.num_ranks = num_ranks
        self.attempt = attempt
        self._log_path = log_path or (lambda r: self.folder / f"rank-{r}.log")
        self._clock = clock
        self._started = clock()
        self._history: dict[int, deque[tuple[float, int]]] = {}
        self._metrics: dict[str, list[tuple[int, float]]] = {}
        self._metrics_offset = 0
        self._gpus = _GPUs(gpu_indices)
        self._procs: list[Any] = []
        if pids and not gpu_indices:
            try:
                import psutil

                self._procs = [psutil.Process(pid) for pid in pids]
                for p in self._procs:
                    p.cpu_percent(None)  # the first reading starts the measurement
            except Exception:  # noqa: BLE001 - a rank already gone
                self._procs = []

    def close(self) -> None:
        self._gpus.close()

    # -- reading ------------------------------------------------------------------------
    def _progress(self, rank: int, known: Mapping[int, Mapping[str, Any]]) -> Mapping[str, Any] | None:
        record = _read_json(self.folder / f"progress-{rank}.json")
        other = known.get(rank)  # what the group handed the controller (a Ray actor's report, say)
        if other is not None and (record is None or (_number(other.get("time")) or 0) > (_number(record.get("time")) or 0)):
            record = other
        if record is None or (_number(record.get("time")) or 0) < self._started - 5:
            return None  # an earlier attempt's file
        return record

    def _rate(self, rank: int, when: float, step: int) -> float | None:
        history = self._history.setdefault(rank, deque())
        if not history or history[-1] != (when, step):
            history.append((when, step))
        while len(history) > 2 and history[0][0] < when - RATE_WINDOW_S:
            history.popleft()
        while len(history) > 2 and history[0][1] == history[1][1] != step:
            history.popleft()  # the steps/s count from when the steps began to move (not the start-up)
        first_t, first_step = history[0]
        if len(history) < 2 or when <= first_t:
            return None
        return max(0, step - first_step) / (when - first_t)

    def _read_metrics(self) -> None:
        path = self.folder / METRICS_FILE.format(rank=0)
        try:
            with open(path, "rb") as f:
                f.seek(self._metrics_offset)
                data = f.read(_METRICS_READ_BYTES)
        except OSError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._metrics_offset += end + 1
        for raw in data[: end + 1].splitlines():
            try:
                record = json.loads(raw)
                step = int(record["step"])
                values = record["metrics"]
            except (ValueError, KeyError, TypeError):
                continue
            if not isinstance(values, dict):
                continue
            for name, value in values.items():
                v = _number(value)
                if v is None or not isinstance(name, str):
                    continue
                points = self._metrics.setdefault(name[:64], [])
                points.append((step, v))
                if len(points) > MAX_POINTS:
                    points[:] = points[::2]

    def read(self, status: Any = None, *, state: str = "RUNNING", error: BaseException | None = None,
             mlflow_run_id: str | None = None, mlflow_link: str | None = None) -> Snapshot:  # fmt: skip
        """The run now; ``status`` is the controller's last :class:`~gpufleet.launch.group.GroupStatus`."""
        results = getattr(status, "results", {}) or {}
        failures = dict(getattr(status, "failures", {}) or {})
        failures.update(failures_of(error))
        known = getattr(status, "progress", {}) or {}
        self._read_metrics()
        usage = self._usage()
        ranks = []
        for rank in range(self.num_ranks):
            record = self._progress(rank, known)
            step = total = rate = None
            if record is not None:
                step = _number(record.get("step"))
                total = _number(record.get("total"))
                when = _number(record.get("time"))
                if step is not None and when is not None:
                    rate = self._rate(rank, when, int(step))
            line = last_line(self._log_path(rank))
            failure = failures.get(rank)
            if failure is not None and getattr(failure, "kind", "") != "stopped":
                what = FAILED
            elif rank in results:
                what = DONE
            elif failure is not None:
                what = "stopped"
            elif line or (record is not None and (step or record.get("seq") is not None)):
                what = RUNNING  # it printed, stepped or joined a process group (not still loading)
            else:
                what = STARTING
            cpu, rss = usage.get(rank, (None, None))
            ranks.append(RankView(
                rank, what, int(step or 0), int(total) if total else None, rate, line, cpu, rss,
                _failure_line(failure) if failure is not None else "",
            ))  # fmt: skip
        message = ""
        if error is not None:
            message = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            message = f"{type(error).__name__}: {message}"
        return Snapshot(
            self.run_id, self.attempt, self._clock() - self._started, tuple(ranks),
            {k: tuple(v) for k, v in self._metrics.items()}, self._gpus.sample(), state,
            mlflow_run_id, mlflow_link, message,
        )  # fmt: skip

    def _usage(self) -> dict[int, tuple[float | None, int | None]]:
        out: dict[int, tuple[float | None, int | None]] = {}
        for rank, proc in enumerate(self._procs):
            try:
                with proc.oneshot():
                    out[rank] = (proc.cpu_percent(None), int(proc.memory_info().rss))
            except Exception:  # noqa: BLE001 - the rank exited
                continue
        return out


def failures_of(error: BaseException | None) -> dict[int, Any]:
    """The per-rank failures behind a run's error (a worker group's error, or a rank's own exception)."""
    if error is None:
        return {}
    group = error if hasattr(error, "failures") else getattr(error, "gpufleet_error", None)
    failures = getattr(group, "failures", None)
    return dict(failures) if isinstance(failures, dict) else {}


def _failure_line(failure: Any) -> str:
    exc_type, message = getattr(failure, "exc_type", ""), getattr(failure, "message", "")
    text = f"{exc_type}: {message}" if exc_type else message or getattr(failure, "kind", "")
    return (text.strip().splitlines() or [""])[0][:200]
