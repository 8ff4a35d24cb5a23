"""Tracking is an observer: a bounded look at the tracking server, and time limits on gpufleet's MLflow work.

MLflow's HTTP client retries a server that refuses connections for minutes (seven retries with a
growing back-off) and waits two minutes for one that accepts a connection but never answers. A
call, a workload's supervisor or ``gpufleet cancel`` that waited for that would stall, and a call
could lose its result to its own timeout. So:

- :func:`unreachable` asks an ``http(s)`` tracking server's ``/health`` once, for a few seconds,
  before gpufleet opens or attaches a run there; a server that refuses, does not answer or
  cannot be resolved is named in one warning and the run goes on untracked. Other stores
  (SQLite, files, Databricks) are not probed.
- :func:`bounded` runs one tracking step (opening a run, recording its end) in a daemon thread
  and waits for it at most :func:`tracking_wait_s` seconds (``$GPUFLEET_TRACKING_WAIT_S``,
  default 30); past that the step is given up (:class:`TrackingStalledError`) and whatever
  waited goes on. The step may still finish later, in the background.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import GpufleetError
from ..launch.node import envcontract

T = TypeVar("T")

DEFAULT_WAIT_S = 30.0
PROBE_S = 3.0
VERDICT_S = 30.0  # how long one probe's verdict is reused for the same server

_verdicts: dict[str, tuple[float, str | None]] = {}
_verdicts_lock = threading.Lock()


class TrackingStalledError(GpufleetError, TimeoutError):
    """A tracking step did not finish in the time gpufleet waits for it."""


def tracking_wait_s() -> float:
    """Seconds gpufleet waits for one tracking step: ``$GPUFLEET_TRACKING_WAIT_S`` (default 30, at least 0.1)."""
    try:
        value = float(os.environ.get(envcontract.TRACKING_WAIT_S) or DEFAULT_WAIT_S)
    except ValueError:
        return DEFAULT_WAIT_S
    return max(0.1, value) if value == value and value != float("inf") else DEFAULT_WAIT_S


def bounded(fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
    """``fn()``, given up after ``timeout_s`` (default :func:`tracking_wait_s`) seconds.

    Raises:
        TrackingStalledError: ``fn`` was still running then (it goes on in a daemon thread).
        Exception: what ``fn`` raised.
    """
    limit = tracking_wait_s() if timeout_s is None else timeout_s
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"gpufleet-tracking-{what}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise TrackingStalledError(
            f"the tracking store did not answer within {limit:g} s ({what}); gpufleet goes on without it "
            f"(set {envcontract.TRACKING_WAIT_S} to wait longer)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _probe(uri: str, timeout_s: float) -> str | None:
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s) as response:
            response.read(64)
    except urllib.error.HTTPError:
        return None  # it answered (an MLflow server behind a path or a proxy may say 404)
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ConnectionRefusedError):
            return f"the tracking server {uri} refuses connections"
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return f"the tracking server {uri} did not accept a connection within {timeout_s:g} s"
        if isinstance(reason, socket.gaierror):
            return f"the tracking server's host in {uri} cannot be resolved ({reason})"
        if "ssl" in type(reason).__module__.lower() or "certificate" in str(reason).lower():
            return None  # it speaks TLS: MLflow's own TLS settings decide
        return f"the tracking server {uri} cannot be reached ({reason})"
    except TimeoutError:
        return f"the tracking server {uri} accepted a connection but did not answer within {timeout_s:g} s"
    except (ConnectionError, OSError, ValueError) as e:  # reset, closed without an answer, a bad URL
        return f"the tracking server {uri} gave no answer ({type(e).__name__}: {e})"
    return None


def unreachable(uri: str | None) -> str | None:
    """Why the tracking server at ``uri`` cannot be used now, or None (it answered, or it is no HTTP server).

    At most about :data:`PROBE_S` seconds; a verdict is reused for the same server for
    :data:`VERDICT_S` seconds, so the calls of one notebook do not each wait for a dead server.
    """
    if not uri or not uri.lower().startswith(("http://", "https://")):
        return None
    now = time.monotonic()
    with _verdicts_lock:
        seen = _verdicts.get(uri)
    if seen is not None and now - seen[0] < VERDICT_S:
        return seen[1]
    limit = min(PROBE_S, tracking_wait_s())
    try:
        verdict = bounded(lambda: _probe(uri, limit), "probe", timeout_s=limit + 1.0)
    except TrackingStalledError:
        verdict = f"the tracking server {uri} did not answer within {limit:g} s"
    with _verdicts_lock:
        _verdicts[uri] = (time.monotonic(), verdict)
    return verdict
