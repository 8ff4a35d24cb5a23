"""A rank's traceback shows the user's file and source lines for code sent by value, gpufleet's frames as one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from gpufleet.launch import tracebacks
from gpufleet.launch.spec import Payload

REPO = Path(__file__).resolve().parents[2]

SCRIPT = '''
from gpufleet import distributed


def helper(batch):
    labels = batch.get("labels")
    raise ValueError(f"batch has no labels: {labels}")


@distributed(gpus=2, gpu_type="cpu", tracking=False)
def train(batch):
    return helper(batch)


if __name__ == "__main__":
    train.distributed({"x": 1})
'''


def test_a_main_script_rank_traceback_has_the_script_path_and_source_lines(tmp_path: Path) -> None:
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "GPUFLEET_TRACKING": "0"},
    )  # fmt: skip
    err = done.stderr
    assert done.returncode == 1, err
    remote = err.split("The above exception was the direct cause")[0]
    assert f'File "{script}", line 12, in train\n    return helper(batch)' in remote, err
    assert f'File "{script}", line 7, in helper\n    raise ValueError(f"batch has no labels: {{labels}}")' in remote, err
    assert "<dynamic-code>" not in err
    # the worker's own frame is one line; the caller's side has one gpufleet frame
    assert "[gpufleet, 1 frame: launch/worker.py line" in remote and "worker.py\", line" not in err, err
    local = err.split("The above exception was the direct cause")[1]
    assert local.count('File "') == 2 and "in distributed" in local, local  # the script's line, then api.py
    assert "ValueError: batch has no labels: None" in local


WARM_SCRIPT = """
from gpufleet import distributed


@distributed(gpus=1, gpu_type="cpu", tracking=False, keep_warm=True)
def step(n):
    if n > 1:
        raise RuntimeError(f"step {n} went wrong")
    return n


if __name__ == "__main__":
    print(step.distributed(1))
    step.distributed(2)
"""


def test_a_warm_rank_traceback_has_the_source_lines_too(tmp_path: Path) -> None:
    script = tmp_path / "warm_steps.py"
    script.write_text(WARM_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "GPUFLEET_TRACKING": "0"},
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout.startswith("[1]"), done
    assert f'File "{script}", line 8, in step\n    raise RuntimeError(f"step {{n}} went wrong")' in done.stderr, done.stderr


NOTEBOOK_CELLS = [
    "from gpufleet import distributed\nimport traceback",
    '''
@distributed(gpus=1, gpu_type="cpu", tracking=False)
def evaluate(scores):
    total = sum(scores)
    return total / len([s for s in scores if s > 1])
''',
    '''
try:
    evaluate.distributed([0.5, 0.25])
except ZeroDivisionError as e:
    print("".join(traceback.format_exception(e)))
''',
]


def test_a_notebook_cell_rank_traceback_has_the_cell_and_its_source_line(tmp_path: Path, monkeypatch) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src.strip()) for src in NOTEBOOK_CELLS]
    monkeypatch.setenv("GPUFLEET_TRACKING", os.environ.get("GPUFLEET_TRACKING", "0"))  # the kernel's, not later tests'
    client = NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(REPO)}})
    client.execute()
    out = "".join(o.get("text", "") for o in nb.cells[2].outputs if o.get("output_type") == "stream")
    assert 'File "Cell In[2]", line 4, in evaluate\n    return total / len([s for s in scores if s > 1])' in out, out
    assert "ZeroDivisionError: float division by zero" in out and "<dynamic-code>" not in out, out
    assert "[gpufleet, 1 frame: launch/worker.py line" in out, out


def _raise_inside(depth: int) -> None:
    if depth == 0:
        raise KeyError("deep")
    _raise_inside(depth - 1)


def test_runs_of_gpufleet_frames_are_one_line_and_the_raising_frame_stays_whole(monkeypatch) -> None:
    here = str(Path(__file__).resolve())
    # pretend this test file is part of gpufleet: every frame of it is then "gpufleet's own"
    monkeypatch.setattr(tracebacks, "_is_gpufleet", lambda filename: os.path.abspath(filename) == here)
    try:
        _raise_inside(3)
    except KeyError as e:
        error = e
    text = tracebacks.format_exception(error)
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith("  [gpufleet, 4 frames: ") and "_raise_inside" in lines[1], text
    assert lines[2].startswith(f'  File "{here}"') and lines[3].strip() == 'raise KeyError("deep")', text
    monkeypatch.setenv(tracebacks.FULL_TRACEBACK_ENV, "1")
    full = tracebacks.format_exception(error)
    assert full == "".join(traceback.format_exception(error)) and "[gpufleet" not in full


def test_sources_are_shipped_in_the_payload_and_registered_for_tracebacks(tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    source = textwrap.dedent('''
        def f(x):
            y = x * 2
            raise RuntimeError(y)
    ''')
    exec(compile(source, "<my-snippet>", "exec"), namespace)
    import linecache

    linecache.cache["<my-snippet>"] = (len(source), None, source.splitlines(True), "<my-snippet>")
    call, sources = tracebacks.dumps_call((namespace["f"], (1,), {}))
    assert sources == {"<my-snippet>": source}
    Payload(call, ("a",), True, sources).write(tmp_path / "payload")
    back = Payload.read(tmp_path / "payload")
    assert back.sources == sources and back.sys_path == ("a",) and back.call == call
    del linecache.cache["<my-snippet>"]
    tracebacks.register_sources(back.sources)
    import cloudpickle

    func, args, _ = cloudpickle.loads(back.call)
    try:
        func(*args)
    except RuntimeError as e:
        error = e
    text = tracebacks.format_exception(error)
    assert 'File "<my-snippet>", line 4, in f\n    raise RuntimeError(y)' in text, text
    # a payload file written without sources (by an older gpufleet) still reads
    import pickle

    with open(tmp_path / "old", "wb") as f:
        pickle.dump({"sys_path": [], "fast_exit": True, "call_size": len(call)}, f)
        f.write(call)
    assert Payload.read(tmp_path / "old") == Payload(call)
