"""One Slurm job of an attempt, from the submitting machine: sbatch, its state, scancel.

Used by the Slurm engine (:mod:`gpufleet.launch.engines.slurm.engine`), for a call's ranks
(:mod:`gpufleet.launch.engines.slurm.group`) and a workload's node commands. A job is one allocation of ``num_nodes``
nodes; its batch step (:mod:`gpufleet.launch.engines.slurm.node`) starts the ranks or node commands with
``srun``. The job's environment is the submitting process's (``--export=ALL``): secrets reach the
nodes that way only, never in the batch script (which holds only paths) or on a command line.

The job asks Slurm for ``SIGUSR1`` to its batch step ``signal_before_s`` seconds before its time
limit (``--signal=B:USR1@N``). The batch step marks the attempt preempted (:data:`PREEMPTED_FILE`),
which the ranks' checkpoint managers see (:mod:`gpufleet.checkpoint.preemption`), and the attempt is
resubmitted as a new job. A preemption (a job of a higher priority tier takes the nodes) is
different: at the start of the partition's ``GraceTime`` Slurm sends ``SIGTERM`` to the job's tasks,
not to the batch step (``SIGUSR1`` only where the site sets ``PreemptParameters=send_user_signal``),
and records the moment as the job's ``PreemptTime``; a rank with a checkpoint manager checkpoints at
its next step, and the attempt counts as preempted whatever its tasks' exit codes. Before gpufleet
itself ends a job (cancel, timeout, hang) it writes :data:`CANCELED_FILE`, so that a rank tells that
``SIGTERM`` from the scheduler's. Jobs are submitted ``--no-requeue``; one that Slurm requeues anyway
(an administrator, a site policy) is seen back in the queue: it counts as preempted, and is canceled
rather than left waiting behind Slurm's begin-time hold, since its successor is submitted at once
with the next attempt's environment.

Slurm's client commands are found on ``PATH``; ``SLURM_CONF`` says which cluster, as for ``sbatch``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ....errors import GpufleetError, LaunchConfigError
from ...node import envcontract

__all__ = ["CANCELED_FILE", "PREEMPT_FILE_ENV", "PREEMPTED_FILE", "SlurmJob", "SlurmOptions", "SlurmError", "slurm_options"]

#: The ranks' environment: the file whose existence means "checkpoint now, the job ends soon"
#: (read by :mod:`gpufleet.checkpoint.preemption`).
PREEMPT_FILE_ENV = envcontract.PREEMPT_FILE
#: In the attempt's folder: written by the batch step when Slurm signals the job to stop.
PREEMPTED_FILE = "preempted.json"
#: In the attempt's folder: written by gpufleet before it ends the job itself (its SIGTERM is no preemption).
CANCELED_FILE = "canceled.json"
#: Job states after which nothing of the job runs any more.
ENDED_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT", "SPECIAL_EXIT", "REVOKED",
})  # fmt: skip
#: sbatch options gpufleet sets itself (``compute.slurm.sbatch_args`` may not).
OWN_OPTIONS = (
    "--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--gpus-per-node", "--gpus", "-G", "--cpus-per-task",
    "-c", "--output", "-o", "--error", "-e", "--job-name", "-J", "--export", "--signal", "--requeue",
    "--no-requeue", "--wrap", "--chdir", "-D", "--parsable",
)  # fmt: skip
_SCONTROL_WAIT_S = 20.0
#: How long a job's last known state stands while Slurm's controller does not answer.
UNREACHABLE_S = 300.0
_TIME_RE = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")


class SlurmError(GpufleetError, RuntimeError):
    """A Slurm command failed (the message has its output)."""


@dataclass(frozen=True)
class SlurmOptions:
    """Where on the cluster a job goes: the ``sbatch`` options of a workload or a call.

    Attributes:
        partition, account, qos, constraint: ``--partition`` etc. (None: the cluster's default).
        time: the job's time limit in a form ``sbatch --time`` takes (``MM``, ``HH:MM:SS``, ``D-HH``).
        signal_before_s: seconds before the time limit at which Slurm signals the job to checkpoint.
        sbatch_args: more ``sbatch`` options as they are (``--mem=64G``, ``--exclusive``).
    """

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str | None = None
    signal_before_s: int = 120
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)

    def problems(self) -> list[str]:
        """What is wrong with these options, each as one sentence (empty: nothing)."""
        found = []
        if self.time is not None and not _TIME_RE.match(self.time):
            found.append(f"time {self.time!r} is not a Slurm time limit; use minutes (90), HH:MM:SS or D-HH:MM:SS")
        if not 1 <= self.signal_before_s <= 65535:
            found.append(f"signal_before_s must be between 1 and 65535 seconds, got {self.signal_before_s}")
        for arg in self.sbatch_args:
            name = arg.split("=", 1)[0]
            if not arg.startswith("-"):
                found.append(f"sbatch_args: {arg!r} is not an option (write --name=value)")
            elif name in OWN_OPTIONS:
                found.append(f"sbatch_args: {name} is set by gpufleet (nodes, tasks, GPUs, logs and signals follow "
                             "compute and the run); remove it")  # fmt: skip
        return found

    def args(self) -> list[str]:
        """The ``sbatch`` options these settings stand for."""
        out = [f"--{k}={v}" for k in ("partition", "account", "qos", "constraint", "time")
               if (v := getattr(self, k)) is not None]  # fmt: skip
        return out + list(self.sbatch_args)


def slurm_options(settings: Mapping[str, object] | None, also: Sequence[str] = ()) -> SlurmOptions:
    """Checked :class:`SlurmOptions` from a mapping (the decorator's ``slurm=``); keys in ``also`` are the caller's."""
    settings = {k: v for k, v in (settings or {}).items() if k not in also}
    known = set(SlurmOptions.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    problems = [f"unknown key {k!r}; allowed keys: {', '.join(sorted(known | set(also)))}" for k in unknown]
    if "sbatch_args" in settings:
        settings["sbatch_args"] = tuple(settings["sbatch_args"])  # type: ignore[arg-type]
    opts = SlurmOptions(**{k: v for k, v in settings.items() if k in known})  # type: ignore[arg-type]
    problems += opts.problems()
    if problems:
        raise LaunchConfigError("slurm options: " + "; ".join(problems))
    return opts


def require_slurm() -> None:
    """Raise :class:`~gpufleet.errors.LaunchConfigError` unless ``sbatch``, ``squeue`` etc. are on PATH."""
    missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        raise LaunchConfigError(
            f"running on Slurm needs its client commands ({', '.join(missing)} not found on PATH): run from a "
            "login node of the cluster, or install Slurm's client (Debian: slurm-client) with SLURM_CONF set"
        )


def _run(cmd: Sequence[str], timeout: float = _SCONTROL_WAIT_S, env: Mapping[str, str] | None = None) -> str:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"`{' '.join(cmd[:2])}` did not answer within {timeout:g} s") from e
    if done.returncode != 0:
        raise SlurmError(f"`{' '.join(cmd[:2])}` failed: {(done.stderr or done.stdout).strip()[:500]}")
    return done.stdout


def parse_show(text: str) -> dict[str, str]:
    """``scontrol show ... -o`` output (``Key=Value`` pairs, values without spaces) as a dict."""
    out: dict[str, str] = {}
    for part in text.split():
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


@dataclass(frozen=True)
class JobState:
    """What ``scontrol show job`` says of a job at one moment (``state`` ``UNKNOWN`` once Slurm forgot it)."""

    state: str
    reason: str = ""
    nodes: str = ""
    restarts: int = 0
    exit_code: str = ""
    #: When Slurm chose the job for preemption (its ``PreemptTime``; empty: never).
    preempt_time: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES or self.state == "UNKNOWN"

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED")


class SlurmJob:
    """One submitted job: its id, its state (read at most once a second) and canceling it."""

    def __init__(self, job_id: str, slurm_conf: str | None = None) -> None:
        self.job_id = job_id
        # the cluster the job went to, whatever this process's environment says later
        self._env = {**os.environ, "SLURM_CONF": slurm_conf} if slurm_conf else None
        self._lock = threading.Lock()
        self._state: JobState | None = None
        self._read = 0.0
        self._error_since: float | None = None
        self.ran = False  # seen running at least once

    @classmethod
    def submit(cls, script: Path, args: Sequence[str], env: Mapping[str, str], cwd: str) -> SlurmJob:
        """``sbatch`` the batch script with ``args`` and the environment ``env`` (exported whole)."""
        require_slurm()
        # Slurm's output variables of a job this process may itself run in are not the new job's
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        out = _run(["sbatch", "--parsable", "--export=ALL", f"--chdir={cwd}", *args, str(script)], env=env)
        return cls(out.strip().split(";")[0], env.get("SLURM_CONF"))

    def state(self, max_age_s: float = 1.0) -> JobState:
        """The job's state, at most ``max_age_s`` old."""
        with self._lock:
            now = time.monotonic()
            if self._state is not None and (now - self._read < max_age_s or self._state.state == "UNKNOWN"):
                return self._state
            try:
                info = parse_show(_run(["scontrol", "show", "job", "-o", self.job_id], env=self._env))
                restarts = int(info.get("Restarts", "0") or 0)
                preempt_time = info.get("PreemptTime", "")
                self._state = JobState(info.get("JobState", "UNKNOWN"), info.get("Reason", ""),
                                       info.get("NodeList", ""), restarts, info.get("ExitCode", ""),
                                       "" if preempt_time in ("", "None", "Unknown") else preempt_time)  # fmt: skip
                self._error_since = None
            except SlurmError as e:
                if "Invalid job id" in str(e):
                    self._state = JobState("UNKNOWN", "Slurm no longer knows the job")
                else:  # a busy or restarting controller: the last answer stands for a while
                    self._error_since = self._error_since or now
                    if self._state is None or now - self._error_since > UNREACHABLE_S:
                        raise SlurmError(f"Slurm did not answer about job {self.job_id} for "
                                         f"{now - self._error_since:.0f} s: {e}") from e  # fmt: skip
                    self._read = now
                    return self._state
            self._read = now
            if self._state.running:
                self.ran = True
            return self._state

    def requeued(self) -> bool:
        """Slurm put the job back in the queue after it ran (a requeue, with its begin-time hold)."""
        s = self.state()
        return s.restarts > 0 or (self.ran and s.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"))

    def signal_batch(self, signame: str) -> None:
        """Send ``signame`` to the job's batch step (what Slurm does before a time limit)."""
        _run(["scancel", f"--signal={signame}", "--batch", self.job_id], env=self._env)

    def signal_tasks(self, signame: str) -> None:
        """Send ``signame`` to every task of the job's steps."""
        _run(["scancel", f"--signal={signame}", self.job_id], env=self._env)

    def cancel(self, wait_s: float = 30.0) -> JobState:
        """``scancel`` (TERM to every step, KILL after the cluster's KillWait); wait until nothing runs."""
        try:
            _run(["scancel", self.job_id], env=self._env)
        except SlurmError:
            pass  # already over
        deadline = time.monotonic() + wait_s
        while True:
            s = self.state(max_age_s=0.0)
            if s.ended or s.state == "PENDING" and not self.ran or time.monotonic() > deadline:
                return s
            time.sleep(0.25)

    def nodes(self) -> list[str]:
        """The job's node names, in Slurm's order (node 0 first)."""
        listed = self.state().nodes
        if not listed or listed == "(null)":
            return []
        return _run(["scontrol", "show", "hostnames", listed], env=self._env).split()


def node_address(name: str) -> str:
    """A node's address as Slurm knows it (``NodeAddr``), or its name."""
    try:
        return parse_show(_run(["scontrol", "show", "node", "-o", name])).get("NodeAddr") or name
    except SlurmError:
        return name


def resource_args(num_nodes: int, per_node: int, use_gpus: bool, tasks_per_node: int) -> list[str]:
    """The allocation: ``num_nodes`` nodes, and per node ``per_node`` GPUs (or CPUs) for ``tasks_per_node`` tasks."""
    args = [f"--nodes={num_nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if use_gpus:
        args.append(f"--gpus-per-node={per_node}")
    else:
        args.append(f"--cpus-per-task={max(1, per_node // tasks_per_node)}")
    return args


def batch_script(folder: Path, mode: str, python: str, gpus: bool = True) -> Path:
    """Write the job's batch script into ``folder`` (paths only: the environment comes with sbatch).

    ``gpus=False``: the tasks see no GPU (Slurm unsets ``CUDA_VISIBLE_DEVICES`` for a job without
    GPUs on a node that has them, and without device cgroups every GPU is then visible).
    """
    path = folder / "slurm-batch.sh"
    cpu = "" if gpus else " cpu"
    mark = _quote(str(folder / PREEMPTED_FILE))
    path.write_text(
        "#!/bin/bash\n"
        "# Slurm's SIGUSR1 to this shell (--signal=B:USR1@N: the time limit is near) may come at once, before\n"
        "# Python is up: the shell marks the attempt preempted itself and runs the batch step as its child.\n"
        f"mark={mark}\n"
        "on_usr1() {\n"
        '  printf \'{"time": %s, "job": "%s", "signal": "USR1"}\' "$(date +%s)" "$SLURM_JOB_ID" > "$mark.$$.tmp" && mv -f "$mark.$$.tmp" "$mark"\n'
        '  echo "gpufleet: Slurm job $SLURM_JOB_ID was told to stop soon (SIGUSR1: its time limit or a preemption is near);'
        ' the ranks checkpoint at their next step and the run resubmits" >&2\n'
        "}\n"
        "trap on_usr1 USR1\n"
        f"{_quote(python)} -m gpufleet.launch.engines.slurm.node batch {mode} {_quote(str(folder))}{cpu} &\n"
        "step=$!\n"
        'while :; do wait "$step"; rc=$?; kill -0 "$step" 2>/dev/null || exit "$rc"; done  # a trapped signal ends a wait\n'
    )
    os.chmod(path, 0o700)
    return path


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
