"""Where the live view goes: an ``IPython.display`` handle in the cell, or rich's ``Live`` under the logs."""

from __future__ import annotations

import sys

from .snapshot import Snapshot


class NotebookView:
    """One output of the cell, replaced in place (``update_display_data``) at each refresh.

    HTML for front ends that render it, and the status line (the summary at the end) as its
    plain-text form for those that do not.
    """

    def __init__(self) -> None:
        from IPython.display import display

        self._display = display
        self._last = ""
        self._handle = display({"text/html": '<div data-gpufleet-panel="" data-state="PENDING">gpufleet: starting…</div>',
                                "text/plain": "gpufleet: starting"}, raw=True, display_id=True)  # fmt: skip

    def show(self, snap: Snapshot) -> None:
        from .html import render
        from .text import status_line, summary_line

        text = render(snap)
        if text != self._last and self._handle is not None:
            self._last = text
            plain = summary_line(snap) if snap.state != "RUNNING" else status_line(snap)
            self._handle.update({"text/html": text, "text/plain": f"gpufleet: {plain}"}, raw=True)

    def close(self, snap: Snapshot) -> None:
        self.show(snap)

    def stop(self) -> None:
        """Nothing to give back: the last panel stays in the cell."""


class TerminalView:
    """A status line under the streamed logs (rich's ``Live``; the logs print above it).

    Made before the ranks start, so their log streams take rich's redirected ``sys.stdout`` /
    ``sys.stderr``; at the end the line is replaced by one summary line.
    """

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self._console = Console()
        self._live = Live(console=self._console, auto_refresh=False, transient=True,
                          redirect_stdout=True, redirect_stderr=True)  # fmt: skip
        self._live.start()

    def show(self, snap: Snapshot) -> None:
        from .text import rich_line

        self._live.update(rich_line(snap), refresh=True)  # type: ignore[arg-type]

    def close(self, snap: Snapshot) -> None:
        from rich.text import Text

        from .text import summary_line

        self.stop()
        style = "green" if snap.state == "SUCCESS" else "red"
        self._console.print(Text("gpufleet: ", style="dim") + Text(summary_line(snap), style=style), soft_wrap=True)
        sys.stdout.flush()

    def stop(self) -> None:
        """Give the terminal back (safe to call twice)."""
        self._live.stop()
