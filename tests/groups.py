"""Helpers of the engine tests: drive a worker group the way the controller does, without one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def run_group(group: Any, timeout: float = 120.0, poll_s: float = 0.2) -> Any:
    """Start ``group`` and poll it until every unit ended or one failed; its last status."""
    group.start()
    deadline = time.monotonic() + timeout
    while True:
        status = group.poll(poll_s)
        if status.finished or status.failures:
            return status
        assert time.monotonic() < deadline, f"the group's units did not end within {timeout} s"


def run_attempt(group: Any, timeout: float = 120.0, poll_s: float = 0.2) -> Any:
    """One whole attempt of ``group`` as the controller runs it: start, poll until every unit ended or
    one failed (then stop the others), close it, and close its engine; the status it ended with."""
    succeeded = False
    try:
        status = run_group(group, timeout, poll_s)
        succeeded = status.succeeded
        if status.failures:
            group.stop("another unit failed", 1.0)
        return status
    finally:
        group.close(succeeded)
        group.executor.close()


def until(what: str, check: Callable[[], object], timeout: float = 60.0) -> None:
    """Wait until ``check()`` is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.05)
