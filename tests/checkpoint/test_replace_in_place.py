"""A rank whose process dies is replaced in place (recovery="replace"): the other ranks keep their
processes, the run goes on from the last step every rank completed, nothing is lost or redone twice."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpufleet import distributed, run_handle
from gpufleet.runs.store import RunStore
from tests.checkpoint.helpers import torch_equal
from tests.checkpoint.training import read_records, train_replaceable

TOTAL = 40


def _run(tmp: Path, data_dir: Path, name: str, workers: int = 2, train_args: dict[str, Any] | None = None,
         **options: Any) -> tuple[list[dict], list[list[dict]]]:  # fmt: skip
    """One run of :func:`train_replaceable` on ``workers`` CPU ranks: each rank's result and step records."""
    records = tmp / name
    records.mkdir()
    fn = distributed(train_replaceable, gpus=workers, gpu_type="cpu", timeout=240, tracking=False, **options)
    with pytest.warns(RuntimeWarning, match="4 CPU workers") if workers > 2 else contextlib.nullcontext():
        out = fn.distributed(str(tmp / f"ckpt-{name}"), str(data_dir), TOTAL, str(records), **(train_args or {}))
    return out, [read_records(str(records), rank) for rank in range(workers)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[list[dict], list[list[dict]]]:
    return _run(tmp_path_factory.mktemp("reference"), data_dir, "reference")


def _assert_same(reference: tuple[list[dict], list[list[dict]]], out: list[dict], records: list[list[dict]]) -> None:
    ref_out, ref_records = reference
    for rank in range(2):
        assert [r["step"] for r in records[rank]] == list(range(1, TOTAL + 1)), f"rank {rank}: steps run"
        assert [r["ids"] for r in records[rank]] == [r["ids"] for r in ref_records[rank]], f"rank {rank}: data"
        assert [r["loss"] for r in records[rank]] == [r["loss"] for r in ref_records[rank]], f"rank {rank}: losses"
        for name, value in ref_out[rank]["params"].items():
            assert torch_equal(out[rank]["params"][name], value), f"rank {rank}: {name} differs"


def _assert_ends_same(reference: tuple[list[dict], list[list[dict]]], out: list[dict], records: list[list[dict]]) -> None:
    """Each rank's steps in its final process repeat the reference's losses, and its parameters equal them."""
    ref_out, ref_records = reference
    for rank in range(len(out)):
        last = [r for r in records[rank] if r["pid"] == out[rank]["pid"]]
        assert [r["loss"] for r in last] == [r["loss"] for r in ref_records[rank]][-len(last):], f"rank {rank}: losses"
        for name, value in ref_out[rank]["params"].items():
            assert torch_equal(out[rank]["params"][name], value), f"rank {rank}: {name} differs"


@pytest.mark.parametrize("dead", [1, 0])
def test_a_killed_rank_is_replaced_in_place_and_the_run_ends_as_if_nothing_happened(
    tmp_path: Path, data_dir: Path, reference: tuple[list[dict], list[list[dict]]], dead: int,
    capfd: pytest.CaptureFixture[str],
) -> None:
    out, records = _run(tmp_path, data_dir, "replaced", recovery="replace", faults=[f"kill:rank={dead}:step=30"])
    assert [o["attempt"] for o in out] == ["1", "1"]  # one attempt: nothing restarted the group
    survivor = 1 - dead
    assert {r["pid"] for r in records[survivor]} == {out[survivor]["pid"]}  # the survivor never changed process
    before, after = [r["pid"] for r in records[dead] if r["step"] < 30], [r["pid"] for r in records[dead] if r["step"] >= 30]
    assert len(set(before)) == 1 and set(after) == {out[dead]["pid"]} and before[0] != out[dead]["pid"]
    _assert_same(reference, out, records)
    err = capfd.readouterr().err
    assert f"rank {dead} died (SIGKILL); replaced in place by a new process (pid {out[dead]['pid']})" in err
    assert (f"rank {dead} (SIGKILL) is back: every rank went on after step 29, " in err
            and f"s after the death; 0 steps trained again (pid {before[0]} -> {out[dead]['pid']})" in err)


def _gpufleet(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gpufleet.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_each_recovery_is_recorded_in_the_run_store_gpufleet_get_and_mlflow(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
    experiment = f"recovery-{uuid.uuid4().hex[:8]}"
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, recovery="replace",
                     experiment_name=experiment, faults=["kill:rank=1:step=30"])  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    out = handle.result(timeout=240)
    old_pid = read_records(str(records), 1)[0]["pid"]

    stored = json.loads(_gpufleet("get", handle.run_id, "-o", "json"))
    (attempt,) = stored["attempts"]
    (recovery,) = attempt["recoveries"]
    assert {k: recovery[k] for k in ("attempt", "number", "rank", "cause", "outcome", "resumed_step", "steps_lost",
                                     "old_pid", "new_pid", "warm", "generation", "reason")} == {  # fmt: skip
        "attempt": 1, "number": 1, "rank": 1, "cause": "SIGKILL", "outcome": "recovered", "resumed_step": 29,
        "steps_lost": 0, "old_pid": old_pid, "new_pid": out[1]["pid"], "warm": False, "generation": 1, "reason": None}
    assert 0 < recovery["seconds_lost"] < 120
    assert recovery["recovered_at"] == pytest.approx(recovery["died_at"] + recovery["seconds_lost"])
    assert [r.to_dict() for r in handle.recoveries] == [recovery]  # the caller's handle
    assert [r.to_dict() for r in run_handle(handle.run_id).recoveries] == [recovery]  # any process's, from the store
    text = _gpufleet("get", handle.run_id)
    assert "recovery 1 of attempt 1 at " in text and ": rank 1 (SIGKILL) is back: every rank went on after step 29" in text

    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(attempt["mlflow_run_id"])
    assert run.data.tags["gpufleet.recovery.1"].startswith("rank 1 (SIGKILL) is back: every rank went on after step 29")
    assert run.data.tags["gpufleet.recoveries"] == "1"
    seconds = client.get_metric_history(run.info.run_id, "gpufleet.recovery.seconds_lost")
    assert [(m.step, round(m.value, 3)) for m in seconds] == [(1, round(recovery["seconds_lost"], 3))]
    assert run.data.metrics["gpufleet.recovery.steps_lost"] == 0 and run.data.metrics["gpufleet.recovery.rank"] == 1


def test_a_rank_that_raises_is_not_replaced_and_the_run_fails_with_its_error(
    tmp_path: Path, data_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace")
    with pytest.raises(ValueError, match="a bug at step 30"):  # the rank's own error, its own type
        fn.distributed(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records), raise_at=30)
    err = capfd.readouterr().err
    assert "rank 1 failed (ValueError); not replaced in place: it raised ValueError" in err
    assert "replaced in place by a new process" not in err
    (run,) = RunStore().list(states=None, limit=1, filters={"kind": "call"})  # the newest call: this one
    assert run.state == "FAILED" and [(r["rank"], r["cause"], r["outcome"]) for r in run.attempts[0].recoveries] == [(1, "ValueError", "refused")]


def test_a_second_death_of_the_same_slot_falls_back_to_restarting_every_rank(
    tmp_path: Path, data_dir: Path, reference: tuple[list[dict], list[list[dict]]], capfd: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     max_retries=1, faults=["kill:rank=1:step=10", "kill:rank=1:step=20:incarnation=2"])  # fmt: skip
    out = fn.distributed(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    err = capfd.readouterr().err
    assert "rank 1 died (SIGKILL); replaced in place" in err  # the first death, at step 10
    assert "rank 1 failed (SIGKILL); not replaced in place: its slot already failed 1 time in this attempt" in err
    assert [o["attempt"] for o in out] == ["2", "2"]  # the retry restarted every rank (no checkpoint: from step 1)
    steps = [read_records(str(records), rank) for rank in range(2)]
    assert [r["step"] for r in steps[0] if r["pid"] == out[0]["pid"]] == list(range(1, TOTAL + 1))
    _assert_ends_same(reference, out, steps)


def test_no_process_for_the_slot_falls_back_to_restarting_every_rank_and_says_why(
    tmp_path: Path, data_dir: Path, reference: tuple[list[dict], list[list[dict]]], capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The system refuses the replacement's process (fork's EAGAIN at a process limit): the rank's
    slot cannot be filled, so the attempt ends and the retry restarts every rank."""
    from gpufleet.launch.engines.local.group import LocalWorkerGroup

    start_rank = LocalWorkerGroup._start_rank

    def no_process_for_a_replacement(self: LocalWorkerGroup, rank: int, extra: dict[str, str]) -> Any:
        if extra:  # a replacement (the first start of each rank has no extra variables)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return start_rank(self, rank, extra)

    monkeypatch.setattr(LocalWorkerGroup, "_start_rank", no_process_for_a_replacement)
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     max_retries=1, faults=["kill:rank=1:step=30"])  # fmt: skip
    out = fn.distributed(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    err = capfd.readouterr().err
    assert ("rank 1 failed (SIGKILL); not replaced in place: no process could take its place "
            "(BlockingIOError: [Errno 11] Resource temporarily unavailable)") in err  # fmt: skip
    assert "replaced in place by" not in err
    assert [o["attempt"] for o in out] == ["2", "2"]  # the retry restarted every rank
    second, first_run = RunStore().list(states=None, limit=2, filters={"kind": "call"})  # a call's run per attempt
    assert (second.state, first_run.state) == ("SUCCESS", "FAILED")
    (first,) = first_run.attempts
    assert [(r["rank"], r["outcome"]) for r in first.recoveries] == [(1, "refused")]
    assert "no process could take its place" in first.recoveries[0]["reason"]
    _assert_ends_same(reference, out, [read_records(str(records), rank) for rank in range(2)])


def test_a_cancel_while_the_replacement_starts_ends_the_run_and_leaves_nothing(tmp_path: Path, data_dir: Path) -> None:
    from gpufleet.errors import RunCanceledError

    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     faults=["kill:rank=1:step=10", "hang:rank=1:after=0:incarnation=2"])  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    log = Path(handle.run_dir) / "rank-1.log"
    deadline = time.monotonic() + 120
    while "injected fault: hang" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)  # the replacement is up and stuck; rank 0 waits for it to join
    assert "injected fault: hang" in log.read_text()
    handle.cancel(wait=30)
    assert handle.status == "CANCELED"
    with pytest.raises(RunCanceledError):
        handle.result(timeout=5)


def test_a_timeout_while_the_replacement_hangs_ends_the_run_timed_out_and_leaves_nothing(
    tmp_path: Path, data_dir: Path
) -> None:
    """The call's one timeout also covers its recoveries: a replacement stuck before it joins does
    not keep the run (its survivor waiting for it) past it."""
    from gpufleet.errors import DistributedTimeoutError

    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=45, tracking=False, recovery="replace",
                     faults=["kill:rank=1:step=10", "hang:rank=1:after=0:incarnation=2"])  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    with pytest.raises(DistributedTimeoutError, match="ran past its timeout of 45 s"):
        handle.result(timeout=120)
    assert handle.status == "TIMEDOUT"
    assert "injected fault: hang" in (Path(handle.run_dir) / "rank-1.log").read_text()  # it timed out in the recovery
    (recovery,) = handle.recoveries
    assert recovery.outcome == "failed" and "DistributedTimeoutError" in recovery.reason


def _run4(tmp: Path, data_dir: Path, name: str, save_every: int = 0, **options: Any) -> tuple[list[dict], list[list[dict]]]:
    """4 ranks of a model whose DDP buckets are two (1.4 MB of parameters: the first bucket 1 MB)."""
    return _run(tmp, data_dir, name, 4, {"hidden": 60_000, "save_every": save_every}, **options)


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[list[dict], list[list[dict]]]:
    return _run4(tmp_path_factory.mktemp("reference4"), data_dir, "reference")


def test_four_ranks_lose_rank_2_and_every_survivor_goes_on_in_its_own_process_bit_for_bit(
    tmp_path: Path, data_dir: Path, reference4: tuple[list[dict], list[list[dict]]]
) -> None:
    """Ranks not connected to the dead one learn of it too (their neighbours shut the old group's
    connections) and all three survivors join the replacement. With four ranks the order of the
    all-reduce's sums depends on DDP's buckets: the new wrappers take the run's, so the parameters
    equal the uninterrupted run's bit for bit."""
    out, records = _run4(tmp_path, data_dir, "killed", recovery="replace", faults=["kill:rank=2:step=30"])
    assert [o["attempt"] for o in out] == ["1"] * 4
    for rank in range(4):
        assert [r["step"] for r in records[rank]] == list(range(1, TOTAL + 1))  # every step once: none lost or redone
        pids = {r["pid"] for r in records[rank]}
        assert pids == {out[rank]["pid"]} if rank != 2 else len(pids) == 2
    _assert_ends_same(reference4, out, records)


def test_four_ranks_restarted_from_a_checkpoint_end_bit_for_bit_too(
    tmp_path: Path, data_dir: Path, reference4: tuple[list[dict], list[list[dict]]]
) -> None:
    """The whole-group retry resumes from the checkpoint of step 20, whose marker keeps the run's DDP
    buckets: the new wrappers sum step 21's gradients as the uninterrupted run did."""
    out, records = _run4(tmp_path, data_dir, "restarted", max_retries=1, faults=["kill:rank=2:step=30"],
                         save_every=10)  # fmt: skip
    assert [o["attempt"] for o in out] == ["2"] * 4
    assert [r["step"] for r in records[0] if r["pid"] == out[0]["pid"]] == list(range(21, TOTAL + 1))
    _assert_ends_same(reference4, out, records)


def test_a_loop_that_does_not_mark_its_steps_falls_back_and_says_why(tmp_path: Path, data_dir: Path) -> None:
    from gpufleet.checkpoint.in_memory import RecoveryError

    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     faults=["kill:rank=1:step=30"])  # fmt: skip
    # the rank is replaced, but at the join no rank knows a completed step: every rank raises, saying why
    with pytest.raises(RecoveryError, match=r"holds no completed step \(the loop must run over CheckpointManager.steps"):
        fn.distributed(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records), use_steps=False)


def test_a_warm_spare_takes_the_dead_ranks_place_and_the_run_ends_as_if_nothing_happened(
    tmp_path: Path, data_dir: Path, reference: tuple[list[dict], list[list[dict]]], capfd: pytest.CaptureFixture[str],
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     spares=1, faults=["kill:rank=1:step=30"])  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    out = handle.result(timeout=240)
    ranks = [read_records(str(records), rank) for rank in range(2)]
    _assert_same(reference, out, ranks)
    assert [o["attempt"] for o in out] == ["1", "1"] and {r["pid"] for r in ranks[0]} == {out[0]["pid"]}
    (recovery,) = handle.recoveries
    assert (recovery.outcome, recovery.warm, recovery.new_pid) == ("recovered", True, out[1]["pid"])
    err = capfd.readouterr().err
    assert f"rank 1 died (SIGKILL); replaced in place by a warm spare (pid {out[1]['pid']})" in err
    assert f"[rank 1] gpufleet: warm spare 0 (pid {out[1]['pid']}) takes rank 1" in err  # its lines are rank 1's now
    assert (Path(handle.run_dir) / "spare-0.log").exists() and (Path(handle.run_dir) / "spare-1.log").exists()  # refilled


def test_two_deaths_in_one_run_each_take_a_warm_spare(tmp_path: Path, data_dir: Path,
                                                      reference: tuple[list[dict], list[list[dict]]]) -> None:  # fmt: skip
    """Rank 1 dies at step 12 and takes spare 0; once it is back, spare 1 starts; rank 0 dies at step 30 and
    takes it. Every step runs once on each rank, bit for bit as without the deaths."""
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     spares=1, faults=["kill:rank=1:step=12", "kill:rank=0:step=30"])  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records))
    out = handle.result(timeout=240)
    _assert_same(reference, out, [read_records(str(records), rank) for rank in range(2)])
    assert [(r.rank, r.outcome, r.warm, r.resumed_step) for r in handle.recoveries] == [
        (1, "recovered", True, 11), (0, "recovered", True, 29)]  # fmt: skip
    assert [r.new_pid for r in handle.recoveries] == [out[1]["pid"], out[0]["pid"]]


def test_a_failed_run_with_a_spare_leaves_no_process(tmp_path: Path, data_dir: Path) -> None:
    """The spare that no death needed is stopped with the ranks (the suite's leftover-process check)."""
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     spares=1)  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(records), raise_at=20)
    with pytest.raises(ValueError, match="a bug at step 20"):
        handle.result(timeout=240)
    assert (Path(handle.run_dir) / "spare-0.log").exists()


@pytest.mark.parametrize("dead", [1, 0])
def test_an_fsdp2_rank_is_replaced_from_its_neighbours_copy_and_the_run_ends_as_if_resumed_there(
    tmp_path: Path, data_dir: Path, dead: int
) -> None:
    """No survivor holds the dead rank's shard: the next rank's copy of it (taken every 5 steps) comes
    to the replacement, every rank goes back to that step and trains the steps after it again, and
    the run ends as an uninterrupted one: the re-run steps are the same steps. (The copy of step 25
    travels while steps 26 to 29 run; on a busy machine it may not have arrived, and step 20's is
    used: that of 20 surely has, as step 25's copy waits for it.)"""
    ref_records, out_records = tmp_path / "ref", tmp_path / "records"
    ref_records.mkdir()
    out_records.mkdir()
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False)
    reference = fn.distributed(str(tmp_path / "ckpt-ref"), str(data_dir), TOTAL, str(ref_records), strategy="fsdp2")
    fn = distributed(train_replaceable, gpus=2, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     faults=[f"kill:rank={dead}:step=30"])  # fmt: skip
    handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), TOTAL, str(out_records), strategy="fsdp2",
                       replica_every=5)  # fmt: skip
    out = handle.result(timeout=240)
    assert [o["attempt"] for o in out] == ["1", "1"]
    (recovery,) = handle.recoveries
    back_to = recovery.resumed_step
    assert recovery.outcome == "recovered" and back_to in (20, 25) and recovery.steps_lost == 29 - back_to
    survivor = 1 - dead
    for rank in range(2):
        ref, records = read_records(str(ref_records), rank), read_records(str(out_records), rank)
        steps = [r["step"] for r in records]
        assert steps == list(range(1, 30)) + list(range(back_to + 1, TOTAL + 1)), f"rank {rank}"
        if rank == survivor:  # in its own process all along
            assert {r["pid"] for r in records} == {out[rank]["pid"]}
        last = {r["step"]: r for r in records}  # each step's last run
        assert [last[s]["loss"] for s in range(1, TOTAL + 1)] == [r["loss"] for r in ref], f"rank {rank}: losses"
        assert [last[s]["ids"] for s in range(1, TOTAL + 1)] == [r["ids"] for r in ref], f"rank {rank}: data"
        for name, value in reference[rank]["params"].items():
            assert torch_equal(out[rank]["params"][name], value), f"rank {rank}: {name} differs"


def test_four_fsdp2_ranks_lose_rank_3_whose_copy_is_on_rank_0(tmp_path: Path, data_dir: Path) -> None:
    """The ring wraps: the last rank's shard is copied to rank 0, which hands it to the replacement."""
    records = tmp_path / "records"
    records.mkdir()
    fn = distributed(train_replaceable, gpus=4, gpu_type="cpu", timeout=240, tracking=False, recovery="replace",
                     faults=["kill:rank=3:step=15"])  # fmt: skip
    with pytest.warns(RuntimeWarning, match="4 CPU workers"):
        handle = fn.submit(str(tmp_path / "ckpt"), str(data_dir), 20, str(records), strategy="fsdp2", replica_every=4)
        out = handle.result(timeout=240)
    assert [o["attempt"] for o in out] == ["1"] * 4
    (recovery,) = handle.recoveries
    # the copies of step 12 (exchanged while steps 13 and 14 ran), or on a busy machine step 8's
    back_to = recovery.resumed_step
    assert (recovery.rank, recovery.outcome) == (3, "recovered") and back_to in (8, 12)
    assert recovery.steps_lost == 14 - back_to
    for rank in range(4):
        steps = [r["step"] for r in read_records(str(records), rank)]
        assert steps == list(range(1, 15)) + list(range(back_to + 1, 21)), f"rank {rank}"
