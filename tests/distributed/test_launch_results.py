"""Results, runtime values and argument passing through the local launcher (CPU, gloo)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpufleet import distributed, runtime


def _ranks_report(tag, scale=1.0, *, offset=0):
    import torch
    import torch.distributed as dist

    dev = runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    return {
        "tag": tag,
        "scale": scale,
        "offset": offset,
        "rank": runtime.get_global_rank(),
        "local_rank": runtime.get_local_rank(),
        "world": runtime.get_world_size(),
        "local_world": runtime.get_local_world_size(),
        "node": runtime.get_node_rank(),
        "main": runtime.is_main_process(),
        "sum": t.item(),
        "device": str(dev),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
    }


@pytest.mark.parametrize("num_workers", [2, 3])
def test_results_in_rank_order_with_runtime_values(num_workers):
    fn = distributed(gpus=num_workers, gpu_type="cpu")(_ranks_report)
    results = fn.distributed("x", 2.0, offset=5)
    assert [r["rank"] for r in results] == list(range(num_workers))
    expected_sum = num_workers * (num_workers + 1) / 2
    for rank, r in enumerate(results):
        assert r["tag"] == "x" and r["scale"] == 2.0 and r["offset"] == 5
        assert r["world"] == r["local_world"] == num_workers
        assert r["local_rank"] == rank and r["node"] == 0
        assert r["main"] is (rank == 0)
        assert r["sum"] == expected_sum  # a real all-reduce across all ranks
        assert r["device"] == "cpu"
        assert r["env"]["RANK"] == str(rank) and r["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert len({r["env"]["MASTER_PORT"] for r in results}) == 1


def test_defaults_apply_when_arguments_are_omitted():
    fn = distributed(gpus=2, gpu_type="cpu")(_ranks_report)
    results = fn.distributed("only-tag")
    assert all(r["scale"] == 1.0 and r["offset"] == 0 for r in results)


def test_runtime_outside_a_run_returns_single_process_values(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert runtime.get_global_rank() == 0 and runtime.get_world_size() == 1
    assert runtime.get_local_rank() == 0 and runtime.get_local_world_size() == 1
    assert runtime.is_main_process() and not runtime.is_distributed_env()


def _sum_array(arr):
    return float(arr.sum()), arr.shape, arr.dtype.str


def test_a_100_mb_numpy_argument_reaches_every_rank():
    arr = np.arange(100 * 1024 * 1024 // 8, dtype=np.float64)  # 100 MB
    out = distributed(gpus=2, gpu_type="cpu")(_sum_array).distributed(arr)
    assert out == [(float(arr.sum()), arr.shape, arr.dtype.str)] * 2


def test_run_directory_is_private_and_keeps_every_rank_log(tmp_path):
    def speak():
        print(f"hello from {runtime.get_global_rank()}")
        return os.environ["GPUFLEET_RUN_DIR"]

    out = distributed(gpus=2, gpu_type="cpu", runs_dir=str(tmp_path))(speak).distributed()
    run_dir = out[0]
    assert out[1] == run_dir and run_dir.startswith(str(tmp_path))
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    for rank in range(2):
        assert f"hello from {rank}" in open(os.path.join(run_dir, f"rank-{rank}.log")).read()
    # the payload and outcome files are removed once the results are read
    assert not [n for n in os.listdir(run_dir) if n.endswith(".pkl")]


MAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from gpufleet import distributed, runtime

    SCALE = 3

    class Point:
        def __init__(self, x):
            self.x = x
        def scaled(self):
            return Point(self.x * SCALE)

    def make_adder(n):
        def add(x):
            return x + n
        return add

    adder = make_adder(10)
    square = lambda v: v * v

    @distributed(gpus=2, gpu_type="cpu")
    def work(p, fn):
        r = runtime.get_global_rank()
        return {"rank": r, "point": p.scaled().x, "closure": adder(r), "lambda": fn(r + 2),
                "cls": type(p.scaled()).__name__}

    if __name__ == "__main__":
        out = work.distributed(Point(2), square)
        # a class defined in __main__ comes back as the caller's own class
        back = distributed(gpus=2, gpu_type="cpu")(lambda: Point(7)).distributed()
        assert all(type(b) is Point and b.x == 7 for b in back), back
        print("RESULT=" + json.dumps(out))
    """
)


def test_closures_lambdas_and_classes_defined_in_main_travel_by_value(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")][0]
    import json

    out = json.loads(line[len("RESULT="):])
    assert out == [
        {"rank": 0, "point": 6, "closure": 10, "lambda": 4, "cls": "Point"},
        {"rank": 1, "point": 6, "closure": 11, "lambda": 9, "cls": "Point"},
    ]
