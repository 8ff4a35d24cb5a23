"""Free TCP ports for rendezvous, chosen by the OS and never handed out twice by one process."""

from __future__ import annotations

import socket
import threading
import time

_lock = threading.Lock()
_recent: dict[int, float] = {}
_HOLD_S = 60.0


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on ``host``; not returned again by this process for a minute."""
    with _lock:
        now = time.monotonic()
        for port, t in list(_recent.items()):
            if now - t > _HOLD_S:
                del _recent[port]
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _recent:
                _recent[port] = now
                return port
    raise RuntimeError("could not find a free TCP port")
