"""The live view's one hook into a call: a controller callback that refreshes a view a few times a second.

:class:`LiveObserver` opens its view before the first attempt's ranks start (a terminal's
line must exist before the ranks' log streams take ``sys.stdout``), starts a daemon thread
once the ranks run that reads a :class:`~gpufleet.live.snapshot.RunWatcher` and the
controller's last status every ``interval_s``, and, when the attempt ends, stops the thread
and shows the summary from the caller's thread, before the call returns or raises. It reads
only what the ranks and the controller write anyway; a view that breaks is dropped with one
warning and never changes the call's outcome (every hook is guarded by the controller too).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..launch.controller import ControllerCallback
from .snapshot import RunWatcher, Snapshot

logger = logging.getLogger(__name__)

#: Seconds between refreshes of the view.
REFRESH_S = 0.25


def _make_view(kind: str) -> Any:
    from .views import NotebookView, TerminalView

    return NotebookView() if kind == "notebook" else TerminalView()


def _mlflow_link(run_id: str) -> str:
    from ..tracking.links import run_link

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        from ..tracking.runs import default_tracking_uri

        uri = default_tracking_uri()
    return run_link(uri, run_id)


class LiveObserver(ControllerCallback):
    """Feeds a live view (``"notebook"`` or ``"terminal"``) from the run folder and the controller."""

    def __init__(self, kind: str, refresh_s: float = REFRESH_S) -> None:
        self.kind = kind
        self.refresh_s = refresh_s
        self.view: Any = None
        self._controller: Any = None
        self._watcher: RunWatcher | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._broken = False

    def attach(self, controller: Any) -> None:
        self._controller = controller

    def before_start(self, group: Any, attempt: int) -> None:
        if self.view is None or self.kind == "terminal":  # a terminal line per attempt, one panel per call
            self._guard(lambda: setattr(self, "view", _make_view(self.kind)))

    def after_start(self, group: Any, attempt: int) -> None:
        if self.view is None:
            return
        placement = getattr(group, "placement", None)
        gpus = tuple(placement.gpu_indices) if placement is not None and getattr(placement, "use_gpus", False) else ()
        self._watcher = RunWatcher(
            group.run_id, group.run_dir.path, group.num_ranks, attempt=attempt, log_path=group.log_path,
            gpu_indices=gpus, pids=group.pids,
        )  # fmt: skip
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(group,), name=f"gpufleet-live-{group.run_id}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def on_end(self, group: Any, attempt: int, state: str, error: BaseException | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        watcher, self._watcher = self._watcher, None
        if self.view is None:
            return
        if watcher is None:  # the ranks never started: an empty summary with the error
            watcher = RunWatcher(group.run_id, group.run_dir.path, group.num_ranks, attempt=attempt)
        mlflow_id = getattr(group, "mlflow_run_id", None)

        def close() -> None:
            link = _mlflow_link(mlflow_id) if mlflow_id else None
            snap = watcher.read(getattr(self._controller, "status", None), state=state, error=error,
                                mlflow_run_id=mlflow_id, mlflow_link=link)  # fmt: skip
            self.view.close(snap)

        self._guard(close)
        watcher.close()
        if self.kind == "terminal":
            view, self.view = self.view, None
            try:
                view.stop()  # the terminal is the user's again, even after the view broke
            except Exception:  # noqa: BLE001
                pass

    # -- the refresh thread -------------------------------------------------------------
    def snapshot(self, group: Any) -> Snapshot | None:
        watcher = self._watcher
        if watcher is None:
            return None
        return watcher.read(getattr(self._controller, "status", None), mlflow_run_id=getattr(group, "mlflow_run_id", None))

    def _loop(self, group: Any) -> None:
        while not self._broken:
            self._guard(lambda: self._show(group))
            if self._stop.wait(self.refresh_s):
                return

    def _show(self, group: Any) -> None:
        snap = self.snapshot(group)
        if snap is not None and not self._stop.is_set():
            self.view.show(snap)

    def _guard(self, action: Any) -> None:
        """Run ``action``; the first failure drops the view with a warning (the call goes on)."""
        if self._broken:
            return
        try:
            with self._lock:
                action()
        except Exception as e:  # noqa: BLE001 - the view never changes a call's outcome
            self._broken = True
            logger.warning("gpufleet: the live view is off for this call (%s: %s)", type(e).__name__, e)
