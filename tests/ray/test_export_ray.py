"""An exported @distributed call run across two Ray nodes with ``--override compute.*``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.workload.export import load_results
from tests.workload.helpers import cli

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_an_exported_call_runs_on_two_ray_nodes(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    from tests.workload.export_example import rank_sum

    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    target = rank_sum.to_workload(tmp_path / "export" / "sum.yaml", 5, scale=2.0)
    rc, out, err = cli(
        capsys, "run", "-f", str(target), "--watch", "--no-tracking",
        "--override", f"compute.cluster={two_nodes.address}", "--override", "compute.accelerator_type=CPU_1",
    )  # fmt: skip
    assert rc == 0, out + err
    assert load_results(out.splitlines()[0], home=tmp_path / "home") == [
        {"rank": 0, "world": 2, "value": 11.0}, {"rank": 1, "world": 2, "value": 11.0},
    ]  # fmt: skip
