"""The live panel in a real Jupyter kernel (nbclient): it ends as a summary, and a failed rank is shown failed.

nbclient applies each ``update_display_data`` to the cell's output, as a front end does, so the
cell's HTML output after the run is the panel's last state.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]

SETUP = """
import os
os.environ["GPUFLEET_TRACKING"] = "0"
from gpufleet import distributed, runtime
from gpufleet.tracking import log_metrics
"""

GOOD = """
@distributed(gpus=2, gpu_type="cpu", keep_warm=False)
def train(steps):
    import time
    runtime.set_total_steps(steps)
    loss = 2.0
    for step in range(1, steps + 1):
        time.sleep(0.05)
        loss *= 0.9
        runtime.report_step(step)
        log_metrics({"loss": loss}, step=step)
    print("trained", flush=True)
    return round(loss, 6)

print("RESULT", train.distributed(20))
"""

FAILING = """
class LabelsMissing(Exception):
    pass

@distributed(gpus=2, gpu_type="cpu", keep_warm=False)
def broken():
    import time
    for step in range(1, 4):
        runtime.report_step(step)
        time.sleep(0.2)
    if runtime.get_global_rank() == 1:
        raise LabelsMissing("batch 3 has no labels")
    time.sleep(30)

broken.distributed()
"""

OFF = """
@distributed(gpus=2, gpu_type="cpu", keep_warm=False, live=False)
def quiet():
    return 1

print("QUIET", quiet.distributed())
"""


def _panels(cell) -> list[str]:
    return [o["data"]["text/html"] for o in cell.outputs
            if o.get("output_type") in ("display_data", "update_display_data") and "text/html" in o.get("data", {})]  # fmt: skip


def _run(cells: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    client = NotebookClient(nb, kernel_name="python3", allow_errors=True, timeout=120,
                            resources={"metadata": {"path": str(REPO)}})  # fmt: skip
    client.km = client.create_kernel_manager()
    client.start_new_kernel(env=env)
    client.execute(cleanup_kc=True)
    return nb


@pytest.mark.slow
def test_panel_summary_failed_rank_and_switch_off():
    nb = _run([SETUP, GOOD, FAILING, OFF])
    good, failing, off = nb.cells[1], nb.cells[2], nb.cells[3]

    panels = _panels(good)
    assert len(panels) == 1, "one panel in the cell, replaced in place"
    final = panels[0]
    assert 'data-gpufleet-panel=""' in final and 'data-state="SUCCESS"' in final
    assert "data-gpufleet-summary" in final
    assert len(re.findall(r'<tr data-rank="\d"', final)) == 2
    assert re.findall(r'data-rank="\d" data-state="done" data-step="20"', final), final
    points = int(re.search(r'data-gpufleet-plot="" data-points="(\d+)"', final).group(1))
    assert points >= 10  # rank 0's loss, logged every step
    assert "final loss 0.2432" in final  # 2 * 0.9 ** 20 = 0.24315
    assert "RESULT [0.243153, 0.243153]" in "".join(o.get("text", "") for o in good.outputs)

    errors = [o for o in failing.outputs if o.get("output_type") == "error"]
    assert errors and errors[0]["ename"] == "LabelsMissing", "the cell raises the rank's own exception"
    final = _panels(failing)[0]
    assert 'data-state="FAILED"' in final
    assert 'data-rank="1" data-state="failed"' in final
    assert "LabelsMissing: batch 3 has no labels" in final

    assert not _panels(off), "live=False shows no panel"
    assert "QUIET [1, 1]" in "".join(o.get("text", "") for o in off.outputs)
