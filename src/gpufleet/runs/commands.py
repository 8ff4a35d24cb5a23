"""The run commands of the CLI: get, list, logs, wait, cancel, for calls and workloads alike.

Exit codes: 0 success; 1 a run id that names no run, a cancel that did not finish in time, or
an error; 2 bad arguments (a run id that is empty, a prefix shorter than 6 characters or an
ambiguous one), or a state folder or run store that cannot be used (someone else's, read-only,
damaged, locked for too long). :data:`EXIT_CODES` maps a finished run's state to the exit code
of the commands that wait for a run (``gpufleet run --watch``, ``gpufleet wait``; 3: still running at
``wait --timeout``).

One concern, the surface of these commands: arguments, text and JSON output, exit codes. What
they show is made in :mod:`.view` and :mod:`.ps`; what they read, through :mod:`.liveness`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..launch.node import envcontract
from ..states import CANCELED, FAILED, SUCCESS, TIMEDOUT, RunState
from .ps import add_list_filters, list_filters

EXIT_CODES = {SUCCESS: 0, FAILED: 1, TIMEDOUT: 124, CANCELED: 130}
#: ``gpufleet wait --timeout``: the run was still PENDING or RUNNING.
EXIT_STILL_ACTIVE = 3
EXIT_INVALID = 2


def common_options(parser: argparse.ArgumentParser) -> None:
    """``-o/--output`` and ``--home``, which every run command takes."""
    parser.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "--home",
        default=None,
        help=f"gpufleet state folder holding the run store (default: ${envcontract.HOME} or ~/.gpufleet)",
    )


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register get, list, logs, wait and cancel on the ``gpufleet`` parser."""
    p = subparsers.add_parser("get", help="show one run")
    p.add_argument("run_id", help="run id (or a unique prefix of at least 6 characters)")
    common_options(p)
    p.set_defaults(handler=cmd_get)

    p = subparsers.add_parser("list", help="list runs: workloads and @distributed calls (active ones unless --all-status)")
    p.add_argument("--all-status", action="store_true", help="include finished runs")
    add_list_filters(p)
    p.add_argument("--limit", type=int, default=20, help="at most this many runs, newest first (default 20; 0 = all)")
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="state=FAILED[,TIMEDOUT], experiment=NAME, id=PREFIX, idempotency_key=K; repeatable",
    )
    common_options(p)
    p.set_defaults(handler=cmd_list)

    p = subparsers.add_parser("logs", help="print (or follow) a run's per-node logs")
    p.add_argument("run_id", help="run id (or a unique prefix of at least 6 characters)")
    p.add_argument("--node", "--rank", type=int, default=None, help="only this node rank (a call: this rank)")
    p.add_argument("--attempt", type=int, default=None, help="only this attempt (default: all)")
    p.add_argument("--lines", type=int, default=None, help="only the last N lines of each log")
    p.add_argument("--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--setup", action="store_true", help="the environment set-up and supervisor logs")
    common_options(p)
    p.set_defaults(handler=cmd_logs)

    p = subparsers.add_parser("wait", help="wait until a run ends; exits with its end's code")
    p.add_argument("run_id", help="run id (or a unique prefix of at least 6 characters)")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 3)")
    common_options(p)
    p.set_defaults(handler=cmd_wait)

    p = subparsers.add_parser("cancel", help="cancel runs (stops every process of each run)")
    p.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="run ids (or unique prefixes of at least 6 characters)")
    p.add_argument("--all", action="store_true", help="cancel every PENDING or RUNNING run")
    p.add_argument("--no-wait", action="store_true", help="ask for the cancel and return at once")
    p.add_argument("--wait-timeout", type=float, default=60.0, help="seconds to wait for the runs to stop (default 60)")
    common_options(p)
    p.set_defaults(handler=cmd_cancel)


# ------------------------------------------------------------------ helpers


def print_json(value: Any) -> None:
    """``value`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def err(msg: str) -> None:
    """One line on stderr."""
    sys.stderr.write(msg.rstrip("\n") + "\n")
    sys.stderr.flush()


def open_store(args: argparse.Namespace) -> Any:
    """The run store; a wait for a lock of another process is announced on stderr."""
    from .store import RunStore

    return RunStore(args.home, on_busy=lambda message: err(f"gpufleet: {message}"))


def not_found(e: Exception, args: argparse.Namespace) -> int:
    """A run id that names no run: exit 1; one that cannot name a run (empty, short, ambiguous): 2."""
    from .store import RunIdError

    return error(str(e), args, EXIT_INVALID if isinstance(e, RunIdError) else 1)


def error(msg: str, args: argparse.Namespace, code: int = 1) -> int:
    """Report an error (``error: ...`` on stderr, and ``{"error": ...}`` with ``-o json``); returns ``code``."""
    if args.output == "json":
        print_json({"error": msg})
    err(f"error: {msg}")
    return code


# ------------------------------------------------------------------ get / list


def cmd_get(args: argparse.Namespace) -> int:
    """``gpufleet get RUN_ID``."""
    from .liveness import get_run
    from .store import RunNotFoundError
    from .view import mlflow_links, run_details

    try:
        run = get_run(open_store(args), args.run_id)
    except RunNotFoundError as e:
        return not_found(e, args)
    if args.output == "json":
        print_json({**run.to_dict(), "mlflow_runs": mlflow_links(run)})
    else:
        run_details(run)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """``gpufleet list``."""
    from .liveness import list_runs
    from .store import ACTIVE_STATES, STATES
    from .view import runs_table

    filters: dict[str, str] = {}
    for item in args.filter:
        if "=" not in item:
            return error(f"a filter is KEY=VALUE, got {item!r}", args, EXIT_INVALID)
        k, v = item.split("=", 1)
        filters[k.strip()] = v.strip()
    try:
        filters.update(list_filters(args))
    except ValueError as e:
        return error(str(e), args, EXIT_INVALID)
    if "state" in filters or "status" in filters:
        wanted = (filters.get("state") or filters.get("status") or "").upper().split(",")
        bad = [s for s in wanted if s not in STATES]
        if bad:
            return error(f"unknown state(s) {', '.join(bad)}; states are {', '.join(STATES)}", args, EXIT_INVALID)
    if args.limit < 0:
        return error("--limit must be >= 0", args, EXIT_INVALID)
    states = None if args.all_status or "state" in filters or "status" in filters else ACTIVE_STATES
    store = open_store(args)
    try:
        runs = list_runs(store, states=states, limit=args.limit or None, filters=filters)
    except ValueError as e:
        return error(str(e), args, EXIT_INVALID)
    if args.output == "json":
        print_json([r.to_dict() for r in runs])
        return 0
    if not runs:
        hidden = sum(n for s, n in store.count().items() if s not in ACTIVE_STATES)
        msg = "no runs" + (" are pending or running" if states else "")
        if states and hidden:
            msg += f" ({hidden} finished; `gpufleet list --all-status` shows them)"
        print(msg)
        return 0
    runs_table(runs)
    return 0


# ------------------------------------------------------------------ logs


def cmd_logs(args: argparse.Namespace) -> int:
    """``gpufleet logs RUN_ID``."""
    from .liveness import get_run
    from .store import RunNotFoundError
    from .view import log_lines, tail_lines

    store = open_store(args)
    try:
        run = get_run(store, args.run_id)
    except RunNotFoundError as e:
        return not_found(e, args)
    if args.node is not None and run.is_call and not 0 <= args.node < run.log_units:
        return error(f"--rank {args.node}: run {run.id} is a call with ranks 0..{run.log_units - 1}", args, EXIT_INVALID)
    if args.node is not None and not run.is_call and not 0 <= args.node < run.command_nodes:
        if run.command_nodes == 1 < run.num_nodes:
            return error(f"--node {args.node}: run {run.id} is a Ray driver run; its command ran once, as "
                          "node 0 (its Ray workers log to the Ray cluster)", args, EXIT_INVALID)  # fmt: skip
        return error(f"--node {args.node}: run {run.id} has nodes 0..{run.num_nodes - 1}", args, EXIT_INVALID)
    numbers = [a.attempt for a in run.attempts]
    if args.attempt is not None and args.attempt not in numbers:
        return error(f"--attempt {args.attempt}: run {run.id} has attempts {numbers or 'none yet'}", args, EXIT_INVALID)
    run_dir = Path(run.run_dir)
    if args.setup:
        files = [("environment", run_dir / "environment.log"), ("supervisor", run_dir / "supervisor.log")]
    else:
        files = [
            (f"attempt {a.attempt} {run.log_name} {n}", Path(a.log_dir) / f"{run.log_name}-{n}.log")
            for a in run.attempts
            if args.attempt is None or a.attempt == args.attempt
            for n in range(run.log_units)
            if args.node is None or n == args.node
        ]
    if args.follow and not args.setup:
        return _follow(store, run, args)
    if args.output == "json":
        print_json(
            {"run_id": run.id, "state": run.state,
             "logs": [{"name": name, "path": str(p), "lines": tail_lines(p, args.lines)} for name, p in files]}
        )  # fmt: skip
        return 0
    if args.setup:  # each file's lines with its name: [environment] / [supervisor]
        for name, path in files:
            sys.stdout.writelines(f"[{name}] {line}\n" for line in tail_lines(path, args.lines))
        sys.stdout.flush()
        return 0
    # what --follow prints of a finished run: each line with its [node N] / [rank N] prefix
    # (none with --node), and a separator before each attempt
    for prefix, line in log_lines(run, node=args.node, attempt=args.attempt, num_lines=args.lines):
        sys.stdout.write((prefix if args.node is None else "") + line + "\n")
    sys.stdout.flush()
    if not files:
        err(f"run {run.id} ({run.state}) has no logs yet")
    return 0


def _follow(store: Any, run: Any, args: argparse.Namespace) -> int:
    from .view import follow_logs

    def write(prefix: str, line: str) -> None:
        if args.output == "json":
            sys.stdout.write(json.dumps({"source": prefix.strip(" []"), "line": line}) + "\n")
        else:
            sys.stdout.write((prefix if args.node is None else "") + line + "\n")
        sys.stdout.flush()

    from ..live import choose_view
    from .store import RunNotFoundError

    # a live status line under the lines on a terminal (not with -o json, GPUFLEET_LIVE=0 or a pipe)
    status = args.output != "json" and choose_view(None) == "terminal"
    try:
        final = follow_logs(store, run.id, write, node=args.node, attempt=args.attempt, status_line=status)
    except KeyboardInterrupt:
        return 130
    except RunNotFoundError as e:  # its row was deleted meanwhile
        return not_found(e, args)
    err(f"gpufleet: run {final.id} {final.state}")
    return 0


# ------------------------------------------------------------------ wait


def cmd_wait(args: argparse.Namespace) -> int:
    """``gpufleet wait RUN_ID [--timeout S]``: the run's end, with :data:`EXIT_CODES`; 3 if it still runs at the timeout."""
    from .liveness import get_run
    from .store import RunNotFoundError

    store = open_store(args)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        try:
            run = get_run(store, args.run_id)
        except RunNotFoundError as e:
            return not_found(e, args)
        if not run.is_active or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(0.5)
    if args.output == "json":
        print_json(run.to_dict())
    else:
        print(f"{run.id}\t{run.state}" + (f"\t{run.message}" if run.message and not run.is_active else ""))
    return EXIT_CODES.get(run.state, 1) if not run.is_active else EXIT_STILL_ACTIVE


# ------------------------------------------------------------------ cancel


def cmd_cancel(args: argparse.Namespace) -> int:
    """``gpufleet cancel RUN_ID... | --all``."""
    from .cancel import end_unstarted, request_cancel
    from .liveness import get_run, list_runs
    from .store import ACTIVE_STATES, PENDING, RunNotFoundError

    if bool(args.run_ids) == bool(args.all):
        return error("give run ids or --all (not both)", args, EXIT_INVALID)
    store = open_store(args)
    if args.all:
        runs = list_runs(store, states=ACTIVE_STATES, limit=None)
    else:
        runs = []
        for rid in args.run_ids:  # every id is resolved before anything is canceled
            try:
                runs.append(get_run(store, rid))
            except RunNotFoundError as e:
                return not_found(e, args)
    results: dict[str, dict[str, Any]] = {}
    waiting = []
    for run in runs:
        if not run.is_active:
            results[run.id] = {"id": run.id, "state": run.state, "canceled": False, "note": f"already {run.state}"}
            freed = _give_back_idle_gpus(run) if not args.no_wait else None
            if freed is not None:
                results[run.id]["note"] += ("; its idle warm ranks gave their GPUs back" if freed
                                            else "; its idle warm ranks did not give their GPUs back")  # fmt: skip
            continue
        request_cancel(store, run)
        waiting.append(run.id)
    deadline = time.monotonic() + (0 if args.no_wait else args.wait_timeout)
    while waiting:
        for rid in list(waiting):
            r = get_run(store, rid)
            if not r.is_active:
                waiting.remove(rid)
                results[rid] = {"id": rid, "state": r.state, "canceled": r.state == CANCELED}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for rid in waiting:
        r = get_run(store, rid)
        if r.state == PENDING and args.no_wait is False:
            r = end_unstarted(store, rid)  # never picked up by a supervisor
        results[rid] = {"id": rid, "state": r.state, "canceled": r.state == CANCELED,
                        **({"note": "cancel requested; still stopping"} if r.is_active else {})}  # fmt: skip
    ordered = [results[r.id] for r in runs]
    if args.output == "json":
        print_json(ordered)
    else:
        if not ordered:
            print("no pending or running runs")
        for r in ordered:
            print(f"{r['id']}\t{r['state']}" + (f"\t({r['note']})" if r.get("note") else ""))
    return 0 if all(RunState(r["state"]).terminal for r in ordered) or args.no_wait else 1


def _give_back_idle_gpus(run: Any) -> bool | None:
    """A finished call whose idle warm ranks still hold GPUs under its id: ask them back (None: none held)."""
    if not run.is_call:
        return None
    from ..errors import GpufleetError
    from ..launch.leasing.leases import give_back_idle

    try:
        return give_back_idle(run.id)
    except GpufleetError:
        return None
