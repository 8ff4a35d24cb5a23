"""Faults injected on purpose, to rehearse what a run does when a rank dies, hangs, exits or slows.

A fault names an action, the ranks it hits and when: at a step (gpufleet counts steps where it
sees them: batches from its data loader, optimizer steps through ``prepare()``, and
``runtime.report_step()``) or after some seconds. Faults reach the ranks through the
``GPUFLEET_FAULTS`` environment variable (JSON), set from ``@distributed(faults=...)``,
``gpufleet run --inject-fault``, or by hand for code run any other way. A rank with no fault
pays one check of a module global per step.

Spec strings (the CLI form) are ``ACTION[:key=value...]``, e.g. ``kill:rank=1:step=30``,
``hang:rank=0:after=20``, ``exit:rank=1:step=5:code=3``, ``slow:rank=1:factor=3``.

One concern, a little past 400 lines: a rehearsed fault from its spec (parsing and the checks
that refuse one that can never fire) to its firing inside the rank.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import LaunchConfigError
from .launch.node import envcontract

#: The environment variable that carries the faults (a JSON list) to every rank.
FAULTS_ENV = envcontract.FAULTS
ACTIONS = ("kill", "hang", "exit", "slow")

__all__ = ["FAULTS_ENV", "Fault", "check_fit", "fault_problems", "faults_env", "fit_problems", "parse_faults"]


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
        code: the exit code of ``exit`` (0 to 255).
        factor: how much slower ``slow`` makes each step.
        attempt: the attempt it hits (1: the first; a retry then runs without it); None: every attempt.
        incarnation: which process of the rank it hits when the rank is replaced in place
            (``recovery="replace"``): 1, the first (its replacement then runs without it); 2, the
            first replacement; None: every one.
    """

    action: str
    rank: int | None = None
    step: int | None = None
    after: float | None = None
    code: int = 1
    factor: float = 2.0
    attempt: int | None = 1
    incarnation: int | None = 1

    def check(self) -> Fault:
        """Refuse a fault that could never fire or makes no sense, saying why (every problem at once)."""
        problems = _problems(asdict(self), given=None)
        if problems:
            raise LaunchConfigError(f"fault {self.describe()}: " + "; ".join(problems))
        return self

    def describe(self) -> str:
        """The fault in its spec-string form, e.g. ``'kill:rank=1:step=30'``."""
        parts = [str(self.action)]
        for key in _KEYS_OF.get(self.action, ()):
            value = getattr(self, key)
            if key in ("attempt", "incarnation"):
                if value != 1:
                    parts.append(f"{key}={'all' if value is None else value}")
            elif value is not None and not (key == "code" and value == 1) and not (key == "factor" and value == 2.0):
                parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
        return repr(":".join(parts))


_KEYS = {"rank": int, "step": int, "after": float, "code": int, "factor": float, "attempt": int, "incarnation": int}
#: The keys each action takes.
_KEYS_OF = {
    "kill": ("rank", "step", "after", "attempt", "incarnation"),
    "hang": ("rank", "step", "after", "attempt", "incarnation"),
    "exit": ("rank", "step", "after", "code", "attempt", "incarnation"),
    "slow": ("rank", "factor", "attempt", "incarnation"),
}


#: The largest ``factor`` of a ``slow`` fault: a rank a thousand times slower is a hang (use ``hang``).
MAX_FACTOR = 1000.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _problems(fields: Mapping[str, Any], given: Iterable[str] | None) -> list[str]:
    """Everything wrong with a fault's fields (``given``: the keys the user wrote, checked against
    what the action takes; None for a whole :class:`Fault`)."""
    action = fields.get("action")
    if action not in ACTIONS:
        return [f"action {action!r} is not one of {', '.join(ACTIONS)}"]
    out = []
    if given is not None:
        extra = [k for k in given if k != "action" and k not in _KEYS_OF[action]]
        if extra:
            out.append(f"{action} takes no {', '.join(extra)} (it takes {', '.join(_KEYS_OF[action])})")
    rank, step, after = fields.get("rank"), fields.get("step"), fields.get("after")
    code, factor, attempt = fields.get("code", 1), fields.get("factor", 2.0), fields.get("attempt", 1)
    if rank is not None and (not _is_int(rank) or rank < 0):
        out.append(f"rank must be an integer >= 0 (a global rank), got {rank!r}")
    if attempt is not None and (not _is_int(attempt) or attempt < 1):
        out.append(f"attempt must be an integer >= 1 (1: the first), got {attempt!r}")
    incarnation = fields.get("incarnation", 1)
    if incarnation is not None and (not _is_int(incarnation) or incarnation < 1):
        out.append(f"incarnation must be an integer >= 1 (1: the rank's first process), got {incarnation!r}")
    if action == "slow":
        if not _is_number(factor) or not math.isfinite(factor) or not 1 <= factor <= MAX_FACTOR:
            out.append(f"a slow fault needs a factor from 1 to {MAX_FACTOR:g} (how many times as long each step "
                       f"takes; a slower rank is a hang: use hang), got {factor!r}")  # fmt: skip
        return out
    if (step is None) == (after is None):
        out.append(f"a {action} fault needs exactly one of step=N or after=SECONDS")
    if step is not None and (not _is_int(step) or step < 1):
        out.append(f"step must be an integer >= 1, got {step!r}")
    if after is not None and (not _is_number(after) or not math.isfinite(after) or not 0 <= after <= threading.TIMEOUT_MAX):
        out.append(f"after must be a number of seconds from 0 to {threading.TIMEOUT_MAX:g}, got {after!r}")
    if action == "exit" and (not _is_int(code) or not 0 <= code <= 255):
        out.append(f"code must be an exit code from 0 to 255 (a process cannot exit with another), got {code!r}")
    return out


def _fields_of(spec: str | Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The fields a spec string or dict gives, and what is wrong with its form."""
    if isinstance(spec, Mapping):
        unknown = sorted(str(k) for k in set(spec) - {"action", *_KEYS})
        if unknown or "action" not in spec:
            return {}, [f"a fault is a dict with 'action' and some of {', '.join(_KEYS)}; got {dict(spec)!r}"]
        return dict(spec), []
    if not isinstance(spec, str) or not spec.strip():
        return {}, [f"a fault is 'ACTION[:key=value...]' such as 'kill:rank=1:step=30', got {spec!r}"]
    action, *parts = spec.strip().split(":")
    fields: dict[str, Any] = {"action": action}
    problems = []
    for part in parts:
        key, _, value = part.partition("=")
        if key not in _KEYS or not value:
            problems.append(f"{part!r} is not key=value with a key among {', '.join(_KEYS)}")
        elif key in fields:
            problems.append(f"{key} is given twice")
        elif key in ("attempt", "incarnation") and value in ("all", "every"):
            fields[key] = None
        else:
            try:
                fields[key] = _KEYS[key](value)
            except ValueError:
                kind = "an integer" if _KEYS[key] is int else "a number"
                problems.append(f"{key}={value!r} is not {kind}")
    return fields, problems


def _check_one(spec: str | Mapping[str, Any] | Fault) -> tuple[Fault | None, list[str]]:
    """The fault, or None and its problems (one line naming the fault, every problem in it)."""
    if isinstance(spec, Fault):
        problems = _problems(asdict(spec), given=None)
        return (None if problems else spec), ([f"fault {spec.describe()}: " + "; ".join(problems)] if problems else [])
    fields, problems = _fields_of(spec)
    if fields and not problems:
        problems = _problems(fields, given=fields)
    name = repr(spec) if isinstance(spec, str) else repr(dict(spec)) if isinstance(spec, Mapping) else repr(spec)
    if problems:
        return None, [f"fault {name}: " + "; ".join(problems)]
    return Fault(**fields), []


def parse_fault(spec: str | Mapping[str, Any] | Fault) -> Fault:
    """A checked :class:`Fault` from ``"kill:rank=1:step=30"``, a dict or a Fault."""
    fault, problems = _check_one(spec)
    if problems:
        raise LaunchConfigError("; ".join(problems))
    assert fault is not None
    return fault


def fault_problems(specs: Iterable[str | Mapping[str, Any] | Fault]) -> list[tuple[int, str]]:
    """``(index, problems)`` of each fault of a list that is wrong, every problem named (empty: all are valid)."""
    return [(i, p) for i, spec in enumerate(specs) for p in _check_one(spec)[1]]


def parse_faults(specs: Iterable[str | Mapping[str, Any] | Fault] | str | None) -> tuple[Fault, ...]:
    """Checked faults from a list (or one spec string, or None); every problem is reported at once."""
    if specs is None:
        return ()
    if isinstance(specs, (str, Mapping, Fault)):
        specs = [specs]
    specs = list(specs)
    problems = fault_problems(specs)
    if problems:
        raise LaunchConfigError("; ".join(p for _, p in problems))
    return tuple(parse_fault(s) for s in specs)


def fit_problems(faults: Iterable[Fault], world_size: int | None, max_attempts: int | None) -> list[tuple[int, str]]:
    """``(index, problem)`` of each fault that could never fire in a run of ``world_size`` ranks
    and at most ``max_attempts`` attempts (None: not known yet)."""
    out = []
    for i, f in enumerate(faults):
        if world_size is not None and f.rank is not None and f.rank >= world_size:
            out.append((i, f"fault {f.describe()}: rank {f.rank} does not exist: the run has {world_size} "
                           f"rank{'s' if world_size != 1 else ''} (0..{world_size - 1})"))  # fmt: skip
        if max_attempts is not None and f.attempt is not None and f.attempt > max_attempts:
            out.append((i, f"fault {f.describe()}: attempt {f.attempt} never runs: the run makes at most "
                           f"{max_attempts} attempt{'s' if max_attempts != 1 else ''} (max_retries={max_attempts - 1}); "
                           f"set max_retries to {f.attempt - 1} or more"))  # fmt: skip
    return out


def check_fit(faults: Iterable[Fault], world_size: int | None, max_attempts: int | None) -> None:
    """Refuse, before launch, faults that could never fire in this run (see :func:`fit_problems`)."""
    problems = fit_problems(faults, world_size, max_attempts)
    if problems:
        raise LaunchConfigError("; ".join(p for _, p in problems))


def faults_env(faults: Iterable[Fault], attempt: int = 1) -> dict[str, str]:
    """The environment that carries the faults of attempt ``attempt`` (1: the first) to the ranks.

    Empty when none applies: a run without faults sets nothing.
    """
    items = [asdict(f) for f in faults if f.attempt is None or f.attempt == attempt]
    return {FAULTS_ENV: json.dumps(items)} if items else {}


# -- in the rank ----------------------------------------------------------------------------
_armed: list[Fault] = []
_last_step_time: float | None = None
_step = 0  # the highest step seen: gpufleet's count (progress) or torch optimizer steps
_torch_steps = 0
_hooked = False
_armed_at_start: tuple[str, int] | None = None
_timers: list[threading.Timer] = []
_unfired: list[Fault] = []  # this rank's faults that have not fired yet (told at exit)
_armed_since = 0.0
_told_at_exit = False


def arm(rank: int, at_start: bool = False) -> None:
    """Arm this rank's faults from ``GPUFLEET_FAULTS`` (time-triggered ones start their timers).

    ``at_start``: armed as the process starts (``gpufleet/fault_boot``, a workload rank that
    may never call into gpufleet); the next :func:`arm` with the same faults (``runtime.setup``)
    then keeps them rather than arming them twice. Faults of an earlier call (a warm rank's) are
    disarmed first: a timer never outlives its call.
    """
    global _armed, _last_step_time, _step, _torch_steps, _armed_at_start, _unfired, _armed_since, _told_at_exit
    raw = os.environ.get(FAULTS_ENV) or ""
    if not at_start and _armed_at_start is not None:
        armed_at_start, _armed_at_start = _armed_at_start, None
        if armed_at_start == (raw, rank):
            return
    disarm()
    _step, _torch_steps = 0, 0
    if not raw:
        return
    if at_start:
        _armed_at_start = (raw, rank)
    incarnation = int(os.environ.get(envcontract.INCARNATION) or 1)
    mine = [f for f in (Fault(**d).check() for d in json.loads(raw))
            if (f.rank is None or f.rank == rank) and (f.incarnation is None or f.incarnation == incarnation)]  # fmt: skip
    _unfired, _armed_since = list(mine), time.monotonic()
    if mine and not _told_at_exit:
        import atexit

        _told_at_exit = True
        atexit.register(_say_unfired)
    _armed = [f for f in mine if f.after is None]
    for f in mine:
        if f.after is not None:
            fire = _hang_in_main_thread() if f.action == "hang" else _fire
            timer = threading.Timer(f.after, fire, args=(f, f"{f.after:g} s after the start"))
            timer.daemon = True
            timer.start()
            _timers.append(timer)
    if _armed:
        _count_torch_optimizer_steps()


#: The signal a timer thread sends the main thread to hang it there (a real-time one, unused by Python or torch).
_HANG_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
_pending_hang: list[tuple[Fault, str]] = []


def _hang_in_main_thread() -> Callable[[Fault, str], None]:
    """What a ``hang:after=`` timer calls: a hang must stop the rank's own code, which runs in the
    main thread, not the timer's thread. The timer signals the main thread, whose handler hangs
    (at its next Python instruction: a rank blocked in a collective hangs once that returns).
    Where no handler can be set (a rank armed from another thread), the timer's thread hangs."""
    if _HANG_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return _fire
    signal.signal(_HANG_SIGNAL, _on_hang_signal)

    def fire(fault: Fault, when: str) -> None:
        _pending_hang.append((fault, when))
        signal.pthread_kill(threading.main_thread().ident, _HANG_SIGNAL)

    return fire


def _on_hang_signal(signum: int, frame: Any) -> None:
    if _pending_hang:
        _fire(*_pending_hang.pop(0))


def _count_torch_optimizer_steps() -> None:
    """Count every torch optimizer step as a step too, so that ``step=N`` and ``slow`` fire in a
    loop that uses none of gpufleet's helpers (a torchrun script with its own process group)."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    _after_import("torch.optim.optimizer", lambda module: module.register_optimizer_step_post_hook(_on_torch_step))


def _on_torch_step(*_: Any) -> None:
    global _torch_steps
    _torch_steps += 1
    _seen(_torch_steps)


def restart_count() -> None:
    """Count steps afresh: the function runs again in this process (a survivor of a replaced rank),
    from its resumed step, and its ``step=N`` faults fire at that count, not at the earlier run's."""
    global _step, _torch_steps, _last_step_time
    _step, _torch_steps, _last_step_time = 0, 0, None


def disarm() -> None:
    """Forget this rank's faults and cancel their timers (a warm rank's call has ended)."""
    global _armed, _last_step_time, _unfired
    _armed, _last_step_time, _unfired = [], None, []
    while _timers:
        _timers.pop().cancel()


def on_step(step: int) -> None:
    """Called at each step gpufleet counts: fire the faults due now."""
    _seen(step)


def _seen(step: int) -> None:
    """A step count from one of the two counters: fire the faults due at each new highest step."""
    global _last_step_time, _step
    if not _armed or step <= _step:
        return
    _step = step
    now = time.monotonic()
    for f in _armed:
        if f.action == "slow" and _last_step_time is not None:
            _done(f)
            time.sleep((f.factor - 1.0) * (now - _last_step_time))
        elif f.step == step:
            _fire(f, f"step {step}")
    _last_step_time = time.monotonic()


def _after_import(name: str, then: Callable[[Any], None]) -> None:
    """Call ``then(module)`` once module ``name`` is imported (now, if it is already)."""
    module = sys.modules.get(name)
    if module is not None:
        _call_quietly(then, module)
        return
    sys.meta_path.insert(0, _ThenFinder(name, then))


def _call_quietly(then: Callable[[Any], None], module: Any) -> None:
    try:
        then(module)
    except Exception as e:  # noqa: BLE001 - never break the rank's import
        print(f"gpufleet: faults given step=N cannot count torch optimizer steps here: {e}", file=sys.stderr, flush=True)


class _ThenFinder(importlib.abc.MetaPathFinder):
    """Finds module ``name`` as the other finders do, and calls ``then`` once it has run."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class _ThenLoader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                module.__loader__ = module.__spec__.loader = loader  # the module sees its own loader
                loader.exec_module(module)
                _call_quietly(then, module)

        spec.loader = _ThenLoader()
        return spec


def _done(fault: Fault) -> None:
    with contextlib.suppress(ValueError):
        _unfired.remove(fault)


def _say_unfired() -> None:
    """At the rank's exit: each fault of it that never fired, and why it could not."""
    for f in list(_unfired):
        if f.after is not None:
            why = f"this rank ended {time.monotonic() - _armed_since:.1f} s after the start, before {f.after:g} s"
        else:
            why = (f"this rank counted {_step} step{'s' if _step != 1 else ''} (steps: batches of gpufleet's data "
                   "loader, optimizer steps, runtime.report_step())")  # fmt: skip
        verb = "never slowed a step" if f.action == "slow" else "never fired"
        with contextlib.suppress(Exception):  # a closed stderr at exit
            print(f"gpufleet: injected fault {f.describe()} {verb}: {why}", file=sys.stderr, flush=True)


def _fire(fault: Fault, when: str) -> None:
    _done(fault)
    print(f"gpufleet: injected fault: {fault.action} at {when}", file=sys.stderr, flush=True)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "exit":
        os._exit(fault.code)
    elif fault.action == "hang":
        while True:  # stopped for good, as a rank stuck outside the collective its peers wait in
            time.sleep(3600)
