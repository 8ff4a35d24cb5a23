"""Execute a recipe notebook headless and save the executed copy.

Usage: ``python run_notebook.py NOTEBOOK [--out EXECUTED.ipynb] [--timeout SECONDS]``.
Parameters travel as environment variables (``SMOKE=1``, ``GPUS=2``, ``MODEL=...``), so the
same notebook runs the smoke size in CI and the real size on GPUs. The kernel is the
``python3`` kernel of the interpreter running this script.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def run(notebook: str | Path, out: str | Path | None = None, timeout: int = 1800) -> Path:
    """Run every cell of ``notebook`` in its own folder; raise on the first failing cell.

    Returns:
        The path of the executed notebook.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(notebook).resolve()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    finally:
        target = Path(out) if out else path.with_name(path.stem + ".executed.ipynb")
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: run a notebook and print where the executed copy went."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    start = time.monotonic()
    target = run(args.notebook, args.out, args.timeout)
    print(f"executed {args.notebook} in {time.monotonic() - start:.1f}s -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
