"""Training metrics from inside a rank into the call's (or workload attempt's) MLflow run.

::

    from gpufleet.tracking import log_metrics

    log_metrics({"loss": loss, "lr": lr}, step=step)      # rank 0 logs; a no-op elsewhere

Every rank of a tracked call or workload attempt has ``MLFLOW_RUN_ID`` in its environment;
:func:`log_metrics` logs into that run, from rank 0 only unless told otherwise, and does
nothing (returns False) when there is no run: tracking switched off, no MLflow installed, a
plain ``python train.py`` outside gpufleet. A failing store never stops training: it warns once.
Rank 0's metrics also go to the live view (:mod:`gpufleet.live.feed`), tracked or not.
MLflow is imported on the first call that logs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from .. import runtime
from .runs import tracking_enabled

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {"client": None, "warned": False}


def _run_id() -> str | None:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        return run_id
    # mlflow.start_run() (also run by report_to="mlflow") moves MLFLOW_RUN_ID into the active run
    mlflow = sys.modules.get("mlflow")
    active = mlflow.active_run() if mlflow is not None else None
    return active.info.run_id if active is not None else None


def _number(value: Any) -> float:
    """A metric value as a float: numbers, numpy scalars and one-element tensors (``loss``)."""
    item = getattr(value, "item", None)
    return float(item() if callable(item) else value)


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, all_ranks: bool = False) -> bool:
    """Log ``metrics`` (name -> number or one-element tensor) into this rank's MLflow run.

    Args:
        metrics: e.g. ``{"loss": loss, "lr": scheduler.get_last_lr()[0]}``.
        step: the training step or epoch (MLflow's x axis); None logs at step 0, as
            ``mlflow.log_metric`` does.
        all_ranks: log from every rank, each under ``rank<N>/<name>``; by default only rank 0
            (``RANK`` unset counts as rank 0) logs, under the names as given.

    Returns:
        True when the metrics were logged; False when this rank does not log or there is no
        tracked run (tracking off, MLflow missing, ``MLFLOW_RUN_ID`` not set), or the store
        refused them (one warning).
    """
    rank = runtime.rank_text("0")
    if rank == "0" and metrics:  # for the live view (a line in the run folder), tracked or not
        from ..live.feed import record_metrics

        record_metrics(metrics, step, _number)
    if (rank != "0" and not all_ranks) or not metrics or not tracking_enabled():
        return False
    run_id = _run_id()
    if run_id is None:
        return False
    prefix = f"rank{rank}/" if all_ranks else ""
    try:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(prefix + str(k), _number(v), now, int(step or 0)) for k, v in metrics.items()]
        with _lock:
            if _state["client"] is None:
                from mlflow import MlflowClient

                _state["client"] = MlflowClient()  # one client per process: building one opens the store
            _state["client"].log_batch(run_id, metrics=batch)
        return True
    except ImportError:
        return False
    except Exception as e:  # noqa: BLE001 - a metric must never stop training
        if not _state["warned"]:
            _state["warned"] = True
            logger.warning("gpufleet: could not log metrics to MLflow run %s (%s); training goes on", run_id, e)
        return False
