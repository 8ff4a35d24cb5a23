"""``gpufleet stacks`` for a run on Slurm: each node of its job reads its own ranks' stacks.

The run's job is found by its name (``gpufleet-<run id>``, as both Slurm launchers name it); a step
``srun --overlap`` with one task per node runs ``gpufleet stacks RUN_ID -o json --here`` there,
beside the running ranks, and the answers are merged in rank order (a process seen from two tasks,
as on a cluster whose nodes share one host, is listed once).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

_TIMEOUT_S = 60.0


def slurm_job_of(run_id: str) -> tuple[str, str, int] | None:
    """``(run id, job id, nodes)`` of the running Slurm job of a run (or unique prefix of its id), or None."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i|%j|%D"], capture_output=True, text=True,
                             timeout=20, check=True).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    found = []
    for line in out.splitlines():
        job_id, name, nodes = (line.split("|") + ["", "", ""])[:3]
        if name.startswith("gpufleet-") and name[len("gpufleet-"):].startswith(run_id):
            found.append((name[len("gpufleet-"):], job_id, int(nodes or 1)))
    exact = [f for f in found if f[0] == run_id]
    return (exact or found)[0] if len(exact or found) == 1 else None


def collect_on_slurm(run_id: str) -> tuple[str, list[dict[str, Any]]] | None:
    """The run's processes and stacks, read on the nodes of its Slurm job; None when it has no running job."""
    job = slurm_job_of(run_id)
    if job is None:
        return None
    rid, job_id, nodes = job
    cmd = ["srun", f"--jobid={job_id}", "--overlap", f"--nodes={nodes}", "--ntasks-per-node=1", "--export=ALL",
           sys.executable, "-m", "gpufleet.cli", "stacks", rid, "-o", "json", "--here"]  # fmt: skip
    out = ""
    for _ in range(3):  # a step can be refused for a moment (the job's own step still starting)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("reading the stacks of run %s on Slurm job %s took longer than %g s", rid, job_id, _TIMEOUT_S)
            return None
        out = done.stdout
        if out.strip():
            break
        logger.warning("could not read the stacks of run %s on Slurm job %s: %s", rid, job_id, done.stderr.strip()[-500:])
        time.sleep(1.0)
    decoder, i, seen, found = json.JSONDecoder(), 0, set(), []
    while True:
        while i < len(out) and out[i].isspace():
            i += 1
        if i >= len(out):
            break
        try:
            doc, i = decoder.raw_decode(out, i)
        except ValueError:
            break
        for p in doc.get("processes", []):
            key = (p.get("host"), p["pid"])
            if key not in seen:
                seen.add(key)
                found.append(p)
    found.sort(key=lambda p: (p["rank"] is None, p["rank"] if p["rank"] is not None else 0, p["pid"]))
    return rid, found
