"""The data-wait metric: how long the training loop waited for its next batch.

:func:`log_data_wait` is called by the data loader on rank 0 after every batch. It keeps a
running sum and logs the mean wait per step (``data/wait_seconds``) at most once per
:data:`LOG_INTERVAL_S`, asynchronously, so a call costs microseconds; what is left is logged
when the process exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

from .. import runtime
from .runs import tracking_enabled

logger = logging.getLogger(__name__)

DATA_WAIT_METRIC = "data/wait_seconds"
LOG_INTERVAL_S = 5.0

_lock = threading.Lock()
_state: dict[str, Any] = {"client": None, "run_id": None, "total": 0.0, "count": 0, "step": 0, "last": None}


def _run_id() -> str | None:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        return run_id
    # mlflow.start_run() (also run by report_to="mlflow") moves MLFLOW_RUN_ID into the active run
    mlflow = sys.modules.get("mlflow")
    active = mlflow.active_run() if mlflow is not None else None
    return active.info.run_id if active is not None else None


def _flush() -> None:
    """Log the mean wait since the last flush (caller holds the lock)."""
    if not _state["count"] or _state["run_id"] is None:
        return
    mean = _state["total"] / _state["count"]
    _state["total"], _state["count"], _state["last"] = 0.0, 0, time.monotonic()
    try:
        if _state["client"] is None:
            from mlflow import MlflowClient

            _state["client"] = MlflowClient()  # one client: building one opens the store
            atexit.register(flush_data_wait)
        _state["client"].log_metric(
            _state["run_id"], DATA_WAIT_METRIC, mean, step=_state["step"], synchronous=False
        )
    except ImportError:
        _state["run_id"] = None
    except Exception as e:  # noqa: BLE001 - a metric must never stop training
        logger.debug("could not log %s: %s", DATA_WAIT_METRIC, e)


def log_data_wait(seconds: float, step: int | None = None) -> None:
    """Record that step ``step`` waited ``seconds`` for data; logged as ``data/wait_seconds``.

    Meant for the data loader on rank 0: it does nothing on other ranks, outside a tracked
    run (no ``$MLFLOW_RUN_ID``), with tracking switched off or without MLflow. The metric is
    the mean wait per step over each window of :data:`LOG_INTERVAL_S` seconds, logged at the
    window's last step (the first call logs at once).
    """
    if runtime.rank_text("0") != "0" or not tracking_enabled():
        return
    run_id = _run_id() or _state["run_id"]
    if run_id is None:
        return
    with _lock:
        if run_id != _state["run_id"]:  # a new run in this process: close the old one's window
            _flush()
            _state.update(run_id=run_id, last=None, step=0)
        _state["total"] += float(seconds)
        _state["count"] += 1
        _state["step"] = _state["step"] + 1 if step is None else step
        last = _state["last"]
        if last is None or time.monotonic() - last >= LOG_INTERVAL_S:
            _flush()


def flush_data_wait() -> None:
    """Log what :func:`log_data_wait` holds now and wait until MLflow has written it."""
    with _lock:
        _flush()
        client = _state["client"]
    if client is not None:
        try:
            import mlflow

            mlflow.flush_async_logging()
        except Exception as e:  # noqa: BLE001
            logger.debug("could not flush %s: %s", DATA_WAIT_METRIC, e)
