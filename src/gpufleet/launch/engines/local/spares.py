"""Warm spares of a local group (``@distributed(recovery="replace", spares=N)``).

A spare is a worker process started with the ranks (``python -m gpufleet.launch.worker``, with
``GPUFLEET_SPARE`` and without a rank's own variables): it imports what a rank imports, loads the
call, and waits in the launcher's store (:func:`gpufleet.launch.replace.take_rank`). When a rank
dies, the group hands its place to a live spare instead of starting a process cold: it posts the
rank's variables (:class:`gpufleet.launch.store.Assignment`), the spare's output moves to that
rank's log, and the spare's pid is the rank's from then on. A new spare is started for the next
death once the rank is back. Spares hold no state: when the group stops or closes they are killed without grace.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ....results import RunDir
from ...logstream import LogConfig, Pump, RankLog
from ...node import envcontract
from ...store import Assignment, spare_key
from ..base import Unit

__all__ = ["Spare", "Spares"]


@dataclass
class Spare:
    number: int
    proc: subprocess.Popen[bytes]
    pump: Pump


class Spares:
    """The warm spares of one local group (module docstring).

    Args:
        count: how many to keep ready.
        world_size: the group's ranks (a spare's worker number is past them: its files never meet a rank's).
        run_dir: the attempt's run folder.
        env: the environment of a rank (its own variables are taken out).
        start: starts a unit; its process.
        stop: stops processes at once.
    """

    def __init__(self, count: int, world_size: int, run_dir: RunDir, env: Callable[[], dict[str, str]],
                 start: Callable[[Unit], subprocess.Popen[bytes]],
                 stop: Callable[[list[subprocess.Popen[bytes]]], None]) -> None:  # fmt: skip
        self.count = count
        self._world_size = world_size
        self._run_dir = run_dir
        self._env = env
        self._start = start
        self._stop = stop
        self._ready: list[Spare] = []
        self._started = 0

    def start(self) -> None:
        """Start spares until ``count`` are ready."""
        while len(self._ready) < self.count:
            self._ready.append(self._start_one())

    def _start_one(self) -> Spare:
        number = self._started
        self._started += 1
        env = {k: v for k, v in self._env().items() if k not in envcontract.RANK_VARS}
        env[envcontract.SPARE] = str(number)
        proc = self._start(Unit(self._world_size + number, env, run_dir=str(self._run_dir.path)))
        log = RankLog(-1, self._run_dir.path / f"spare-{number}.log", LogConfig(enabled=False))  # not shown: not a rank yet
        return Spare(number, proc, Pump(proc, log))

    def take(self, store: Any, rank: int, generation: int, incarnation: int, rank_env: dict[str, str],
             log: RankLog) -> Spare | None:  # fmt: skip
        """Give rank ``rank``'s place to a live spare (its output to ``log`` from now on); None when no
        spare is alive (the caller starts a process cold). The group calls :meth:`start` for the next
        one once the rank is back: a spare importing meanwhile would slow the recovery."""
        while self._ready:
            spare = self._ready.pop(0)
            if spare.proc.poll() is not None:  # it died waiting (its log says why)
                spare.pump.close()
                continue
            own = {k: v for k, v in rank_env.items() if k in envcontract.RANK_VARS}
            store.set(spare_key(spare.number), Assignment(rank, generation, incarnation, own).to_bytes())
            spare.pump.serve(log).close()
            return spare
        return None

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [s.proc for s in self._ready]

    def close(self) -> None:
        """Kill the spares still waiting; drop their files. Safe to call twice."""
        ready, self._ready = self._ready, []
        if ready:
            self._stop([s.proc for s in ready])
        for spare in ready:
            if spare.proc.poll() is None:
                spare.proc.wait()
            spare.pump.close()
        for number in range(self._started):
            self._run_dir.outcome(self._world_size + number).unlink(missing_ok=True)
