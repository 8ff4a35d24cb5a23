"""The first recipe: the DDP MLP script and its notebook, on 2 CPU workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pytorch-ddp-mlp"


def test_script_trains_on_two_cpu_workers():
    env = {**os.environ, "GPUFLEET_TRACKING": "0"}
    proc = subprocess.run(
        [sys.executable, str(RECIPE / "train.py"), "--cpu", "--workers", "2", "--epochs", "20"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] epoch   0  loss" in proc.stdout
    assert "2 ranks on cpu: loss" in proc.stdout


def test_notebook_runs_in_a_kernel(monkeypatch):
    monkeypatch.setenv("SMOKE", "1")
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")
    nb = nbformat.read(RECIPE / "ddp_mlp.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(RECIPE)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "'rank': 1" in text and "loss_ratio" in text
