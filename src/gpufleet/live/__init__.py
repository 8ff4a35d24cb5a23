"""A live view of a running call: a panel in the notebook cell, a status line in the terminal.

- :mod:`gpufleet.live.feed` (in the ranks): rank 0's ``log_metrics`` into ``metrics-0.jsonl``.
- :mod:`gpufleet.live.snapshot`: what the view shows, read from the run folder (progress
  records, metrics, logs), the controller's last status and NVML.
- :mod:`gpufleet.live.html` / :mod:`gpufleet.live.text`: the panel (HTML + inline SVG) and the line.
- :mod:`gpufleet.live.views`: where it goes (an ``IPython.display`` handle, rich's ``Live``).
- :mod:`gpufleet.live.observer`: the controller callback that feeds a view a few times a second.

On by default for a blocking ``.distributed()`` call where there is somewhere to show it (a
Jupyter kernel, or a terminal on both stdout and stderr); off with ``live=False`` on the
decorator or ``GPUFLEET_LIVE=0``. Importing this package imports nothing heavy.
"""

from __future__ import annotations

import os
import sys

from ..launch.node import envcontract
from .feed import live_off

__all__ = ["choose_view", "live_env", "LIVE_ENV"]

#: ``GPUFLEET_LIVE=0`` switches the live view off everywhere.
LIVE_ENV = envcontract.LIVE
#: How often (seconds) the ranks rewrite their progress records while a live view watches.
LIVE_PROGRESS_S = 0.5


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (a front end that renders rich output)."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # noqa: BLE001
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _tty(stream: object) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def choose_view(live: bool | None) -> str | None:
    """``"notebook"``, ``"terminal"`` or None (off: ``live=False``, ``GPUFLEET_LIVE=0``, or nowhere to show it)."""
    if live is False or live_off():
        return None
    if in_kernel():
        return "notebook"
    if _tty(sys.stdout) and _tty(sys.stderr):
        return "terminal"
    return None


def live_env(view: str | None, env: dict[str, str]) -> dict[str, str]:
    """The ranks' environment ``env`` with progress records often enough for a live view."""
    if view is None:
        return env
    from ..launch.progress import PROGRESS_INTERVAL_ENV

    current = env.get(PROGRESS_INTERVAL_ENV)
    interval = LIVE_PROGRESS_S if current is None else min(float(current), LIVE_PROGRESS_S)
    return {**env, PROGRESS_INTERVAL_ENV: f"{interval:g}"}
