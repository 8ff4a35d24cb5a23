"""Process-tree inspection for tests: find what a run left running."""

from __future__ import annotations

import os
import time

import psutil


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except (psutil.Error, OSError):
        return {}


def processes_with_env(key: str, value: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment has ``key=value``."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if _environ(p).get(key) == value:
            found.append(p)
    return found


def describe(p: psutil.Process) -> str:
    """``PID (state) command line`` of a process, whatever it has become since it was found: a
    zombie has no command line (its name is shown), a vanished one nothing but its pid."""
    try:
        status = p.status()
    except psutil.NoSuchProcess:
        return f"{p.pid} (gone)"
    except psutil.Error:
        status = "?"
    try:
        args = " ".join(p.cmdline())
    except psutil.ZombieProcess:
        args = ""
    except psutil.NoSuchProcess:
        return f"{p.pid} (gone)"
    except psutil.Error:
        args = ""
    if not args:
        try:
            args = f"[{p.name()}]"
        except psutil.Error:
            args = "[?]"
    return f"{p.pid} ({status}) {args}"


def run_processes(run_id: str) -> list[psutil.Process]:
    """Every live process of a run (ranks and whatever they started)."""
    return processes_with_env("GPUFLEET_RUN_ID", run_id)


def leftover_worker_processes(wait_s: float = 0.0) -> list[psutil.Process]:
    """Worker processes launched by this test process that are still alive."""
    deadline = time.monotonic() + wait_s
    while True:
        left = processes_with_env("GPUFLEET_PARENT_PID", str(os.getpid()))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)
