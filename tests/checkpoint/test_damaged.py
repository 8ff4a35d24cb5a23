"""A complete checkpoint damaged after its save (a shard missing or truncated, bad bytes,
unreadable metadata) is skipped by resume, which falls back to the next older one."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpufleet import distributed
from gpufleet.checkpoint import CheckpointError, CheckpointManager, SkippedCheckpoint
from gpufleet.checkpoint.integrity import describe, merge_reasons
from tests.checkpoint.training import resume_and_report, resume_each_and_report, save_at_steps
from tests.proc import leftover_worker_processes

# -- damage -------------------------------------------------------------------------------


def _delete(file: Path) -> None:
    file.unlink()


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _corrupt_tail(file: Path, start: int | None = None) -> None:
    """Same size, the bytes from ``start`` on (the second half by default) overwritten: only
    the read itself sees it, after the tensors before ``start`` were copied into the state."""
    data = file.read_bytes()
    start = len(data) // 2 if start is None else start
    garbage = (bytes(range(256)) * (len(data) // 256 + 1))[: len(data) - start]
    file.write_bytes(data[:start] + garbage)


def _offset_of(path: Path, fqn: str) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data
    return next(info.offset for index, info in storage.items() if index.fqn == fqn)


def _drop_file_list(path: Path) -> None:
    """Make the marker look like one written before it listed the files."""
    marker = json.loads((path / "COMPLETE.json").read_text())
    del marker["files"]
    (path / "COMPLETE.json").write_text(json.dumps(marker))


# -- in one process -----------------------------------------------------------------------


def _build(root: Path) -> tuple[CheckpointManager, torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, scheduler=scheduler, keep_last=None)
    return manager, model, optimizer, scheduler


def _save_1_and_2(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    manager, model, optimizer, scheduler = _build(root)
    gen = torch.Generator().manual_seed(3)
    saved = {}
    for step in (1, 2):
        model(torch.randn(4, 3, generator=gen)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        manager.save(step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()}


def _assert_equal(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _clean_load_of_step_1(root: Path, tmp: Path) -> dict:
    clean = tmp / "clean"
    shutil.copytree(root / "step-1", clean / "step-1")
    manager, model, optimizer, scheduler = _build(clean)
    assert manager.resume() == 1 and manager.last_resume["skipped"] == []
    return _state(model, optimizer, scheduler)


DAMAGES: dict[str, Callable[[Path], None]] = {
    "missing-shard": lambda p: _delete(p / "__0_0.distcp"),
    "truncated-shard": lambda p: _truncate(p / "__0_0.distcp"),
    "corrupted-shard": lambda p: _corrupt_tail(p / "__0_0.distcp"),
    "unreadable-metadata": lambda p: _truncate(p / ".metadata"),
    "garbled-metadata": lambda p: _corrupt_tail(p / ".metadata"),
    "missing-rank-file": lambda p: _delete(p / "gpufleet-rank-0.pt"),
    "missing-shard-old-marker": lambda p: (_drop_file_list(p), _delete(p / "__0_0.distcp")),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_falls_back_from_a_damaged_checkpoint_to_the_older_one(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    saved = _save_1_and_2(root)
    DAMAGES[damage](root / "step-2")
    assert (root / "step-2" / "COMPLETE.json").is_file() and (root / "step-2" / ".metadata").is_file()

    manager, model, optimizer, scheduler = _build(root)
    with caplog.at_level(logging.WARNING, logger="gpufleet.checkpoint"):
        assert manager.resume() == 1
    [skip] = manager.last_resume["skipped"]
    assert isinstance(skip, SkippedCheckpoint) and skip.step == 2 and skip.path == root / "step-2"
    assert manager.last_resume["step"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step-2" in warnings[0] and skip.reason in warnings[0]
    # the reason is the exception's type and message
    expected = {
        "missing-shard": "CheckpointError: step-2: __0_0.distcp is missing",
        "truncated-shard": "CheckpointError: step-2: __0_0.distcp is truncated",
        "corrupted-shard": "DCP load failed: ",
        "unreadable-metadata": "CheckpointError: step-2: .metadata is truncated",
        "garbled-metadata": "",  # whatever unpickling the bytes raises
        "missing-rank-file": "CheckpointError: step-2: gpufleet-rank-0.pt is missing",
        "missing-shard-old-marker": "CheckpointError: step-2: shard __0_0.distcp is missing",
    }[damage]
    assert skip.reason.startswith(expected) and re.search(r"\w+Error: \S", skip.reason), skip.reason
    assert "\n" not in skip.reason
    # bit-identical to step 1, and the same as loading step 1 where step 2 never existed
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[1][name]), name
    _assert_equal(_state(model, optimizer, scheduler), _clean_load_of_step_1(root, tmp_path))


def test_a_failed_load_leaves_a_mixed_state_that_the_older_checkpoint_overwrites(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = _save_1_and_2(root)
    # the model's tensors are read first: bad bytes from its last layer's weight on
    _corrupt_tail(root / "step-2" / "__0_0.distcp", _offset_of(root / "step-2", "model.2.weight"))
    manager, model, optimizer, scheduler = _build(root)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(CheckpointError, match=r"cannot load checkpoint .*step-2: DCP load failed"):
        manager.load(2)
    now = model.state_dict()
    from_2 = [k for k in now if torch.equal(now[k], saved[2][k])]
    untouched = [k for k in now if torch.equal(now[k], initial[k])]
    assert from_2 == ["0.weight", "0.bias"] and untouched == ["2.weight", "2.bias"], (from_2, untouched)

    assert manager.resume() == 1
    _assert_equal(_state(model, optimizer, scheduler), _clean_load_of_step_1(root, tmp_path))


def test_when_no_checkpoint_loads_the_error_lists_each_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    _save_1_and_2(root)
    shutil.copytree(root / "step-2", root / "step-3")
    (root / "step-3" / "COMPLETE.json").unlink()  # torn
    _delete(root / "step-2" / "__0_0.distcp")
    _truncate(root / "step-1" / "gpufleet-rank-0.pt")

    manager, *_ = _build(root)
    with caplog.at_level(logging.WARNING, logger="gpufleet.checkpoint"):
        with pytest.raises(CheckpointError) as err:
            manager.resume()
    text = str(err.value)
    assert "no checkpoint in" in text
    lines = text.splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["step-3", "step-2", "step-1"]
    assert "torn" in lines[0]
    assert "__0_0.distcp is missing" in lines[1]
    assert "gpufleet-rank-0.pt is truncated" in lines[2]
    assert [s.step for s in manager.last_resume["skipped"]] == [3, 2, 1]
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert all(f"step-{s}" in warned for s in (1, 2, 3))


def test_only_torn_checkpoints_still_mean_a_fresh_start(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save_1_and_2(root)
    for step in (1, 2):
        (root / f"step-{step}" / "COMPLETE.json").unlink()
    manager, *_ = _build(root)
    assert manager.resume() is None
    assert [s.step for s in manager.last_resume["skipped"]] == [2, 1]


def test_reasons_of_the_ranks_are_merged() -> None:
    assert merge_reasons([None, None]) is None
    assert merge_reasons(["E: x", "E: x"]) == "E: x"
    assert merge_reasons([None, "E: x"]) == "rank 1: E: x"
    assert merge_reasons(["E: x", "F: y", "E: x"]) == "ranks 0, 2: E: x; rank 1: F: y"
    from torch.distributed.checkpoint.api import CheckpointException

    exc = CheckpointException("read", {0: (FileNotFoundError("gone"), None), 1: (FileNotFoundError("gone"), None)})
    assert describe(exc) == "DCP load failed: FileNotFoundError: gone (ranks 0, 1)"
    assert describe(ValueError("bad")) == "ValueError: bad"


# -- on 2 ranks through gpufleet's launcher -----------------------------------------------

on_2 = distributed(gpus=2, gpu_type="cpu", timeout=240, tracking=False)
save_on_2 = on_2(save_at_steps)
resume_on_2 = on_2(resume_and_report)
resume_each_on_2 = on_2(resume_each_and_report)


@pytest.fixture(scope="module")
def saved_10_and_20(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Checkpoints 10 and 20 saved by 2 DDP ranks (kept pristine; tests damage copies)."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    saved = save_on_2.distributed(str(root), [10, 20])
    return root, saved


def _copy(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    shards = sorted(p.name for p in (root / "step-20").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert all((root / "step-20" / s).stat().st_size > 0 for s in shards)  # each rank wrote a share
    return root


DAMAGES_ON_2: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing-shard": (lambda p: _delete(p / "__1_0.distcp"), "CheckpointError: step-20: __1_0.distcp is missing"),
    "truncated-shard": (lambda p: _truncate(p / "__1_0.distcp"), "CheckpointError: step-20: __1_0.distcp is truncated"),
    "corrupted-shard": (lambda p: _corrupt_tail(p / "__1_0.distcp"), "DCP load failed: "),
    # without the marker's file list only rank 1 sees that its file is gone: the ranks must agree
    "one-rank-only": (
        lambda p: (_drop_file_list(p), _delete(p / "gpufleet-rank-1.pt")),
        "rank 1: CheckpointError: ",
    ),
}


@pytest.mark.slow
def test_on_2_ranks_resume_skips_a_damaged_step_20_and_lands_on_step_10(
    tmp_path: Path, saved_10_and_20: tuple[Path, list[dict]]
) -> None:
    """Each damage of DAMAGES_ON_2 in its own copy of the checkpoints, all resumed in one launch."""
    pristine, saved = saved_10_and_20
    roots = []
    for damage, (apply, _) in DAMAGES_ON_2.items():
        root = _copy(pristine, tmp_path / damage)
        apply(root / "step-20")
        roots.append(str(root))

    reports = resume_each_on_2.distributed(roots)  # per rank: one report per damaged copy
    for i, (damage, (_, reason)) in enumerate(DAMAGES_ON_2.items()):
        after = [reports[rank][i] for rank in range(2)]
        assert [r["resumed"] for r in after] == [10, 10], damage
        for rank in range(2):
            [(step, name, why)] = after[rank]["skipped"]
            assert (step, name) == (20, "step-20") and why.startswith(reason), (damage, why)
            assert why == after[0]["skipped"][0][2], damage  # the same reason on every rank
            expected = saved[rank][10]
            for key, value in expected["params"].items():
                got = after[rank]["params"][key]
                assert got.dtype == value.dtype and torch.equal(got, value), (damage, rank, key)
            assert after[rank]["optim"].keys() == expected["optim"].keys(), damage
            for key, state in expected["optim"].items():
                for part, value in state.items():
                    assert torch.equal(after[rank]["optim"][key][part], value), (damage, rank, key, part)
            assert after[rank]["lr"] == expected["lr"], damage
            assert torch.equal(after[rank]["rng"], expected["rng"]), f"{damage}: rank {rank}: RNG state not step 10's"
        [warning] = after[0]["warnings"]  # logged once, by rank 0
        assert "step-20" in warning and after[0]["skipped"][0][2] in warning, damage
        assert after[1]["warnings"] == [], damage
    assert not leftover_worker_processes(wait_s=10.0)


@pytest.mark.slow
def test_on_2_ranks_when_every_checkpoint_is_damaged_resume_raises_naming_all(
    tmp_path: Path, saved_10_and_20: tuple[Path, list[dict]]
) -> None:
    pristine, _ = saved_10_and_20
    root = _copy(pristine, tmp_path)
    _delete(root / "step-20" / "__1_0.distcp")
    _corrupt_tail(root / "step-10" / "__0_0.distcp")

    with pytest.raises(CheckpointError) as err:
        resume_on_2.distributed(str(root))
    text = str(err.value)
    assert "no checkpoint in" in text and "step-20: CheckpointError: step-20: __1_0.distcp is missing" in text
    assert "step-10: DCP load failed: " in text
    assert not leftover_worker_processes(wait_s=10.0)
