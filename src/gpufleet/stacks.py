"""``gpufleet stacks RUN_ID``: every rank's current stack of a running call or workload on this machine.

Each process of a run carries the run's id in its environment (``GPUFLEET_RUN_ID``): the ranks of a
``@distributed`` call, and everything a workload's node command starts (torchrun and its
children). Their stacks are read with py-spy, from outside and without stopping them; without
py-spy, ranks that gpufleet launched dump their own through faulthandler (SIGUSR2). Ranks on other
machines of a Ray cluster are not reached from here; those of a run on Slurm are read on its job's
nodes (:mod:`gpufleet.launch.slurm_stacks`) when none runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MIN_PREFIX = 6


def _python(proc: Any) -> bool:
    try:
        return "python" in Path(proc.exe()).name or "python" in Path(proc.cmdline()[0]).name
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def find_run(run_id: str) -> tuple[str, list[tuple[Any, dict[str, str]]]]:
    """The run id matched (exactly or by a unique prefix) and its live Python processes with their environments."""
    import psutil

    by_run: dict[str, list[tuple[Any, dict[str, str]]]] = {}
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        rid = env.get("GPUFLEET_RUN_ID")
        if rid and (rid == run_id or (len(run_id) >= MIN_PREFIX and rid.startswith(run_id))) and _python(proc):
            by_run.setdefault(rid, []).append((proc, env))
    if run_id in by_run:
        return run_id, by_run[run_id]
    if len(by_run) > 1:
        raise LookupError(f"{run_id!r} matches several running runs: {', '.join(sorted(by_run))}; give more of the id")
    if not by_run:
        short = f" (give at least {MIN_PREFIX} characters of the id)" if len(run_id) < MIN_PREFIX else ""
        raise LookupError(f"no running process of run {run_id!r} on this machine{short}; a Ray run's ranks on other "
                          "nodes are not reached from here")  # fmt: skip
    (rid, procs), = by_run.items()
    return rid, procs


def _py_spy(pid: int) -> str | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(exe):
        return None
    try:
        out = subprocess.run([exe, "dump", "--full-filenames", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "(py-spy took longer than 20 s)"
    return out.stdout if out.returncode == 0 else f"(py-spy could not read it: {out.stderr.strip()[:300]})"


def _faulthandler(proc: Any, env: dict[str, str]) -> str | None:
    """A rank gpufleet launched dumps its own stack into stacks-R.txt on SIGUSR2 (once its handler is in)."""
    from .launch.progress import request_stacks

    folder, rank = env.get("GPUFLEET_RUN_DIR"), env.get("RANK")
    if not folder or rank is None or not Path(folder, f"progress-{rank}.json").exists():
        return None
    return request_stacks(proc.pid, Path(folder, f"stacks-{rank}.txt"))


def collect(run_id: str) -> tuple[str, list[dict[str, Any]]]:
    """Every Python process of the run, in rank order, with its stack."""
    rid, procs = find_run(run_id)
    found = []
    for proc, env in procs:
        stack = _py_spy(proc.pid)
        if stack is None:
            stack = _faulthandler(proc, env) or "(no stack: install py-spy, or the process is no gpufleet rank)"
        found.append({
            "host": os.uname().nodename,
            "rank": int(env["RANK"]) if env.get("RANK", "").isdigit() else None,
            "node_rank": env.get("NODE_RANK"), "pid": proc.pid,
            "command": " ".join(proc.cmdline())[:200], "stack": stack,
        })  # fmt: skip
    found.sort(key=lambda p: (p["rank"] is None, p["rank"] if p["rank"] is not None else 0, p["pid"]))
    return rid, found


def cmd_stacks(args: argparse.Namespace) -> int:
    try:
        rid, found = collect(args.run_id)
    except LookupError as e:
        from .launch.slurm_stacks import collect_on_slurm

        on_slurm = None if args.here else collect_on_slurm(args.run_id)  # a run on Slurm: ask its nodes
        if on_slurm is None:
            print(f"error: {e}", file=sys.stderr)
            return 1
        rid, found = on_slurm
    if args.output == "json":
        print(json.dumps({"run_id": rid, "processes": found}, indent=2))
        return 0
    for p in found:
        who = f"rank {p['rank']}" if p["rank"] is not None else "process"
        node = f", node {p['node_rank']}" if p["node_rank"] is not None else ""
        print(f"=== {who} (pid {p['pid']}{node}): {p['command']}")
        print(p["stack"].rstrip() + "\n")
    return 0


def add_parsers(sub: Any) -> None:
    """Register ``gpufleet stacks``."""
    p = sub.add_parser("stacks", help="every rank's current stack of a running call or workload on this machine")
    p.add_argument("run_id", help="the run id (of a call's attempt or a workload), or a unique prefix of 6+ characters")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # on a Slurm node: this machine only
    p.set_defaults(handler=cmd_stacks)
