"""CLI commands for workloads: run, get, list, logs, cancel, validate, schema.

Exit codes: 0 success; 1 a failed run or an error; 2 an invalid workload or bad arguments
(a run id that is empty, a prefix shorter than 6 characters or an ambiguous one), or a state
folder or run store that cannot be used (someone else's, read-only, damaged, locked for too
long); 124 a run that timed out; 130 a canceled run (``run --watch`` exits with its run's
outcome).

One concern, the workload CLI's surface: arguments, text and JSON output, exit codes. The
work itself is elsewhere (``submit``, ``liveness``, ``view``, ``schema``); the module is long
because seven commands each print two formats.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..states import CANCELED, FAILED, SUCCESS, TIMEDOUT, RunState
from .ps import add_list_filters, list_filters

EXIT_CODES = {SUCCESS: 0, FAILED: 1, TIMEDOUT: 124, CANCELED: 130}
EXIT_INVALID = 2


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "--home",
        default=None,
        help="gpufleet state folder holding the run store (default: $GPUFLEET_HOME or ~/.gpufleet)",
    )


def _overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="set a field, typed by the field (e.g. compute.num_accelerators=4, parameters.lr=1e-4); repeatable",
    )


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the workload commands on the ``gpufleet`` parser."""
    p = subparsers.add_parser("run", help="submit a workload; prints its run id at once")
    p.add_argument("-f", "--file", required=True, help="workload YAML file")
    _overrides(p)
    p.add_argument(
        "--inject-fault", action="append", default=[], metavar="SPEC",
        help="inject a fault to rehearse a failure, e.g. kill:rank=1:step=30 (docs/hangs.md); repeatable",
    )
    p.add_argument("--watch", action="store_true", help="stream logs and status; exit with the run's outcome")
    p.add_argument("--dry-run", action="store_true", help="validate and resolve nodes/world size; start nothing")
    p.add_argument("--idempotency-key", default=None, help="submitting the same key again returns the existing run")
    p.add_argument("--no-tracking", action="store_true", help="do not create MLflow runs for this run")
    _common(p)
    p.set_defaults(handler=cmd_run)

    p = subparsers.add_parser("get", help="show one run")
    p.add_argument("run_id", help="run id (or a unique prefix of at least 6 characters)")
    _common(p)
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
    _common(p)
    p.set_defaults(handler=cmd_list)

    p = subparsers.add_parser("logs", help="print (or follow) a run's per-node logs")
    p.add_argument("run_id", help="run id (or a unique prefix of at least 6 characters)")
    p.add_argument("--node", "--rank", type=int, default=None, help="only this node rank (a call: this rank)")
    p.add_argument("--attempt", type=int, default=None, help="only this attempt (default: all)")
    p.add_argument("--lines", type=int, default=None, help="only the last N lines of each log")
    p.add_argument("--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--setup", action="store_true", help="the environment set-up and supervisor logs")
    _common(p)
    p.set_defaults(handler=cmd_logs)

    p = subparsers.add_parser("cancel", help="cancel runs (stops every process of each run)")
    p.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="run ids (or unique prefixes of at least 6 characters)")
    p.add_argument("--all", action="store_true", help="cancel every PENDING or RUNNING run")
    p.add_argument("--no-wait", action="store_true", help="ask for the cancel and return at once")
    p.add_argument("--wait-timeout", type=float, default=60.0, help="seconds to wait for the runs to stop (default 60)")
    _common(p)
    p.set_defaults(handler=cmd_cancel)

    p = subparsers.add_parser("validate", help="check a workload file; report every problem at once")
    p.add_argument("-f", "--file", default=None, help="workload YAML file")
    _overrides(p)
    p.add_argument("--explain", metavar="FIELD", default=None, help="describe a field, e.g. compute.accelerator_type")
    _common(p)
    p.set_defaults(handler=cmd_validate)

    p = subparsers.add_parser("schema", help="print the workload JSON schema (for editors) or field help")
    p.add_argument("--explain", metavar="FIELD", default=None, help="describe one field")
    p.add_argument("--fields", action="store_true", help="list every field with its help")
    _common(p)
    p.set_defaults(handler=cmd_schema)


# ------------------------------------------------------------------ helpers


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _err(msg: str) -> None:
    sys.stderr.write(msg.rstrip("\n") + "\n")
    sys.stderr.flush()


def _store(args: argparse.Namespace) -> Any:
    """The run store; a wait for a lock of another process is announced on stderr."""
    from .store import RunStore

    return RunStore(args.home, on_busy=lambda message: _err(f"gpufleet: {message}"))


def _not_found(e: Exception, args: argparse.Namespace) -> int:
    """A run id that names no run: exit 1; one that cannot name a run (empty, short, ambiguous): 2."""
    from .store import RunIdError

    return _error(str(e), args, EXIT_INVALID if isinstance(e, RunIdError) else 1)


def _invalid(e: Any, args: argparse.Namespace) -> int:
    if args.output == "json":
        _print_json({"valid": False, "source": e.source, "problems": [p.to_dict() for p in e.problems]})
    else:
        _err(str(e))
    return EXIT_INVALID


def _error(msg: str, args: argparse.Namespace, code: int = 1) -> int:
    if args.output == "json":
        _print_json({"error": msg})
    _err(f"error: {msg}")
    return code


# ------------------------------------------------------------------ run


def cmd_run(args: argparse.Namespace) -> int:
    """``gpufleet run -f``: dry run, or submit (and optionally watch) a workload."""
    from ..errors import GpufleetError
    from ..private import UnsafeStateError
    from .nodes import ExecutorUnavailableError
    from .schema import WorkloadValidationError
    from .snapshot import SnapshotError
    from .store import RunNotFoundError, StoreError
    from .submit import plan, submit_run
    from .view import mlflow_links

    if args.inject_fault:  # the faults field, as an override: checked with the rest of the file
        args.override = [*args.override, "faults=" + json.dumps(args.inject_fault)]
    try:
        if args.dry_run:
            result = plan(args.file, args.override)
            if args.output == "json":
                _print_json(result)
            else:
                _print_plan(result)
            return 0
        done = submit_run(
            args.file, args.override, args.idempotency_key, tracking=not args.no_tracking, home=args.home
        )
        run, created = done.run, done.created
    except WorkloadValidationError as e:
        return _invalid(e, args)
    except (UnsafeStateError, StoreError) as e:
        return _error(str(e), args, EXIT_INVALID)
    except (ExecutorUnavailableError, GpufleetError, SnapshotError, OSError) as e:
        return _error(str(e), args)
    if not created:
        _err(f"a run with idempotency key {args.idempotency_key!r} exists already: {run.id} ({run.state})")
    elif args.output == "text":
        _err(
            f"submitted run {run.id}: {run.num_nodes} node(s) x "
            f"{run.config['compute']['accelerator_type']}; follow it with `gpufleet logs {run.id} --follow`"
        )
    if created:
        for warning in done.warnings:
            _err(f"warning: {warning}")
        if done.mlflow_line:
            _err(f"gpufleet: {done.mlflow_line}")
    if not args.watch:
        if args.output == "json":
            _print_json({**run.to_dict(), "created": created, "mlflow_runs": mlflow_links(run, done.mlflow_run)})
        else:
            print(run.id, flush=True)
        return 0
    if args.output == "text":
        print(run.id, flush=True)
    from .view import watch

    store = _store(args)
    try:
        final = watch(store, run.id, out=sys.stderr if args.output == "json" else sys.stdout,
                      mlflow_shown={done.mlflow_run["run_id"]} if done.mlflow_run else set())  # fmt: skip
    except KeyboardInterrupt:
        _err(f"stopped watching; run {run.id} goes on (cancel it with `gpufleet cancel {run.id}`)")
        return 130
    except RunNotFoundError as e:  # its row was deleted meanwhile
        return _not_found(e, args)
    if args.output == "json":
        _print_json({**final.to_dict(), "created": created, "mlflow_runs": mlflow_links(final)})
    return EXIT_CODES.get(final.state, 1)


def _print_plan(p: dict[str, Any]) -> None:
    print("workload is valid (dry run: nothing was started)")
    print(f"  experiment      {p['experiment_name']}")
    print(
        f"  compute         {p['num_nodes']} node(s) x {p['accelerators_per_node']} {p['accelerator']} "
        f"= world size {p['world_size']} ({p['accelerator_type']})"
    )
    print(f"  executor        {p['executor']}" + (f" on {p['cluster']}" if p["cluster"] else ""))
    if p["ray_driver"]:
        print("  command runs    once, as a Ray driver (RAY_ADDRESS set on a cluster); it places its own "
              f"workers on the {p['world_size']} accelerators, gpufleet reserves none")
    print(f"  code            {p['code_root'] or '(none: the command runs in an empty folder)'}"
          + (f" ({p['code_files']} files)" if p["code_root"] else ""))  # fmt: skip
    if p["dependencies"]:
        print(f"  dependencies    {', '.join(p['dependencies'])} (environment {p['environment_hash']})")
    print(f"  attempts        up to {p['max_attempts']}" + (
        f", {p['timeout_minutes']:g} min each" if p["timeout_minutes"] else ""))  # fmt: skip
    print(f"  parameters      {json.dumps(p['parameters'], default=str)}")
    print("  node env        " + " ".join(f"{k}={v}" for k, v in p["node_env"].items()))
    if p.get("secrets"):
        print("  secrets         " + ", ".join(f"{k} (from {v})" for k, v in p["secrets"].items()))
    print("  command         " + p["command"].strip().replace("\n", "\n                  "))
    for w in p["warnings"]:
        print(f"  warning: {w}")


# ------------------------------------------------------------------ get / list


def cmd_get(args: argparse.Namespace) -> int:
    """``gpufleet get RUN_ID``."""
    from .liveness import get_run
    from .store import RunNotFoundError
    from .view import mlflow_links, run_details

    try:
        run = get_run(_store(args), args.run_id)
    except RunNotFoundError as e:
        return _not_found(e, args)
    if args.output == "json":
        _print_json({**run.to_dict(), "mlflow_runs": mlflow_links(run)})
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
            return _error(f"a filter is KEY=VALUE, got {item!r}", args, EXIT_INVALID)
        k, v = item.split("=", 1)
        filters[k.strip()] = v.strip()
    try:
        filters.update(list_filters(args))
    except ValueError as e:
        return _error(str(e), args, EXIT_INVALID)
    if "state" in filters or "status" in filters:
        wanted = (filters.get("state") or filters.get("status") or "").upper().split(",")
        bad = [s for s in wanted if s not in STATES]
        if bad:
            return _error(f"unknown state(s) {', '.join(bad)}; states are {', '.join(STATES)}", args, EXIT_INVALID)
    if args.limit < 0:
        return _error("--limit must be >= 0", args, EXIT_INVALID)
    states = None if args.all_status or "state" in filters or "status" in filters else ACTIVE_STATES
    store = _store(args)
    try:
        runs = list_runs(store, states=states, limit=args.limit or None, filters=filters)
    except ValueError as e:
        return _error(str(e), args, EXIT_INVALID)
    if args.output == "json":
        _print_json([r.to_dict() for r in runs])
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

    store = _store(args)
    try:
        run = get_run(store, args.run_id)
    except RunNotFoundError as e:
        return _not_found(e, args)
    if args.node is not None and run.is_call and not 0 <= args.node < run.log_units:
        return _error(f"--rank {args.node}: run {run.id} is a call with ranks 0..{run.log_units - 1}", args, EXIT_INVALID)
    if args.node is not None and not run.is_call and not 0 <= args.node < run.command_nodes:
        if run.command_nodes == 1 < run.num_nodes:
            return _error(f"--node {args.node}: run {run.id} is a Ray driver run; its command ran once, as "
                          "node 0 (its Ray workers log to the Ray cluster)", args, EXIT_INVALID)  # fmt: skip
        return _error(f"--node {args.node}: run {run.id} has nodes 0..{run.num_nodes - 1}", args, EXIT_INVALID)
    numbers = [a.attempt for a in run.attempts]
    if args.attempt is not None and args.attempt not in numbers:
        return _error(f"--attempt {args.attempt}: run {run.id} has attempts {numbers or 'none yet'}", args, EXIT_INVALID)
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
        _print_json(
            {"run_id": run.id, "state": run.state,
             "logs": [{"name": name, "path": str(p), "lines": tail_lines(p, args.lines)} for name, p in files]}
        )  # fmt: skip
        return 0
    # what --follow prints of a finished run: each line with its [node N] / [rank N] prefix
    # (none with --node), and a separator before each attempt
    for prefix, line in log_lines(run, node=args.node, attempt=args.attempt, num_lines=args.lines):
        sys.stdout.write((prefix if args.node is None else "") + line + "\n")
    sys.stdout.flush()
    if not files:
        _err(f"run {run.id} ({run.state}) has no logs yet")
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
        return _not_found(e, args)
    _err(f"gpufleet: run {final.id} {final.state}")
    return 0


# ------------------------------------------------------------------ cancel


def cmd_cancel(args: argparse.Namespace) -> int:
    """``gpufleet cancel RUN_ID... | --all``."""
    from .liveness import get_run, kill_run_processes, list_runs
    from .store import ACTIVE_STATES, PENDING, RunNotFoundError

    if bool(args.run_ids) == bool(args.all):
        return _error("give run ids or --all (not both)", args, EXIT_INVALID)
    store = _store(args)
    if args.all:
        runs = list_runs(store, states=ACTIVE_STATES, limit=None)
    else:
        runs = []
        for rid in args.run_ids:  # every id is resolved before anything is canceled
            try:
                runs.append(get_run(store, rid))
            except RunNotFoundError as e:
                return _not_found(e, args)
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
        signaled = _signal_supervisor(run)  # a RUNNING run stops at once, even while the store is busy
        store.request_cancel(run.id)  # a PENDING run's supervisor reads it as it starts
        if not signaled:
            _signal_supervisor(store.get(run.id))  # it may have started meanwhile
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
            # never picked up by a supervisor: cancel it here
            store.finish_run(rid, CANCELED, message="canceled by the user before it started")
            kill_run_processes(rid)
            r = store.get(rid)
        results[rid] = {"id": rid, "state": r.state, "canceled": r.state == CANCELED,
                        **({"note": "cancel requested; still stopping"} if r.is_active else {})}  # fmt: skip
    ordered = [results[r.id] for r in runs]
    if args.output == "json":
        _print_json(ordered)
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
    from ..launch.leases import give_back_idle

    try:
        return give_back_idle(run.id)
    except GpufleetError:
        return None


def _signal_supervisor(run: Any) -> bool:
    """SIGTERM the supervisor of a RUNNING run (its handler is in place before it is RUNNING).

    The supervisor of a PENDING run may still be starting, and a SIGTERM then would kill it
    instead of canceling the run; it reads the stored cancel request as it starts.
    """
    from .liveness import pid_alive
    from .store import RUNNING

    if run.state != RUNNING or not run.supervisor_pid or not pid_alive(run.supervisor_pid, run.supervisor_started):
        return False
    if run.is_call:  # its "supervisor" is the caller (a notebook kernel, say): it reads the stored request
        return False
    try:
        os.kill(run.supervisor_pid, signal.SIGTERM)  # wakes it at once
    except (ProcessLookupError, PermissionError):
        return False
    return True


# ------------------------------------------------------------------ validate / schema


def _explain(path: str, args: argparse.Namespace) -> int:
    from .schema import explain

    try:
        info = explain(path)
    except KeyError as e:
        return _error(str(e.args[0]), args, EXIT_INVALID)
    if args.output == "json":
        _print_json(info)
        return 0
    print(f"{info['path']}  ({info['type']}, {'required' if info['required'] else 'optional'})")
    print(f"  {info['description']}")
    if "default" in info:
        print(f"  default: {json.dumps(info['default'], default=str)}")
    if "examples" in info:
        print("  examples: " + ", ".join(json.dumps(x) for x in info["examples"]))
    if "fields" in info:
        print("  fields: " + ", ".join(info["fields"]))
    if "constraints" in info:
        print("  constraints: " + ", ".join(info["constraints"]))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """``gpufleet validate -f FILE``: every problem at once, or a summary of the valid workload."""
    from .schema import WorkloadValidationError
    from .submit import plan

    if args.explain:
        return _explain(args.explain, args)
    if not args.file:
        return _error("give a workload file with -f, or a field with --explain", args, EXIT_INVALID)
    try:
        result = plan(args.file, args.override)
    except WorkloadValidationError as e:
        return _invalid(e, args)
    if args.output == "json":
        _print_json(result)
    else:
        print(
            f"{args.file} is valid: {result['num_nodes']} node(s) x {result['accelerators_per_node']} "
            f"{result['accelerator']} = world size {result['world_size']}, executor {result['executor']}"
        )
        for w in result["warnings"]:
            print(f"warning: {w}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    """``gpufleet schema``: the JSON schema, or help for the fields."""
    from .schema import explain, field_paths, json_schema

    if args.explain:
        return _explain(args.explain, args)
    if args.fields:
        infos = [explain(p) for p in field_paths()]
        if args.output == "json":
            _print_json(infos)
        else:
            for i in infos:
                flag = "required" if i["required"] else "optional"
                print(f"{i['path']}  ({i['type']}, {flag})\n  {i['description']}")
        return 0
    _print_json(json_schema())
    return 0
