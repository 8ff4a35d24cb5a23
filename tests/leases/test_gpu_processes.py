"""A rank of another gpufleet run on a GPU is not a process 'outside gpufleet' (its run holds the lease)."""

from __future__ import annotations

import os
import subprocess
import sys

from gpufleet.launch.gpu_processes import foreign_processes
from gpufleet.launch.gpus import list_gpus


def test_ranks_of_gpufleet_runs_are_not_foreign(monkeypatch):
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={**os.environ, "GPUFLEET_RUN_ID": "20261201-000000-other-abcdef"},
                            start_new_session=True)  # fmt: skip
    try:
        # seen on one H200: another caller's rank was named "outside gpufleet" instead of its run
        monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", f"0={rank.pid},1=1")
        gpus = list_gpus()
        found = foreign_processes(gpus)
        assert [p.pid for procs in found.values() for p in procs] == [1]  # pid 1 is outside gpufleet
    finally:
        rank.kill()
        rank.wait()
