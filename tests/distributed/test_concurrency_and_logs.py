"""Concurrent calls, live log streaming and the submit handle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from gpufleet import distributed, runtime


def _port_and_dir():
    import torch
    import torch.distributed as dist

    runtime.setup()
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.environ["MASTER_PORT"], os.environ["GPUFLEET_RUN_DIR"], t.item()


def test_concurrent_calls_from_threads_use_their_own_ports_and_run_dirs():
    fn = distributed(gpus=2, gpu_type="cpu")(_port_and_dir)
    results: dict[int, list] = {}

    def call(i: int) -> None:
        results[i] = fn.distributed()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2]
    ports = {r[0][0] for r in results.values()}
    dirs = {r[0][1] for r in results.values()}
    assert len(ports) == 3 and len(dirs) == 3
    assert all(r[0][2] == 2.0 and r[1][2] == 2.0 for r in results.values())


SCRIPT = """
import os, sys
from gpufleet import distributed, runtime
def f():
    import torch, torch.distributed as dist
    runtime.setup()
    t = torch.ones(1); dist.all_reduce(t)
    return os.environ["MASTER_PORT"] + " " + os.environ["GPUFLEET_RUN_DIR"] + " " + str(t.item())
print("OUT", distributed(gpus=2, gpu_type="cpu")(f).distributed()[0])
"""


def test_concurrent_calls_from_separate_processes_do_not_collide(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "GPUFLEET_TRACKING": "0"}
    procs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    lines = [[ln for ln in o.splitlines() if ln.startswith("OUT ")][0].split() for o, _ in outs]
    assert all(ln[3] == "2.0" for ln in lines)
    assert len({ln[1] for ln in lines}) == 3 and len({ln[2] for ln in lines}) == 3


def _chatty():
    r = runtime.get_global_rank()
    print(f"stdout line from rank {r}")
    print(f"stderr line from rank {r}", file=sys.stderr)
    return r


def test_default_streaming_shows_rank_0_in_full_and_every_rank_stderr(capfd):
    distributed(gpus=2, gpu_type="cpu")(_chatty).distributed()
    out, err = capfd.readouterr()
    assert "[rank 0] stdout line from rank 0" in out
    assert "stdout line from rank 1" not in out + err
    assert "[rank 0] stderr line from rank 0" in err
    assert "[rank 1] stderr line from rank 1" in err


def test_streaming_is_configurable(capfd):
    distributed(gpus=2, gpu_type="cpu", log_ranks="all")(_chatty).distributed()
    out, _ = capfd.readouterr()
    assert "[rank 1] stdout line from rank 1" in out
    distributed(gpus=2, gpu_type="cpu", stream_logs=False)(_chatty).distributed()
    out, err = capfd.readouterr()
    assert "line from rank" not in out + err


def test_submit_handle_reports_status_logs_and_result():
    handle = distributed(gpus=2, gpu_type="cpu")(_chatty).submit()
    assert handle.status in ("RUNNING", "SUCCESS")
    assert handle.result(timeout=120) == [0, 1]
    assert handle.status == "SUCCESS" and handle.done()
    log1 = handle.logs(1)
    assert "stdout line from rank 1" in log1 and "stderr line from rank 1" in log1
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        handle.logs(5)


def test_with_overrides_returns_a_copy_with_new_settings():
    base = distributed(gpus=2, gpu_type="cpu")(_chatty)
    three = base.with_overrides(gpus=3)
    assert base.options.gpus == 2 and three.options.gpus == 3
    assert three.func is base.func
    assert three.distributed() == [0, 1, 2]
