"""A real Slurm cluster on this machine (one slurmctld, two emulated nodes), shared by the session.

``scripts/slurm_local.sh`` brings it up from Debian's packages (``scripts/test.sh`` installs them
where it runs as root with apt). Where the packages are missing or the tests do not run as root,
every test here skips and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm_local.sh"
STATE = os.environ.get("GPUFLEET_SLURM_DIR", "/tmp/gpufleet-slurm")


def _why_not() -> str | None:
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(c) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): run `scripts/slurm_local.sh ensure` as root"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its slurmd as root; these tests run as another user"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[str]:
    """The cluster's SLURM_CONF; started for the session unless it was already up (then left up)."""
    why = _why_not()
    if why:
        pytest.skip(why)
    conf = os.path.join(STATE, "slurm.conf")
    was_up = subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode == 0
    if not was_up:
        done = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"the local Slurm cluster did not start: {done.stderr.strip()[-500:]}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if not was_up:
            subprocess.run([str(SCRIPT), "stop"], capture_output=True)


@pytest.fixture(autouse=True)
def no_job_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a job in Slurm's queue (and cancel it)."""
    yield
    if "slurm_cluster" not in request.fixturenames or not os.environ.get("SLURM_CONF"):
        return
    import time

    deadline = time.monotonic() + 20  # a job that just ended may still be completing
    while (left := squeue_ids()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        subprocess.run(["scancel", *left], capture_output=True)
        pytest.fail(f"Slurm jobs left in the queue after the test: {left}")


def squeue_ids() -> list[str]:
    """Every job id Slurm still has pending or running."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    return out.split()
