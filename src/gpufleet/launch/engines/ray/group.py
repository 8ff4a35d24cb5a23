"""Ray worker group: one Ray actor per rank, gang-scheduled with a placement group.

It reserves one bundle per rank (``{"GPU": 1, "CPU": 1}``, or ``{"CPU": 1}`` for
``gpu_type="cpu"``), puts ranks of the same node next to each other, and starts each rank
through the shared worker entry inside a :class:`~gpufleet.launch.engines.ray.actor.RankProcess`
actor. Output lines come back to the caller's run directory (``rank-N.log``) and are streamed
with a rank prefix, exactly as for local runs; outcomes follow the same per-rank contract.
Its size is one concern: asking the cluster for room, placing ranks, and telling a rank's
failure from the loss of its actor or node.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ....errors import LaunchConfigError, RankFailure
from ....results import ERROR, OK, RunDir, tail
from ... import failures
from ...group import GroupStatus, WorkerGroup, reap_later
from ...logstream import LogConfig, RankLog, failure_text
from ...node import envcontract
from ...spec import LaunchSpec, Rendezvous, slots_by_node
from .connect import before_disconnect
from .engine import POLL_WAIT_S, RayEngine

__all__ = ["RayWorkerGroup", "RayPlacement"]

logger = logging.getLogger(__name__)

_reapers: set[threading.Thread] = set()  # not daemons: the interpreter waits for them at exit
_disconnecting = threading.Event()  # set while this process's Ray connection is about to end
_NODE_DEATH_WAIT_S = 30.0  # how long a dead actor's node may take to be marked dead (Ray health checks)


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


class RayPlacement:
    """What a Ray group asks the cluster for: ``gpus`` ranks, of ``gpu_type`` (or ``"cpu"``)."""

    def __init__(self, address: str, gpus: int | None, gpu_type: str | None, init_kwargs: dict[str, Any]) -> None:
        self.address = address
        self.gpus = gpus
        self.gpu_type = gpu_type
        self.init_kwargs = init_kwargs


class RayWorkerGroup(WorkerGroup):
    """One attempt's ranks as Ray actors, each running the rank in a child process on its node.

    Its engine (:class:`~gpufleet.launch.engines.ray.engine.RayEngine`, the one a workload's nodes
    run on) holds the connection, the placement group and the actors. ``start()`` connects, checks the request against the cluster (a wrong request raises
    :class:`LaunchConfigError` there) and asks for a placement group; the ranks start at the
    first :meth:`poll` that finds their bundles placed.
    """

    starts_at_once = False
    _POLL_WAIT_S = POLL_WAIT_S
    _UNREACHABLE_GRACE_S = 60.0
    _SCHEDULE_LOG_S = 30.0

    def __init__(self, spec: LaunchSpec, run_dir: RunDir, placement: RayPlacement, logs: LogConfig) -> None:
        super().__init__(spec, run_dir)
        self.placement = placement
        self._logs = logs
        self.rendezvous: Rendezvous | None = None
        self.node_ids: list[str] = []
        self.engine = RayEngine(placement.address, spec.run_id)
        self._rank_logs: list[RankLog] = []
        self._num_ranks = 0
        self._use_gpus = False
        self._scheduled = False
        self._schedule_started = time.monotonic()
        self._results: dict[int, dict[str, Any]] = {}
        self._failures: dict[int, RankFailure] = {}
        self._outcomes: dict[int, dict[str, Any]] = {}
        self._polls: dict[Any, int] = {}
        self._progress: dict[int, dict[str, Any]] = {}
        self._unreachable_since: dict[int, float] = {}
        self._closed = False

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

    @property
    def num_nodes(self) -> int | None:
        return len(set(self.node_ids)) if self.node_ids else None

    @property
    def cluster_hosts(self) -> list[str]:
        """The addresses of the cluster's live nodes, once :meth:`start` has connected."""
        if self.engine.ray is None:
            return []
        return sorted({n["NodeManagerAddress"] for n in self.engine.ray.nodes() if n.get("Alive")})

    # -- starting -------------------------------------------------------------------------
    def start(self) -> None:
        from .connect import runtime_env_for

        p = self.placement
        assert self.spec.payload is not None, "a Ray worker group runs a payload"
        init_kwargs = dict(p.init_kwargs)
        init_kwargs["runtime_env"] = runtime_env_for(p.init_kwargs.get("runtime_env"), self.spec.payload.call)
        ray = self.engine.connect(init_kwargs)
        bundles, self._use_gpus = _bundles(ray, p.gpus, p.gpu_type)
        self._num_ranks = len(bundles)
        self._rank_logs = [RankLog(r, self.run_dir.log(r), self._logs) for r in range(self._num_ranks)]
        self.engine.reserve(bundles, "PACK", name=f"gpufleet-{self.run_id}")
        self._schedule_started = time.monotonic()
        logger.debug("run %s: placement group of %d bundles requested", self.run_id, len(bundles))

    def _try_schedule(self, wait_s: float) -> bool:
        """Start one actor per rank once the placement group is ready; False while it is not."""
        engine, ray = self.engine, self.engine.ray
        if not engine.reserved(max(wait_s, self._POLL_WAIT_S)):
            waited = time.monotonic() - self._schedule_started
            if waited % self._SCHEDULE_LOG_S < self._POLL_WAIT_S:
                logger.warning(
                    "run %s: waiting %.0f s for the Ray cluster to free %d bundles",
                    self.run_id, waited, self._num_ranks,
                )
            return False
        node_ips = engine.node_ips()
        layout = _rank_layout(engine.bundle_nodes())
        self.node_ids = [node for _, node, _, _, _ in layout]
        self.spec = _with_nodes(self.spec, self._num_ranks, len(set(self.node_ids)), self._use_gpus)
        for rank, (bundle, _, _, _, _) in enumerate(layout):
            engine.spawn("rank", rank, f"gpufleet-{self.run_id}-rank{rank}", bundle=bundle, num_cpus=1,
                         num_gpus=1 if self._use_gpus else 0)  # fmt: skip
        master_addr = node_ips.get(layout[0][1], "127.0.0.1")
        port_ref = engine.actors[0].free_port.remote()
        engine.wait_for([port_ref], self.abort, "ranks")
        self.rendezvous = Rendezvous(master_addr, ray.get(port_ref))
        payload_ref = ray.put(self.spec.payload)
        starts = []
        for rank, slot in enumerate(slots_by_node(self.node_ids)):
            env = self.spec.rank_env(slot, self.rendezvous)
            env[envcontract.RAY_NODE_ID] = self.node_ids[rank]
            starts.append(engine.actors[rank].start.remote(payload_ref, env))
        engine.wait_for(starts, self.abort, "ranks")
        self._record_lost_from(starts)
        for rank in range(self._num_ranks):
            if rank not in self._failures:
                self._issue(rank)
        logger.debug(
            "run %s: %d ranks on %d nodes, master %s:%d",
            self.run_id, self._num_ranks, self.num_nodes, self.rendezvous.addr, self.rendezvous.port,
        )
        return True

    # -- watching -------------------------------------------------------------------------
    def _issue(self, rank: int) -> None:
        self._polls[self.engine.actors[rank].poll.remote(self._POLL_WAIT_S)] = rank

    def _status(self) -> GroupStatus:
        return GroupStatus(self._num_ranks, dict(self._results), dict(self._failures), started=self._scheduled,
                           progress=dict(self._progress))  # fmt: skip

    def stacks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Every live rank's threads, dumped on its node and sent back by its actor."""
        ray, actors = self.engine.ray, self.engine.actors
        if not actors:
            return {}
        refs = {a.stacks.remote(timeout_s): r for r, a in enumerate(actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s + 5.0)
        found: dict[int, str] = {}
        for ref in ready:
            try:
                text = ray.get(ref)
            except Exception:  # noqa: BLE001 - a lost actor has no stack to give
                continue
            if text:
                found[refs[ref]] = text
        return found

    def poll(self, wait_s: float) -> GroupStatus:
        if not self._scheduled:
            self._scheduled = self._try_schedule(wait_s)
            return self._status()
        ray = self.engine.ray
        if not self._polls:
            time.sleep(wait_s)
            return self._status()
        ready, _ = ray.wait(list(self._polls), num_returns=1, timeout=max(wait_s, self._POLL_WAIT_S))
        for ref in ready:
            rank = self._polls.pop(ref)
            try:
                report = ray.get(ref)
            except ray.exceptions.ActorUnavailableError as e:
                # Unreachable for now (a restarting link, or a node going down): ask again
                # until Ray says the actor or its node is dead, within a grace.
                first = self._unreachable_since.setdefault(rank, time.monotonic())
                if self._node_alive(rank) and time.monotonic() - first < self._UNREACHABLE_GRACE_S:
                    time.sleep(self._POLL_WAIT_S)
                    self._issue(rank)
                else:
                    self._failures[rank] = self._lost(rank, e)
                continue
            except ray.exceptions.RayError as e:
                self._failures[rank] = self._lost(rank, e)
                continue
            self._unreachable_since.pop(rank, None)
            if not self._absorb(rank, report):
                self._issue(rank)
        return self._status()

    def _write(self, rank: int, report: dict[str, Any]) -> None:
        log = self._rank_logs[rank]
        if report.get("dropped"):
            log.write(f"[gpufleet: {report['dropped']} lines of output were dropped]\n".encode(), True)
        for is_stderr, line in report["lines"]:
            log.write(line, is_stderr)

    def _take(self, rank: int, rec: dict[str, Any] | None) -> bool:
        if rec is not None and rec["status"] == ERROR:
            failure = self._failures[rank] = failures.failure_from_outcome(rank, rec, self.run_dir.log(rank))
            if rank < len(self._rank_logs):  # `gpufleet logs` shows why the rank failed
                self._rank_logs[rank].end_with(failure_text(rank, failure.exc_type, failure.traceback))
            return True
        if rec is not None and rec["status"] == OK:
            self._results[rank] = rec
            return True
        return False

    def _known(self, rank: int) -> bool:
        return rank in self._results or rank in self._failures

    def _absorb(self, rank: int, report: dict[str, Any]) -> bool:
        """Take one poll report of ``rank``; True once the rank has its final record."""
        self._write(rank, report)
        if report.get("progress"):
            self._progress[rank] = report["progress"]
        if report["outcome"] is not None:
            self._outcomes[rank] = report["outcome"]
        rec = self._outcomes.get(rank)
        if self._known(rank):
            return True
        if rec is not None and rec["status"] == ERROR:
            return self._take(rank, rec)
        code = report["exit_code"]
        if code is None:
            return False
        if self._take(rank, rec):
            return True
        self._failures[rank] = failures.failure_from_exit(rank, code, self.run_dir.log(rank))
        return True

    def _node_alive(self, rank: int) -> bool:
        node = self.node_ids[rank] if rank < len(self.node_ids) else None
        try:
            alive = {n["NodeID"]: n["Alive"] for n in self.engine.ray.nodes()}
        except Exception:  # noqa: BLE001 - the cluster itself is unreachable
            return False
        return alive.get(node, False) if node else True

    def _node_dies_soon(self, rank: int, within_s: float = _NODE_DEATH_WAIT_S) -> bool:
        """Whether the rank's node is, or within ``within_s`` is marked, dead by the cluster.

        An actor on a node that went away often fails (socket closed) a few seconds before the
        cluster marks the node dead; waiting that long tells a lost node from a dead actor. A
        cancel or timeout (``abort``) ends the wait: naming the failure then is not worth a slower stop.
        """
        deadline = time.monotonic() + within_s
        while True:
            if not self._node_alive(rank):
                return True
            if time.monotonic() >= deadline or self.abort.is_set():
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
            rank=rank, kind=failures.LOST, time=time.time(),
            message=f"the rank stopped because {reason}",
            log_path=str(log), log_tail=tail(log),
        )

    def _record_lost_from(self, starts: list[Any]) -> None:
        """Each rank whose start (answered already, see :meth:`RayEngine.wait_for`) failed is lost."""
        for rank, ref in enumerate(starts):
            try:
                self.engine.ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - recorded as that rank's failure
                self._failures.setdefault(rank, self._lost(rank, e))

    # -- stopping -------------------------------------------------------------------------
    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        """Stop every rank, kill the actors and release the placement group."""
        ray, actors = self.engine.ray, self.engine.actors
        t_stop = time.time()
        try:
            if dump_stacks and actors:
                for a in actors:
                    a.dump_stacks.remote()
                time.sleep(1.0)
            refs = {a.stop.remote(grace_period_s): r for r, a in enumerate(actors)}
            if refs:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=grace_period_s + 10.0)
                for ref in ready:
                    rank = refs[ref]
                    try:
                        report = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        if not self._known(rank) and reason != "finished":
                            self._failures[rank] = self._lost(rank, e)
                        continue
                    self._write(rank, report)  # the last lines; its exit code is ours
                    if report["outcome"] is not None:
                        self._outcomes[rank] = report["outcome"]
                    if not self._known(rank):
                        self._take(rank, self._outcomes.get(rank))
        finally:
            self.engine.release()
            for rank in range(self._num_ranks):
                if not self._known(rank):
                    self._failures[rank] = failures.stopped(rank, reason, t_stop, self.run_dir.log(rank))
        return self._status()

    def close(self, succeeded: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if succeeded:
            # Every rank returned: the values go back now, and a reaper lets the ranks finish
            # exiting (atexit handlers, module teardown with fast_exit=False) before it stops
            # what is left and releases the actors.
            reap_later(_reapers, self.run_id, self._reap)
            return
        self.engine.release()
        for log in self._rank_logs:
            log.close()

    def _reap(self, wait_s: float = 10.0) -> None:
        try:
            ray = self.engine.ray
            refs = {a.finish.remote(wait_s, 1.0): r for r, a in enumerate(self.engine.actors)}
            ready: list[Any] = []
            pending = list(refs)
            deadline = time.monotonic() + wait_s + 15.0
            # In slices, so that a connection about to end (_before_ray_disconnects) stops the wait:
            # a thread still inside ray.wait at ray.shutdown crashes the process.
            while pending and time.monotonic() < deadline and not _disconnecting.is_set():
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=self._POLL_WAIT_S)
                ready.extend(done)
            if not _disconnecting.is_set():
                for ref in ready:
                    try:
                        self._write(refs[ref], ray.get(ref))  # the lines printed while exiting
                    except Exception:  # noqa: BLE001 - an actor that is gone has nothing left to say
                        pass
        except Exception as e:  # noqa: BLE001 - the cluster may be gone: release what we can
            logger.warning("run %s: could not let its ranks finish: %s", self.run_id, e)
        finally:
            self.engine.release()
            for log in self._rank_logs:
                log.close()


def _before_ray_disconnects() -> None:
    """Stop the reapers' waits and return once they are out of Ray (see ray_connect.before_disconnect)."""
    _disconnecting.set()
    try:
        for reaper in list(_reapers):
            reaper.join(timeout=30.0)
    finally:
        _disconnecting.clear()


def _with_nodes(spec: LaunchSpec, world_size: int, num_nodes: int, use_gpus: bool) -> LaunchSpec:
    from dataclasses import replace

    return replace(spec, world_size=world_size, num_nodes=num_nodes, use_gpus=use_gpus)


before_disconnect(_before_ray_disconnects)
