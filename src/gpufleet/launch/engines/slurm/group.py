"""Slurm worker group: a call's ranks as the tasks of one Slurm job (``@distributed(remote="slurm")``).

Each attempt is one job of ``nodes`` nodes with ``gpus / nodes`` tasks per node (and as many GPUs per
node, or CPUs for ``gpu_type="cpu"``); every task runs the one worker entry
(:mod:`gpufleet.launch.engines.slurm.node`, then :mod:`gpufleet.launch.worker`), so a rank's outcome file,
error and traceback are those of a local rank. The caller (a script or notebook on the login node)
reads the outcome files from the run folder, which must be on storage the nodes share, and streams
each rank's output from its ``rank-R.stream`` into ``rank-R.log`` with the ``[rank R]`` prefix
(:mod:`gpufleet.launch.logstream`). Stop is ``scancel`` (TERM to every task, KILL after the cluster's
KillWait); stacks at a timeout are ``SIGUSR1`` to the tasks (faulthandler in each rank).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ....errors import LaunchConfigError, RankFailure
from ....results import ERROR, OK, RunDir, read_outcome
from ... import failures
from ...group import GroupStartCanceled, GroupStatus, WorkerGroup
from ...logstream import LogConfig, RankLog
from ...node import envcontract
from ...progress import PROGRESS_INTERVAL_ENV, read_progress
from ...spec import LaunchSpec, Rendezvous, package_parent
from .engine import SlurmEngine
from .job import SlurmError, SlurmJob, SlurmOptions, require_slurm, slurm_options

__all__ = ["SlurmPlacement", "SlurmWorkerGroup", "slurm_placement"]


def signal_name(signum: int) -> str:
    """``USR2`` for ``signal.SIGUSR2``: how scancel names a signal."""
    return signal.Signals(signum).name.removeprefix("SIG")

logger = logging.getLogger(__name__)

#: Seconds between two looks at the outcome files (they are on shared storage).
_POLL_S = 0.25
#: GPUs per node assumed when a call names only ``gpus`` (8 per node, the usual GPU server).
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class SlurmPlacement:
    """Where a Slurm call's ranks go: nodes, tasks (ranks) per node, GPUs or CPUs, sbatch options."""

    num_nodes: int
    tasks_per_node: int
    use_gpus: bool
    options: SlurmOptions

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.tasks_per_node


def slurm_placement(gpus: int | None, gpu_type: str | None, settings: Mapping[str, Any] | None) -> SlurmPlacement:
    """The placement of a call from ``gpus``, ``gpu_type`` and the decorator's ``slurm={...}``.

    ``slurm`` takes the sbatch options of :class:`SlurmOptions` plus ``nodes`` (default: ``gpus / 8``
    for GPUs when that divides evenly, else one node).
    """
    require_slurm()
    nodes = dict(settings or {}).get("nodes")
    options = slurm_options(settings, also=("nodes",))
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise LaunchConfigError(f"remote='slurm' needs gpus=<number of ranks in all>, got gpus={gpus!r}")
    use_gpus = (gpu_type or "").lower() != "cpu"
    if nodes is None:
        nodes = gpus // DEFAULT_GPUS_PER_NODE if use_gpus and gpus % DEFAULT_GPUS_PER_NODE == 0 and gpus > DEFAULT_GPUS_PER_NODE else 1
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or gpus % nodes:
        raise LaunchConfigError(
            f"slurm nodes={nodes!r} must be a whole number >= 1 that divides gpus={gpus} (ranks per node = gpus / nodes)"
        )
    return SlurmPlacement(nodes, gpus // nodes, use_gpus, options)


class SlurmWorkerGroup(WorkerGroup):
    """One attempt's ranks as the tasks of a Slurm job."""

    starts_at_once = False  # the job may wait in the queue

    def __init__(self, spec: LaunchSpec, run_dir: RunDir, placement: SlurmPlacement, logs: LogConfig) -> None:
        super().__init__(spec, run_dir)
        self.placement = placement
        self._logs = logs
        self.engine = SlurmEngine(placement.options, spec.run_id, per_node=placement.tasks_per_node,
                                  use_gpus=placement.use_gpus)  # fmt: skip
        self._results: dict[int, dict[str, Any]] = {}
        self._failures: dict[int, RankFailure] = {}
        self._progress: dict[int, dict[str, Any]] = {}
        self._progress_read = 0.0
        self._rank_logs: list[RankLog] = []
        self._offsets: list[int] = []
        self._tail_lock = threading.Lock()
        self._stop_tail = threading.Event()
        self._tailer: threading.Thread | None = None
        self._closed = False

    @property
    def job(self) -> SlurmJob | None:
        """The attempt's Slurm job (once submitted), held by the engine."""
        return self.engine.job

    @property
    def num_nodes(self) -> int | None:
        return self.placement.num_nodes

    @property
    def slurm_job_id(self) -> str | None:
        """The attempt's Slurm job (once submitted)."""
        return self.job.job_id if self.job is not None else None

    @property
    def cluster_hosts(self) -> list[str]:
        """The job's nodes, node 0 first (empty until it runs)."""
        try:
            return self.job.nodes() if self.job is not None else []
        except SlurmError:
            return []

    # -- starting -------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        """The job's environment (every task's, before slurm_node adds its rank): the caller's and the contract."""
        p = self.placement
        env = dict(os.environ)
        env.update(self.spec.node_env(0, p.tasks_per_node, Rendezvous("slurm-first-node", 0)))
        for key in (envcontract.MASTER_ADDR, envcontract.MASTER_PORT, envcontract.NODE_RANK, envcontract.RANK,
                    envcontract.LOCAL_RANK, "SLURM_JOB_ID"):
            env.pop(key, None)  # each task's own (slurm_node), or the caller's own job's
        env["PYTHONPATH"] = os.pathsep.join(x for x in [package_parent(), env.get("PYTHONPATH", "")] if x)
        env[envcontract.RUN_DIR] = str(self.run_dir.path)
        if p.use_gpus:
            env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets each node's
        return env

    def start(self) -> None:
        assert self.spec.payload is not None, "a Slurm worker group runs a payload"
        p = self.placement
        self.spec = LaunchSpec(self.spec.run_id, p.world_size, p.num_nodes, p.use_gpus, self.spec.attempt,
                               self.spec.env, self.spec.payload)  # fmt: skip
        if self.abort.is_set():
            raise GroupStartCanceled("before its Slurm job was submitted")
        self.spec.payload.write(self.run_dir.payload)
        self.engine.cancel_event = self.abort
        self.engine.submit(self.run_dir.path, "rank", self._env(), os.getcwd(), p.num_nodes, p.tasks_per_node)
        self._rank_logs = [RankLog(r, self.run_dir.log(r), self._logs) for r in range(p.world_size)]
        self._offsets = [0] * p.world_size
        self._tailer = threading.Thread(target=self._tail_loop, name=f"gpufleet-slurm-logs-{self.run_id}", daemon=True)
        self._tailer.start()

    # -- logs -----------------------------------------------------------------------------
    def _tail_once(self) -> None:
        with self._tail_lock:
            for rank, log in enumerate(self._rank_logs):
                path = self.run_dir.path / f"rank-{rank}.stream"
                try:
                    with open(path, "rb") as f:
                        f.seek(self._offsets[rank])
                        data = f.read()
                except OSError:
                    continue
                end = data.rfind(b"\n") + 1  # whole lines only
                if end <= 0:
                    continue
                self._offsets[rank] += end
                for line in data[:end].splitlines(keepends=True):
                    log.write(line[1:], is_stderr=line[:1] == b"E")

    def _last_lines(self, wait_s: float = 3.0) -> None:
        """Every rank returned: wait (briefly) until each task has passed on all its output, then take it."""
        deadline = time.monotonic() + wait_s
        while any(self.engine.exit_code("rank", r) is None for r in range(self.placement.world_size)) \
                and time.monotonic() < deadline:  # fmt: skip
            time.sleep(0.05)
        self._tail_once()

    def _tail_loop(self) -> None:
        while not self._stop_tail.wait(0.2):
            self._tail_once()

    # -- watching -------------------------------------------------------------------------
    def _known(self, rank: int) -> bool:
        return rank in self._results or rank in self._failures

    def _collect(self) -> bool:
        news = False
        if self.job is None:
            return False
        for rank in range(self.placement.world_size):
            if self._known(rank):
                continue
            rec = read_outcome(self.run_dir.outcome(rank))
            if rec is not None and rec["status"] in (OK, ERROR):
                if rec["status"] == OK:
                    self._results[rank] = rec
                else:
                    self._tail_once()
                    self._failures[rank] = failures.failure_from_outcome(rank, rec, self.run_dir.log(rank))
                news = True
                continue
            code = self.engine.exit_code("rank", rank)
            if code is not None:
                self._tail_once()
                self._failures[rank] = failures.failure_from_exit(rank, code, self.run_dir.log(rank))
                news = True
                continue
            state = self.engine.ended_unreported()
            if state is not None:
                why = self.engine.lost_message(state, f"rank {rank} reported an outcome", "its node or the job")
                self._failures[rank] = failures.stopped(rank, why, time.time(), self.run_dir.log(rank))
                news = True
        return news

    def _status(self) -> GroupStatus:
        started = self.job is not None and self.job.ran
        return GroupStatus(self.placement.world_size, dict(self._results), dict(self._failures), started=started,
                           progress=dict(self._progress))  # fmt: skip

    def poll(self, wait_s: float) -> GroupStatus:
        if self.job is not None and not self.job.ran:
            self.job.state()
        if not self._collect() and wait_s > 0:
            self.abort.wait(max(wait_s, _POLL_S))
        if len(self._results) == self.placement.world_size:
            self._last_lines()
        now = time.monotonic()
        if PROGRESS_INTERVAL_ENV in self.spec.env and now - self._progress_read >= 1.0:
            self._progress_read = now
            for rank in range(self.placement.world_size):
                record = read_progress(self.run_dir.path, rank)
                if record is not None:
                    self._progress[rank] = record
        return self._status()

    def stacks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Every live rank's threads: SIGUSR2 to the job's tasks, each rank's faulthandler writes ``stacks-R.txt``.

        Only once every rank's stack handler is in place (all progress files exist): before that the
        signal would end a rank.
        """
        from ...progress import STACKS_SIGNAL

        job, n, folder = self.job, self.placement.world_size, self.run_dir.path
        if job is None or not all((folder / f"progress-{r}.json").exists() for r in range(n)):
            return {}
        files = [folder / f"stacks-{r}.txt" for r in range(n)]
        sizes = [f.stat().st_size if f.exists() else 0 for f in files]
        try:
            job.signal_tasks(signal_name(STACKS_SIGNAL))
        except SlurmError:
            return {}
        got: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(got) < n:
            for r, f in enumerate(files):
                if r not in got and not self._known(r) and f.exists() and f.stat().st_size > sizes[r]:
                    time.sleep(0.1)  # let faulthandler finish the dump
                    with open(f, "rb") as fh:
                        fh.seek(sizes[r])
                        got[r] = fh.read().decode("utf-8", "replace")
            time.sleep(0.05)
        return got

    # -- stopping -------------------------------------------------------------------------
    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        self._collect()
        job = self.job
        if job is not None:
            if dump_stacks and job.state(max_age_s=0.0).running:
                try:
                    job.signal_tasks("USR1")  # faulthandler in every rank prints its stacks into its log
                    time.sleep(1.0)
                except Exception:  # noqa: BLE001 - the stacks are a courtesy
                    pass
            self.engine.cancel_job(grace_period_s)
        self._collect()
        t_stop = time.time()
        for rank in range(self.placement.world_size):
            if not self._known(rank):
                self._failures[rank] = failures.stopped(rank, reason, t_stop, self.run_dir.log(rank))
        self._tail_once()
        return self._status()

    def close(self, succeeded: bool) -> None:
        if self._closed:
            return
        self._closed = True
        threading.Thread(target=self._finish, name=f"gpufleet-slurm-reap-{self.run_id}").start()

    def _finish(self) -> None:
        """Let the job end by itself (ranks that returned are exiting), then cancel what is left; last logs."""
        job = self.job
        try:
            self.engine.finish(15.0)
        except SlurmError as e:
            logger.warning("run %s: could not check that Slurm job %s ended: %s", self.run_id, job.job_id if job else "?", e)
        finally:
            self._stop_tail.set()
            self._tail_once()
            for log in self._rank_logs:
                log.close()
            # the raw channels (unmasked output), the call and the outcomes have been read
            names = ["payload.pkl"] + [f"{kind}-{r}.{ext}" for r in range(self.placement.world_size)
                                       for kind, ext in (("rank", "stream"), ("rank", "exit"), ("outcome", "pkl"))]  # fmt: skip
            for name in names:
                try:
                    (self.run_dir.path / name).unlink()
                except FileNotFoundError:
                    pass
