"""Tracking tests run with tracking on, whatever the rest of the suite chooses."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def tracking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
