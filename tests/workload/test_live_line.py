"""``gpufleet logs RUN --follow`` on a terminal: a live line with the ranks' steps under the logs."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.live.test_terminal_line import _run_on_pty
from tests.workload.helpers import REPO, cli_process, wait_state, write_workload

TRAIN = textwrap.dedent(
    """
    import time
    from gpufleet import runtime
    from gpufleet.tracking import log_metrics

    runtime.setup()
    runtime.set_total_steps(40)
    for step in range(1, 41):
        time.sleep(0.25)
        runtime.report_step(step)
        log_metrics({"loss": 1.0 / step}, step=step)
    print("trained", flush=True)
    """
)


@pytest.mark.slow
def test_logs_follow_shows_the_ranks_progress_on_a_terminal(tmp_path: Path, store: RunStore) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    write_workload(
        code, experiment_name="live", compute={"accelerator_type": "CPU_2", "num_accelerators": 2},
        code_source={"root_path": "."},
        command="torchrun --nnodes=1 --nproc_per_node=$LOCAL_WORLD_SIZE --master_addr=$MASTER_ADDR "
                "--master_port=$MASTER_PORT train.py\n",
    )  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    started = cli_process("run", "-f", str(code / "workload.yaml"), "--no-tracking", "-o", "json", env=env)
    assert started.returncode == 0, started.stderr
    run_id = json.loads(started.stdout)["id"]
    follow = tmp_path / "follow.py"
    follow.write_text(f"import sys\nfrom gpufleet.cli import main\nsys.exit(main(['logs', {run_id!r}, '--follow']))\n")
    rc, out = _run_on_pty(follow, "", {**os.environ, **env, "TERM": "xterm-256color", "COLUMNS": "200"})  # wide: the line must not wrap
    text = out.decode("utf-8", "replace")
    assert rc == 0, text
    run = wait_state(store, run_id)
    assert run.state == "SUCCESS", (run.message, text[-3000:])
    assert "trained" in text  # the logs
    assert "2 ranks: 2 running" in text and "steps/s" in text and "/40" in text, text[-3000:]
    assert f"run {run_id} SUCCESS" in text, text[-3000:]
