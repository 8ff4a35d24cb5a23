"""Ray actors that run one child process on their node: a rank, or a workload node's command.

:class:`RankProcess` starts ``python -m gpufleet.launch.worker DIR RANK`` (the same entry the
local launcher uses) in a node-local directory; :class:`NodeCommand` starts a workload's
``bash -c COMMAND``. Both collect the child's output line by line and hand the lines, the
exit code and (for ranks) the outcome record back to the caller through ``poll``.
Running the rank in a child process keeps signals, exit codes and process-tree teardown
identical to local runs; the child kills itself if the actor process goes away.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from ....results import RunDir, read_outcome
from ... import node as node_helpers
from ...node import envcontract
from ...ports import find_free_port
from ...proctree import popen_in_own_group, stop_tree
from ...spec import PARENT_PID_ENV, Payload, default_threads

# Lines kept between two polls; beyond this the oldest are dropped (the caller is told).
_MAX_PENDING_LINES = 100_000


def _stop_tree(proc: subprocess.Popen[bytes], grace_period_s: float) -> None:
    """Stop the child's process group and every descendant: TERM, grace period, KILL.

    Without the run's id: other ranks of the same run may share this node, so the id cannot
    tell this child's processes from theirs.
    """
    stop_tree([proc], grace_period_s, poll_s=0.05)


class ChildProcess:
    """Owns one child process on the node where Ray placed this actor; hands its output back."""

    def __init__(self, prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: list[tuple[bool, bytes]] = []
        self._dropped = 0
        self._cond = threading.Condition()
        self._pumps: list[threading.Thread] = []
        self._sampler: Any = None  # this node's system metrics, when this actor samples them
        self._sampling_lock = threading.Lock()
        self._sampling_stopped = False

    def _sample_node(self, env: dict[str, str], node_id: str) -> None:
        """Log this node's GPU/CPU/RAM into the tracked run while the child runs.

        Started on a thread of its own: the sampler imports MLflow (seconds, a minute on a loaded
        machine), and the rank's start must not wait for it (the call stays PENDING meanwhile).
        """
        if env.get("MLFLOW_RUN_ID"):
            threading.Thread(target=self._start_sampler, args=(env, node_id), name="gpufleet-node-sampler",
                             daemon=True).start()  # fmt: skip

    def _start_sampler(self, env: dict[str, str], node_id: str) -> None:
        try:
            from ....tracking.system_metrics import start_node_sampler
        except ImportError:
            return
        sampler = start_node_sampler(env, node_id)
        with self._sampling_lock:
            if not self._sampling_stopped:
                self._sampler, sampler = sampler, None
        if sampler is not None:  # the child ended while the sampler started: one sample, then stop
            sampler.stop()

    def _stop_sampling(self) -> None:
        """Stop the node's sampler (it logs a last sample). Never waits for one still starting: that
        one stops itself, with its one sample, once started (tracking never holds up a run's end)."""
        with self._sampling_lock:
            self._sampling_stopped = True
            sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: Ray node id, the cluster's GCS address, node address, host name and pid."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "gcs_address": ray.get_runtime_context().gcs_address,  # the cluster, as its nodes reach it
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A TCP port free on this node (for the rendezvous store of rank 0 / node 0)."""
        return find_free_port("0.0.0.0")

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        self._proc = popen_in_own_group(argv, env, cwd)
        for pipe, is_stderr in ((self._proc.stdout, False), (self._proc.stderr, True)):
            t = threading.Thread(target=self._pump, args=(pipe, is_stderr), daemon=True)
            t.start()
            self._pumps.append(t)
        return self._proc.pid

    def _outcome(self) -> dict[str, Any] | None:
        return None

    def _pump(self, pipe: IO[bytes], is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            with self._cond:
                self._lines.append((is_stderr, line))
                if len(self._lines) > _MAX_PENDING_LINES:
                    del self._lines[0]
                    self._dropped += 1
                self._cond.notify_all()
        pipe.close()

    def poll(self, wait_s: float = 0.5) -> dict[str, Any]:
        """New output lines, the exit code (``None`` while running) and the outcome once.

        Waits up to ``wait_s`` for something new, so the caller can poll in a loop.
        """
        proc = self._proc
        if proc is None:
            return {"lines": [], "exit_code": None, "outcome": None, "dropped": 0}
        with self._cond:
            if not self._lines and proc.poll() is None:
                self._cond.wait(wait_s)
        code = proc.poll()
        if code is not None:
            for t in self._pumps:  # the last lines before the exit
                t.join(2.0)
            self._stop_sampling()
        outcome = self._outcome()
        with self._cond:
            lines, self._lines = self._lines, []
            dropped, self._dropped = self._dropped, 0
        return {"lines": lines, "exit_code": code, "outcome": outcome, "dropped": dropped, "progress": self._progress()}

    def _progress(self) -> dict[str, Any] | None:
        return None

    def stacks(self, timeout_s: float = 3.0) -> str | None:
        """The child's stack of every thread, now (a gpufleet rank with the hang watchdog on), or None."""
        return None

    def dump_stacks(self) -> None:
        """Make the worker print every thread's stack into its log (faulthandler, SIGUSR1)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.kill(self._proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def finish(self, wait_s: float, grace_period_s: float) -> dict[str, Any]:
        """After the child returned its outcome: let it exit by itself (up to ``wait_s``), then stop what is left."""
        if self._proc is not None:
            try:
                self._proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        return self.stop(grace_period_s)

    def stop(self, grace_period_s: float) -> dict[str, Any]:
        """Stop the worker's process tree (TERM, grace, KILL); returns a last :meth:`poll`."""
        if self._proc is not None:
            _stop_tree(self._proc, grace_period_s)
            self._proc.wait()
        self._stop_sampling()
        last = self.poll(0.0)
        shutil.rmtree(self.dir, ignore_errors=True)
        return last


class RankProcess(ChildProcess):
    """One rank of a ``@distributed`` run: the shared worker entry in a child process."""

    def __init__(self, run_id: str, rank: int) -> None:
        super().__init__(f"gpufleet-{run_id}-rank{rank}-")
        self.rank = rank
        self.run_dir = RunDir(self.dir)
        self._outcome_sent = False

    def start(self, payload: Payload, env: dict[str, str]) -> int:
        """Start the rank's worker process with ``env`` on top of the actor's environment.

        ``payload`` is the launch spec's payload as it is (``fast_exit`` included); its import
        paths are the caller's, which mean nothing here, so the actor's own are used.
        """
        replace(payload, sys_path=()).write(self.run_dir.payload)
        full_env = dict(os.environ)
        full_env.update(env)
        full_env.update(default_threads(full_env, int(env.get(envcontract.LOCAL_WORLD_SIZE, "1"))))
        # The actor's import path holds the code shipped through the runtime_env.
        paths = [p for p in sys.path if p and os.path.exists(p)]
        if full_env.get("PYTHONPATH"):
            paths.append(full_env["PYTHONPATH"])
        full_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        full_env[PARENT_PID_ENV] = str(os.getpid())
        full_env[envcontract.RUN_DIR] = str(self.dir)
        argv = [sys.executable, "-m", "gpufleet.launch.worker", str(self.dir), str(self.rank)]
        pid = self._spawn(argv, full_env, os.getcwd())
        if env.get(envcontract.LOCAL_RANK) == "0":  # one sampler per node: its first rank's actor
            self._sample_node(full_env, f"node{env.get(envcontract.NODE_RANK, '0')}")
        return pid

    def _progress(self) -> dict[str, Any] | None:
        from ...progress import read_progress

        return read_progress(self.dir, self.rank)

    def stacks(self, timeout_s: float = 3.0) -> str | None:

        from ...progress import request_stacks

        if self._proc is None or self._proc.poll() is not None or not (self.dir / f"progress-{self.rank}.json").exists():
            return None
        return request_stacks(self._proc.pid, self.dir / f"stacks-{self.rank}.txt", timeout_s)

    def _outcome(self) -> dict[str, Any] | None:
        if self._outcome_sent:
            return None
        outcome = read_outcome(self.run_dir.outcome(self.rank))
        self._outcome_sent = outcome is not None
        return outcome


#: Set in a node actor's environment when Ray ships the workload's code snapshot to its node.
SHIPPED_CODE_ENV = envcontract.SHIPPED_CODE
_BUILD_THEN_RUN = (
    f'bin=$("${envcontract.NODE_PYTHON}" "${envcontract.ENVS_PY}" | tail -n 1) && [ -d "$bin" ] || exit 97\n'
    'export PATH="$bin:$PATH" VIRTUAL_ENV="$(dirname "$bin")"\n'
    f'exec bash -c "${envcontract.NODE_COMMAND}"\n'
)


class NodeCommand(ChildProcess):
    """One node of a CLI workload: its bash command in a child process on this node."""

    def __init__(self, run_id: str, node_rank: int) -> None:
        super().__init__(f"gpufleet-{run_id}-node{node_rank}-")
        self.node_rank = node_rank

    def start(self, command: str, env: dict[str, str], cwd: str, files: dict[str, bytes]) -> int:
        """Run ``bash -c command`` in ``cwd`` with ``env`` on top of this node's environment.

        ``files`` maps environment variable names to file contents: each is written on this
        node and the variable points at it (the hyperparameters file, for example).
        """
        full_env = dict(os.environ)
        full_env.update(env)
        if not os.path.isdir(cwd):
            if os.environ.get(SHIPPED_CODE_ENV) != "1":
                raise FileNotFoundError(
                    f"the workload's code folder {cwd} is not on node {socket.gethostname()}: put "
                    f"{envcontract.HOME} (where run folders live) on storage every node mounts"
                )
            # No shared storage: run in the copy of the code snapshot Ray brought to this node
            # (the actor's runtime_env working_dir, its current directory).
            cwd = os.getcwd()
            full_env[envcontract.CODE_SOURCE_PATH] = cwd
        # The run's environment (when this node sees it) and the node's own Python come first,
        # so `torchrun` and `python` resolve on every node.
        run_bin = env.get(envcontract.SUPERVISOR_BIN, "")
        bins = [run_bin, os.path.dirname(sys.executable)]
        bins = [b for b in bins if b and os.path.isdir(b)]
        full_env["PATH"] = os.pathsep.join(list(dict.fromkeys(bins)) + [full_env.get("PATH", "")])
        for name, data in files.items():
            path = self.dir / name.lower()
            path.write_bytes(data)
            full_env[name] = str(path)
        node_dir = Path(node_helpers.__file__).resolve().parent  # run by path: stdlib only
        if env.get(envcontract.DEPENDENCIES) and not os.path.isdir(run_bin):
            # This node does not see the run's environment: it builds its own (cached per spec
            # under this node's GPUFLEET_HOME), its pip output in the node's log, then the command
            # runs with that environment first on PATH.
            full_env[envcontract.NODE_COMMAND] = command
            full_env[envcontract.NODE_PYTHON] = sys.executable
            full_env[envcontract.ENVS_PY] = str(node_dir / "envs.py")
            command = _BUILD_THEN_RUN
        # The guard leads the command's process group and stops it if this actor dies (a killed
        # actor or raylet would otherwise leave the command running on the node). Run by path: it
        # needs nothing but the standard library.
        guard = str(node_dir / "guard.py")
        pid = self._spawn([sys.executable, guard, "--", "bash", "-c", command], full_env, cwd)
        self._sample_node(full_env, f"node{self.node_rank}")
        return pid
