"""In a rank: the metrics rank 0 logs (``log_metrics``), appended to its run folder for the live view.

Each call of :func:`gpufleet.tracking.log_metrics` on rank 0 queues one JSON line
``{"step": N, "time": T, "metrics": {"loss": 0.42}}`` (with or without MLflow); a daemon thread
appends the queued lines to ``metrics-0.jsonl`` in the run folder (``GPUFLEET_RUN_DIR``) four
times a second, and :func:`flush` writes the rest as the call ends, so the training loop never
waits for the disk. The panel in the notebook cell and the terminal line read them from there.
At most :data:`MAX_QUEUED` lines wait (the oldest are dropped past that). A rank outside a
launched run (no run folder) or with ``GPUFLEET_LIVE=0`` queues nothing. Standard library only;
it never raises into the training loop.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..launch.node import envcontract

#: The file of rank R's metrics in its run folder.
METRICS_FILE = "metrics-{rank}.jsonl"
#: Lines waiting for the writer thread, at most.
MAX_QUEUED = 10000
#: Seconds between the writer thread's writes.
WRITE_S = 0.25

_queue: deque[tuple[str, int, int, float, dict[str, float]]] = deque(maxlen=MAX_QUEUED)  # folder, rank, step, time, values
_lock = threading.Lock()
_writer: dict[str, Any] = {"thread": None, "fd": None, "path": None}


def live_off() -> bool:
    """Whether ``GPUFLEET_LIVE`` switches the live view off (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get(envcontract.LIVE, "").strip().lower() in ("0", "false", "no", "off")


def record_metrics(metrics: Mapping[str, Any], step: int | None, number: Callable[[Any], float], rank: int = 0) -> None:
    """Queue ``metrics`` (converted with ``number``; those that are not finite numbers are left out)."""
    folder = os.environ.get(envcontract.RUN_DIR)
    if not folder or live_off():
        return
    try:
        values: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                v = number(value)
            except Exception:  # noqa: BLE001 - not a number: MLflow will say so, the view skips it
                continue
            if math.isfinite(v):
                values[str(name)] = v
        if not values:
            return
        _queue.append((folder, rank, int(step or 0), time.time(), values))  # made a line by the writer
        if _writer["thread"] is None:
            _start_writer()
    except Exception:  # noqa: BLE001 - the live view never disturbs training
        pass


def _start_writer() -> None:
    with _lock:
        if _writer["thread"] is not None:
            return

        def loop() -> None:
            while True:
                time.sleep(WRITE_S)
                flush()

        thread = threading.Thread(target=loop, name="gpufleet-live-metrics", daemon=True)
        _writer["thread"] = thread
        thread.start()
        atexit.register(flush)  # a workload's rank that ends without gpufleet's worker


def flush() -> None:
    """Append every queued line to its run folder's file now (the writer thread, and the end of a call)."""
    with _lock:
        try:
            while _queue:
                folder, rank, step, when, values = _queue.popleft()
                line = json.dumps({"step": step, "time": when, "metrics": values})
                path = os.path.join(folder, METRICS_FILE.format(rank=rank))
                if _writer["path"] != path:  # a warm worker's next call has another run folder
                    if _writer["fd"] is not None:
                        os.close(_writer["fd"])
                        _writer["fd"] = None
                    _writer["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    _writer["path"] = path
                os.write(_writer["fd"], (line + "\n").encode())
        except Exception:  # noqa: BLE001 - a folder gone or a full disk: the view misses points
            if _writer["fd"] is not None:
                try:
                    os.close(_writer["fd"])
                except OSError:
                    pass
            _writer["fd"], _writer["path"] = None, None
