"""``gpufleet stacks RUN_ID``: every rank's current stack of a running call or workload on this machine.

The id names a run of this user's run store (``--home``), fully or by a unique prefix; each
process of a run carries the run's id in its environment (``GPUFLEET_RUN_ID``): the ranks of a
``@distributed`` call, and everything a workload's node command starts (torchrun and its
children). Only this user's processes that carry exactly that id are read. Their stacks are read with py-spy, from outside and without stopping them; without
py-spy, ranks that gpufleet launched dump their own through faulthandler (SIGUSR2). Ranks on other
machines of a Ray cluster are not reached from here; those of a run on Slurm are read on its job's
nodes (:mod:`gpufleet.launch.engines.slurm.stacks`) when none runs here.
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

from .launch.node import envcontract


def _python(proc: Any) -> bool:
    try:
        return "python" in Path(proc.exe()).name or "python" in Path(proc.cmdline()[0]).name
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def find_processes(run_id: str) -> list[tuple[Any, dict[str, str]]]:
    """This user's live Python processes that carry exactly run id ``run_id``, with their environments."""
    import psutil

    found = []
    me, uid = os.getpid(), os.getuid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.uids().real != uid:  # another user's process is never ours, whatever it carries
                continue
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(envcontract.RUN_ID) == run_id and _python(proc):
            found.append((proc, env))
    return found


def resolve_run(run_id: str, home: str | None = None) -> Any:
    """The run of this store (``home``: its state folder) that ``run_id`` names, fully or by a
    unique prefix, while it runs; LookupError saying why there is nothing to show otherwise."""
    from .runs.liveness import get_run
    from .runs.store import RunIdError, RunNotFoundError, RunStore

    store = RunStore(home)
    try:
        run = get_run(store, run_id)
    except RunIdError as e:
        raise LookupError(str(e)) from None
    except RunNotFoundError:
        raise LookupError(f"no run {run_id!r} in the run store {store.path} (`gpufleet list --all-status` lists "
                          f"its runs; --home or {envcontract.HOME} names another store)") from None  # fmt: skip
    if not run.is_active:
        raise LookupError(f"run {run.id} is {run.state}: none of its processes runs any more")
    return run


def find_run(run_id: str, home: str | None = None) -> tuple[str, list[tuple[Any, dict[str, str]]]]:
    """The run of this store that ``run_id`` names and its live Python processes on this machine."""
    run = resolve_run(run_id, home)
    procs = find_processes(run.id)
    if not procs:
        on_ray = bool((run.config.get("compute") or {}).get("cluster") or run.placement.get("nodes"))
        raise LookupError(f"run {run.id} is {run.state} but none of its processes runs on this machine now"
                          + ("; its ranks on other nodes of the Ray cluster are not reached from here" if on_ray
                             else " (it may be starting or ending: try again)"))  # fmt: skip
    return run.id, procs


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

    folder, rank = env.get(envcontract.RUN_DIR), env.get(envcontract.RANK)
    if not folder or rank is None or not Path(folder, f"progress-{rank}.json").exists():
        return None
    return request_stacks(proc.pid, Path(folder, f"stacks-{rank}.txt"))


def collect(run_id: str, home: str | None = None, stored: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """Every Python process of the run, in rank order, with its stack.

    ``stored``: ``run_id`` names a run of the store at ``home`` (or a unique prefix of one);
    False: exactly this run id (a supervisor's own run).
    """
    if stored:
        rid, procs = find_run(run_id, home)
    else:
        rid, procs = run_id, find_processes(run_id)
    found = []
    for proc, env in procs:
        stack = _py_spy(proc.pid)
        if stack is None:
            stack = _faulthandler(proc, env) or "(no stack: install py-spy, or the process is no gpufleet rank)"
        found.append({
            "host": os.uname().nodename,
            "rank": int(env[envcontract.RANK]) if env.get(envcontract.RANK, "").isdigit() else None,
            "node_rank": env.get(envcontract.NODE_RANK), "pid": proc.pid,
            "command": " ".join(proc.cmdline())[:200], "stack": stack, "run_dir": env.get(envcontract.RUN_DIR),
        })  # fmt: skip
    found.sort(key=lambda p: (p["rank"] is None, p["rank"] if p["rank"] is not None else 0, p["pid"]))
    return rid, found


def cmd_stacks(args: argparse.Namespace) -> int:
    try:
        rid, found = collect(args.run_id, getattr(args, "home", None))
    except LookupError as e:
        from .launch.engines.slurm.stacks import collect_on_slurm

        on_slurm = None if args.here else collect_on_slurm(args.run_id)  # a run on Slurm: ask its nodes
        if on_slurm is None:
            print(f"error: {e}", file=sys.stderr)
            return 1
        rid, found = on_slurm
    from .launch.hangwatch.watchdog import read_note

    note = next((n for n in (read_note(p["run_dir"]) for p in found if p.get("run_dir")) if n), None)
    if args.output == "json":
        print(json.dumps({"run_id": rid, "watchdog": note, "processes": found}, indent=2))
        return 0
    if note:
        print(f"hang watchdog: {note}\n")
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
    p.add_argument("--home", default=None,
                   help=f"gpufleet state folder holding the run store (default: ${envcontract.HOME} or ~/.gpufleet)")
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # on a Slurm node: this machine only
    p.set_defaults(handler=cmd_stacks)
