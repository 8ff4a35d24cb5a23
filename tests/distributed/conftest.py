"""Launch-core tests run without MLflow tracking (tests/tracking covers it)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_tracking(monkeypatch):
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")
