"""Shared test set-up: a private GPUFLEET_HOME, offline hubs, no process left behind, and the
tests of the recipes' separate environments last (scripts/test.sh builds those meanwhile).

Under pytest-xdist (``-n 2``) every worker has a GPUFLEET_HOME of its own (so its run store,
MLflow database and fake GPUs' leases too). The tests that start a Ray cluster or use the local
Slurm cluster are marked ``cluster`` (scripts/test.sh runs them after the others, Ray's group
on one worker and Slurm's on the other) and get one xdist group each; every other test gets its module's, so that ``--dist loadgroup``
keeps a module (and its module-scoped fixtures) on one worker.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

from tests.proc import describe, leftover_worker_processes

# Loopback only: every Ray node the suite starts (its two-node cluster, a recipe's local Ray, a
# `ray start`) registers and serves on 127.0.0.1, not the machine's network address. Set when this
# file is imported: Ray reads it when it is imported, and pytest imports the conftest files of the
# paths it is given (tests/ray/conftest.py imports ray) before any pytest_configure runs.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

# The test environment's own tools first on PATH, for every process the suite starts (as in an
# activated environment). torch builds DeepSpeed's op with the `ninja` it finds on PATH: the
# environment's (1.13) in a notebook kernel, the system's (1.11) in a rank started from a bare
# PATH. Each reads the other's build log as foreign and compiles the op again (two minutes of
# both cores on a 2-core machine), so one session built it two or three times instead of once.
_ENV_BIN = os.path.dirname(os.path.abspath(sys.executable))
if os.environ.get("PATH", "").split(os.pathsep)[0] != _ENV_BIN:
    os.environ["PATH"] = os.pathsep.join([_ENV_BIN, os.environ.get("PATH", "")])


_DEFAULT_HOME = "GPUFLEET_TEST_DEFAULT_HOME"  # the home below was made here, not given by the caller


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(_DEFAULT_HOME) == os.environ.get("GPUFLEET_HOME"):
        # an xdist worker inherits the controller's default home: it gets one of its own
        os.environ.pop("GPUFLEET_HOME", None)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    elif worker and "GPUFLEET_HOME" in os.environ:
        # a home the caller gave: one folder in it per worker
        os.environ["GPUFLEET_HOME"] = os.path.join(os.environ["GPUFLEET_HOME"], f"xdist-{worker}")
        os.makedirs(os.environ["GPUFLEET_HOME"], exist_ok=True)
    if "GPUFLEET_HOME" not in os.environ:
        os.environ["GPUFLEET_HOME"] = os.environ[_DEFAULT_HOME] = tempfile.mkdtemp(prefix="gpufleet-test-home-")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + os.path.join(os.environ["GPUFLEET_HOME"], "mlflow-test.db"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # torch's JIT extensions (DeepSpeed's shared-memory op) build in the session's own folder, shared
    # by its tests, its xdist workers (which inherit it) and their subprocesses: built once per
    # session, as on a new machine, and never stalled by a lock that a build killed in another
    # session left in ~/.cache/torch_extensions (scripts/test.sh gives one folder to both its phases)
    if not worker and not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="gpufleet-test-torch-ext-")


def _recipe_env(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("recipe_env")
    return marker.args[0] if marker else None


def _xdist_group(item: pytest.Item) -> str:
    """The xdist group of a test: "slurm" or "ray" for those that need that machine-wide cluster
    (one test at a time), else its module, so that a module's fixtures (module-scoped launches,
    DeepSpeed's compile) run once, on one worker, not once per worker."""
    if item.get_closest_marker("slurm") or "tests/slurm/" in item.nodeid:
        return "slurm"
    if item.get_closest_marker("ray") or "tests/ray/" in item.nodeid or "ray-train" in item.nodeid:
        return "ray"  # `ray start` is the machine's latest cluster, which a bare ray.init() joins
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of a recipe environment run after every other test, grouped by environment; each
    test gets its xdist group, and Ray's and Slurm's the ``cluster`` mark. First of the hooks: an
    xdist worker reads the xdist_group marks in its own hook of this name, which otherwise runs
    before this one."""
    order = {name: i for i, name in enumerate(dict.fromkeys(filter(None, map(_recipe_env, items))))}
    items.sort(key=lambda item: -1 if _recipe_env(item) is None else order[_recipe_env(item)])
    loadgroup = bool(os.environ.get("PYTEST_XDIST_WORKER")) and items and items[0].config.getvalue("loadgroup")
    for item in items:
        group = _xdist_group(item)
        if group in ("ray", "slurm"):  # scripts/test.sh runs these after the others (-m cluster)
            item.add_marker(pytest.mark.cluster)
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        if loadgroup and hasattr(item, "_id"):
            _tag_with_group(item)


def _tag_with_group(item: pytest.Item) -> None:
    """The "ID@GROUP" test id that xdist's loadgroup scheduler groups by. pytest 9.2 keeps a test's
    id in ``_id``, and xdist 3.8's worker still writes it to ``_nodeid``, which pytest no longer
    reads, so each group's tests would spread over every worker; this writes it where pytest reads it."""
    from _pytest.nodeid import coerce_node_id

    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
    item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Before a recipe environment's test, outside its timeout: wait for that environment's build."""
    name = _recipe_env(item)
    if name is not None:
        from tests.recipes.nb import wait_for_build

        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        wait_for_build(name, say=lambda text: reporter.write_line(text) if reporter else print(text))
    yield


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves any worker it launched (or their children) running."""
    yield
    left = leftover_worker_processes(wait_s=10.0)
    if left:
        named = [describe(p) for p in left]  # before the kill: a killed process is a zombie without a command line
        for p in left:
            try:
                p.kill()
            except Exception:
                pass
        pytest.fail("processes left running after the test:\n  " + "\n  ".join(named))
