"""docs/getting-started.md and the README, run as a newcomer would: their commands as written, in order.

Each page's bash lines run in one shell that has activated nothing: PATH is /usr/bin:/bin and HOME
a new folder (so the default GPUFLEET_HOME, ~/.gpufleet, is empty); a command not found or failing
fails the test. ``.venv`` is the one the test runs in, ready, so ``scripts/demo.sh`` does not
install again, as on a user's second run. The page's python blocks run as notebook cells.

Commands run in a form fit for a test, as the pages' own notes allow: the demo trains 3 epochs
(``--epochs 3``), ``pip install`` installs nothing new (``--no-index``: the packages are already
in the test environment), and ``mlflow ui`` is started on a free port with one worker, asked for its
page once, and stopped. Of the README, ``scripts/test.sh`` is what ``.ci/run`` runs (CI is its test), and the
lines getting-started.md has word for word (but ``source`` lines) run in the page's test.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
README = REPO / "README.md"


def _blocks(language: str, page: Path = PAGE) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), re.M | re.S)


def _bash_lines(page: Path) -> list[str]:
    return [line for block in _blocks("bash", page) for line in block.splitlines() if line.strip()]


def _command(line: str) -> str:
    """The line without its trailing comment (``code   # what it does``)."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def _fresh_env(tmp: Path) -> dict[str, str]:
    """A login's bare environment: nothing activated, a new HOME.

    PYTHONPATH is kept where it is set: it names the checkout's src when .venv is shared by checkouts.
    """
    home = tmp / "user"
    home.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "TMPDIR": str(tmp)}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _for_the_test(line: str, tmp: Path) -> str:
    command = _command(line)
    if command == "scripts/demo.sh":
        return command + " --epochs 3"
    if command.startswith("pip install"):
        return command + " --no-index --quiet"
    if command.startswith("mlflow ui"):
        port = _free_port()
        probe = (
            "import sys, time, urllib.request\n"
            "deadline = time.monotonic() + 300\n"  # it takes a minute to start on a busy machine
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            f"        urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2); print('mlflow ui answered'); sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.2)\n"
            "sys.exit('mlflow ui did not answer')\n"
        )
        # its own process group (set -m), so that stopping it stops its server workers too
        log = tmp / "mlflow-ui.log"
        # one worker: on a busy machine uvicorn's supervisor restarts workers that boot slower than 5 s
        return (f"set -m; {command} --port {port} --workers 1 > {log} 2>&1 & ui=$!; set +m\n"
                f"python -c \"{probe}\" || {{ cat {log}; kill -- -$ui; exit 1; }}\n"
                "kill -- -$ui; wait $ui || true")  # fmt: skip
    return line


def _run_lines(lines: list[str], tmp: Path, timeout: float) -> str:
    """The lines in order in one fresh shell (each echoed first); their output. Fails on any failing line."""
    script = "set -euo pipefail\n" + "".join(f"echo {shlex.quote('+ ' + line)}\n{_for_the_test(line, tmp)}\n" for line in lines)
    (tmp / "page.sh").write_text(script)
    done = subprocess.run(["bash", str(tmp / "page.sh")], cwd=REPO, env=_fresh_env(tmp), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    out = done.stdout + done.stderr
    (tmp / "page.out").write_text(out)
    assert "command not found" not in out and done.returncode == 0, out[-6000:]
    return out


@pytest.mark.timeout(1800)  # about two minutes on an idle 2-core machine; 13 on one kept busy by many
def test_every_bash_command_of_the_page_runs_in_order(tmp_path: Path) -> None:
    lines = _bash_lines(PAGE)
    assert lines[0] == "scripts/demo.sh" and any(line.startswith("mlflow ui") for line in lines)
    out = _run_lines(lines, tmp_path, timeout=1700)
    home = tmp_path / "user" / ".gpufleet"  # a new user's default GPUFLEET_HOME
    assert re.search(r"^==> torch \S+: (CPU build|CUDA \S+ build), ", out, re.M), out[:3000]  # which torch .venv has
    assert "run folder: " + str(home / "runs") in out
    assert "[node 0] [rank 1] rank 1 of 2 done" in out  # run --watch, then logs --follow
    assert "SUCCESS" in out and "CANCELED" in out
    assert out.count("mlflow ui answered") == 1

    # What the demo printed works as printed in another fresh shell, elsewhere: the line that puts
    # .venv's commands on PATH, and the `mlflow ui` line (the page's own `mlflow ui` served this
    # store above; here it is asked for its help, which needs the program found and the line parsed).
    activate = re.search(r"To use them in any shell:\n  (source \S+)\n", out).group(1)  # type: ignore[union-attr]
    run_id = re.search(r"^run id: +(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    mlflow_line = re.search(r"to look at it:\n  (.+)\n", out).group(1)  # type: ignore[union-attr]
    assert mlflow_line == f"{REPO / '.venv' / 'bin' / 'mlflow'} ui --backend-store-uri sqlite:///{home}/mlflow.db"
    printed = f"{activate} && gpufleet list --all-status --kind call && deactivate && {mlflow_line} --help"
    again = subprocess.run(["bash", "-c", printed], cwd=tmp_path, env=_fresh_env(tmp_path), capture_output=True,
                           text=True, timeout=180)  # fmt: skip
    assert again.returncode == 0 and run_id in again.stdout and "--backend-store-uri" in again.stdout, (
        again.stdout + again.stderr
    )


def test_the_readme_commands_run_in_order(tmp_path: Path) -> None:
    lines = _bash_lines(README)
    first = [_command(line) for line in lines[:3]]
    assert first == ["scripts/demo.sh", "scripts/test.sh", "source .venv/bin/activate"], first
    assert "exec scripts/test.sh " in (REPO / ".ci" / "run").read_text()  # CI runs the README's test command
    on_the_page = {_command(line) for line in _bash_lines(PAGE)}
    assert "scripts/demo.sh" in on_the_page
    # a `source` line changes the shell the later lines run in: it runs here too
    to_run = [line for line in lines if _command(line) != "scripts/test.sh"
              and (_command(line).startswith("source ") or _command(line) not in on_the_page)]  # fmt: skip
    assert to_run[0] == lines[2] and any(_command(line).startswith("gpufleet advise") for line in to_run), to_run
    out = _run_lines(to_run, tmp_path, timeout=180)
    assert "+ gpufleet advise" in out and "+ gpufleet validate" in out, out[-3000:]


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
