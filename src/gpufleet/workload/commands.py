"""CLI commands for workloads: run, validate, schema.

Exit codes: 0 success; 1 an error; 2 an invalid workload or bad arguments, or a state folder or
run store that cannot be used; ``run --watch`` exits with its run's outcome (124 a run that
timed out, 130 a canceled one). The commands that read runs of every kind (get, list, logs,
cancel) are :mod:`gpufleet.runs.commands`.

One concern, the workload CLI's surface: arguments, text and JSON output, exit codes. The
work itself is elsewhere (``submit``, ``schema``, :mod:`gpufleet.runs.view`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..runs.commands import (
    EXIT_CODES,
    EXIT_INVALID,
    common_options,
    err,
    error,
    not_found,
    open_store,
    print_json,
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
    common_options(p)
    p.set_defaults(handler=cmd_run)

    p = subparsers.add_parser("validate", help="check a workload file; report every problem at once")
    p.add_argument("-f", "--file", default=None, help="workload YAML file")
    _overrides(p)
    p.add_argument("--explain", metavar="FIELD", default=None, help="describe a field, e.g. compute.accelerator_type")
    common_options(p)
    p.set_defaults(handler=cmd_validate)

    p = subparsers.add_parser("schema", help="print the workload JSON schema (for editors) or field help")
    p.add_argument("--explain", metavar="FIELD", default=None, help="describe one field")
    p.add_argument("--fields", action="store_true", help="list every field with its help")
    common_options(p)
    p.set_defaults(handler=cmd_schema)


def _invalid(e: Any, args: argparse.Namespace) -> int:
    if args.output == "json":
        print_json({"valid": False, "source": e.source, "problems": [p.to_dict() for p in e.problems]})
    else:
        err(str(e))
    return EXIT_INVALID


# ------------------------------------------------------------------ run


def cmd_run(args: argparse.Namespace) -> int:
    """``gpufleet run -f``: dry run, or submit (and optionally watch) a workload."""
    from ..errors import GpufleetError
    from ..private import UnsafeStateError
    from ..runs.store import RunNotFoundError, StoreError
    from ..runs.view import mlflow_links
    from .nodes import ExecutorUnavailableError
    from .schema import WorkloadValidationError
    from .snapshot import SnapshotError
    from .submit import plan, submit_run

    if args.inject_fault:  # the faults field, as an override: checked with the rest of the file
        args.override = [*args.override, "faults=" + json.dumps(args.inject_fault)]
    try:
        if args.dry_run:
            result = plan(args.file, args.override)
            if args.output == "json":
                print_json(result)
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
        return error(str(e), args, EXIT_INVALID)
    except (ExecutorUnavailableError, GpufleetError, SnapshotError, OSError) as e:
        return error(str(e), args)
    if not created:
        err(f"a run with idempotency key {args.idempotency_key!r} exists already: {run.id} ({run.state})")
    elif args.output == "text":
        err(
            f"submitted run {run.id}: {run.num_nodes} node(s) x "
            f"{run.config['compute']['accelerator_type']}; follow it with `gpufleet logs {run.id} --follow`"
        )
    if created:
        for warning in done.warnings:
            err(f"warning: {warning}")
        if done.mlflow_line:
            err(f"gpufleet: {done.mlflow_line}")
    if not args.watch:
        if args.output == "json":
            print_json({**run.to_dict(), "created": created, "mlflow_runs": mlflow_links(run, done.mlflow_run)})
        else:
            print(run.id, flush=True)
        return 0
    if args.output == "text":
        print(run.id, flush=True)
    from ..runs.view import watch

    store = open_store(args)
    try:
        final = watch(store, run.id, out=sys.stderr if args.output == "json" else sys.stdout,
                      mlflow_shown={done.mlflow_run["run_id"]} if done.mlflow_run else set())  # fmt: skip
    except KeyboardInterrupt:
        err(f"stopped watching; run {run.id} goes on (cancel it with `gpufleet cancel {run.id}`)")
        return 130
    except RunNotFoundError as e:  # its row was deleted meanwhile
        return not_found(e, args)
    if args.output == "json":
        print_json({**final.to_dict(), "created": created, "mlflow_runs": mlflow_links(final)})
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


# ------------------------------------------------------------------ validate / schema


def _explain(path: str, args: argparse.Namespace) -> int:
    from .schema import explain

    try:
        info = explain(path)
    except KeyError as e:
        return error(str(e.args[0]), args, EXIT_INVALID)
    if args.output == "json":
        print_json(info)
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
        return error("give a workload file with -f, or a field with --explain", args, EXIT_INVALID)
    try:
        result = plan(args.file, args.override)
    except WorkloadValidationError as e:
        return _invalid(e, args)
    if args.output == "json":
        print_json(result)
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
            print_json(infos)
        else:
            for i in infos:
                flag = "required" if i["required"] else "optional"
                print(f"{i['path']}  ({i['type']}, {flag})\n  {i['description']}")
        return 0
    print_json(json_schema())
    return 0
