"""What a hang looks like from outside: which rank is missing from which collective, and where each rank is.

Built from each rank's last progress record (the process group's collective count, its backend
and, where torch's flight recorder keeps them, the last collectives), each rank's stack dump and
what each rank did meanwhile (busy, idle, stopped: :mod:`gpufleet.launch.hangwatch.activity`).

A rank's collective count goes up as it *enters* a collective. A rank whose count is behind the
others' is missing from the collective they wait in (that one cannot have completed). Ranks at
the same count are inside that collective only where their stack shows it (or NCCL's flight
recorder has not seen it complete); a rank that left it is "in its own code after" it. Ranks at
the same count in different collectives (or with different sizes) are mismatched.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')  # faulthandler
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^()]+):(?P<line>\d+)\)\s*$")  # py-spy dump
_NOT_USER = re.compile(r"(/site-packages/|/dist-packages/|/lib/python3\.\d+/|(^|/)gpufleet/(launch|faults)|(^|/)torch/|^<frozen )")
_IN_COLLECTIVE = re.compile(r"(^|/)torch/distributed/")
#: A rank whose progress record is older than this (seconds; it is rewritten every second or faster)
#: has a progress reporter that cannot run.
STALE_S = 3.0


@dataclass(frozen=True)
class Diagnosis:
    """The watchdog's findings.

    Attributes:
        summary: lines for the top of the error.
        missing: ranks blamed (behind, mismatched, stuck), with what is wrong with each.
        waiting: the other ranks, with where each waits.
        report: the full report (summary, last collectives, every rank's stacks).
        clear: the evidence is clear enough for the fast path: a collective that has not
            completed, and every rank blamed for it does nothing (idle or stopped).
        busy: ranks busy in their own code (CPU or GPU) while others wait, with their line.
    """

    summary: list[str]
    missing: dict[int, str] = field(default_factory=dict)
    waiting: dict[int, str] = field(default_factory=dict)
    report: str = ""
    clear: bool = False
    busy: dict[int, str] = field(default_factory=dict)


def _threads(stack: str) -> tuple[list[Any], list[list[Any]]]:
    """The frames (innermost first) of the thread running the function, and of every other thread."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) )", stack.strip())
    frames = [[m for m in (_FRAME.match(line) or _SPY_FRAME.match(line) for line in b.splitlines()) if m] for b in blocks]
    # the thread running the function: inside the worker's run_call, or py-spy's MainThread, else the last one
    main = next((i for i, b in enumerate(blocks) if " in run_call" in b or "run_call (" in b or '"MainThread"' in b),
                len(blocks) - 1)  # fmt: skip
    if not blocks or not frames[main]:
        return [], [f for f in frames if f]
    return frames[main], [f for i, f in enumerate(frames) if i != main and f]


def _describe(m: Any) -> str:
    source = linecache.getline(m["file"], int(m["line"])).strip()
    where = f'{m["file"]}:{m["line"]} in {m["func"]}'
    return f"{where}: {source}" if source else where


def _user(frames: list[Any]) -> Any:
    return next((m for m in frames if not _NOT_USER.search(m["file"])), None)


def user_frame(stack: str) -> str:
    """Where the rank's own code is in a faulthandler dump: ``file:line in func: source``, or ''."""
    main, _ = _threads(stack)
    chosen = _user(main) or (main[0] if main else None)
    return _describe(chosen) if chosen is not None else ""


def in_collective(stack: str) -> bool | None:
    """Whether the thread running the function is inside a collective now (None: no stack to tell)."""
    main, _ = _threads(stack)
    if not main:
        return None
    if _IN_COLLECTIVE.search(main[0]["file"]):
        return True
    # a C-level wait called from the user's line (``work.wait()``, a future of a comm hook)
    return not _NOT_USER.search(main[0]["file"]) and ".wait(" in linecache.getline(main[0]["file"], int(main[0]["line"]))


def other_threads(stack: str) -> list[str]:
    """The user's line of each other thread that is in user code (a deadlock between threads shows there)."""
    _, others = _threads(stack)
    return [_describe(m) for m in (_user(f) for f in others) if m is not None]


def _collective(progress: Mapping[str, Any], seq: int | None) -> Mapping[str, Any] | None:
    for entry in reversed(progress.get("collectives") or []):
        if seq is None or entry.get("seq") == seq:
            return entry
    return None


def _name(entry: Mapping[str, Any] | None, seq: int | None) -> str:
    if entry is None:
        return f"collective #{seq}" if seq is not None else "a collective"
    sizes = f" {entry['sizes']}" if entry.get("sizes") else ""
    return f"{entry.get('op', '?')} #{entry.get('seq', seq)}{sizes}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _pending_in_recorder(record: Mapping[str, Any], seq: int) -> bool:
    """NCCL's flight recorder saw collective ``seq`` start and not complete (gloo's never marks completion)."""
    if record.get("backend") != "nccl":
        return False
    entry = _collective(record, seq)
    return entry is not None and entry.get("state") in ("scheduled", "started")


_ACTIVITY = {"busy": "busy", "idle": "idle", "stopped": "stopped: SIGSTOP or SIGTSTP",
             "unknown": "activity unknown"}  # fmt: skip


class _Ranks:
    """Per-rank facts the wording is built from."""

    def __init__(self, progress: Mapping[int, Mapping[str, Any]], stacks: Mapping[int, str],
                 activity: Mapping[int, str], now: float | None) -> None:  # fmt: skip
        self.progress, self.stacks, self.activity, self.now = progress, stacks, activity, now
        #: the collective a rank is known to have completed at least (the others entered the next one)
        self.completed: dict[int, int] = {}

    def seq(self, r: int) -> int | None:
        return self.progress.get(r, {}).get("seq")

    def where(self, r: int) -> str:
        return user_frame(self.stacks.get(r, ""))

    def after(self, r: int) -> str:
        """The last collective it completed: its own count, or later where the others prove it (a stale record)."""
        seq = max(self.seq(r) or 0, self.completed.get(r, 0))
        if not seq:
            return "before its first collective"
        entry = next((e for p in [self.progress.get(r, {}), *self.progress.values()] if (e := _collective(p, seq))), None)
        return f"after {_name(entry, seq)}"

    def doing(self, r: int) -> str:
        """``busy``, ``idle``, ...; with a silent progress reporter (a C call holding the GIL) named."""
        act = self.activity.get(r, "unknown")
        text = _ACTIVITY.get(act, act)
        record = self.progress.get(r)
        if record and self.now is not None and act != "stopped":
            silent = self.now - float(record.get("time", self.now))
            if silent > STALE_S:
                text += f"; its progress reporter has not run for {silent:.0f} s: a call that holds the GIL"
        return text

    def own_code(self, r: int) -> str:
        """``in its own code at FILE:LINE, after collective #N (busy|idle)``, and its other threads."""
        where = self.where(r)
        if not where and r not in self.progress:
            return ("no progress record and no stack: it never reached runtime.setup() or gpufleet's "
                    f"progress reporting, or it runs on another machine ({self.doing(r)})")  # fmt: skip
        at = f" at {where}" if where else " (no stack could be read)"
        text = f"in its own code{at}, {self.after(r)} ({self.doing(r)})"
        threads = other_threads(self.stacks.get(r, ""))
        if threads:
            text += "; its other threads: " + "; ".join(threads)
        return text

    def waiting_in(self, r: int, name: str) -> str:
        where = self.where(r)
        return f"waiting in {name}" + (f" at {where}" if where else "")


def diagnose(
    progress: Mapping[int, Mapping[str, Any]], stacks: Mapping[int, str], num_ranks: int, idle_s: float,
    finished: frozenset[int] = frozenset(), activity: Mapping[int, str] | None = None, now: float | None = None,
    limit: str = "",
) -> Diagnosis:
    """Name the ranks behind, mismatched or stuck, and where each rank is.

    Args:
        progress: each rank's last progress record.
        stacks: each rank's stack dump (faulthandler or py-spy).
        num_ranks: the ranks of the run.
        idle_s: how long nothing moved.
        finished: ranks that returned.
        activity: what each rank did meanwhile (``busy``, ``idle``, ``stopped``, ``unknown``).
        now: the wall-clock time of the look (a progress record older than :data:`STALE_S`
            then means that the rank's reporter cannot run).
        limit: which limit was reached, for the first line.
    """
    facts = _Ranks(progress, stacks, activity or {}, now)
    seqs = {r: facts.seq(r) for r in range(num_ranks)}
    known = {r: s for r, s in seqs.items() if s is not None}
    limit_text = f"; {limit}" if limit else ""
    summary = [f"no rank made progress for {idle_s:.0f} s (no collective completed, no step reported{limit_text})"]
    missing: dict[int, str] = {}
    waiting: dict[int, str] = {}
    clear = False
    live = [r for r in range(num_ranks) if r not in finished]
    quiet = lambda ranks: all(facts.activity.get(r) in ("idle", "stopped") for r in ranks)  # noqa: E731
    if known:
        top = max(known.values())
        ahead = [r for r in live if seqs[r] == top]
        behind = [r for r in live if seqs[r] is None or seqs[r] < top]
        entries = {r: _collective(progress[r], top) for r in range(num_ranks) if seqs[r] == top}
        name = _name(next((e for e in entries.values() if e), None), top)
        kinds = {(e.get("op"), str(e.get("sizes"))) for e in entries.values() if e}
        inside = {r: in_collective(stacks.get(r, "")) for r in ahead}
        for r in ahead:
            if _pending_in_recorder(progress[r], top):
                inside[r] = True
        if len(kinds) > 1:
            summary.append("mismatched collectives: " + "; ".join(
                f"rank {r} in {_name(e, top)}" for r, e in sorted(entries.items())))  # fmt: skip
            for r, e in entries.items():
                where = facts.where(r)
                missing[r] = f"in {_name(e, top)}" + (f" at {where}" if where else "") + ", which does not match the other ranks'"
            clear = True
        elif behind and ahead:
            verb = "waits" if len(ahead) == 1 else "wait"
            summary.append(f"{_ranks(behind)} missing from {name}, which {_ranks(ahead)} {verb} in")
            for r in behind:  # the others entered #top: every rank completed #top-1
                facts.completed[r] = top - 1
                if inside.get(r) or in_collective(stacks.get(r, "")):
                    missing[r] = (f"missing from {name}: in a collective at {facts.where(r)} that the others passed "
                                  f"(its collective count: #{seqs[r]}; another process group, or different "
                                  "collectives on the ranks)")  # fmt: skip
                else:
                    missing[r] = f"missing from {name}: {facts.own_code(r)}"
            for r in ahead:
                waiting[r] = facts.waiting_in(r, name)
            clear = quiet(behind)
        elif finished and ahead and any((seqs[r] or 0) < top for r in finished):
            gone = sorted(r for r in finished if (seqs[r] or 0) < top)
            verb = "waits" if len(ahead) == 1 else "wait"
            summary.append(f"{_ranks(gone)} returned without entering {name}, which {_ranks(ahead)} {verb} in")
            for r in ahead:
                missing[r] = f"{facts.waiting_in(r, name)}, which {_ranks(gone)} never entered (it returned)"
            clear = True
        elif finished and ahead:
            stuck = [r for r in ahead if inside.get(r)]  # seen inside it (an unread stack proves nothing)
            if stuck:  # the others wait in a collective that a rank which returned completed on its side
                verb = "waits" if len(stuck) == 1 else "wait"
                summary.append(f"{_ranks(sorted(finished))} returned while {_ranks(stuck)} still {verb} in {name}: "
                               "the ranks ran different collectives (e.g. a broadcast on one rank, an all-reduce "
                               "on another)")  # fmt: skip
                for r in stuck:
                    where = facts.where(r)
                    missing[r] = (f"stuck in {name}, which {_ranks(sorted(finished))} passed with a different "
                                  f"collective before returning" + (f" at {where}" if where else ""))  # fmt: skip
                clear = True
        elif ahead:
            in_top = [r for r in ahead if inside[r]]
            own = [r for r in ahead if inside[r] is False]
            unread = [r for r in ahead if inside[r] is None]
            if in_top and not own and not unread:
                summary.append(f"every rank is in {name} and none is missing: it does not complete "
                               "(a network or device problem, or a rank blocked in another process group)")  # fmt: skip
                for r in in_top:
                    waiting[r] = facts.waiting_in(r, name)
                clear = True
            elif in_top and own:
                verb = "waits" if len(in_top) == 1 else "wait"
                summary.append(f"{_ranks(own)} passed {name}, which {_ranks(in_top)} still {verb} in: the ranks ran "
                               "different collectives (e.g. a broadcast on one rank, an all-reduce on another)")  # fmt: skip
                for r in own:
                    missing[r] = facts.own_code(r)
                for r in in_top:
                    waiting[r] = facts.waiting_in(r, name)
                clear = quiet(own)
            elif own and not in_top:
                idle = quiet(own)
                summary.append(f"no rank waits in a collective: {'every rank is' if len(own) == len(live) else _ranks(own) + ' are'} "
                               f"in its own code after {name}, which completed" +
                               (" (all idle: a deadlock, e.g. in a data loader or between threads)" if idle else ""))  # fmt: skip
                for r in own:
                    missing[r] = facts.own_code(r)
    elif live:
        summary.append("no rank has entered a collective yet")
        for r in live:
            missing[r] = facts.own_code(r)
    busy = {r: facts.where(r) for r in missing if facts.activity.get(r) == "busy"}
    for r in range(num_ranks):
        if r in finished:
            missing.pop(r, None)
            waiting[r] = f"returned its result ({facts.after(r)})"
        elif r not in missing and r not in waiting:
            waiting[r] = facts.own_code(r)
    for r in range(num_ranks):
        summary.append(f"  rank {r}: {missing.get(r) or waiting.get(r)}")
    lines = [*summary, "", "last collectives per rank (from torch's flight recorder, where it records them):"]
    for r in range(num_ranks):
        recent = progress.get(r, {}).get("collectives") or []
        shown = ", ".join(f"#{e.get('seq')} {e.get('op')} {e.get('sizes')} {e.get('state')}" for e in recent)
        lines.append(f"  rank {r}: seq {seqs[r]}; {shown or 'none recorded'}")
    for r in range(num_ranks):
        lines += ["", f"--- rank {r}: every thread's stack ---", stacks.get(r, "").rstrip() or "(no stack dump)"]
    return Diagnosis(summary, missing, waiting, "\n".join(lines) + "\n", clear=clear and not busy, busy=busy)
