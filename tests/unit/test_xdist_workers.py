"""scripts/test.sh runs the suite on pytest-xdist workers: each has a GPUFLEET_HOME of its own, and
the tests of one machine-wide cluster (Ray, Slurm) share one xdist group (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE_OUT = "GPUFLEET_TEST_XDIST_PROBE"  # where each probe writes
PROBE = Path(__file__).with_name("xdist_probe.py")  # not collected by the suite (not test_*.py)


def _probe(tmp_path: Path, *args: str, **env: str) -> list[dict]:
    out = tmp_path / "probes"
    out.mkdir()
    run_env = {k: v for k, v in os.environ.items() if k not in ("GPUFLEET_HOME", "MLFLOW_TRACKING_URI",
                                                                "GPUFLEET_TEST_DEFAULT_HOME", "PYTEST_XDIST_WORKER",
                                                                "TORCH_EXTENSIONS_DIR")}  # fmt: skip
    run_env.update({PROBE_OUT: str(out), **env})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                           str(PROBE.relative_to(REPO))], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_each_xdist_worker_has_its_own_home_and_mlflow_store(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    seen = _probe(tmp_path, "-n", "2", "--dist", "load")
    assert all(p["groups"] == ["tests/unit/xdist_probe.py"] for p in seen), seen
    homes = {p["worker"]: p["home"] for p in seen}
    assert set(homes) == {"gw0", "gw1"}, seen
    assert len(set(homes.values())) == 2  # never one home shared by two workers
    for p in seen:
        assert p["mlflow"] == "sqlite:///" + os.path.join(p["home"], "mlflow-test.db")
    # one folder of torch's JIT extensions for the session: DeepSpeed's op compiles once, not per worker
    [ext] = {p["torch_extensions"] for p in seen}
    assert ext and "gpufleet-test-torch-ext-" in ext


def test_loadgroup_runs_one_group_on_one_worker(tmp_path: Path) -> None:
    """scripts/test.sh's `--dist loadgroup`: the four tests of one group (here one module) all run
    on one worker, so two workers never share one machine-wide cluster or one module's fixture."""
    pytest.importorskip("xdist")
    seen = _probe(tmp_path, "-n", "2", "--dist", "loadgroup")
    assert len(seen) == 4
    assert len({p["worker"] for p in seen}) == 1, seen
    assert all(p["nodeid"].endswith("@tests/unit/xdist_probe.py") for p in seen), seen


def test_a_home_the_caller_gives_gets_a_folder_per_worker(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    given = tmp_path / "given-home"
    seen = _probe(tmp_path, "-n", "2", "--dist", "load", GPUFLEET_HOME=str(given))
    assert {p["home"] for p in seen} == {str(given / "xdist-gw0"), str(given / "xdist-gw1")}


def test_ray_and_slurm_tests_get_their_xdist_group_and_others_their_module_s(pytestconfig: pytest.Config) -> None:
    from tests.conftest import _xdist_group

    class Item:
        def __init__(self, nodeid: str, marker: str | None = None) -> None:
            self.nodeid, self.marker = nodeid, marker

        def get_closest_marker(self, name: str) -> object:
            return object() if name == self.marker else None

    assert _xdist_group(Item("tests/ray/test_ray_launch.py::test_x")) == "ray"
    assert _xdist_group(Item("tests/tracking/test_runs.py::test_y", marker="ray")) == "ray"
    assert _xdist_group(Item("tests/recipes/test_workloads.py::test_smoke[ray-train-resnet50]")) == "ray"
    assert _xdist_group(Item("tests/slurm/test_sbatch.py::test_z")) == "slurm"
    # any other test: its module, so that a module-scoped fixture (one launch) runs on one worker only
    assert _xdist_group(Item("tests/unit/test_controller.py::test_w[a]")) == "tests/unit/test_controller.py"


def _collected(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # a plain pytest, not a worker's
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode in (0, 5), done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_clusters_tests_are_one_phase_and_every_other_test_the_other() -> None:
    """scripts/test.sh runs `-m "not cluster"` on the workers, then `-m cluster` alone: a Slurm test
    (and a Ray one, by the same rule) is in the second phase only, a unit test in the first only."""
    paths = ["tests/slurm/test_slurm_options.py", "tests/unit/test_leftover_check.py"]
    cluster, rest = _collected("-m", "cluster", *paths), _collected("-m", "not cluster", *paths)
    assert cluster and all(line.startswith("tests/slurm/") for line in cluster), cluster
    assert rest and all(line.startswith("tests/unit/") for line in rest), rest
