"""The terminal's live status line: drawn under the logs on a pseudo-terminal, absent (no ANSI) when piped."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, time
from gpufleet import distributed, runtime
from gpufleet.tracking import log_metrics

@distributed(gpus=2, gpu_type="cpu", tracking=False, live=None if sys.argv[1] == "on" else False)
def train(steps):
    import torch.distributed as dist
    runtime.setup()
    dist.barrier()  # both ranks in the loop together, however long either took to start
    runtime.set_total_steps(steps)
    for step in range(1, steps + 1):
        time.sleep(0.1)
        runtime.report_step(step)
        log_metrics({"loss": 1.0 / step}, step=step)
    dist.barrier()
    print("LOOP DONE", flush=True)
    return step

print("RESULT", train.distributed(30))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_LIVE"}
    return {**env, "PYTHONPATH": str(REPO / "src"), "TERM": "xterm-256color", "COLUMNS": "140"}


def _run_on_pty(script: Path, arg: str, env: dict[str, str]) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen([sys.executable, str(script), arg], stdin=slave, stdout=slave, stderr=slave,
                            env=env, close_fds=True)  # fmt: skip
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(30), bytes(out)


@pytest.mark.slow
def test_status_line_on_a_terminal_and_plain_logs_in_a_pipe(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = _env()

    code, out = _run_on_pty(script, "on", env)
    text = out.decode("utf-8", "replace")
    assert code == 0, text
    assert "\x1b[" in text  # drawn and redrawn in place
    assert "2 ranks: 2 running" in text and "steps/s" in text and "/30" in text, text[-3000:]
    assert "loss 0." in text  # rank 0's log_metrics
    assert "[rank 0] LOOP DONE" in text and "RESULT [30, 30]" in text  # the logs still print, above the line
    assert "SUCCESS in" in text and "step 30" in text  # the summary line that replaces it

    piped = subprocess.run([sys.executable, str(script), "on"], capture_output=True, env=env, timeout=180)
    assert piped.returncode == 0, piped.stderr.decode()
    both = piped.stdout.decode() + piped.stderr.decode()
    assert "\x1b" not in both and "steps/s" not in both  # no line, no escape codes in a pipe
    assert "[rank 0] LOOP DONE" in both and "RESULT [30, 30]" in both


@pytest.mark.slow
def test_switched_off_on_a_terminal(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for arg, env in (("off", _env()), ("on", {**_env(), "GPUFLEET_LIVE": "0"})):
        code, out = _run_on_pty(script, arg, env)
        text = out.decode("utf-8", "replace")
        assert code == 0, text
        assert "steps/s" not in text and "\x1b[" not in text, (arg, text)
        assert "RESULT [30, 30]" in text
