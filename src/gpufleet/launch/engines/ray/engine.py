"""The Ray engine: one actor per unit on a Ray cluster, for a call's ranks and a workload's node commands alike.

It connects to the cluster (:mod:`.connect`), reserves a placement group (one bundle per unit:
``PACK`` for a call's ranks, ``STRICT_SPREAD`` for a workload's nodes), starts one actor per
unit in its bundle (:class:`~gpufleet.launch.engines.ray.actor.RankProcess` for a rank,
:class:`~gpufleet.launch.engines.ray.actor.NodeCommand` for a node command, both running their
process as a child on their node), takes node 0's address and a free port there as the
rendezvous, and at the end kills its actors and removes the placement group, once, for both.

A call's group (:class:`~gpufleet.launch.engines.ray.group.RayWorkerGroup`) reserves without
waiting and starts its ranks at the first poll that finds their bundles placed (the call stays
PENDING meanwhile); a workload's supervisor waits inside :meth:`RayEngine.rendezvous` (up to
:data:`SCHEDULE_TIMEOUT_S`), starts each node's command with :meth:`RayEngine.start` and polls it
through a :class:`RayProc`. The node command's own environment rules (what a node keeps of its
own, the dependencies it may build, a Ray driver) are the workload's
(:class:`~gpufleet.workload.ray_executor.RayExecutor`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ....errors import SchedulingTimeoutError
from ...group import GroupStartCanceled
from ...node import envcontract
from ..base import GRACE_PERIOD_S, Engine, Proc, Unit

__all__ = ["LOST_EXIT_CODE", "SCHEDULE_TIMEOUT_S", "RayEngine", "RayProc"]

logger = logging.getLogger(__name__)

#: How long a workload's attempt waits for its placement on the cluster.
SCHEDULE_TIMEOUT_S = 600.0
#: Exit code reported for a node command whose actor or Ray node was lost (as for SIGKILL).
LOST_EXIT_CODE = 137
#: The slice of every wait on Ray, so that a cancel is seen within it.
POLL_WAIT_S = 0.5


class RayEngine(Engine):
    """The actors and placement group of one attempt on the Ray cluster at ``address``."""

    def __init__(self, address: str, run_id: str, node_bundle: dict[str, float] | None = None) -> None:
        self.address = address
        self.run_id = run_id
        self.node_bundle = node_bundle  #: the resources of one node command's bundle
        self.ray: Any = None
        self.pg: Any = None
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []  # what each node command's actor said of its node
        self._ready_ref: Any = None

    # -- placing --------------------------------------------------------------------------
    def connect(self, init_kwargs: dict[str, Any] | None = None) -> Any:
        """Connect this process to the cluster (once per address; :func:`.connect.connect`)."""
        from .connect import connect

        self.ray = connect(self.address, init_kwargs)
        return self.ray

    def reserve(self, bundles: list[dict[str, float]], strategy: str, name: str = "") -> None:
        """Ask the cluster for a placement group of ``bundles``; :meth:`reserved` says when it is placed."""
        from ray.util.placement_group import placement_group

        self.pg = placement_group(bundles, strategy=strategy, name=name)
        self._ready_ref = self.pg.ready()

    def reserved(self, timeout_s: float) -> bool:
        """Whether the placement group is placed, waiting up to ``timeout_s`` for it."""
        return bool(self.ray.wait([self._ready_ref], timeout=timeout_s)[0])

    def wait(self, ready: Callable[[], bool], what: str, failure: Callable[[int], str]) -> None:
        """Wait until ``ready()`` (which blocks about a second when not), up to :data:`SCHEDULE_TIMEOUT_S`.

        A cancel raises :class:`~gpufleet.launch.group.GroupStartCanceled`; the time limit raises
        :class:`~gpufleet.errors.SchedulingTimeoutError` with ``failure(nodes alive)``.
        """
        deadline = time.monotonic() + SCHEDULE_TIMEOUT_S  # read now: a test shortens it
        while not ready():
            if self.canceled():
                raise GroupStartCanceled(f"while waiting for {what} on the Ray cluster")
            if time.monotonic() > deadline:
                raise SchedulingTimeoutError(failure(sum(1 for n in self.ray.nodes() if n["Alive"])))

    def bundle_nodes(self) -> dict[int, str]:
        """The Ray node id of each placed bundle, by bundle index."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.pg)
        return {int(k): v for k, v in table["bundles_to_node_id"].items()}

    def node_ips(self) -> dict[str, str]:
        """Each node's address, by Ray node id."""
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes()}

    def spawn(self, payload: str, index: int, name: str, bundle: int | None, num_cpus: float,
              num_gpus: float = 0.0) -> Any:  # fmt: skip
        """Start the actor of one unit (``payload``: ``rank`` or ``node``), in bundle ``bundle`` of the
        placement group (None: anywhere, holding nothing: a Ray driver's)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .actor import NodeCommand, RankProcess

        options: dict[str, Any] = {
            "num_cpus": num_cpus,
            "max_restarts": 0,
            "max_concurrency": 4,  # poll, stop and stack dumps may overlap
            "name": name,
            "runtime_env": {"env_vars": {envcontract.RUN_ID: self.run_id}},
        }
        if num_gpus:
            options["num_gpus"] = num_gpus
        if bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            )
        actor_cls = self.ray.remote(RankProcess if payload == "rank" else NodeCommand)
        actor = actor_cls.options(**options).remote(self.run_id, index)
        self.actors.append(actor)
        return actor

    def wait_for(self, refs: list[Any], abort: threading.Event | None, what: str) -> None:
        """Wait until every one of ``refs`` has answered (a value or an error), or ``abort`` is set.

        Under load an actor's start can take a minute; a cancel or timeout must not wait for it.
        """
        pending = list(refs)
        while pending:
            _, pending = self.ray.wait(pending, num_returns=len(pending), timeout=POLL_WAIT_S)
            if pending and abort is not None and abort.is_set():
                raise GroupStartCanceled(f"the run was stopped while its {what} were starting")

    # -- the node-command payload ---------------------------------------------------------
    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        """Node commands: the previous attempt's actors go, then :meth:`place_nodes` (``node_bundle`` each)."""
        assert self.node_bundle is not None, "node commands need the resources of a node's bundle"
        self.release()
        self.connect()
        return self.place_nodes(num_nodes, self.node_bundle)

    def place_nodes(self, num_nodes: int, bundle: dict[str, float]) -> tuple[str, int]:
        """Place one node command's actor on each of ``num_nodes`` nodes (``STRICT_SPREAD``), waiting
        for room up to :data:`SCHEDULE_TIMEOUT_S`; node 0's address and a free port there."""
        self.reserve([dict(bundle) for _ in range(num_nodes)], "STRICT_SPREAD")
        self.wait(lambda: self.reserved(1.0), f"{num_nodes} nodes of {bundle}",
                  lambda alive: f"the Ray cluster at {self.address} could not give {num_nodes} nodes "
                                f"{bundle} each within {SCHEDULE_TIMEOUT_S:g} s ({alive} nodes alive)")  # fmt: skip
        attempt = int(time.time())
        for rank in range(num_nodes):  # the bundle's resources are the command's
            self.spawn("node", rank, f"gpufleet-{self.run_id}-{attempt}-node{rank}", bundle=rank, num_cpus=0)
        self.nodes = self.ray.get([a.node_info.remote() for a in self.actors])
        return self.nodes[0]["ip"], self.ray.get(self.actors[0].free_port.remote())

    def start(self, unit: Unit, files: dict[str, bytes] | None = None) -> RayProc:
        """Start a node command in its placed actor; ``files`` are written on its node for it."""
        assert unit.command is not None and unit.log_path is not None, "the Ray engine's start runs node commands"
        actor = self.actors[unit.index]
        proc = RayProc(self.ray, actor, unit, self.nodes[unit.index])
        proc.pid = self.ray.get(actor.start.remote(unit.command, unit.env, unit.cwd, files or {}))
        return proc

    # -- releasing ------------------------------------------------------------------------
    def release(self, pids: list[int] | None = None) -> None:
        """Kill every actor and remove the placement group (safe to call twice)."""
        ray = self.ray
        if ray is None:
            return
        actors, self.actors, self.nodes = self.actors, [], []
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        pg, self.pg, self._ready_ref = self.pg, None, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                logger.warning("run %s: could not remove its placement group", self.run_id)

    def close(self) -> None:
        self.release()


class RayProc(Proc):
    """One node command, running in a :class:`~gpufleet.launch.engines.ray.actor.NodeCommand` on its node.

    Its output comes back with each poll into the node's log; an actor or node that is lost
    ends it with :data:`LOST_EXIT_CODE` and a line in that log that says so.
    """

    def __init__(self, ray: Any, actor: Any, unit: Unit, node: dict[str, Any]) -> None:
        assert unit.log_path is not None
        self.index = unit.index
        self._ray = ray
        self._actor = actor
        self._unit = unit
        self._node = node
        self._log = open(unit.log_path, "ab", buffering=0)  # noqa: SIM115 - closed in cleanup()
        self._pending: Any = None
        self._code: int | None = None
        self.pid = 0

    def _write(self, report: dict[str, Any]) -> None:
        if self._log.closed:
            return
        if report.get("dropped"):
            self._log.write(f"[gpufleet: {report['dropped']} lines of output were dropped]\n".encode())
        for _, line in report["lines"]:
            self._log.write(line)

    def _lost(self, error: BaseException) -> None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if not self._log.closed:
            self._log.write(
                f"gpufleet: node {self.index} ({self._node.get('ip')}) was lost: "
                f"{type(error).__name__}: {first[:300]}\n".encode()
            )
        self._code = LOST_EXIT_CODE

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ray = self._ray
        if self._pending is None:
            self._pending = self._actor.poll.remote(0.0)
        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        ref, self._pending = self._pending, None
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as e:
            self._lost(e)
            return self._code
        self._write(report)
        self._code = report["exit_code"]
        return self._code

    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        if self._code is not None:
            return
        ray = self._ray
        try:
            report = ray.get(self._actor.stop.remote(grace_period_s), timeout=grace_period_s + 15.0)
        except (ray.exceptions.RayError, TimeoutError) as e:  # GetTimeoutError is a TimeoutError
            self._lost(e)
            return
        self._write(report)
        self._code = report["exit_code"]

    def cleanup(self) -> None:
        ray = self._ray
        if self._code is None:
            self.cancel(1.0)
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._log.close()

    def describe(self) -> dict[str, Any]:
        return {
            "node_rank": self.index,
            "host": self._node.get("hostname") or self._node.get("ip"),
            "ip": self._node.get("ip"),
            "ray_node_id": self._node.get("node_id"),
            "pid": self.pid,
            "log_path": self._unit.log_path,
        }
