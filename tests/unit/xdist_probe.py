"""What an xdist worker sees, for tests/unit/test_xdist_workers.py (which runs this file by its path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.mark.parametrize("n", range(4))
def test_probe(n: int, request: pytest.FixtureRequest) -> None:
    """What this worker sees (its GPUFLEET_HOME, MLflow store, xdist groups, torch extensions folder), as a JSON file."""
    out = os.environ["GPUFLEET_TEST_XDIST_PROBE"]
    groups = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    Path(out, f"{n}.json").write_text(json.dumps({
        "worker": os.environ.get("PYTEST_XDIST_WORKER"), "home": os.environ["GPUFLEET_HOME"],
        "mlflow": os.environ["MLFLOW_TRACKING_URI"], "groups": groups, "nodeid": request.node.nodeid,
        "torch_extensions": os.environ.get("TORCH_EXTENSIONS_DIR")}))  # fmt: skip
