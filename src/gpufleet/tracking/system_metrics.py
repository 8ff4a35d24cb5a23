"""Per-node system metrics (GPU through NVML, CPU and RAM through psutil) logged to a run.

This is MLflow's own ``SystemMetricsMonitor`` (its NVML GPU monitor, psutil CPU/memory,
disk and network monitors, metric names ``system/...``), with one addition: stopping it
logs a last sample, so a run shorter than the sampling interval still gets its metrics.
Only imported when a tracked run starts (it imports MLflow).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
INTERVAL_ENV = "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"


def sampling_interval(interval_s: float | None = None) -> float:
    """Seconds between samples: the argument, else ``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``, else 10."""
    if interval_s is not None:
        if interval_s <= 0:
            raise ValueError(f"the system metrics interval must be > 0 seconds, got {interval_s!r}")
        return float(interval_s)
    raw = os.environ.get(INTERVAL_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if value > 0:
            return value
        logger.warning("%s=%r is not a positive number; using %g s", INTERVAL_ENV, raw, DEFAULT_INTERVAL_S)
    return DEFAULT_INTERVAL_S


def start_node_sampler(env: Mapping[str, str], node_id: str) -> SystemMetricsSampler | None:
    """Sample this node into the run named by ``env`` (``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI``).

    Used on each node of a Ray run, where the caller's machine is not where training happens.
    Returns None (after a warning when something went wrong) when the run is not tracked.
    """
    run_id, uri = env.get("MLFLOW_RUN_ID"), env.get("MLFLOW_TRACKING_URI")
    if not run_id or not uri:  # set only for a tracked run (tracking off: never set)
        return None
    try:
        sampler = SystemMetricsSampler(run_id, uri, node_id=node_id)
        sampler.start()
    except Exception as e:  # noqa: BLE001 - metrics must never stop a run
        logger.warning("system metrics of %s are not logged for MLflow run %s: %s", node_id, run_id, e)
        return None
    return sampler


class SystemMetricsSampler:
    """Samples this node's GPU/CPU/RAM in a background thread and logs them as ``system/...``.

    Args:
        run_id: MLflow run to log into.
        tracking_uri: the run's tracking URI.
        interval_s: seconds between samples (see :func:`sampling_interval`).
        node_id: in multi-node runs, a name for this node; metrics become ``system/<node_id>/...``.
    """

    def __init__(
        self, run_id: str, tracking_uri: str, interval_s: float | None = None, node_id: str | None = None
    ) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        class _Monitor(SystemMetricsMonitor):
            def finish(self) -> None:
                thread = self._process
                if thread is None:
                    return
                self._shutdown_event.set()
                thread.join()
                self._process = None
                try:  # the loop drops the sample it was collecting when told to stop: log it
                    self.collect_metrics()
                    self.publish_metrics(self.aggregate_metrics())
                    self.mlflow_logger.flush()
                except Exception as e:  # noqa: BLE001 - metrics must never fail the run
                    logger.warning("could not log the last system metrics sample: %s", e)

        quiet = logging.getLogger("mlflow.system_metrics")
        if quiet.level == logging.NOTSET:  # its start/stop/"no GPU" lines are noise in a notebook cell
            quiet.setLevel(logging.WARNING)
        interval = sampling_interval(interval_s)
        # MLflow's monitor prefers its environment variable over the argument; pass ours through it.
        self._monitor: Any = _Monitor(
            run_id, sampling_interval=interval, samples_before_logging=1, node_id=node_id, tracking_uri=tracking_uri
        )
        self._monitor.sampling_interval = interval
        self.interval_s = interval

    @property
    def monitor_names(self) -> list[str]:
        """Names of the monitors in use (``CPUMonitor``, ``GPUMonitor``, ...)."""
        return [type(m).__name__ for m in self._monitor.monitors]

    def start(self) -> None:
        """Start the sampling thread."""
        self._monitor.start()

    def stop(self) -> None:
        """Stop the thread and log a final sample (safe to call more than once)."""
        self._monitor.finish()
