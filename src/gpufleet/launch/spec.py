"""The launch spec: the rank environment contract and the payload format, for every launcher.

A :class:`LaunchSpec` says what one attempt runs (world size, nodes, extra environment, the
pickled call) independently of where its processes come from. Local processes, Ray actors and
workload nodes all build their ranks' environments from it, so the values of the torchrun contract
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...) are written once, here; their names
are those of :mod:`gpufleet.launch.node.envcontract`.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .node import envcontract

#: Set in each rank's environment: the caller's pid (a rank ends itself when its caller is gone).
PARENT_PID_ENV = envcontract.PARENT_PID
#: Set in each rank's environment when part of it comes after the start: the file that will hold
#: it (JSON, written whole). The rank waits for it before it loads the call, then adds it to
#: ``os.environ``; the call sees one environment either way.
LATE_ENV_VAR = envcontract.LATE_ENV


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's (node 0's) rendezvous store listens."""

    addr: str
    port: int


@dataclass(frozen=True)
class RankSlot:
    """One rank's place in the world: its global rank, node, and rank on that node."""

    rank: int
    local_rank: int
    node_rank: int
    local_world_size: int


def package_dir() -> Path:
    """The installed ``gpufleet`` package folder (what a Ray job uploads as a module)."""
    return Path(__file__).resolve().parent.parent


def package_parent() -> str:
    """The folder that holds the ``gpufleet`` package: what a rank's ``PYTHONPATH`` starts with."""
    return str(package_dir().parent)


def local_slots(num_ranks: int) -> list[RankSlot]:
    """The slots of ``num_ranks`` ranks that all run on one node."""
    return [RankSlot(r, r, 0, num_ranks) for r in range(num_ranks)]


def slots_by_node(node_of_rank: list[str]) -> list[RankSlot]:
    """Slots for ranks placed on nodes (``node_of_rank[i]`` is where rank ``i`` runs).

    Ranks of one node must be consecutive; node ranks follow the order nodes first appear.
    """
    node_ranks: dict[str, int] = {}
    local: dict[str, int] = {}
    for node in node_of_rank:
        node_ranks.setdefault(node, len(node_ranks))
        local[node] = local.get(node, 0) + 1
    seen: dict[str, int] = {}
    slots = []
    for rank, node in enumerate(node_of_rank):
        slots.append(RankSlot(rank, seen.get(node, 0), node_ranks[node], local[node]))
        seen[node] = seen.get(node, 0) + 1
    return slots


def default_threads(env: Mapping[str, str], local_world_size: int, cpu_count: int | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for a rank or node command, unless ``env`` already sets it.

    The node's cores shared by its ranks (at least one each): the value torch would pick
    alone oversubscribes a machine running several ranks, and torchrun's fallback of 1 is slow.
    """
    if "OMP_NUM_THREADS" in env:
        return {}
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // max(1, local_world_size)))}


@dataclass(frozen=True)
class Payload:
    """What every rank runs: the cloudpickled ``(func, args, kwargs)`` and how to run it.

    Attributes:
        call: ``cloudpickle.dumps((func, args, kwargs))``.
        sys_path: import paths of the caller that the worker appends to its own.
        fast_exit: end the worker without module teardown once its outcome is written.
        sources: source text of the code sent by value (a script, notebook cells), by file name,
            for the worker's ``linecache`` (:mod:`gpufleet.launch.tracebacks`).
    """

    call: bytes
    sys_path: tuple[str, ...] = ()
    fast_exit: bool = True
    sources: Mapping[str, str] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        """Write the payload file (0600): a small pickled header, then the call's bytes as they are.

        The call is not pickled a second time, so a large argument is not copied again here or
        in the worker that reads it.
        """
        header = {
            "sys_path": list(self.sys_path), "fast_exit": self.fast_exit, "call_size": len(self.call),
            "sources": dict(self.sources),
        }  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(header, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.write(self.call)

    @classmethod
    def read(cls, path: Path) -> Payload:
        """Read a payload file written by :meth:`write`."""
        with open(path, "rb") as f:
            header: dict[str, Any] = pickle.load(f)
            call = f.read()
        if len(call) != header["call_size"]:
            raise ValueError(f"the payload file {path} is cut short ({len(call)} of {header['call_size']} bytes)")
        return cls(call, tuple(header["sys_path"]), bool(header["fast_exit"]), dict(header.get("sources", {})))


@dataclass(frozen=True)
class LaunchSpec:
    """One attempt of a run, independent of the launcher that starts it.

    Attributes:
        run_id: the attempt's run id (``GPUFLEET_RUN_ID``, ``TORCHELASTIC_RUN_ID``).
        world_size: total number of ranks.
        num_nodes: nodes the ranks span.
        use_gpus: ranks use GPUs (else ``CUDA_VISIBLE_DEVICES`` is emptied).
        attempt: the attempt number, from 1 (``GPUFLEET_ATTEMPT``).
        env: extra environment for every rank (the user's ``env``, tracking's ``MLFLOW_*``).
        payload: the call every rank runs; None for a workload's node commands.
    """

    run_id: str
    world_size: int
    num_nodes: int = 1
    use_gpus: bool = False
    attempt: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    payload: Payload | None = None

    def with_env(self, extra: Mapping[str, str]) -> LaunchSpec:
        """A copy whose ranks also get ``extra``."""
        return replace(self, env={**self.env, **extra})

    def node_env(self, node_rank: int, local_world_size: int, rendezvous: Rendezvous) -> dict[str, str]:
        """What every process of node ``node_rank`` sees (a workload's node command gets just this).

        ``RANK`` and ``LOCAL_RANK`` are not in it: a node command's launcher (torchrun) sets them.
        """
        env = dict(self.env)
        env.update({
            envcontract.WORLD_SIZE: str(self.world_size),
            envcontract.LOCAL_WORLD_SIZE: str(local_world_size),
            envcontract.NODE_RANK: str(node_rank),
            envcontract.NUM_NODES: str(self.num_nodes),
            envcontract.MASTER_ADDR: rendezvous.addr,
            envcontract.MASTER_PORT: str(rendezvous.port),
            "PYTHONUNBUFFERED": "1",
            envcontract.RUN_ID: self.run_id,
            envcontract.ATTEMPT: str(self.attempt),
        })
        if not self.use_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU workers must not pick up a GPU by accident
        return env

    def rank_env(self, slot: RankSlot, rendezvous: Rendezvous) -> dict[str, str]:
        """The torchrun environment contract of one rank (on top of :meth:`node_env`)."""
        env = self.node_env(slot.node_rank, slot.local_world_size, rendezvous)
        env.update(rank_vars(slot.rank, slot.local_rank, slot.node_rank, self.world_size, self.run_id))
        return env


def rank_vars(rank: int | str, local_rank: int | str, node_rank: int | str, world_size: int | str,
              run_id: str) -> dict[str, str]:
    """What one rank sees beyond its node's environment (``envcontract.RANK_VARS``): its ranks and
    the run id, as torchrun sets them. :meth:`LaunchSpec.rank_env` and the Slurm engine's rank
    task (from Slurm's task ids) both write them with this."""
    return {
        envcontract.RANK: str(rank),
        envcontract.LOCAL_RANK: str(local_rank),
        envcontract.GROUP_RANK: str(node_rank),
        envcontract.ROLE_RANK: str(rank),
        envcontract.ROLE_WORLD_SIZE: str(world_size),
        envcontract.TORCHELASTIC_RUN_ID: run_id,
    }
