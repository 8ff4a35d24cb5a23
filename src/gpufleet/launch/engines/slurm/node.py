"""Inside a Slurm job: the batch step, and each task that ``srun`` starts (a rank, or a node's command).

``python -m gpufleet.launch.engines.slurm.node batch MODE FOLDER`` is the job's batch script
(:func:`gpufleet.launch.engines.slurm.job.batch_script`). It runs on the allocation's first node, sets
``MASTER_ADDR`` (that node's address as Slurm knows it) and ``MASTER_PORT`` (a free port there),
and starts one task per rank or per node with ``srun``. Slurm's ``SIGUSR1`` (sent before the time
limit, ``--signal=B:USR1@N``; a preemption's ``SIGTERM`` goes to the tasks, see
:mod:`gpufleet.checkpoint.preemption`) goes to the batch script's shell, which turns it into the
attempt's preempted mark (it may come before Python is up):

- ``task rank FOLDER``: one rank of a call. ``RANK``, ``LOCAL_RANK``, ``NODE_RANK`` and the rest of the
  rank contract come from Slurm's task ids; the task runs ``python -m gpufleet.launch.worker FOLDER
  RANK`` (the one worker entry), writes its output lines, each tagged ``O`` (stdout) or ``E``
  (stderr), to ``rank-R.stream`` for the caller, and its exit code to ``rank-R.exit``.
- ``task node FOLDER``: one node of a workload. ``NODE_RANK`` is Slurm's node id; the node's command
  runs under the node guard (:mod:`gpufleet.launch.node.guard`) with its output in ``node-N.log``; its
  exit code is written to ``node-N.exit`` (atomically) for the supervisor.

A trailing ``cpu`` (a job without GPUs) empties ``CUDA_VISIBLE_DEVICES`` in every task: Slurm unsets
it for such a job on a node that has GPUs, and without device cgroups the tasks would see them all.
Everything else of the environment came with ``sbatch --export=ALL`` from the submitting process.
The run folder must be on storage that the login node and every node of the job share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from ....results import write_atomic
from ...node import envcontract
from ...spec import default_threads, rank_vars
from .job import node_address


def _cores() -> int:
    """The cores this process may run on (its share of the allocation where Slurm binds tasks)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _outlive(signum: int) -> None:
    """Let this task survive ``signum`` (a handler, not SIG_IGN: its children get the default back at exec)."""
    signal.signal(signum, lambda *_: None)


def _say(message: str) -> None:
    print(f"gpufleet: {message}", file=sys.stderr, flush=True)


def batch(mode: str, folder: Path, cpu: bool = False) -> int:
    """The batch step: rendezvous address, the preemption signal, one task per rank/node through srun."""
    from ...ports import find_free_port

    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    addr = node_address(node)
    os.environ[envcontract.MASTER_ADDR] = addr
    os.environ[envcontract.MASTER_PORT] = str(find_free_port(addr))
    _outlive(signal.SIGUSR1)  # Slurm's SIGUSR1 goes to the batch script's shell, which marks it (job.batch_script)
    # Each task gets its share of the node's CPUs (srun's default is one per task): a node command
    # all of them, for the ranks its torchrun starts; a rank its part.
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE", "1").split("(")[0] or 1)
    tasks = int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1) if mode == "rank" else 1
    cmd = ["srun", "--export=ALL", "--kill-on-bad-exit=0", f"--cpus-per-task={max(1, cpus // tasks)}",
           sys.executable, "-m", "gpufleet.launch.engines.slurm.node", "task", mode, str(folder), *(["cpu"] if cpu else [])]  # fmt: skip
    step = subprocess.Popen(cmd)
    while True:
        try:
            return step.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue


def _rank_task(folder: Path) -> int:
    env = dict(os.environ)
    rank, local = env["SLURM_PROCID"], env.get("SLURM_LOCALID", "0")
    node, world = env.get("SLURM_NODEID", "0"), env.get("SLURM_NTASKS", env.get(envcontract.WORLD_SIZE, "1"))
    env.update(rank_vars(rank, local, node, world, env[envcontract.RUN_ID]))  # the run id: the job's (spec.node_env)
    env.update({
        envcontract.NODE_RANK: node, envcontract.WORLD_SIZE: world,
        envcontract.LOCAL_WORLD_SIZE: env.get("SLURM_NTASKS_PER_NODE", env.get(envcontract.LOCAL_WORLD_SIZE, "1")).split("(")[0],
    })  # fmt: skip
    env.update(default_threads(env, 1, cpu_count=_cores()))  # this task's cores are this rank's
    # Slurm's TERM (a cancel), USR1 (stacks before a timeout) and USR2 (stacks of the hang watchdog)
    # are for the rank; this task reports.
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        _outlive(signum)
    child = subprocess.Popen([sys.executable, "-m", "gpufleet.launch.worker", str(folder), rank], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             restore_signals=True)  # fmt: skip
    stream = os.open(folder / f"rank-{rank}.stream", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    lock = threading.Lock()

    def pump(pipe: IO[bytes], tag: bytes) -> None:
        for line in iter(pipe.readline, b""):
            with lock:
                os.write(stream, tag + (line if line.endswith(b"\n") else line + b"\n"))
        pipe.close()

    pumps = [threading.Thread(target=pump, args=(child.stdout, b"O")), threading.Thread(target=pump, args=(child.stderr, b"E"))]
    for t in pumps:
        t.start()
    code = child.wait()
    for t in pumps:
        t.join(5.0)
    os.close(stream)
    write_atomic(folder / f"rank-{rank}.exit", json.dumps({"exit_code": code, "host": os.uname().nodename}).encode())
    return 0 if code == 0 else 1


def _node_task(folder: Path) -> int:
    node_rank = os.environ.get("SLURM_NODEID", "0")
    os.environ[envcontract.NODE_RANK] = node_rank
    os.environ.update(default_threads(os.environ, int(os.environ.get(envcontract.LOCAL_WORLD_SIZE, "1")), cpu_count=_cores()))
    # Slurm's TERM reaches every process of the step: the command stops, the guard reports its code,
    # and this task writes it down before it exits.
    _outlive(signal.SIGTERM)
    command = (folder / "node-command.sh").read_text()
    log = os.open(folder / f"node-{node_rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        child = subprocess.Popen([sys.executable, "-m", "gpufleet.launch.node.guard", "--", "bash", "-c", command],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
    finally:
        os.close(log)
    code = child.wait()
    record = {"exit_code": code, "host": os.uname().nodename, "node": os.environ.get("SLURMD_NODENAME", ""),
              "time": time.time()}  # fmt: skip
    write_atomic(folder / f"node-{node_rank}.exit", json.dumps(record).encode())
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (len(argv) not in (3, 4) or argv[0] not in ("batch", "task") or argv[1] not in ("rank", "node")
            or argv[3:] not in ([], ["cpu"])):  # fmt: skip
        print("usage: python -m gpufleet.launch.engines.slurm.node batch|task rank|node FOLDER [cpu]", file=sys.stderr)
        return 2
    where, mode, folder, cpu = argv[0], argv[1], Path(argv[2]), argv[3:] == ["cpu"]
    if where == "batch":
        return batch(mode, folder, cpu)
    if cpu:  # a job without GPUs: Slurm unset CUDA_VISIBLE_DEVICES, and a node's GPUs must stay unseen
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return _rank_task(folder) if mode == "rank" else _node_task(folder)


if __name__ == "__main__":
    sys.exit(main())
