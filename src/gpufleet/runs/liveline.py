"""The live status line of a workload run (``gpufleet run --watch``, ``gpufleet logs --follow`` on a terminal).

The run's id, state, attempt and time, and, while it runs, what its ranks report in the run
folder through :mod:`gpufleet.live` (ranks by state, step of total, steps/s, rank 0's last
metrics, ETA). ``GPUFLEET_LIVE=0`` leaves the ranks' part out.
"""

from __future__ import annotations

from pathlib import Path

from .formats import fmt_duration
from .store import TERMINAL_STATES, RunRecord

STATE_STYLE = {
    "PENDING": "yellow",
    "RUNNING": "cyan",
    "SUCCESS": "green",
    "FAILED": "red",
    "CANCELED": "magenta",
    "TIMEDOUT": "red",
}


class RankProgress:
    """What the ranks of a running workload report in its run folder (steps, steps/s, rank 0's metrics).

    Only ranks that use gpufleet (``runtime.setup``, ``report_step``, its data loader) report;
    the live line shows nothing of the others. See :mod:`gpufleet.live`.
    """

    def __init__(self) -> None:
        self._watcher: object | None = None

    def parts(self, run: RunRecord) -> list[str]:
        from ..live.feed import live_off

        if run.state != "RUNNING" or not run.run_dir or not run.world_size or live_off():
            return []
        try:
            from ..live.snapshot import STARTING, RunWatcher
            from ..live.text import progress_parts

            if self._watcher is None:
                self._watcher = RunWatcher(run.id, Path(run.run_dir), int(run.world_size))
            snap = self._watcher.read(None)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the line never stops the view
            return []
        if all(r.state == STARTING for r in snap.ranks):
            return []
        return progress_parts(snap)


def render_status(r: RunRecord, progress: RankProgress | None = None) -> object:
    """The live status line of a run: id, state, attempt, time, and (running) its ranks' progress."""
    from rich.spinner import Spinner
    from rich.text import Text

    style = STATE_STYLE.get(r.state, "")
    text = Text.assemble(("run ", "dim"), (r.id, "bold"), "  ", (r.state, f"bold {style}"))
    if r.attempt:
        text.append(f"  attempt {r.attempt}/{r.max_attempts}", style="dim")
    text.append(f"  {fmt_duration(r.duration_s)}", style="dim")
    if r.state in TERMINAL_STATES:
        if r.message:
            text.append(f"\n{r.message}", style=style)
        return text
    for part in progress.parts(r) if progress is not None else []:
        text.append(" · ", style="dim")
        text.append(part, style="cyan" if part.startswith("step") else "")
    return Spinner("dots", text=text)
