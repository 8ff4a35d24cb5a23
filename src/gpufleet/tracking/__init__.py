"""MLflow tracking for every gpufleet call and workload attempt.

``start_tracked_run`` opens one MLflow run (nested under an active run, if any) whose id,
tracking URI and experiment are handed to every rank through the environment, so
``mlflow.log_*``, Hugging Face ``report_to="mlflow"`` and Lightning's ``MLFlowLogger`` log into
it. A sampler thread logs the node's system metrics (``system/...``) while the run is open.
``log_metrics`` is the one-line way for a training loop to log rank 0's metrics into it.

Importing this package is light: MLflow is imported only when a tracked run starts.
"""

from __future__ import annotations

from .data_wait import DATA_WAIT_METRIC, flush_data_wait, log_data_wait
from .metrics import log_metrics
from .runs import (
    TRACKING_ENV,
    TrackedRun,
    default_tracking_uri,
    flatten_params,
    start_tracked_run,
    tracking_enabled,
)

__all__ = [
    "DATA_WAIT_METRIC",
    "TRACKING_ENV",
    "TrackedRun",
    "default_tracking_uri",
    "flatten_params",
    "flush_data_wait",
    "log_data_wait",
    "log_metrics",
    "start_tracked_run",
    "tracking_enabled",
]
