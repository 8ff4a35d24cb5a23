"""docs/getting-started.md, run as a newcomer would: every bash line in order, every python block as a notebook cell.

Three commands run in a form fit for a test, as the page's own notes allow: the demo trains 3
epochs (``--epochs 3``), ``pip install`` installs nothing new (``--no-index``: the packages are
already in the test environment), and ``mlflow ui`` is started on a free port, asked for its
page once, and stopped.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", PAGE.read_text(), re.M | re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _for_the_test(line: str, tmp: Path) -> str:
    if line.startswith("scripts/demo.sh"):
        return line + " --epochs 3"
    if line.startswith("pip install"):
        return line + " --no-index --quiet"
    if line.startswith("mlflow ui"):
        port = _free_port()
        probe = (
            "import sys, time, urllib.request\n"
            "for _ in range(300):\n"
            "    try:\n"
            f"        urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2); print('mlflow ui answered'); sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.2)\n"
            "sys.exit('mlflow ui did not answer')\n"
        )
        # its own process group (set -m), so that stopping it stops its server workers too
        log = tmp / "mlflow-ui.log"
        return (f"set -m; {line} --port {port} > {log} 2>&1 & ui=$!; set +m\n"
                f"python -c \"{probe}\" || {{ cat {log}; kill -- -$ui; exit 1; }}\n"
                "kill -- -$ui; wait $ui || true")  # fmt: skip
    return line


def test_every_bash_command_of_the_page_runs_in_order(tmp_path: Path) -> None:
    lines = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert lines[0] == "scripts/demo.sh" and any(line.startswith("mlflow ui") for line in lines)
    script = "set -euo pipefail\n" + "".join(f"echo {shlex.quote('+ ' + line)}\n{_for_the_test(line, tmp_path)}\n" for line in lines)
    (tmp_path / "page.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLEET_", "VIRTUAL_ENV"))}
    env["GPUFLEET_HOME"] = str(tmp_path / "home")  # a new user's state, in the default MLflow store
    done = subprocess.run(["bash", str(tmp_path / "page.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    home = tmp_path / "home"
    assert "run folder: " + str(home / "runs") in out and f"mlflow ui --backend-store-uri sqlite:///{home}/mlflow.db\n" in out
    assert "[node 0] [rank 1] rank 1 of 2 done" in out  # run --watch, then logs --follow
    assert "SUCCESS" in out and "CANCELED" in out
    assert "mlflow ui answered" in out


def test_the_python_blocks_run_as_notebook_cells() -> None:
    cells = _blocks("python")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src.strip()) for src in cells]
    NotebookClient(nb, kernel_name="python3", timeout=120, allow_errors=True,
                   resources={"metadata": {"path": str(REPO)}}).execute()  # fmt: skip
    first = "".join(o["data"].get("text/plain", "") for o in nb.cells[0].outputs if o["output_type"] == "execute_result")
    assert first == "[{'rank': 0, 'sum': 30.0}, {'rank': 1, 'sum': 30.0}]", nb.cells[0].outputs
    errors = [o for o in nb.cells[1].outputs if o["output_type"] == "error"]
    assert errors and errors[0]["ename"] == "ValueError", nb.cells[1].outputs
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0]["traceback"]))
    assert 'File "Cell In[2]", line 4, in broken\n    raise ValueError(f"rank {rank} found no data")' in text, text


def test_the_cpu_workload_in_workloads_md_is_the_example_file() -> None:
    import yaml

    text = (REPO / "docs" / "workloads.md").read_text()
    section = text.split("## A workload that runs on any CPU machine", 1)[1].split("\n## ", 1)[0]
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))  # type: ignore[union-attr]
    assert shown == yaml.safe_load((REPO / "examples" / "cpu-workload" / "workload.yaml").read_text())
