"""How the CLI writes times, durations and an attempt's recoveries."""

from __future__ import annotations

import datetime as _dt
from typing import Any


def fmt_time(ts: float | None) -> str:
    """A timestamp as local ``YYYY-mm-dd HH:MM:SS`` (``-`` when absent)."""
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def fmt_duration(seconds: float | None) -> str:
    """Seconds as ``1h02m03s`` / ``2m05s`` / ``4.2s``."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def recovery_lines(recoveries: list[dict[str, Any]]) -> list[str]:
    """One line per lost rank of an attempt (``AttemptRecord.recoveries``): what became of it, and when."""
    from ..launch.recoveries import Recovery

    lines = []
    for stored in recoveries:
        record = Recovery.from_dict(stored)
        try:
            line = None if record is None else (f"recovery {record.number} of attempt {record.attempt} at "
                                                f"{fmt_time(record.died_at)}: {record.describe()}")  # fmt: skip
        except (TypeError, ValueError, OverflowError):  # a field of the wrong type
            line = None
        lines.append(line or f"recovery (not a record gpufleet writes): {stored!r}")
    return lines
