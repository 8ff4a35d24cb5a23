"""Tracking servers that cannot be used, on loopback: a closed port, one that never answers, one that stalls."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
from collections.abc import Iterator


def closed_port() -> int:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers a byte."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


@contextlib.contextmanager
def stalling_server() -> Iterator[int]:
    """An MLflow-like server whose ``/health`` answers, and whose API never does (until it is shut down)."""
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _handle(self) -> None:
            if self.path.startswith("/health"):
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"OK")
                return
            stop.wait()

        do_GET = do_POST = _handle

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
