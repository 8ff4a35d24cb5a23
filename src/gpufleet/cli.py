"""The ``gpufleet`` command line: run/validate/schema, get/list/logs/cancel/ps/stacks, advise, doctor.

Each command group lives in its own module and registers its subcommands here through an
``add_parsers(subparsers)`` function; this file only wires them together.

A state folder or run store that cannot be used (another user's, writable by others, a file,
read-only, a damaged ``runs.db``, a store locked for too long) ends any command with one line
``error: ...`` on stderr and exit code 2, never a traceback. Output into a pipe whose reader
has gone (``gpufleet get RUN_ID | head -1``) ends quietly with exit code 141, as git does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

# module path -> the commands it adds (its add_parsers(subparsers) registers them), in the help's order:
# the workload's own commands, then those of every run (calls and workloads), then the tools
_COMMAND_MODULES = {
    "gpufleet.workload.commands": ("run", "validate", "schema"),
    "gpufleet.runs.commands": ("get", "list", "logs", "wait", "cancel"),
    "gpufleet.runs.ps": ("ps",),
    "gpufleet.stacks": ("stacks",),
    "gpufleet.strategies.advisor_cli": ("advise",),
    "gpufleet.doctor": ("doctor",),
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every available command."""
    parser = argparse.ArgumentParser(
        prog="gpufleet",
        description="Multi-GPU and multi-node PyTorch training: workloads, runs and tools.",
    )
    parser.add_argument("--version", action="version", version=f"gpufleet {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("gpufleet"):
                continue  # command group not present in this build
            raise
        module.add_parsers(sub)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpufleet`` console script; returns the exit code."""
    if argv is None:  # this process's own command line: the console script, ``python -m gpufleet.cli``
        code = main(sys.argv[1:])
        if "mlflow" in sys.modules:  # with MLflow loaded the interpreter's teardown takes most of a second
            from .runtime import exit_without_teardown

            exit_without_teardown(code)  # atexit handlers, threads and stdio first, then no module teardown
        return code
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _discard_stdout()
        return SIGPIPE_EXIT
    except Exception as e:
        if not _unusable_state(e):
            raise
        message = " ".join(str(e).split())  # one line
        if getattr(args, "output", None) == "json":
            sys.stdout.write(json.dumps({"error": message}) + "\n")
            sys.stdout.flush()
        print(f"error: {message}", file=sys.stderr)
        return 2


#: Exit status when the reader of stdout went away (``gpufleet list | head -1``): 128 + SIGPIPE,
#: what a shell reports for ``git log | head -1``.
SIGPIPE_EXIT = 141


def _stdout_closed() -> bool:
    """Whether nothing reads stdout any more (a pipe whose reader exited)."""
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or stdout is not a file
        return True


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _unusable_state(e: BaseException) -> bool:
    """Whether ``e`` says the state folder or the run store cannot be used (the user fixes that, not the code)."""
    from .private import UnsafeStateError

    if isinstance(e, UnsafeStateError):
        return True
    try:
        from .runs.store import StoreError
    except ImportError:
        return False
    return isinstance(e, StoreError)


if __name__ == "__main__":
    sys.exit(main())
