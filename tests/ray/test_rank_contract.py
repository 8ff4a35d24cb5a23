"""The same rank contract from every worker group: local processes, Ray actors, a workload node.

One rank-environment check and one failure, run against the three ways gpufleet starts ranks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gpufleet import distributed, errors

pytestmark = [pytest.mark.ray, pytest.mark.slow]

#: What every process of a rank sees, whatever started it.
NODE_CONTRACT = (
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NUM_NODES", "MASTER_ADDR", "MASTER_PORT",
    "PYTHONUNBUFFERED", "GPUFLEET_RUN_ID", "GPUFLEET_ATTEMPT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
)
RANK_CONTRACT = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _environment() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in NODE_CONTRACT + RANK_CONTRACT}


def _rank_one_exits() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)  # dies without returning: no outcome, exit code 3
    time.sleep(60)


def check_contract(envs: list[dict[str, str | None]], num_nodes: int) -> None:
    """Two ranks with the torchrun contract, CPU only, one run id, a rendezvous they share."""
    assert [e["RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        missing = [k for k in NODE_CONTRACT + RANK_CONTRACT if not e.get(k) and k != "CUDA_VISIBLE_DEVICES"]
        assert not missing, f"rank {e['RANK']} lacks {missing}"
        assert e["WORLD_SIZE"] == "2" and e["NUM_NODES"] == str(num_nodes)
        assert int(e["LOCAL_WORLD_SIZE"]) * num_nodes == 2
        assert e["CUDA_VISIBLE_DEVICES"] == ""
        assert e["PYTHONUNBUFFERED"] == "1" and int(e["OMP_NUM_THREADS"]) >= 1
        assert e["GPUFLEET_ATTEMPT"].isdigit()
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert len({e["GPUFLEET_RUN_ID"] for e in envs}) == 1


def test_local_group(tmp_path):
    f = distributed(_environment, gpus=2, gpu_type="cpu", runs_dir=str(tmp_path), tracking=False)
    check_contract(f.distributed(), num_nodes=1)
    with pytest.raises(errors.WorkerExitError, match="rank 1 of 2 failed first: process exited with code 3"):
        distributed(
            _rank_one_exits, gpus=2, gpu_type="cpu", runs_dir=str(tmp_path), tracking=False, grace_period_s=1.0
        ).distributed()


def test_ray_group(two_nodes, tmp_path):
    f = distributed(
        _environment, gpus=2, gpu_type="cpu", remote=two_nodes.address, runs_dir=str(tmp_path), tracking=False
    )
    check_contract(f.distributed(), num_nodes=2)
    g = distributed(
        _rank_one_exits, gpus=2, gpu_type="cpu", remote=two_nodes.address, runs_dir=str(tmp_path),
        tracking=False, grace_period_s=1.0,
    )
    with pytest.raises(errors.WorkerExitError, match="rank 1 of 2 failed first: process exited with code 3"):
        g.distributed()


DUMP = """
import json, os, sys
keys = sys.argv[1].split(",")
out = os.path.join(os.environ["GPUFLEET_RUN_DIR"], "env-" + os.environ["RANK"] + ".json")
json.dump({k: os.environ.get(k) for k in keys}, open(out, "w"))
if os.environ.get("EXIT_RANK") == os.environ["RANK"]:
    sys.exit(3)
"""


def test_workload_node_group(tmp_path, monkeypatch, capsys):
    from gpufleet.cli import main
    from gpufleet.runs.store import RunStore
    from tests.workload.helpers import write_workload

    home = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    code = tmp_path / "code"
    code.mkdir()
    (code / "dump.py").write_text(DUMP)
    keys = ",".join(NODE_CONTRACT + RANK_CONTRACT)
    # torchrun sets RANK and LOCAL_RANK from the node contract; gpufleet sets the rest
    command = (
        "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
        f"--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT dump.py {keys}\n"
    )
    for name, env in (("ok", {}), ("fail", {"EXIT_RANK": "1"})):
        wl = write_workload(
            code, name=f"{name}.yaml", compute={"accelerator_type": "CPU_2", "num_accelerators": 2},
            code_source={"root_path": "."}, command=command, env_variables=env,
        )
        capsys.readouterr()
        rc = main(["run", "-f", str(wl), "--watch", "--no-tracking"])
        out = capsys.readouterr().out
        run = RunStore(str(home)).get(out.splitlines()[0])
        if name == "ok":
            assert rc == 0, out
            envs = [json.loads((Path(run.run_dir) / f"env-{r}.json").read_text()) for r in (0, 1)]
            # under torchrun, TORCHELASTIC_RUN_ID is torchrun's own; the rest must match the contract
            check_contract(envs, num_nodes=1)
        else:
            assert rc == 1 and run.state == "FAILED"
            # the rank's exit ends its torchrun, and the node's exit code names the failure
            assert "node 0 exited with code" in run.message


def _finalised_at_exit(folder: str) -> int:
    """Leaves an object whose finaliser marks that the interpreter tore its modules down."""
    import builtins

    class Finalised:
        def __init__(self, path: str) -> None:
            self.path, self.touch = path, open

        def __del__(self) -> None:
            self.touch(self.path, "w").close()

    builtins._gpufleet_test_finalised = Finalised(os.path.join(folder, f"finalised-{os.environ['RANK']}"))
    return 1


@pytest.mark.parametrize("fast_exit", [True, False])
def test_fast_exit_setting_reaches_ray_ranks(two_nodes, tmp_path, fast_exit):
    marks = tmp_path / "marks"
    marks.mkdir()
    f = distributed(
        _finalised_at_exit, gpus=2, gpu_type="cpu", remote=two_nodes.address, runs_dir=str(tmp_path),
        tracking=False, fast_exit=fast_exit,
    )
    assert f.distributed(str(marks)) == [1, 1]
    deadline = time.monotonic() + 60
    while not fast_exit and len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5 if not fast_exit else 3.0)
    # fast_exit=False: a normal interpreter shutdown finalises module globals; True skips it
    assert len(list(marks.iterdir())) == (0 if fast_exit else 2)


def _rank_1_sleeps_outside_the_collective() -> None:
    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    runtime.setup()
    t = torch.ones(4)
    dist.all_reduce(t)
    if runtime.get_global_rank() == 1:
        time.sleep(600)  # rank 1 never comes to collective #2
    dist.all_reduce(t)


def test_the_hang_watchdog_on_ray_names_the_missing_rank(two_nodes, tmp_path):
    f = distributed(
        _rank_1_sleeps_outside_the_collective, gpus=2, gpu_type="cpu", remote=two_nodes.address,
        runs_dir=str(tmp_path), tracking=False, hang_timeout=4.0, grace_period_s=1.0, timeout=120,
    )
    with pytest.raises(errors.DistributedHangError) as info:
        f.distributed()
    text = str(info.value)
    assert "rank 1 missing from all_reduce #2 [[4]], which rank 0 waits in" in text
    assert "time.sleep(600)" in text and info.value.rank == 1
