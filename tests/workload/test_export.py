"""A @distributed call exported as a workload (``to_workload``) gives what the call gives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from gpufleet.runs.store import RunStore
from gpufleet.workload.export import load_results
from tests.workload.helpers import cli, cli_json

REPO = Path(__file__).resolve().parents[2]

SETUP = """
import json, os, torch
from gpufleet import distributed, runtime
"""

DEFINE = """
OFFSET = 100

class Scaler:
    def __init__(self, k):
        self.k = k

@distributed(gpus=2, gpu_type="cpu", tracking=False, stream_logs=False)
def train(n, scaler, *, note="hello"):
    import torch, torch.distributed as dist
    runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": runtime.get_global_rank(), "value": runtime.get_global_rank() * scaler.k * n + t.item() + OFFSET,
            "note": note, "scaler": Scaler(scaler.k + runtime.get_global_rank())}

def plain(results):
    return [[r["rank"], r["value"], r["note"], r["scaler"].k] for r in results]
"""

CALL = "print('DIRECT', json.dumps(plain(train.distributed(3, Scaler(10), note='from a notebook'))))"
EXPORT = "print('EXPORTED', train.to_workload({path!r}, 3, Scaler(10), note='from a notebook'))"


def _plain(results: list) -> list:
    return [[r["rank"], r["value"], r["note"], r["scaler"].k] for r in results]


@pytest.mark.slow
def test_a_notebook_call_exported_as_a_workload_gives_the_same_results(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    target = tmp_path / "export" / "train.yaml"
    target.parent.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (SETUP, DEFINE, CALL, EXPORT.format(path=str(target)))]
    NotebookClient(nb, kernel_name="python3", timeout=180, resources={"metadata": {"path": str(REPO)}}).execute()
    texts = ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream") for c in nb.cells]
    direct = json.loads(texts[2].split("DIRECT ", 1)[1].splitlines()[0])
    assert direct == [[0, 103.0, "from a notebook", 10], [1, 133.0, "from a notebook", 11]]
    assert f"EXPORTED {target}" in texts[3]

    document = yaml.safe_load(target.read_text())
    assert document["compute"] == {"accelerator_type": "CPU_2", "num_accelerators": 2}
    assert document["code_source"] == {"root_path": ".", "include_paths": ["train.gpufleet"]}
    meta = json.loads((target.parent / "train.gpufleet" / "export.json").read_text())
    assert meta["mode"] == "pickled" and meta["python"] and meta["cloudpickle"]
    assert "pickled by value: needs Python 3." in target.read_text().splitlines()[0]

    rc, out, err = cli(capsys, "run", "-f", str(target), "--watch", "--no-tracking")
    assert rc == 0, err + out
    run_id = out.splitlines()[0]
    assert _plain(load_results(run_id)) == direct
    run = cli_json(capsys, "get", run_id)
    summary = (Path(run["run_dir"]) / "results" / "summary.txt").read_text()
    assert summary.startswith("rank 0: {'rank': 0, 'value': 103.0") and "rank 1: {'rank': 1, 'value': 133.0" in summary
    assert "gpufleet: results of 2 ranks in" in out


@pytest.mark.slow
def test_a_module_function_is_exported_as_source(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.workload.export_example import rank_sum

    direct = rank_sum.distributed(5, scale=2.0)
    target = rank_sum.with_overrides(max_retries=1, run_name="sum").to_workload(tmp_path / "sum.yaml", 5, scale=2.0)
    folder = tmp_path / "sum.gpufleet"
    meta = json.loads((folder / "export.json").read_text())
    assert (meta["mode"], meta["module"], meta["qualname"]) == ("source", "tests.workload.export_example", "rank_sum")
    assert (folder / "src" / "tests" / "workload" / "export_example.py").exists()
    document = yaml.safe_load(target.read_text())
    assert document["max_retries"] == 1 and document["mlflow_run_name"] == "sum"
    assert document["parameters"] == {"args.base": 5, "args.scale": 2.0}
    # it runs from its own copy of the source, not from this checkout
    rc, out, err = cli(capsys, "run", "-f", str(target), "--watch", "--no-tracking")
    assert rc == 0, err + out
    assert load_results(out.splitlines()[0]) == direct == [
        {"rank": 0, "world": 2, "value": 11.0}, {"rank": 1, "world": 2, "value": 11.0},
    ]  # fmt: skip
    assert os.path.isdir(Path(cli_json(capsys, "get", out.splitlines()[0])["run_dir"]) / "code" / "sum.gpufleet" / "src")


def test_export_needs_a_yaml_path_and_arguments_that_fit(tmp_path: Path) -> None:
    from gpufleet.errors import LaunchConfigError
    from tests.workload.export_example import rank_sum

    with pytest.raises(LaunchConfigError, match="ending in .yaml"):
        rank_sum.to_workload(tmp_path / "x.txt", 1)
    with pytest.raises(TypeError, match="nothing was launched"):
        rank_sum.to_workload(tmp_path / "x.yaml", 1, 2, 3)
