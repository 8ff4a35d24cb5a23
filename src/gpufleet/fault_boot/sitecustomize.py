"""Arms gpufleet's faults in each rank of a workload that rehearses them, as Python starts.

When a workload attempt has faults (``gpufleet run --inject-fault``, the ``faults`` field), the
node guard puts this folder first on the command's ``PYTHONPATH``. Python imports
``sitecustomize`` at start-up, so every Python process of the command runs this file: one with
a ``RANK`` (each worker torchrun starts; not torchrun itself) arms the faults of
``GPUFLEET_FAULTS`` for that rank, also when its code never calls into gpufleet (a script that
calls ``dist.init_process_group`` itself). Then the next ``sitecustomize`` on the path, if there
is one, runs as it would have without this folder.
"""

import os
import sys


def _arm() -> None:
    rank = os.environ.get("RANK", "")
    if not os.environ.get("GPUFLEET_FAULTS") or not rank.isdigit():
        return
    try:
        from gpufleet import faults

        faults.arm(int(rank), at_start=True)
    except Exception as e:  # noqa: BLE001 - a rank must start even so; its log says why
        print(f"gpufleet: the faults of GPUFLEET_FAULTS are not armed in rank {rank}: {e}", file=sys.stderr, flush=True)


def _next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # Python's start-up, not an import of gpufleet.fault_boot.sitecustomize
    _arm()
    _next_sitecustomize()
