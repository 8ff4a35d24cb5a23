"""Tracking for ``@distributed`` calls: one MLflow run per local attempt.

:func:`start_tracked_local_run` opens the MLflow run, puts its id into every rank's
environment, starts the ranks, and returns the launched run wrapped so that, when the
attempt ends, the per-rank logs are uploaded and the final status is set.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

from .runs import TrackedRun, start_tracked_run


class TrackedLocalRun:
    """A launched local run and its MLflow run; behaves like the run it wraps.

    Attributes:
        tracked: the :class:`~gpufleet.tracking.TrackedRun` of this attempt.
    """

    def __init__(self, run: Any, tracked: TrackedRun) -> None:
        self._run = run
        self.tracked = tracked
        self._finish_lock = threading.Lock()
        self._finished = False

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run id of this attempt."""
        return self.tracked.run_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    def wait(self) -> list[Any]:
        """Wait for the ranks (as the wrapped run does), then close the MLflow run."""
        try:
            result = self._run.wait()
        except BaseException as e:
            self._finish(e)
            raise
        self._finish(None)
        return result

    def _finish(self, error: BaseException | None) -> None:
        with self._finish_lock:
            if self._finished:
                return
            self._finished = True
        run = self._run
        status = run.status if run.status in ("SUCCESS", "FAILED", "CANCELED", "TIMEDOUT") else "FAILED"
        self.tracked.log_artifacts(sorted(run.run_dir.path.glob("rank-*.log")), "logs")
        if error is not None and status in ("FAILED", "TIMEDOUT"):  # root cause, remote traceback, other ranks
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self.tracked.log_text(text, "error.txt")
        self.tracked.end(status)


def start_tracked_local_run(
    run: Any, *, function_name: str, gpus: int | None, gpu_type: str | None,
    experiment_name: str | None, attempt: int, max_retries: int, timeout: float | None,
) -> Any:
    """Open an MLflow run for a not yet started ``LocalRun``, start the ranks, and wrap it.

    Every rank gets ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI`` and the experiment in its
    environment. Returns the started run itself when tracking ends up disabled (MLflow missing).
    """
    spec = run.spec
    tracked = start_tracked_run(
        experiment_name,
        run.run_id,
        params={
            "gpufleet.function": function_name,
            "gpufleet.gpus": gpus,
            "gpufleet.gpu_type": gpu_type,
            "gpufleet.world_size": spec.num_workers,
            "gpufleet.num_nodes": 1,
            "gpufleet.attempt": attempt,
            "gpufleet.max_retries": max_retries,
            "gpufleet.timeout_s": timeout,
        },
        tags={
            "gpufleet.run_id": run.run_id,
            "gpufleet.run_dir": str(run.run_dir.path),
            "gpufleet.function": function_name,
            "gpufleet.launcher": "local",
        },
    )
    if not tracked.enabled:
        return run.start()
    spec.env.update(tracked.env())
    try:
        run.start()
    except BaseException:
        tracked.end("FAILED")
        raise
    return TrackedLocalRun(run, tracked)
