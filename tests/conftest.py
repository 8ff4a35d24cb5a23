"""Shared test set-up: a private GPUFLEET_HOME, offline hubs, and no process left behind."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.proc import leftover_worker_processes


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("GPUFLEET_HOME", tempfile.mkdtemp(prefix="gpufleet-test-home-"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + os.path.join(os.environ["GPUFLEET_HOME"], "mlflow-test.db"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves any worker it launched (or their children) running."""
    yield
    left = leftover_worker_processes(wait_s=10.0)
    if left:
        for p in left:
            try:
                p.kill()
            except Exception:
                pass
        pytest.fail(f"processes left running after the test: {[(p.pid, p.cmdline()) for p in left]}")
