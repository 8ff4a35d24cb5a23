"""Faults injected on purpose, to rehearse what a run does when a rank dies, hangs, exits or slows.

A fault names an action, the ranks it hits and when: at a step (gpufleet counts steps where it
sees them: batches from its data loader, optimizer steps through ``prepare()``, and
``runtime.report_step()``) or after some seconds. Faults reach the ranks through the
``GPUFLEET_FAULTS`` environment variable (JSON), set from ``@distributed(faults=...)``,
``gpufleet run --inject-fault``, or by hand for code run any other way. A rank with no fault
pays one check of a module global per step.

Spec strings (the CLI form) are ``ACTION[:key=value...]``, e.g. ``kill:rank=1:step=30``,
``hang:rank=0:after=20``, ``exit:rank=1:step=5:code=3``, ``slow:rank=1:factor=3``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import LaunchConfigError

#: The environment variable that carries the faults (a JSON list) to every rank.
FAULTS_ENV = "GPUFLEET_FAULTS"
ACTIONS = ("kill", "hang", "exit", "slow")

__all__ = ["FAULTS_ENV", "Fault", "parse_faults", "faults_env"]


@dataclass(frozen=True)
class Fault:
    """One fault.

    Attributes:
        action: ``kill`` (SIGKILL, as the out-of-memory killer), ``hang`` (the rank stops there
            for good: the others wait for it in their next collective), ``exit`` (the process
            exits with ``code``) or ``slow`` (every step takes ``factor`` times as long).
        rank: the global rank it hits; None: every rank.
        step: when the rank's step count reaches this (not for ``slow``).
        after: seconds after the rank started (not for ``slow``).
        code: the exit code of ``exit``.
        factor: how much slower ``slow`` makes each step.
        attempt: the attempt it hits (1: the first; a retry then runs without it); None: every attempt.
    """

    action: str
    rank: int | None = None
    step: int | None = None
    after: float | None = None
    code: int = 1
    factor: float = 2.0
    attempt: int | None = 1

    def check(self) -> Fault:
        """Refuse a fault that could never fire or makes no sense, saying why."""
        if self.action not in ACTIONS:
            raise LaunchConfigError(f"fault action {self.action!r} is not one of {', '.join(ACTIONS)}")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 0):
            raise LaunchConfigError(f"fault rank must be an integer >= 0, got {self.rank!r}")
        if self.attempt is not None and (not isinstance(self.attempt, int) or self.attempt < 1):
            raise LaunchConfigError(f"fault attempt must be an integer >= 1 (1: the first), got {self.attempt!r}")
        if self.action == "slow":
            if not isinstance(self.factor, (int, float)) or self.factor < 1:
                raise LaunchConfigError(f"a slow fault needs factor >= 1, got {self.factor!r}")
            return self
        if (self.step is None) == (self.after is None):
            raise LaunchConfigError(f"a {self.action} fault needs exactly one of step=N or after=SECONDS")
        if self.step is not None and (not isinstance(self.step, int) or self.step < 1):
            raise LaunchConfigError(f"fault step must be an integer >= 1, got {self.step!r}")
        if self.after is not None and (not isinstance(self.after, (int, float)) or self.after < 0):
            raise LaunchConfigError(f"fault after must be a number of seconds >= 0, got {self.after!r}")
        return self


_KEYS = {"rank": int, "step": int, "after": float, "code": int, "factor": float, "attempt": int}


def parse_fault(spec: str | Mapping[str, Any] | Fault) -> Fault:
    """A checked :class:`Fault` from ``"kill:rank=1:step=30"``, a dict or a Fault."""
    if isinstance(spec, Fault):
        return spec.check()
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"action", *_KEYS}
        if unknown or "action" not in spec:
            raise LaunchConfigError(f"a fault is a dict with 'action' and some of {', '.join(_KEYS)}; got {dict(spec)!r}")
        return Fault(**dict(spec)).check()
    if not isinstance(spec, str) or not spec.strip():
        raise LaunchConfigError(f"a fault is 'ACTION[:key=value...]' such as 'kill:rank=1:step=30', got {spec!r}")
    action, *parts = spec.strip().split(":")
    fields: dict[str, Any] = {"action": action}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in _KEYS or not value:
            raise LaunchConfigError(f"fault {spec!r}: {part!r} is not key=value with a key among {', '.join(_KEYS)}")
        try:
            fields[key] = _KEYS[key](value)
        except ValueError:
            raise LaunchConfigError(f"fault {spec!r}: {key}={value!r} is not a number") from None
    return Fault(**fields).check()


def parse_faults(specs: Iterable[str | Mapping[str, Any] | Fault] | str | None) -> tuple[Fault, ...]:
    """Checked faults from a list (or one spec string, or None)."""
    if specs is None:
        return ()
    if isinstance(specs, (str, Mapping, Fault)):
        specs = [specs]
    return tuple(parse_fault(s) for s in specs)


def faults_env(faults: Iterable[Fault], attempt: int = 1) -> dict[str, str]:
    """The environment that carries the faults of attempt ``attempt`` (1: the first) to the ranks.

    Empty when none applies: a run without faults sets nothing.
    """
    items = [asdict(f) for f in faults if f.attempt is None or f.attempt == attempt]
    return {FAULTS_ENV: json.dumps(items)} if items else {}


# -- in the rank ----------------------------------------------------------------------------
_armed: list[Fault] = []
_last_step_time: float | None = None
_timers: list[threading.Timer] = []


def arm(rank: int) -> None:
    """Arm this rank's faults from ``GPUFLEET_FAULTS`` (time-triggered ones start their timers).

    Faults of an earlier call (a warm rank's) are disarmed first: a timer never outlives its call.
    """
    global _armed, _last_step_time
    disarm()
    raw = os.environ.get(FAULTS_ENV)
    if not raw:
        return
    mine = [f for f in parse_faults(json.loads(raw)) if f.rank is None or f.rank == rank]
    _armed = [f for f in mine if f.after is None]
    for f in mine:
        if f.after is not None:
            timer = threading.Timer(f.after, _fire, args=(f, f"{f.after:g} s after the start"))
            timer.daemon = True
            timer.start()
            _timers.append(timer)


def disarm() -> None:
    """Forget this rank's faults and cancel their timers (a warm rank's call has ended)."""
    global _armed, _last_step_time
    _armed, _last_step_time = [], None
    while _timers:
        _timers.pop().cancel()


def on_step(step: int) -> None:
    """Called at each counted step: fire the faults due now."""
    global _last_step_time
    if not _armed:
        return
    now = time.monotonic()
    for f in _armed:
        if f.action == "slow" and _last_step_time is not None:
            time.sleep((f.factor - 1.0) * (now - _last_step_time))
        elif f.step == step:
            _fire(f, f"step {step}")
    _last_step_time = time.monotonic()


def _fire(fault: Fault, when: str) -> None:
    import sys

    print(f"gpufleet: injected fault: {fault.action} at {when}", file=sys.stderr, flush=True)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "exit":
        os._exit(fault.code)
    elif fault.action == "hang":
        while True:  # stopped for good, as a rank stuck outside the collective its peers wait in
            time.sleep(3600)
