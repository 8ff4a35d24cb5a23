"""Shared test set-up: a private GPUFLEET_HOME, offline hubs, no process left behind, and the
tests of the recipes' separate environments last (scripts/test.sh builds those meanwhile)."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.proc import describe, leftover_worker_processes

# Loopback only: every Ray node the suite starts (its two-node cluster, a recipe's local Ray, a
# `ray start`) registers and serves on 127.0.0.1, not the machine's network address. Set when this
# file is imported: Ray reads it when it is imported, and pytest imports the conftest files of the
# paths it is given (tests/ray/conftest.py imports ray) before any pytest_configure runs.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("GPUFLEET_HOME", tempfile.mkdtemp(prefix="gpufleet-test-home-"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + os.path.join(os.environ["GPUFLEET_HOME"], "mlflow-test.db"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # torch's JIT extensions (DeepSpeed's shared-memory op) build in the session's own folder, shared
    # by its tests and their subprocesses: built once per session, as on a new machine, and never
    # stalled by a lock that a build killed in another session left in ~/.cache/torch_extensions
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", tempfile.mkdtemp(prefix="gpufleet-test-torch-ext-"))


def _recipe_env(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("recipe_env")
    return marker.args[0] if marker else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of a recipe environment run after every other test, grouped by environment."""
    order = {name: i for i, name in enumerate(dict.fromkeys(filter(None, map(_recipe_env, items))))}
    items.sort(key=lambda item: -1 if _recipe_env(item) is None else order[_recipe_env(item)])


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
