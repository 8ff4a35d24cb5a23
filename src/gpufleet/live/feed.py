"""In a rank: the metrics rank 0 logs (``log_metrics``), appended to its run folder for the live view.

Each call of :func:`gpufleet.tracking.log_metrics` on rank 0 appends one JSON line
``{"step": N, "time": T, "metrics": {"loss": 0.42}}`` to ``metrics-0.jsonl`` in the run folder
(``GPUFLEET_RUN_DIR``), with or without MLflow: the panel in the notebook cell and the terminal
line plot and show them from there. One ``write`` of a short line per call, to a private file
kept open; a rank outside a launched run (no run folder) or with ``GPUFLEET_LIVE=0`` writes
nothing. Standard library only; it never raises into the training loop.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

#: The file of rank R's metrics in its run folder.
METRICS_FILE = "metrics-{rank}.jsonl"

_lock = threading.Lock()
_open: dict[str, Any] = {"folder": None, "fd": None}


def live_off() -> bool:
    """Whether ``GPUFLEET_LIVE`` switches the live view off (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get("GPUFLEET_LIVE", "").strip().lower() in ("0", "false", "no", "off")


def record_metrics(metrics: Mapping[str, Any], step: int | None, number: Callable[[Any], float], rank: int = 0) -> None:
    """Append ``metrics`` (converted with ``number``; those that are not finite numbers are left out)."""
    folder = os.environ.get("GPUFLEET_RUN_DIR")
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
        line = json.dumps({"step": int(step or 0), "time": time.time(), "metrics": values}) + "\n"
        with _lock:
            if _open["folder"] != folder:  # a warm worker's next call has another run folder
                if _open["fd"] is not None:
                    os.close(_open["fd"])
                    _open["fd"] = None
                path = os.path.join(folder, METRICS_FILE.format(rank=rank))
                _open["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                _open["folder"] = folder
            os.write(_open["fd"], line.encode())
    except Exception:  # noqa: BLE001 - the live view never disturbs training
        pass
