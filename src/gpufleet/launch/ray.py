"""Ray launcher: one Ray actor per rank, gang-scheduled with a placement group.

A :class:`RayRun` has the interface of :class:`gpufleet.launch.local.LocalRun` (``run_id``,
``run_dir``, ``status``, ``pids``, ``wait()``, ``cancel()``, ``logs(rank)``). It reserves one
bundle per rank (``{"GPU": 1, "CPU": 1}``, or ``{"CPU": 1}`` for ``gpu_type="cpu"``), puts
ranks of the same node next to each other, and starts each rank through the shared worker
entry inside a :class:`~gpufleet.launch.ray_actor.RankProcess` actor. Output lines come back
to the caller's run directory (``rank-N.log``) and are streamed with a rank prefix, exactly
as for local runs; results and errors follow the same per-rank contract.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import LaunchConfigError, RankFailure, WorkerGroupError
from ..results import ERROR, OK, RunDir, new_run_id, tail
from ..states import FAILED, PENDING, RUNNING, SUCCESS
from .outcomes import LogConfig, RankGroupRun, echo_line

if TYPE_CHECKING:
    from ..api import LaunchOptions

logger = logging.getLogger(__name__)

__all__ = ["RayRun", "start_ray_run", "ray_launch", "connect", "import_ray"]

_NODE_DEATH_WAIT_S = 30.0  # how long a dead actor's node may take to be marked dead (Ray health checks)
LOST = "lost"  # the rank's Ray actor died (its node was lost, or the actor was killed)

_connected_address: str | None = None
_connected_kwargs: dict[str, Any] | None = None
_connect_lock = threading.Lock()
_active: weakref.WeakSet[RayRun] = weakref.WeakSet()


@atexit.register
def _stop_active_runs() -> None:
    for run in list(_active):
        run.cancel("the calling process is exiting", grace_period_s=1.0)


def import_ray() -> Any:
    """Import Ray, or say which extra installs it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "running on a Ray cluster needs Ray: pip install 'gpufleet[ray]'"
        ) from e
    return ray


def connect(address: str, init_kwargs: dict[str, Any] | None = None) -> Any:
    """Connect this process to the Ray cluster at ``address``; later calls reuse the connection.

    A connection this module made with other settings (another address, or another
    runtime_env because another call's code must travel) is replaced; a connection the user
    made with ``ray.init`` is reused as it is.
    """
    global _connected_address, _connected_kwargs
    ray = import_ray()
    kwargs: dict[str, Any] = {"log_to_driver": False}
    kwargs.update(init_kwargs or {})
    with _connect_lock:
        if ray.is_initialized():
            if _connected_address is None:
                logger.info("using the Ray connection made by ray.init (its runtime_env is kept)")
                return ray
            if _connected_address == address and _connected_kwargs == kwargs:
                return ray
            ray.shutdown()
        handlers = _python_signal_handlers()
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as e:
            raise LaunchConfigError(
                f"cannot connect to the Ray cluster at {address!r}: {e}. Start one with "
                "'ray start --head' (see docs/multinode.md) or fix the address."
            ) from e
        finally:
            _restore_signal_handlers(handlers)
        _connected_address, _connected_kwargs = address, kwargs
    return ray


_GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _python_signal_handlers() -> dict[int, Any]:
    """This process's Python handlers of SIGTERM, SIGINT and SIGHUP (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}


def _restore_signal_handlers(handlers: dict[int, Any]) -> None:
    """Put back the handlers ``ray.init`` replaced.

    Ray's core worker installs a native handler for SIGTERM that logs a stack and ends the process
    at once; a gpufleet supervisor (cancel = SIGTERM) or a caller with its own handlers would die
    without stopping its runs. Python still reports its own handler there, so each is installed again.
    """
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


# -- what travels to the workers --------------------------------------------------------------
def _is_installed(path: Path) -> bool:
    parts = set(path.parts)
    return bool(parts & {"site-packages", "dist-packages"}) or str(path).startswith(sys.base_prefix)


def _code_paths(call_bytes: bytes) -> list[str]:
    """Local code the call needs on the workers: gpufleet itself and the function's package."""
    import cloudpickle

    paths = [str(Path(__file__).resolve().parents[1])]  # the gpufleet package
    try:
        func, _, _ = cloudpickle.loads(call_bytes)
    except Exception:  # the workers report it with the rank's traceback
        return paths
    module_name = getattr(func, "__module__", None) or "__main__"
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module_name == "__main__" or not file:
        return paths  # pickled by value (notebook cells, scripts)
    top = sys.modules.get(module_name.split(".")[0])
    top_file = getattr(top, "__file__", None)
    if top_file is None:
        return paths
    top_path = Path(top_file).resolve()
    target = top_path.parent if top_path.name == "__init__.py" else top_path
    if not _is_installed(target) and str(target) not in paths:
        paths.append(str(target))
    return paths


def _runtime_env(opts: LaunchOptions, call_bytes: bytes) -> dict[str, Any]:
    """The job's runtime_env: the user's own one plus the local code this call needs.

    Ray uploads local ``py_modules`` only for a job (``ray.init``), so the code of the call
    decides the job's runtime_env.
    """
    base = dict(opts.ray_init_kwargs.get("runtime_env") or {})
    py_modules = list(base.get("py_modules") or [])
    for path in _code_paths(call_bytes):
        if path not in py_modules:
            py_modules.append(path)
    base["py_modules"] = py_modules
    excludes = list(base.get("excludes") or [])
    base["excludes"] = excludes + [e for e in ("__pycache__", "*.pyc", ".git") if e not in excludes]
    return base


# -- placement ---------------------------------------------------------------------------------
def _accelerator_resource(ray: Any, gpu_type: str) -> str:
    """Ray's ``accelerator_type:<T>`` resource for ``gpu_type``, checked against the cluster."""
    types = sorted(
        k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:")
    )
    for t in types:
        if t.lower() == gpu_type.lower():
            return f"accelerator_type:{t}"
    raise LaunchConfigError(
        f"gpu_type={gpu_type!r} was asked for, but the Ray cluster has "
        f"{', '.join(types) if types else 'no GPUs with a known type'}"
    )


def _bundles(ray: Any, gpus: int | None, gpu_type: str | None) -> tuple[list[dict[str, float]], bool]:
    """One placement-group bundle per rank, and whether ranks use GPUs."""
    resources = ray.cluster_resources()
    if gpu_type is not None and gpu_type.lower() == "cpu":
        if gpus is None:
            raise LaunchConfigError(
                "gpu_type='cpu' on a Ray cluster needs gpus=<number of CPU workers>"
            )
        have = int(resources.get("CPU", 0))
        if gpus > have:
            raise LaunchConfigError(f"asked for {gpus} CPU workers but the Ray cluster has {have} CPUs")
        return [{"CPU": 1.0} for _ in range(gpus)], False
    have = int(resources.get("GPU", 0))
    if gpus is None:
        if have == 0:
            raise LaunchConfigError(
                "the Ray cluster has no GPUs; pass gpu_type='cpu' and gpus=N for CPU workers"
            )
        gpus = have
    if gpus > have:
        raise LaunchConfigError(f"asked for {gpus} GPUs but the Ray cluster has {have}")
    bundle: dict[str, float] = {"GPU": 1.0, "CPU": 1.0}
    if gpu_type:
        bundle[_accelerator_resource(ray, gpu_type)] = 0.001
    return [dict(bundle) for _ in range(gpus)], True


def _rank_layout(bundle_nodes: dict[int, str]) -> list[tuple[int, str, int, int, int]]:
    """Ranks in node order: (bundle index, node id, node rank, local rank, local world size).

    Bundles on the same node get consecutive ranks; nodes are ordered by their first bundle.
    """
    by_node: dict[str, list[int]] = {}
    for index in sorted(bundle_nodes):
        by_node.setdefault(bundle_nodes[index], []).append(index)
    layout = []
    for node_rank, (node_id, indices) in enumerate(by_node.items()):
        for local_rank, index in enumerate(indices):
            layout.append((index, node_id, node_rank, local_rank, len(indices)))
    return layout


# -- the run -----------------------------------------------------------------------------------
class _RankLog:
    """Writes one rank's lines into its log file and, filtered, to the caller's streams."""

    def __init__(self, rank: int, path: Path, logs: LogConfig) -> None:
        self.rank = rank
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._logs = logs
        self._out: IO[str] = sys.stdout
        self._err: IO[str] = sys.stderr

    def write(self, lines: list[tuple[bool, bytes]], dropped: int = 0) -> None:
        if dropped:
            lines = [(True, f"[gpufleet: {dropped} lines of output were dropped]\n".encode())] + lines
        for is_stderr, line in lines:
            if self._file.closed:
                return
            self._file.write(line)
            echo_line(self._logs, self.rank, is_stderr, line, self._out, self._err)

    def close(self) -> None:
        self._file.close()


class RayRun(RankGroupRun):
    """One group of ranks on a Ray cluster, started by :func:`start_ray_run`."""

    _POLL_WAIT_S = 0.5
    _UNREACHABLE_GRACE_S = 60.0
    _SCHEDULE_LOG_S = 30.0
    _KIND_HEADLINES = {LOST: "a rank's Ray actor or node was lost; every other rank was stopped"}

    def __init__(
        self, opts: LaunchOptions, address: str, call_bytes: bytes, name: str, attempt: int, time_left: float | None = None
    ) -> None:
        # time_left: what the call's timeout leaves for this attempt (a retry); None: the whole timeout
        timeout = opts.timeout if time_left is None or opts.timeout is None else time_left
        super().__init__(timeout, opts.grace_period_s, opts.timeout)
        self.opts = opts
        self.address = address
        self.attempt = attempt
        self.run_id = new_run_id(name)
        self.run_dir = RunDir.create(opts.runs_dir, self.run_id)
        self.logs_config = LogConfig(enabled=opts.stream_logs, full_ranks=opts.log_ranks, stderr=opts.stream_stderr)
        self.master_addr = ""
        self.master_port = 0
        self.node_ranks: list[int] = []
        self.node_ids: list[str] = []
        self._env = dict(opts.env)
        self._call_bytes = call_bytes
        self._ray: Any = None
        self._pg: Any = None
        self._actors: list[Any] = []
        self._rank_logs: list[_RankLog] = []
        self._num_ranks = 0
        self._use_gpus = False
        self._outcomes: dict[int, dict[str, Any]] = {}
        self._unreachable_since: dict[int, float] = {}
        self._started = time.monotonic()

    @property
    def num_ranks(self) -> int:
        """How many ranks the run has (known once :meth:`start` has checked the cluster)."""
        return self._num_ranks

    @property
    def num_nodes(self) -> int | None:
        """How many Ray nodes the ranks were placed on; None until they are placed."""
        return len(set(self.node_ids)) if self.node_ids else None

    @property
    def cluster_hosts(self) -> list[str]:
        """The addresses of the cluster's live nodes, once :meth:`start` has connected."""
        if self._ray is None:
            return []
        return sorted({n["NodeManagerAddress"] for n in self._ray.nodes() if n.get("Alive")})

    def add_env(self, env: dict[str, str]) -> None:
        """Add ``env`` to every rank's environment; only before the ranks start in :meth:`wait`."""
        self._env.update(env)

    # -- starting -------------------------------------------------------------------------
    def start(self) -> RayRun:
        """Connect to the cluster, check the request against it and reserve the bundles."""
        from ray.util.placement_group import placement_group

        init_kwargs = dict(self.opts.ray_init_kwargs)
        init_kwargs["runtime_env"] = _runtime_env(self.opts, self._call_bytes)
        self._ray = connect(self.address, init_kwargs)
        bundles, self._use_gpus = _bundles(self._ray, self.opts.gpus, self.opts.gpu_type)
        self._num_ranks = len(bundles)
        self._rank_logs = [
            _RankLog(r, self.run_dir.log(r), self.logs_config) for r in range(self._num_ranks)
        ]
        self._pg = placement_group(bundles, strategy="PACK", name=f"gpufleet-{self.run_id}")
        self._started = time.monotonic()
        _active.add(self)
        logger.debug("run %s: placement group of %d bundles requested", self.run_id, len(bundles))
        return self

    def _deadline(self) -> float | None:
        timeout = self._timeout_s
        return None if timeout is None else self._started + timeout

    def _schedule(self) -> bool:
        """Wait for the placement group, then start one actor per rank; False if stopped."""
        ray = self._ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .ray_actor import RankProcess

        ready = self._pg.ready()
        waited = 0.0
        while True:
            done, _ = ray.wait([ready], timeout=self._POLL_WAIT_S)
            if done:
                break
            waited += self._POLL_WAIT_S
            if self._stop_reason is not None or self._past_deadline():
                return False
            if waited % self._SCHEDULE_LOG_S < self._POLL_WAIT_S:
                logger.warning(
                    "run %s: waiting %.0f s for the Ray cluster to free %d bundles",
                    self.run_id, waited, self._num_ranks,
                )
        table = placement_group_table(self._pg)
        bundle_nodes = {int(k): v for k, v in table["bundles_to_node_id"].items()}
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        layout = _rank_layout(bundle_nodes)
        num_nodes = len({node for _, node, _, _, _ in layout})
        runtime_env = {"env_vars": {"GPUFLEET_RUN_ID": self.run_id}}
        actor_cls = ray.remote(RankProcess)
        for rank, (bundle, _, _, _, _) in enumerate(layout):
            actor = actor_cls.options(
                num_cpus=1,
                num_gpus=1 if self._use_gpus else 0,
                max_restarts=0,
                max_concurrency=4,  # poll, stop and stack dumps may overlap
                runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=bundle
                ),
                name=f"gpufleet-{self.run_id}-rank{rank}",
            ).remote(self.run_id, rank)
            self._actors.append(actor)
        self.node_ids = [node for _, node, _, _, _ in layout]
        self.node_ranks = [node_rank for _, _, node_rank, _, _ in layout]
        self.master_addr = node_ips.get(layout[0][1], "127.0.0.1")
        port_ref = self._actors[0].free_port.remote()
        while True:
            done, _ = ray.wait([port_ref], timeout=self._POLL_WAIT_S)
            if done:
                break
            if self._stop_reason is not None or self._past_deadline():
                return False
        self.master_port = ray.get(port_ref)
        call_ref = ray.put(self._call_bytes)
        self._call_bytes = b""
        starts = []
        for rank, (_, node_id, node_rank, local_rank, local_world) in enumerate(layout):
            env = {
                **self._env,
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self._num_ranks),
                "LOCAL_WORLD_SIZE": str(local_world),
                "NODE_RANK": str(node_rank),
                "GROUP_RANK": str(node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(self._num_ranks),
                "NUM_NODES": str(num_nodes),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "TORCHELASTIC_RUN_ID": self.run_id,
                "PYTHONUNBUFFERED": "1",
                "GPUFLEET_RUN_ID": self.run_id,
                "GPUFLEET_ATTEMPT": str(self.attempt),
                "GPUFLEET_RAY_NODE_ID": node_id,
                "OMP_NUM_THREADS": self._env.get("OMP_NUM_THREADS", "1"),
            }
            if not self._use_gpus:
                env["CUDA_VISIBLE_DEVICES"] = ""
            starts.append(self._actors[rank].start.remote(call_ref, env))
        try:
            ray.get(starts)
        except ray.exceptions.RayError as e:
            self._record_lost_from(starts, e)
        with self._lock:
            if self.status == PENDING:
                self.status = RUNNING
        logger.debug(
            "run %s: %d ranks on %d nodes, master %s:%d",
            self.run_id, self._num_ranks, num_nodes, self.master_addr, self.master_port,
        )
        return True

    def _past_deadline(self) -> bool:
        deadline = self._deadline()
        return deadline is not None and time.monotonic() > deadline

    # -- watching -------------------------------------------------------------------------
    def _watch(self) -> None:
        """Start the ranks once their bundles are free, then watch them until the end."""
        try:
            if self._schedule():
                self._watch_ranks()
            elif self._stop_reason is not None:
                self._finish_canceled()
            else:
                self._finish_timeout()
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            if not self._finished.is_set():
                self._stop(f"stopped because the launcher failed: {e}", 1.0)
                self._finalize(FAILED, WorkerGroupError, f"the Ray launcher failed: {type(e).__name__}: {e}")
            raise

    def _watch_ranks(self) -> None:
        ray = self._ray
        polls: dict[Any, int] = {}

        def issue(rank: int) -> None:
            polls[self._actors[rank].poll.remote(self._POLL_WAIT_S)] = rank

        for rank in range(self._num_ranks):
            if rank not in self._failures:
                issue(rank)
        while True:
            if self._stop_reason is not None:
                self._finish_canceled()
                return
            if self._failures:
                self._finish_failed()
                return
            if len(self._done) == self._num_ranks:
                self._stop("finished", 0.0)
                self._finalize(SUCCESS)
                return
            if self._past_deadline():
                self._finish_timeout()
                return
            ready, _ = ray.wait(list(polls), num_returns=1, timeout=self._POLL_WAIT_S)
            for ref in ready:
                rank = polls.pop(ref)
                try:
                    report = ray.get(ref)
                except ray.exceptions.ActorUnavailableError as e:
                    # Unreachable for now (a restarting link, or a node going down): ask
                    # again until Ray says the actor or its node is dead, within a grace.
                    first = self._unreachable_since.setdefault(rank, time.monotonic())
                    if self._node_alive(rank) and time.monotonic() - first < self._UNREACHABLE_GRACE_S:
                        time.sleep(self._POLL_WAIT_S)
                        issue(rank)
                    else:
                        self._failures[rank] = self._lost(rank, e)
                    continue
                except ray.exceptions.RayError as e:
                    self._failures[rank] = self._lost(rank, e)
                    continue
                self._unreachable_since.pop(rank, None)
                if self._absorb(rank, report) is None:
                    issue(rank)

    def _absorb(self, rank: int, report: dict[str, Any]) -> str | None:
        """Take one poll report of ``rank``; returns its final state once it has one."""
        self._rank_logs[rank].write(report["lines"], report.get("dropped", 0))
        if report["outcome"] is not None:
            self._outcomes[rank] = report["outcome"]
        rec = self._outcomes.get(rank)
        if self._known(rank):
            return "known"
        if rec is not None and rec["status"] == ERROR:
            return self._take_outcome(rank, rec)
        code = report["exit_code"]
        if code is None:
            return None
        if rec is not None and rec["status"] == OK:
            return self._take_outcome(rank, rec)
        self._failures[rank] = self._failure_from_exit(rank, code)
        return ERROR

    def _absorb_stopped(self, rank: int, report: dict[str, Any]) -> None:
        """Take the last report of a rank that gpufleet stopped: its exit code is ours."""
        self._rank_logs[rank].write(report["lines"], report.get("dropped", 0))
        if report["outcome"] is not None:
            self._outcomes[rank] = report["outcome"]
        rec = self._outcomes.get(rank)
        if not self._known(rank):
            self._take_outcome(rank, rec)

    def _node_alive(self, rank: int) -> bool:
        node = self.node_ids[rank] if rank < len(self.node_ids) else None
        try:
            alive = {n["NodeID"]: n["Alive"] for n in self._ray.nodes()}
        except Exception:  # noqa: BLE001 - the cluster itself is unreachable
            return False
        return alive.get(node, False) if node else True

    def _node_dies_soon(self, rank: int, within_s: float = _NODE_DEATH_WAIT_S) -> bool:
        """Whether the rank's node is, or within ``within_s`` is marked, dead by the cluster.

        An actor on a node that went away often fails (socket closed) a few seconds before the
        cluster marks the node dead; waiting that long tells a lost node from a dead actor. A
        cancel or timeout ends the wait: naming the failure then is not worth a slower stop.
        """
        deadline = time.monotonic() + within_s
        while True:
            if not self._node_alive(rank):
                return True
            if time.monotonic() >= deadline or self._stop_reason is not None or self._past_deadline():
                return False
            time.sleep(0.5)

    def _lost(self, rank: int, error: BaseException) -> RankFailure:
        node = self.node_ids[rank] if rank < len(self.node_ids) else "?"
        where = f"node {node[:12]}"
        node_died = "node" in str(error).lower() and "died" in str(error).lower() or self._node_dies_soon(rank)
        if node_died:
            reason = f"its Ray node ({where}) was lost"
        elif rank in self._unreachable_since:
            waited = time.monotonic() - self._unreachable_since[rank]
            reason = f"its Ray actor on {where} was unreachable for {waited:.0f} s"
        else:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            reason = f"its Ray actor on {where} died ({type(error).__name__}: {first[:300]})"
        log = self.run_dir.log(rank)
        return RankFailure(
            rank=rank, kind=LOST, time=time.time(),
            message=f"the rank stopped because {reason}",
            log_path=str(log), log_tail=tail(log),
        )

    def _record_lost_from(self, refs: list[Any], error: BaseException) -> None:
        for rank, ref in enumerate(refs):
            try:
                self._ray.get(ref, timeout=5)
            except Exception as e:  # noqa: BLE001 - recorded as that rank's failure
                self._failures.setdefault(rank, self._lost(rank, e))

    # -- stopping -------------------------------------------------------------------------
    def _stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> None:
        """Stop every rank, kill the actors and release the placement group."""
        ray = self._ray
        t_stop = time.time()
        try:
            if dump_stacks and self._actors:
                for a in self._actors:
                    a.dump_stacks.remote()
                time.sleep(1.0)
            refs = {a.stop.remote(grace_period_s): r for r, a in enumerate(self._actors)}
            if refs:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=grace_period_s + 10.0)
                for ref in ready:
                    rank = refs[ref]
                    try:
                        report = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        if rank not in self._done and rank not in self._failures and reason != "finished":
                            self._failures[rank] = self._lost(rank, e)
                        continue
                    self._absorb_stopped(rank, report)
        finally:
            self._release()
            for rank in range(self._num_ranks):
                if not self._known(rank):
                    self._mark_stopped(rank, reason, t_stop)

    def _release(self) -> None:
        """Kill every actor and remove the placement group (safe to call twice)."""
        ray = self._ray
        if ray is None:
            return
        actors, self._actors = self._actors, []
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        pg, self._pg = self._pg, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                logger.warning("run %s: could not remove its placement group", self.run_id)

    # -- finishing ------------------------------------------------------------------------
    def _close(self, status: str) -> None:
        for log in self._rank_logs:
            log.close()
        _active.discard(self)

    # -- inspection -----------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Empty: the ranks' processes live on the cluster's nodes, not on this machine."""
        return []


def start_ray_run(opts: LaunchOptions, address: str, call_bytes: bytes, name: str, attempt: int) -> RayRun:
    """Start one attempt of a call on the Ray cluster at ``address`` (used by ``@distributed``)."""
    return RayRun(opts, address, call_bytes, name, attempt).start()


def ray_launch(func: Callable[..., Any] | None = None, **settings: Any) -> Any:
    """Like :func:`gpufleet.distributed`, but Ray spans the ranks and ``func`` is its driver.

    See :func:`gpufleet.launch.ray_cluster.ray_launch`.
    """
    from .ray_cluster import ray_launch as _ray_launch

    return _ray_launch(func, **settings)
