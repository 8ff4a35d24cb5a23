"""Run a recipe notebook in smoke mode in a subprocess and read back what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
ENVS_ROOT = Path(os.environ.get("GPUFLEET_RECIPE_ENVS_DIR", REPO / ".venvs"))


def env_python(name: str) -> Path:
    """The interpreter of the separate recipe environment ``name`` (built by scripts/recipe_env.sh)."""
    return ENVS_ROOT / name / "bin" / "python"


def require_env(name: str) -> Path:
    """Return the env's python; skip the test when it is missing and CI did not promise it."""
    import pytest

    python = env_python(name)
    if not python.exists():
        if os.environ.get("GPUFLEET_RECIPE_ENVS"):
            pytest.fail(f"GPUFLEET_RECIPE_ENVS is set but the '{name}' environment is missing at {python}")
        pytest.skip(f"recipe environment '{name}' not built: run `bash scripts/recipe_env.sh {name}`")
    return python


def run_notebook(
    notebook: str, tmp_path: Path, env: dict[str, str] | None = None, python: Path | None = None, timeout: int = 600
) -> Any:
    """Execute ``recipes/<notebook>`` with SMOKE=1 and return its ``results.json``."""
    out = tmp_path / "out"
    run_env = {
        **os.environ,
        "SMOKE": "1",
        "SMOKE_DIR": str(tmp_path / "assets"),
        "OUTPUT_DIR": str(out),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO / "src"),
        **(env or {}),
    }
    proc = subprocess.run(
        [str(python or sys.executable), str(RECIPES / "_smoke" / "run_notebook.py"), str(RECIPES / notebook),
         "--out", str(tmp_path / "executed.ipynb"), "--timeout", str(timeout)],
        env=run_env, capture_output=True, text=True, timeout=timeout + 60,
    )
    assert proc.returncode == 0, f"notebook {notebook} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((out / "results.json").read_text())
