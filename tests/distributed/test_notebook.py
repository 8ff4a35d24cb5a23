"""The decorator in a real Jupyter kernel, executed headless by nbclient."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    # torch (and with it the CPU runtime) is imported in the kernel before any launch
    "import os, torch\nfrom gpufleet import distributed, runtime\nx = torch.ones(2)\nprint('KERNEL', os.getpid())\n"
    "MARKS = os.environ['GPUFLEET_TEST_MARKS']\nopen(os.path.join(MARKS, 'kernel'), 'w').write(str(os.getpid()))",
    # a function defined in a cell, using a class and a constant defined in the notebook
    """
OFFSET = 100

class Scaler:
    def __init__(self, k):
        self.k = k

@distributed(gpus=2, gpu_type="cpu", tracking=False)
def train(n, scaler):
    import torch, torch.distributed as dist
    runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    print("training on rank", runtime.get_global_rank())
    return runtime.get_global_rank() * scaler.k * n + t.item() + OFFSET
""",
    "print('RUN1', train.distributed(2, Scaler(10)))",
    "print('RUN2', train.distributed(3, Scaler(10)))",  # the same cell run twice
    """
class BadBatch(Exception):
    pass

@distributed(gpus=2, gpu_type="cpu", tracking=False)
def broken():
    if runtime.get_global_rank() == 1:
        raise BadBatch("batch 3 has no labels")
    return 0

try:
    broken.distributed()
except BadBatch as e:
    print('CAUGHT', type(e).__name__, e)
""",
    "broken.distributed()",  # uncaught: the cell output shows the exception type
    """
@distributed(gpus=2, gpu_type="cpu", tracking=False)
def hang():
    import time
    print("hanging", flush=True)
    open(os.path.join(MARKS, f"hanging-{runtime.get_global_rank()}"), "w").close()
    time.sleep(600)

hang.distributed()
""",
    """
import time
from tests.proc import processes_with_env
import gpufleet
gpufleet.shutdown_workers()  # the warm ranks that train's calls left for the next call
deadline = time.monotonic() + 60  # stopped ranks may take a moment to be gone on a loaded machine
while processes_with_env('GPUFLEET_PARENT_PID', str(os.getpid())) and time.monotonic() < deadline:
    time.sleep(0.2)
print('LEFT', len(processes_with_env('GPUFLEET_PARENT_PID', str(os.getpid()))))
""",
]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _interrupt_when_hanging(marks: Path, within_s: float = 300.0) -> None:
    """Interrupt the kernel once, as Jupyter's interrupt button does, when both ranks of the hang cell hang.

    Jupyter sends SIGINT to the kernel's process group; the ranks run in sessions of their own.
    """
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all((marks / f"hanging-{rank}").exists() for rank in (0, 1)) and (marks / "kernel").exists():
            pid = int((marks / "kernel").read_text())
            group = os.getpgid(pid)
            if group == os.getpgrp():  # not a group of its own: the kernel alone
                os.kill(pid, signal.SIGINT)
            else:
                os.killpg(group, signal.SIGINT)
            return
        time.sleep(0.2)


@pytest.mark.slow
def test_decorator_in_a_real_notebook_kernel(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    hang_index = 6
    marks = tmp_path / "marks"
    marks.mkdir()
    env_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    client = NotebookClient(
        nb,
        kernel_name="python3",
        allow_errors=True,
        timeout=300,  # each cell ends on its own (the hang cell by the interrupt), however loaded the machine
        iopub_timeout=60,  # a cell's last outputs may come late on a loaded machine; returns once they are in
        resources={"metadata": {"path": env_root}},
    )
    interrupter = threading.Thread(target=_interrupt_when_hanging, args=(marks,), daemon=True)
    interrupter.start()
    with _env(GPUFLEET_TEST_MARKS=str(marks)):  # the kernel inherits it
        client.execute()
    interrupter.join(5)
    outputs = [_text(c) for c in nb.cells]
    assert "RUN1 [103.0, 123.0]" in outputs[2]
    assert "RUN2 [103.0, 133.0]" in outputs[3]
    assert "[rank 0] training on rank 0" in outputs[2]  # live rank-0 logs reach the cell
    assert "CAUGHT BadBatch batch 3 has no labels" in outputs[4]
    errors = [o for o in nb.cells[5].outputs if o.get("output_type") == "error"]
    assert errors and errors[0]["ename"] == "BadBatch"
    hang_errors = [o for o in nb.cells[hang_index].outputs if o.get("output_type") == "error"]
    assert hang_errors and hang_errors[0]["ename"] == "KeyboardInterrupt"
    assert "LEFT 0" in outputs[7]
