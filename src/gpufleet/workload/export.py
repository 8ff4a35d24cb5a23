"""A ``@distributed`` call written out as a workload: ``train.to_workload("train.yaml", *args, **kwargs)``.

What is written, next to the YAML file (``train.yaml``):

* ``train.gpufleet/call.pkl``: the call, cloudpickled. A function that can be imported (a
  module's top-level function, not ``__main__``) travels as source: its top-level package (or
  module file) is copied to ``train.gpufleet/src/`` when it is not an installed package, and only
  the arguments are pickled; a function defined in a notebook or a script's ``__main__`` is
  pickled by value, which needs the same Python minor version (and a compatible cloudpickle)
  where it runs: ``export.json`` notes both, and the entry refuses another Python version.
* ``train.gpufleet/entry.py``: run on every rank by ``torchrun`` (so the function sees the same
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... as under the decorator); each rank's return value
  goes to ``$GPUFLEET_RUN_DIR/results/attempt-N/rank-R.pkl``, and node 0 then gathers them into
  ``$GPUFLEET_RUN_DIR/results/results.pkl`` (the list, in rank order, as ``.distributed()``
  returns it) and ``results/summary.txt`` (one line per rank). :func:`load_results` reads them.
* ``train.yaml``: the workload, with the decorator's placement (``gpus``, ``gpu_type``,
  ``remote`` as ``compute.cluster``), ``max_retries``, ``timeout`` (per attempt in a workload),
  ``env``, ``secrets``, ``experiment_name`` and ``run_name``. ``gpufleet run -f train.yaml``
  runs it here; ``--override compute.cluster=ray://head:10001`` (and
  ``compute.num_accelerators``) on a Ray cluster, whose nodes must share the run folder for the
  results of nodes other than node 0 to be gathered (as for checkpoints).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import LaunchConfigError
from ..launch.node import envcontract

__all__ = ["RESULTS_DIR", "export_call", "load_results"]

#: Folder of a run (``$GPUFLEET_RUN_DIR``) where an exported call's results go.
RESULTS_DIR = "results"
_EXPERIMENT_RE = re.compile(r"[^A-Za-z0-9_-]+")

ENTRY = '''"""Entry of a @distributed call exported by gpufleet (to_workload): run on every rank by torchrun.

`python entry.py` runs the function on this rank and saves its return value;
`python entry.py --gather` (node 0, after torchrun) puts every rank's value into results.pkl.
"""

import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
META = json.loads((HERE / "export.json").read_text())


def results_dir():
    run_dir = os.environ.get("GPUFLEET_RUN_DIR") or os.getcwd()
    return Path(run_dir) / META["results_dir"]


def attempt_dir():
    return results_dir() / ("attempt-" + os.environ.get("GPUFLEET_ATTEMPT", "1"))


def write_atomic(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp-%d" % os.getpid())
    tmp.write_bytes(data)
    os.replace(tmp, path)


def check_versions():
    here = "%d.%d" % sys.version_info[:2]
    if META["mode"] == "pickled" and here != META["python"].rsplit(".", 1)[0]:
        sys.exit("gpufleet: this call was exported by value from Python %s; it needs Python %s.x here "
                 "(found %s). Run it with that Python, or define the function in a module and export "
                 "again." % (META["python"], META["python"].rsplit(".", 1)[0], platform.python_version()))
    import cloudpickle

    if cloudpickle.__version__.split(".")[0] != META["cloudpickle"].split(".")[0]:
        print("gpufleet: warning: exported with cloudpickle %s, loading with %s"
              % (META["cloudpickle"], cloudpickle.__version__), file=sys.stderr)
    return cloudpickle


def load_function(cloudpickle):
    sys.path.insert(0, str(HERE / "src"))
    with open(HERE / "call.pkl", "rb") as f:
        func, args, kwargs = cloudpickle.load(f)
    if func is None:  # exported as source: import it
        import importlib

        func = importlib.import_module(META["module"])
        for part in META["qualname"].split("."):
            func = getattr(func, part)
        func = getattr(func, "func", func)  # the plain function of a DistributedFunction
    return func, args, kwargs


def run_rank():
    cloudpickle = check_versions()
    func, args, kwargs = load_function(cloudpickle)
    try:
        import gpufleet.launch.tracebacks as tb

        tb.register_sources(META.get("sources") or {})
    except Exception:
        pass
    value = func(*args, **kwargs)
    rank = int(os.environ.get("RANK", "0"))
    write_atomic(attempt_dir() / ("rank-%d.pkl" % rank), cloudpickle.dumps(value))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather(wait_s=120.0):
    if os.environ.get("NODE_RANK", "0") != "0":
        return
    cloudpickle = check_versions()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    files = [attempt_dir() / ("rank-%d.pkl" % r) for r in range(world)]
    deadline = time.monotonic() + wait_s
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            missing = [r for r, f in enumerate(files) if not f.exists()]
            sys.exit("gpufleet: no result from rank(s) %s in %s: on several nodes, the run folder must be on "
                     "storage every node mounts (GPUFLEET_HOME)" % (missing, attempt_dir()))
        time.sleep(0.2)
    values = [cloudpickle.loads(f.read_bytes()) for f in files]
    write_atomic(results_dir() / "results.pkl", cloudpickle.dumps(values))
    lines = ["rank %d: %s" % (r, short(v)) for r, v in enumerate(values)]
    write_atomic(results_dir() / "summary.txt", ("\\n".join(lines) + "\\n").encode())
    print("gpufleet: results of %d ranks in %s" % (world, results_dir() / "results.pkl"))
    for line in lines:
        print("  " + line)


def short(value, limit=300):
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    gather() if sys.argv[1:] == ["--gather"] else run_rank()
'''

COMMAND = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE \\\n"
    "  --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT {folder}/entry.py\n"
    "python {folder}/entry.py --gather\n"
)


def _importable(func: Any) -> tuple[str, str, Path | None] | None:
    """``(module, qualname, source to copy or None when installed)`` of a function found by import, else None."""
    module_name = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    if not module_name or module_name == "__main__" or "<" in qualname:
        return None
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module is None or not file:
        return None
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not func and getattr(found, "func", None) is not func:
        return None  # the name leads elsewhere (redefined, wrapped): send it by value
    top = sys.modules.get(module_name.split(".")[0])
    top_file = getattr(top, "__file__", None)
    if top is None or not top_file:
        return None
    source = Path(top_file).parent if hasattr(top, "__path__") else Path(top_file)
    if {"site-packages", "dist-packages"} & set(source.parts):
        return module_name, qualname, None  # installed where it runs too
    return module_name, qualname, source


def _accelerators(function: Any) -> tuple[str, int]:
    """``(accelerator_type, num_accelerators)`` of the decorator's placement."""
    from ..launch.gpus import CPU, list_gpus, resolve_local

    opts = function.options
    gpus = len(opts.gpus) if isinstance(opts.gpus, tuple) else opts.gpus
    if opts.gpu_type is not None and opts.gpu_type.strip().lower() == CPU:
        count = gpus or resolve_local(None, opts.gpu_type).num_workers
        return f"CPU_{count}", count
    gpu_type = opts.gpu_type
    if gpus is None or gpu_type is None:
        found = list_gpus()
        if not found:
            raise LaunchConfigError(
                "to_workload needs the number and model of GPUs: no GPU is visible here, so set them, e.g. "
                "train.with_overrides(gpus=8, gpu_type='H100').to_workload(...)"
            )
        gpus = gpus or len(found)
        name = found[0].name.removeprefix("NVIDIA ").split()
        gpu_type = gpu_type or (name[0] if name else "GPU")
    return f"GPU_{gpus}x{gpu_type.strip()}", gpus


def _cluster(remote: bool | str) -> str | None:
    if remote is True:
        remote = os.environ.get("RAY_ADDRESS", "")
    return str(remote) if remote else None


def _secrets(secrets: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The call's secret sources for the YAML (files made absolute: the YAML's folder is not this one)."""
    out = {}
    for name, source in secrets.items():
        ((kind, where),) = source.items()
        if kind == "file":
            where = str(Path(os.path.expanduser(where)).absolute())
        out[name] = {kind: where}
    return out


def export_call(function: Any, path: str | os.PathLike[str], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Path:  # fmt: skip
    """Write the workload of ``function(*args, **kwargs)`` to ``path`` (see the module); returns its path."""
    import cloudpickle
    import yaml

    from ..tracking.launch import call_parameters
    from ..tracking.runs import DEFAULT_EXPERIMENT

    function._bind(args, kwargs)
    yaml_path = Path(path).absolute()
    if yaml_path.suffix not in (".yaml", ".yml"):
        raise LaunchConfigError(f"to_workload writes a YAML file: give a path ending in .yaml, got {str(path)!r}")
    opts = function.options
    accelerator_type, count = _accelerators(function)
    folder_name = f"{yaml_path.stem}.gpufleet"
    folder = yaml_path.parent / folder_name
    if folder.exists():
        shutil.rmtree(folder)  # an earlier export of the same name
    folder.mkdir(parents=True)
    func = function.func
    found = _importable(func)
    meta: dict[str, Any] = {
        "function": getattr(func, "__qualname__", repr(func)),
        "python": platform.python_version(),
        "cloudpickle": cloudpickle.__version__,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results_dir": RESULTS_DIR,
    }
    if found is not None:
        module, qualname, source = found
        meta.update(mode="source", module=module, qualname=qualname)
        if source is not None:
            target = folder / "src" / source.name
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
            else:
                target.parent.mkdir(parents=True)
                shutil.copy2(source, target)
        import pickle

        call = cloudpickle.dumps((None, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    else:
        meta.update(mode="pickled")
        call, sources = function._pickle_call(args, kwargs)
        meta["sources"] = sources  # the notebook cells' text, for tracebacks
    (folder / "call.pkl").write_bytes(call)
    (folder / "export.json").write_text(json.dumps(meta, indent=2) + "\n")
    (folder / "entry.py").write_text(ENTRY)
    experiment = _EXPERIMENT_RE.sub("-", opts.experiment_name or DEFAULT_EXPERIMENT).strip("-")[:100] or "gpufleet"
    document: dict[str, Any] = {
        "experiment_name": experiment,
        "compute": {"accelerator_type": accelerator_type, "num_accelerators": count},
        "code_source": {"root_path": ".", "include_paths": [folder_name]},
        "command": COMMAND.format(folder=folder_name),
    }
    cluster = _cluster(opts.remote)
    if cluster:
        document["compute"]["cluster"] = cluster
    if opts.env:
        document["env_variables"] = dict(opts.env)
    if opts.secrets:
        document["secrets"] = _secrets(opts.secrets)
    if opts.run_name:
        document["mlflow_run_name"] = opts.run_name
    params = call_parameters(function._signature, args, kwargs)
    if params:
        document["parameters"] = params  # shown in MLflow as for the call; the function gets the pickled ones
    document["max_retries"] = opts.max_retries
    if opts.timeout:
        document["timeout_minutes"] = round(opts.timeout / 60, 3)
    how = (
        f"{meta['module']}.{meta['qualname']}, exported as source"
        if meta["mode"] == "source"
        else f"{meta['function']}, pickled by value: needs Python {platform.python_version().rsplit('.', 1)[0]}.x "
        f"and cloudpickle {cloudpickle.__version__.split('.')[0]}.x where it runs"
    )
    header = (
        f"# gpufleet workload exported from the @distributed call {how}.\n"
        f"# Run it: gpufleet run -f {yaml_path.name} [--watch] [--override compute.cluster=ray://HEAD:10001]\n"
        f"# Results: ${envcontract.RUN_DIR}/{RESULTS_DIR}/results.pkl (gpufleet.workload.export.load_results(RUN_ID)).\n"
        "# timeout_minutes is per attempt here (the decorator's timeout covered every attempt).\n"
    )
    yaml_path.write_text(header + yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
    _check_snapshot(yaml_path, folder_name)
    return yaml_path


def _check_snapshot(yaml_path: Path, folder_name: str) -> None:
    """Refuse an export whose files the code snapshot would leave out (a .gitignore that ignores them)."""
    from .snapshot import list_files

    wanted = {str(p.relative_to(yaml_path.parent).as_posix()) for p in (yaml_path.parent / folder_name).rglob("*")
              if p.is_file()}  # fmt: skip
    missing = sorted(wanted - set(list_files(yaml_path.parent, [folder_name])))
    if missing:
        raise LaunchConfigError(
            f"the workload's code snapshot would leave out {', '.join(missing[:5])} (ignored by git or a "
            f".gitignore); export to another folder, or stop ignoring {folder_name}/"
        )


def load_results(run: str | os.PathLike[str], home: str | os.PathLike[str] | None = None) -> list[Any]:
    """The per-rank results of a run of an exported call: a run id (or prefix) or a run folder."""
    import cloudpickle

    folder = Path(run)
    if not (folder / RESULTS_DIR).is_dir():
        from ..runs.store import RunStore

        folder = Path(RunStore(home).get(str(run)).run_dir)
    return cloudpickle.loads((folder / RESULTS_DIR / "results.pkl").read_bytes())
