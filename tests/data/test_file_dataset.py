"""FileDataset and TimedDataLoader: sharding, exact mid-epoch resume, cache, wait times."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet import distributed
from gpufleet.data import FileDataset, TimedDataLoader, copy_into_cache

NUM_FILES = 7


def write_corpus(directory: Path, num_files: int = NUM_FILES) -> list[int]:
    """``num_files`` .jsonl files of 3 to 5 numbered samples each; returns all sample ids."""
    directory.mkdir(parents=True, exist_ok=True)
    ids, next_id = [], 0
    for f in range(num_files):
        with open(directory / f"shard-{f:02d}.jsonl", "w") as out:
            for _ in range(3 + f % 3):
                out.write(json.dumps({"id": next_id}) + "\n")
                ids.append(next_id)
                next_id += 1
    return ids


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[int]]:
    src = tmp_path / "share"
    return src, write_corpus(src)


def ids_of(batches: list) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


def loader_for(src: Path, cache: Path, rank: int, world_size: int, num_workers: int, batch_size: int = 2, seed: int = 3) -> TimedDataLoader:
    dataset = FileDataset(src, pattern="*.jsonl", cache_dir=cache, rank=rank, world_size=world_size, seed=seed)
    return TimedDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)


@pytest.mark.parametrize(("world_size", "num_workers"), [(2, 2), (3, 1), (2, 0)])
def test_every_sample_once_per_epoch_across_ranks_and_workers(
    corpus: tuple[Path, list[int]], tmp_path: Path, world_size: int, num_workers: int
) -> None:
    src, all_ids = corpus
    epochs: list[list[int]] = [[], []]
    for rank in range(world_size):
        loader = loader_for(src, tmp_path / "cache", rank, world_size, num_workers)
        for epoch in range(2):
            epochs[epoch] += ids_of(list(loader))
    for seen in epochs:
        assert Counter(seen) == Counter(all_ids), "a sample is missing or repeated within an epoch"
    assert epochs[0] != epochs[1], "the file order is reshuffled every epoch"


def read_one_epoch() -> list[int]:
    from gpufleet.data import FileDataset, TimedDataLoader

    src = os.environ["CORPUS"]
    loader = TimedDataLoader(FileDataset(src, pattern="*.jsonl", cache_dir=os.environ["CACHE"]), batch_size=2, num_workers=2)
    return [int(i) for batch in loader for i in batch["id"]]


def test_ranks_of_a_launched_run_share_an_epoch_without_a_sampler(corpus: tuple[Path, list[int]], tmp_path: Path) -> None:
    src, all_ids = corpus
    env = {"CORPUS": str(src), "CACHE": str(tmp_path / "cache")}
    per_rank = distributed(gpus=2, gpu_type="cpu", env=env, timeout=120, tracking=False)(read_one_epoch).distributed()
    assert all(per_rank) and sorted(per_rank[0] + per_rank[1]) == sorted(all_ids)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_after", [1, 3])
def test_resuming_mid_epoch_yields_exactly_the_rest(
    corpus: tuple[Path, list[int]], tmp_path: Path, num_workers: int, stop_after: int
) -> None:
    src, _ = corpus
    reference = loader_for(src, tmp_path / "cache", 0, 2, num_workers)
    straight = [ids_of(list(reference)) for _ in range(2)]  # two epochs

    loader = loader_for(src, tmp_path / "cache", 0, 2, num_workers)
    it = iter(loader)
    head = ids_of([next(it) for _ in range(stop_after)])
    state = loader.state_dict()
    del it, loader

    resumed = loader_for(src, tmp_path / "cache", 0, 2, num_workers)
    resumed.load_state_dict(state)
    rest = ids_of(list(resumed))
    assert head + rest == straight[0]
    assert ids_of(list(resumed)) == straight[1], "the epoch after the resumed one continues the schedule"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(1, 4), batch_size=st.integers(1, 4), stop_after=st.integers(0, 6), seed=st.integers(0, 3))
def test_resume_at_any_point_is_exact(tmp_path: Path, world_size: int, batch_size: int, stop_after: int, seed: int) -> None:
    src = tmp_path / "share"
    if not src.exists():
        write_corpus(src)
    for rank in range(world_size):
        reference = loader_for(src, tmp_path / "cache", rank, world_size, 0, batch_size, seed)
        epoch0 = list(reference)
        epoch1 = ids_of(list(reference))
        loader = loader_for(src, tmp_path / "cache", rank, world_size, 0, batch_size, seed)
        head = ids_of(list(itertools.islice(loader, stop_after)))
        state = loader.state_dict()
        again = loader_for(src, tmp_path / "cache", rank, world_size, 0, batch_size, seed)
        again.load_state_dict(state)
        rest = ids_of(list(again))
        if stop_after > len(epoch0):  # the epoch ran out while reading: resume starts the next one
            assert head == ids_of(epoch0) and rest == epoch1
        else:
            assert head + rest == ids_of(epoch0)


def test_files_are_read_from_the_local_cache_and_recopied_when_changed(corpus: tuple[Path, list[int]], tmp_path: Path) -> None:
    src, _ = corpus
    copied: list[str] = []

    def counting_copy(a: Path, b: Path) -> None:
        copied.append(a.name)
        copy_into_cache(a, b)

    cache = tmp_path / "cache"
    dataset = FileDataset(src, pattern="*.jsonl", cache_dir=cache, copy_file=counting_copy, rank=0, world_size=1)
    first = list(dataset)
    assert sorted(copied) == sorted(p.name for p in src.iterdir())
    assert sorted(p.name for p in cache.iterdir()) == sorted(copied)
    assert sorted(x["id"] for x in list(dataset)) == sorted(x["id"] for x in first)
    assert len(copied) == NUM_FILES, "a second epoch reads the cached copies"

    changed = src / "shard-00.jsonl"
    changed.write_text(json.dumps({"id": 1000}) + "\n")
    os.utime(changed, (time.time() + 5, time.time() + 5))
    assert 1000 in [x["id"] for x in dataset]
    assert copied.count("shard-00.jsonl") == 2


def test_bad_input_is_refused_with_a_reason(corpus: tuple[Path, list[int]], tmp_path: Path) -> None:
    src, _ = corpus
    with pytest.raises(FileNotFoundError, match="not a directory"):
        FileDataset(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no file"):
        FileDataset(src, pattern="*.parquet")
    with pytest.raises(ValueError, match="rank"):
        FileDataset(src, rank=2, world_size=2)
    dataset = FileDataset(src, pattern="*.jsonl", cache_dir=False, rank=0, world_size=1, seed=1)
    state = dataset.state_dict()
    other = FileDataset(src, pattern="*.jsonl", cache_dir=False, rank=0, world_size=1, seed=2)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


class SlowReads(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(6):
            time.sleep(0.2)
            yield i


def test_wait_stats_report_the_time_spent_waiting_for_data() -> None:
    loader = TimedDataLoader(SlowReads(), batch_size=1, num_workers=0)
    for _ in loader:
        time.sleep(0.01)  # the "training step"
    stats = loader.wait_stats()
    assert stats["steps"] == 6
    assert stats["wait_s"] >= 6 * 0.2
    # ~0.2 of every ~0.21 s step is spent waiting (~0.95); below 0.7 only if the 0.01 s step took
    # over 0.085 s each time (with 0.05 s reads a step of 0.03 s, common on a loaded machine, failed)
    assert 0.7 < stats["wait_fraction"] < 1.0
    loader.reset_wait_stats()
    assert loader.wait_stats()["steps"] == 0
