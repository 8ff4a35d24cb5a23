"""The hang watchdog's judgement: when a run that stopped moving is hung.

Two limits. The *fast* one is learned from the run: once every rank finished its first step
(model load and compile warm-up are behind it), the watchdog keeps the slowest step and the
longest pause it saw; ``factor`` times that, at least ``floor_s``, is how long nothing may move
before it looks. It then declares the run hung only when the evidence is clear: a collective
that has not completed, and every rank it waits for does nothing (no CPU time in its process
tree, no GPU use, or stopped by a signal). A rank *busy* in its own code, or every rank in its
own code, is not a fast-path hang: it is named once in a warning (and in :attr:`Watchdog.note`,
which ``gpufleet stacks`` and the run's record show), and the run goes on to the long limit,
``hang_timeout``. Before the first step, and while any rank is inside a long section
(``runtime.section``, a ``CheckpointManager`` save or resume), only the long limit (or the
section's own) applies.

``GPUFLEET_HANG_FLOOR_S`` (default 25) and ``GPUFLEET_HANG_FACTOR`` (default 8), read by the
launching process, set the fast limit; ``GPUFLEET_HANG_FLOOR_S=0`` turns the fast path off.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import LaunchConfigError
from ..node import envcontract
from . import activity
from .diagnosis import Diagnosis, diagnose

logger = logging.getLogger(__name__)

#: Looks at each rank (group, progress records, now) -> each rank's :class:`activity.Sample`.
Sampler = Callable[[Any, Mapping[int, Mapping[str, Any]], float], dict[int, activity.Sample]]
#: Steps every rank must have reached before the fast path learns (the first one may compile).
STEADY_STEP = 2


@dataclass(frozen=True)
class HangSettings:
    """The watchdog's limits.

    Attributes:
        long_s: ``hang_timeout``: nothing moved for this long is a hang, whatever the ranks do.
        floor_s: the fast limit is never below this (0: no fast path).
        factor: the fast limit is this many times the slowest step or pause seen.
        window_s: how long the ranks' CPU use is looked at before a verdict.
        recheck_s: how often a stall that was not clear is looked at again.
    """

    long_s: float
    floor_s: float = 25.0
    factor: float = 8.0
    window_s: float = 5.0
    recheck_s: float = 5.0

    @classmethod
    def from_env(cls, long_s: float, env: Mapping[str, str] | None = None) -> HangSettings:
        """The settings for ``hang_timeout=long_s``, with the fast limit from the environment."""
        env = os.environ if env is None else env
        values: dict[str, float] = {}
        for name, key, lowest in ((envcontract.HANG_FLOOR_S, "floor_s", 0.0), (envcontract.HANG_FACTOR, "factor", 1.0)):
            raw = env.get(name)
            if raw in (None, ""):
                continue
            try:
                value = float(raw)  # type: ignore[arg-type]
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < lowest:
                raise LaunchConfigError(f"{name}={raw!r} must be a number >= {lowest:g}; unset it for the default")
            values[key] = value
        return cls(long_s=long_s, **values)


@dataclass(frozen=True)
class Verdict:
    """The run is hung: for how long nothing moved, which limit it passed, and the diagnosis."""

    idle_s: float
    fast: bool
    found: Diagnosis


class Watchdog:
    """Watches one attempt's progress records, poll after poll (:meth:`check`)."""

    def __init__(self, settings: HangSettings, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sampler: Sampler | None = None) -> None:  # fmt: skip
        self.settings = settings
        self._clock, self._wall = clock, wall
        self._sampler = sampler
        self.reset()

    def reset(self) -> None:
        """A new attempt: nothing learned."""
        self._key: Any = None
        self._since = self._clock()
        self._min_step: int | None = None
        self._step_at: float | None = None
        self.slowest_s = 0.0
        self._sectioned = self._step_sectioned = False  # a long section was seen in this pause, this step
        self._samples: list[tuple[float, dict[int, activity.Sample], dict[int, Any]]] = []
        self._pids: dict[int, int] = {}
        self._stacks: dict[int, str] = {}
        self._next_look = 0.0
        self._warned: set[str] = set()
        #: What the watchdog sees now, when a stall is not (yet) a hang: a busy rank and its line.
        self.note: str | None = None

    @property
    def steady(self) -> bool:
        """Every rank finished its first step: the fast limit is being learned."""
        return self._min_step is not None and self._min_step >= STEADY_STEP

    def fast_limit(self) -> float | None:
        """The fast limit learned so far (None: none yet, or off)."""
        s = self.settings
        if not self.steady or self.slowest_s <= 0 or s.floor_s <= 0:
            return None
        return min(s.long_s, max(s.floor_s, s.factor * self.slowest_s))

    # -- learning -------------------------------------------------------------------------
    def _learn(self, progress: Mapping[int, Mapping[str, Any]], num_ranks: int, now: float) -> None:
        key = tuple(sorted((r, p.get("step"), p.get("seq")) for r, p in progress.items()))
        if key == self._key:
            return
        if self.steady and self._key is not None and not self._sectioned:
            self.slowest_s = max(self.slowest_s, now - self._since)  # the pause that just ended
        self._key, self._since, self._sectioned = key, now, False
        self._samples, self._next_look, self.note = [], 0.0, None
        steps = [progress.get(r, {}).get("step") for r in range(num_ranks)]
        if any(not isinstance(s, int) for s in steps):
            return
        low = min(steps)  # type: ignore[type-var]
        if self._min_step is not None and low > self._min_step:
            if self._min_step >= STEADY_STEP and self._step_at is not None and not self._step_sectioned:
                self.slowest_s = max(self.slowest_s, (now - self._step_at) / (low - self._min_step))
            self._step_at, self._step_sectioned = now, False
        self._min_step = low if self._min_step is None else max(self._min_step, low)

    # -- looking --------------------------------------------------------------------------
    def _sample(self, group: Any, progress: Mapping[int, Mapping[str, Any]], now: float) -> None:
        if self._sampler is not None:
            samples = self._sampler(group, progress, now)
        else:
            if any(r not in self._pids for r in progress) or not self._pids:
                self._pids.update(activity.rank_pids(group.workers_are_ranks, group.pids, group.run_id, progress))
            samples = {r: activity.sample(pid, now) for r, pid in self._pids.items()}
        self._samples = [*self._samples[-3:], (now, samples, {r: dict(p) for r, p in progress.items()})]

    def _activity(self, now: float) -> dict[int, str]:
        """What each rank did between the oldest look of the window and the newest."""
        (_, after, rec_after) = self._samples[-1]
        older = [s for s in self._samples[:-1] if now - s[0] >= 1.0] or self._samples[:1]
        (_, before, rec_before) = older[0]
        ranks = set(after) | set(rec_after)
        return {r: activity.judge(before.get(r), after.get(r), rec_before.get(r), rec_after.get(r)) for r in ranks}

    def _ranks(self, group: Any, status: Any) -> tuple[int, frozenset[int]]:
        if group.workers_are_ranks:
            return status.num_ranks, frozenset(status.results)
        # a workload's nodes: the ranks are the ones that report progress
        return max([group.spec.world_size, *(r + 1 for r in status.progress)]), frozenset()

    def check(self, status: Any, group: Any) -> Verdict | None:
        """Look at this poll's status: a :class:`Verdict` once the run is hung, else None."""
        now = self._clock()
        num_ranks, finished = self._ranks(group, status)
        self._learn(status.progress, num_ranks, now)
        if not any(step or seq is not None for _, step, seq in self._key):
            return None  # no rank has a process group or a step yet
        stall = now - self._since
        sections = [s for p in status.progress.values() for s in (p.get("sections") or [])]
        long_s = self.settings.long_s
        if sections:  # a section's own limit (default: hang_timeout); the fast path is off
            long_s = max(float(s.get("limit_s") or long_s) for s in sections)
            self._sectioned = self._step_sectioned = True
        fast = None if sections else self.fast_limit()
        due = min(long_s, fast) if fast is not None else long_s
        window = min(self.settings.window_s, due / 2)
        if stall < due - window:
            return None
        if not self._samples or now - self._samples[-1][0] >= window / 2:
            self._sample(group, status.progress, now)
        if stall < due or now < self._next_look:
            return None
        if stall < long_s:
            limit = (f"the limit learned from this run: {fast:.0f} s ({self.settings.factor:g} x its slowest "
                     f"step or pause, {self.slowest_s:.1f} s; at least {self.settings.floor_s:g} s)")  # fmt: skip
        elif any(s.get("limit_s") for s in sections):
            names = ", ".join(sorted({str(s.get("name")) for s in sections}))
            limit = f"the limit of the section it is in ({names}): {long_s:g} s"
        else:
            limit = f"hang_timeout={long_s:g} s"
        found = self._diagnose(group, status, num_ranks, finished, stall, now, limit)
        if stall >= long_s or found.clear:
            if self._continue_stopped(found):  # their stacks, now that they are stopped for good
                found = self._diagnose(group, status, num_ranks, finished, stall, now, limit, resample=False)
            return Verdict(stall, stall < long_s, found)
        self._next_look = now + self.settings.recheck_s
        self._tell(group, found, stall, long_s, num_ranks)
        return None

    def _diagnose(self, group: Any, status: Any, num_ranks: int, finished: frozenset[int], stall: float,
                  now: float, limit: str, resample: bool = True) -> Diagnosis:  # fmt: skip
        stacks = group.stacks()
        self._stacks = stacks
        if resample:
            self._sample(group, status.progress, now)
        return diagnose(status.progress, stacks, num_ranks, stall, finished, self._activity(now), self._wall(), limit)

    def _continue_stopped(self, found: Diagnosis) -> bool:
        """Let the ranks stopped by a signal run again (they are about to be stopped for good), so that
        their stack handler dumps where they were stopped: continued just after the stack request."""
        import signal
        import threading

        stopped = [self._pids[r] for r, smp in self._samples[-1][1].items()
                   if smp.stopped and not self._stacks.get(r) and r in self._pids]  # fmt: skip
        for pid in stopped:
            timer = threading.Timer(0.3, _signal, args=(pid, signal.SIGCONT))
            timer.daemon = True
            timer.start()
        return bool(stopped)

    def _tell(self, group: Any, found: Diagnosis, stall: float, long_s: float, num_ranks: int) -> None:
        """Say once per finding why a stall is not called a hang yet (a busy rank and its line)."""
        if found.busy:
            who = "; ".join(f"rank {r} at {where or '(no stack)'}" for r, where in sorted(found.busy.items()))
            others = " while the others wait" if len(found.busy) < num_ranks else ""  # nobody waits when all are busy
            self.note = (f"nothing moved for {stall:.0f} s: busy in its own code{others}: {who}; "
                         f"not called a hang before hang_timeout={long_s:g} s")  # fmt: skip
        else:
            self.note = (f"nothing moved for {stall:.0f} s: {found.summary[1] if len(found.summary) > 1 else ''}; "
                         f"not called a hang before hang_timeout={long_s:g} s")  # fmt: skip
        key = self.note.split(": ", 1)[1]
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("run %s: %s", group.run_id, self.note)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


#: The watchdog's current note in the run folder (``gpufleet stacks`` shows it).
NOTE_FILE = "watchdog.json"


def write_note(folder: Any, note: str | None) -> None:
    """Keep the watchdog's note (None: nothing to say) in the run folder; never fails the run."""
    import json
    from pathlib import Path

    path = Path(folder) / NOTE_FILE
    try:
        tmp = path.with_name(f".{NOTE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"time": time.time(), "note": note}))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not write %s: %s", path, e)


def read_note(folder: Any) -> str | None:
    """The watchdog's note of a running attempt, from its run folder (None: none)."""
    import json
    from pathlib import Path

    try:
        note = json.loads((Path(folder) / NOTE_FILE).read_text()).get("note")
    except (OSError, ValueError, AttributeError):
        return None
    return note if isinstance(note, str) else None
