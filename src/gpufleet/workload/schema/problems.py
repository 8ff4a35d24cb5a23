"""Validation problems: one problem (a field path and a message) and the error that lists them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import GpufleetError


class WorkloadValidationError(GpufleetError):
    """A workload document is invalid; ``problems`` lists every problem with its field path."""

    def __init__(self, problems: list[Problem], source: str = "workload", document: Any = None) -> None:
        self.problems = problems
        self.source = source
        #: The document found invalid (when it was parsed), so that later checks can still read it.
        self.document = document
        lines = [f"{source} is invalid ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Problem:
    """One validation problem: where (a dotted field path) and what is wrong / allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<document>'}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


def describe(value: Any) -> str:
    """A value for a message: its type and a short repr (``str 'lots'``)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def path_of(loc: tuple[Any, ...]) -> str:
    """A field location as a dotted path: ``compute.num_accelerators``, ``parameters.tags[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).isprintable() and str(part).strip() and "." not in str(part):
            out += ("." if out else "") + str(part)
        else:  # a key with dots, spaces or control characters: quoted, on one line
            out += f"[{str(part)!r}]"
    return out


class ItemProblems(GpufleetError, ValueError):
    """Raised by a list field's validator (pydantic takes ValueErrors): a problem of each wrong
    item (``(index, message)``), reported at each item's path (``faults[1]``)."""

    def __init__(self, items: list[tuple[int, str]]) -> None:
        self.items = items
        super().__init__("; ".join(f"[{i}] {m}" for i, m in items))
