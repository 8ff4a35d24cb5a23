"""``gpufleet ps`` (what runs on this machine now, with its GPUs), ``list``'s filters, a call's details.

``ps`` reads the GPU leases of the machine (every user's: :mod:`gpufleet.launch.leasing.leases`),
NVML's processes outside gpufleet, and the active runs of this user's run store (calls and
workloads). The GPUs a run holds are those whose lease names it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import socket
import sys
import time
from typing import IO, Any

from ..launch.node import envcontract
from .records import RunRecord

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def since_timestamp(text: str, now: float | None = None) -> float:
    """``--since``: an age (``90s``, ``30m``, ``2h``, ``3d``, ``1w``) or a local date/time (``2026-01-31``, ``2026-01-31T08:00``)."""
    match = _DURATION.match(text)
    if match:
        return (time.time() if now is None else now) - float(match.group(1)) * _UNIT_S[match.group(2).lower()]
    try:
        return _dt.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither an age (90s, 30m, 2h, 3d, 1w) nor a date/time (2026-01-31, 2026-01-31T08:00)"
        ) from None


def add_list_filters(parser: argparse.ArgumentParser) -> None:
    """``list``'s own filters (besides ``--filter KEY=VALUE``)."""
    parser.add_argument("--kind", choices=("call", "workload"), default=None, help="only @distributed calls or workloads")
    parser.add_argument("--state", default=None, metavar="STATE[,STATE]", help="only runs in these states (any age)")
    parser.add_argument("--name", default=None, help="only runs of this function (calls) or experiment (workloads)")
    parser.add_argument("--since", default=None, metavar="AGE|DATE",
                        help="only runs created since: an age (30m, 2h, 3d) or a local date/time (2026-01-31T08:00)")  # fmt: skip


def list_filters(args: argparse.Namespace) -> dict[str, str]:
    """The store filters of ``list``'s own options."""
    filters: dict[str, str] = {}
    if getattr(args, "kind", None):
        filters["kind"] = args.kind
    if getattr(args, "state", None):
        filters["state"] = args.state
    if getattr(args, "name", None):
        filters["name"] = args.name
    if getattr(args, "since", None):
        filters["since"] = repr(since_timestamp(args.since))
    return filters


# ------------------------------------------------------------------ a call's details


def _placement(run: RunRecord) -> str:
    p = run.placement or {}
    if p.get("device") == "gpu":
        gpus = ", ".join(str(g) for g in p.get("gpus", []))
        return f"GPU {gpus} ({p.get('gpu_name', 'GPU')}) on {p.get('host', '?')}"
    if p.get("device") == "cpu":
        return f"{run.world_size} CPU process(es) on {p.get('host', '?')}"
    if p.get("slurm_job_id"):
        return f"Slurm job {p['slurm_job_id']}: {p.get('nodes') or '?'} node(s): {', '.join(p.get('hosts') or []) or '?'}"
    if p.get("hosts") or p.get("nodes"):
        return f"{p.get('nodes') or '?'} Ray node(s): {', '.join(p.get('hosts') or []) or '?'}"
    return "- (not started)"


def call_details(run: RunRecord, out: IO[str]) -> None:
    """``gpufleet get`` of a call's attempt."""
    from .formats import fmt_duration, fmt_time, recovery_lines

    c, o = run.config, run.origin
    mlflow = run.mlflow_run_ids()
    lines = [
        ("id", run.id),
        ("kind", "call (one attempt of a @distributed call)"),
        ("state", run.state),
        ("function", f"{c.get('function', run.experiment)}" + (f" ({c['module']})" if c.get("module") else "")),
        ("attempt", f"{run.attempt or c.get('attempt', 1)}/{run.max_attempts}" + (
            f" (first attempt: {c['call_id']})" if c.get("call_id") and c.get("call_id") != run.id else "")),
        ("launcher", f"{c.get('launcher', '?')}" + (f" {c['remote']}" if isinstance(c.get("remote"), str) else "")),
        ("placement", _placement(run)),
        ("world size", str(run.world_size)),
        ("from", f"{o.get('kind', '?')} {o.get('path', '?')}"),
        ("host / user / pid", f"{o.get('host', '?')} / {o.get('user', '?')} / {o.get('pid', '?')}"),
        ("created", fmt_time(run.created_at)),
        ("started", fmt_time(run.started_at)),
        ("ended", fmt_time(run.ended_at)),
        ("duration", fmt_duration(run.duration_s)),
        ("message", run.message or "-"),
        ("mlflow run", ", ".join(mlflow) or "-"),
        ("run dir", run.run_dir),
    ]  # fmt: skip
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        out.write(f"{k:<{width}}  {v}\n")
    for a in run.attempts:
        for line in recovery_lines(a.recoveries):
            out.write(f"{line}\n")
    for r in range(run.world_size):
        out.write(f"  rank {r} log: {run.log_dir / f'rank-{r}.log'}\n")


# ------------------------------------------------------------------ ps


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gpufleet ps``."""
    p = subparsers.add_parser("ps", help="what runs on this machine now: each GPU's holder, and active runs")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format (default: text)")
    p.add_argument("--home", default=None, help=f"gpufleet state folder (default: ${envcontract.HOME} or ~/.gpufleet)")
    p.set_defaults(handler=cmd_ps)


def _use_dict(use: Any) -> dict[str, Any]:
    return {
        "index": use.gpu.index, "name": use.gpu.name, "uuid": use.gpu.uuid, "free": use.free, "held": use.held,
        "holder": None if use.holder is None else use.holder.__dict__,
        "outside_gpufleet": [p.__dict__ for p in use.foreign],
        "beside": [p.__dict__ for p in getattr(use, "beside", ())], "used_by": use.describe().split(": ", 1)[1],
    }  # fmt: skip


def cmd_ps(args: argparse.Namespace) -> int:
    """``gpufleet ps``: every GPU of this machine and its holder, then this store's active runs here."""
    from ..errors import GpufleetError
    from ..launch.leasing.leases import gpu_uses
    from ..states import ACTIVE_STATES
    from .formats import fmt_duration, fmt_time
    from .liveness import list_runs
    from .store import RunStore

    try:
        uses = gpu_uses()
    except GpufleetError as e:
        print(f"gpufleet: the GPU leases cannot be read: {e}", file=sys.stderr)
        uses = []
    store = RunStore(args.home, on_busy=lambda m: print(f"gpufleet: {m}", file=sys.stderr))
    host = socket.gethostname()
    runs = [r for r in list_runs(store, states=ACTIVE_STATES, limit=None)
            if not r.is_call or r.origin.get("host") in (None, host)]  # fmt: skip
    held_by: dict[str, list[int]] = {}
    for use in uses:
        if use.holder is not None:
            held_by.setdefault(use.holder.run_id, []).append(use.gpu.index)
    if args.output == "json":
        payload = {"host": host, "gpus": [_use_dict(u) for u in uses],
                   "runs": [{**r.to_dict(), "gpus": held_by.get(r.id, [])} for r in runs]}  # fmt: skip
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0
    out = sys.stdout
    if uses:
        out.write("GPU\tNAME\tUSED BY\n")
        for use in uses:
            out.write(f"{use.gpu.index}\t{use.gpu.name}\t{use.describe().split(': ', 1)[1]}\n")
    else:
        out.write("no GPU on this machine\n")
    out.write("\n")
    if not runs:
        out.write("no run of yours is pending or running here\n")
        return 0
    out.write("ID\tSTATE\tKIND\tNAME\tGPUS\tPID\tSTARTED\tTIME\n")
    for r in runs:
        gpus = ",".join(map(str, held_by.get(r.id, []))) or ("cpu" if r.placement.get("device") == "cpu" else "-")
        pid = r.supervisor_pid if r.supervisor_pid is not None else "-"
        out.write(f"{r.id}\t{r.state}\t{r.kind}\t{r.experiment}\t{gpus}\t{pid}\t"
                  f"{fmt_time(r.started_at or r.created_at)[5:]}\t{fmt_duration(r.duration_s)}\n")  # fmt: skip
    return 0
