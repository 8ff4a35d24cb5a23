"""How the CLI writes times and durations."""

from __future__ import annotations

import datetime as _dt


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
