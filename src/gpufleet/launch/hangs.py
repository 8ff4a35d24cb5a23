"""What a hang looks like from outside: which rank is missing from which collective, and where each rank is.

Built from each rank's last progress record (the process group's collective count and, where
torch's flight recorder keeps them, the last collectives) and each rank's stack dump. A rank
whose count is behind the others' is missing from the collective they wait in; ranks at the
same count in different collectives (or with different sizes) are mismatched.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')  # faulthandler
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^()]+):(?P<line>\d+)\)\s*$")  # py-spy dump
_NOT_USER = re.compile(r"(/site-packages/|/dist-packages/|/lib/python3\.\d+/|(^|/)gpufleet/(launch|faults)|(^|/)torch/)")


@dataclass(frozen=True)
class Diagnosis:
    """The watchdog's findings.

    Attributes:
        summary: lines for the top of the error.
        missing: ranks blamed (behind or mismatched), with what is wrong with each.
        waiting: the other ranks, with where each waits.
        report: the full report (summary, last collectives, every rank's stacks).
    """

    summary: list[str]
    missing: dict[int, str] = field(default_factory=dict)
    waiting: dict[int, str] = field(default_factory=dict)
    report: str = ""


def user_frame(stack: str) -> str:
    """Where the rank's own code is in a faulthandler dump: ``file:line in func: source``, or ''."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) )", stack.strip())
    # the thread running the function: inside the worker's run_call, or py-spy's MainThread
    main = next((b for b in blocks if " in run_call" in b or "run_call (" in b or '"MainThread"' in b),
                blocks[-1] if blocks else "")  # fmt: skip
    frames = [m for m in (_FRAME.match(line) or _SPY_FRAME.match(line) for line in main.splitlines()) if m]
    chosen = next((m for m in frames if not _NOT_USER.search(m["file"])), frames[0] if frames else None)
    if chosen is None:
        return ""
    source = linecache.getline(chosen["file"], int(chosen["line"])).strip()
    where = f'{chosen["file"]}:{chosen["line"]} in {chosen["func"]}'
    return f"{where}: {source}" if source else where


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


def diagnose(
    progress: Mapping[int, Mapping[str, Any]], stacks: Mapping[int, str], num_ranks: int, idle_s: float,
    finished: frozenset[int] = frozenset(),
) -> Diagnosis:
    """Name the ranks behind or mismatched, and where each rank's code is (``finished``: ranks that returned)."""
    where = {r: user_frame(stacks.get(r, "")) if r not in finished else "" for r in range(num_ranks)}
    seqs = {r: progress.get(r, {}).get("seq") for r in range(num_ranks)}
    known = {r: s for r, s in seqs.items() if s is not None}
    summary = [f"no rank made progress for {idle_s:.0f} s (no collective completed, no step reported)"]
    missing: dict[int, str] = {}
    waiting: dict[int, str] = {}
    if known:
        top = max(known.values())
        ahead = [r for r, s in known.items() if s == top]
        behind = [r for r in range(num_ranks) if seqs[r] is None or seqs[r] < top]
        entry = next((_collective(progress[r], top) for r in ahead if _collective(progress[r], top)), None)
        name = _name(entry, top)
        if behind:
            verb = "waits" if len(ahead) == 1 else "wait"
            summary.append(f"{_ranks(behind)} missing from {name}, which {_ranks(ahead)} {verb} in")
            for r in behind:
                missing[r] = f"missing from {name} (its last collective: #{seqs[r]})" if seqs[r] else f"missing from {name}"
        else:
            entries = {r: _collective(progress[r], top) for r in ahead}
            kinds = {(e.get("op"), str(e.get("sizes"))) for e in entries.values() if e}
            if len(kinds) > 1:
                summary.append("mismatched collectives: " + "; ".join(
                    f"rank {r} in {_name(e, top)}" for r, e in sorted(entries.items())))  # fmt: skip
                for r, e in entries.items():
                    missing[r] = f"in {_name(e, top)}, which does not match the other ranks'"
            elif not finished:
                summary.append(f"every rank is in {name} and none is missing: it does not complete "
                               "(a network or device problem, or a rank blocked in another process group)")  # fmt: skip
        for r in ahead:
            if r not in missing:
                waiting[r] = f"waiting in {name}"
    for r in range(num_ranks):
        at = f" at {where[r]}" if where[r] else ""
        if r in finished:
            missing.pop(r, None)
            waiting[r] = f"returned its result (its last collective: #{seqs[r]})"
        elif r in missing:
            missing[r] += at
        else:
            waiting[r] = waiting.get(r, "no collective yet") + at
    if finished and not missing and known:
        # the others wait in a collective that a rank which already returned completed on its side
        stuck = [r for r in range(num_ranks) if r not in finished]
        top = max(known.values())
        name = _name(next((_collective(progress[r], top) for r in stuck if r in progress), None), top)
        verb = "waits" if len(stuck) == 1 else "wait"
        summary.insert(1, f"{_ranks(sorted(finished))} returned while {_ranks(stuck)} still {verb} in {name}: "
                          "the ranks ran different collectives (e.g. a broadcast on one rank, an all-reduce "
                          "on another)")  # fmt: skip
        for r in stuck:
            where_r = f" at {where[r]}" if where[r] else ""
            missing[r] = (f"stuck in {name}, which {_ranks(sorted(finished))} passed with a different "
                          f"collective before returning{where_r}")  # fmt: skip
            waiting.pop(r, None)
    for r in range(num_ranks):
        summary.append(f"  rank {r}: {missing.get(r) or waiting.get(r)}")
    lines = [*summary, "", "last collectives per rank (from torch's flight recorder, where it records them):"]
    for r in range(num_ranks):
        recent = progress.get(r, {}).get("collectives") or []
        shown = ", ".join(f"#{e.get('seq')} {e.get('op')} {e.get('sizes')} {e.get('state')}" for e in recent)
        lines.append(f"  rank {r}: seq {seqs[r]}; {shown or 'none recorded'}")
    for r in range(num_ranks):
        lines += ["", f"--- rank {r}: every thread's stack ---", stacks.get(r, "").rstrip() or "(no stack dump)"]
    return Diagnosis(summary, missing, waiting, "\n".join(lines) + "\n")
