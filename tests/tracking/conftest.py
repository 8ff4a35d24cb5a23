"""Tracking tests run with tracking on, whatever the rest of the suite chooses."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def tracking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)


@pytest.fixture(autouse=True)
def no_mlflow_environment_leaks():
    """MLflow writes MLFLOW_EXPERIMENT_ID (set_experiment) into os.environ: a later test's runs must not inherit it."""
    import os

    before = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for key in [k for k in os.environ if k.startswith("MLFLOW_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)
