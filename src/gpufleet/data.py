"""Data loading: a cached, sharded, resumable dataset over a directory of files, and a loader
that measures how long each step waited for data.

:class:`FileDataset` reads the files of a directory (a local disk or a mounted network share),
copies each one into a local cache before reading it (the next files are copied in the
background while the current one is read), and splits the files over ranks x loader workers
itself, so no ``DistributedSampler`` is needed. Its position (epoch, file, sample) is saved and
restored through ``state_dict``/``load_state_dict``.

:class:`TimedDataLoader` is torchdata's ``StatefulDataLoader`` with good defaults and a timer
around every ``next()``: :meth:`TimedDataLoader.wait_stats` says how long the training loop
waited for data, for tracking to report.

Example::

    dataset = FileDataset("/mnt/share/corpus", pattern="*.jsonl", seed=0)
    loader = TimedDataLoader(dataset, batch_size=32)
    for batch in loader:
        ...
    print(loader.wait_stats())    # {'steps': ..., 'wait_fraction': ...}

One concern past 400 lines: the data path of a rank (listing, caching and sharding the
files, the resumable position, and the timed loader over them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:
    import torch
    from torch.utils.data import IterableDataset, get_worker_info
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gpufleet.data needs torch and torchdata: pip install 'gpufleet[torch]'"
    ) from e

from . import runtime
from .launch.progress import note_batch
from .results import gpufleet_home

logger = logging.getLogger(__name__)

__all__ = ["FileDataset", "TimedDataLoader", "read_samples", "copy_into_cache"]

Reader = Callable[[Path], Iterable[Any]]
CopyFile = Callable[[Path, Path], None]


def read_samples(path: Path) -> Iterable[Any]:
    """Read the samples of one file, chosen by its suffix (the default reader).

    ``.jsonl``: one JSON value per line; ``.txt``: one string per line (newline stripped);
    ``.pt``: ``torch.load`` of a list/tuple (its items) or a tensor (its rows); ``.npy``: the
    rows of the array; anything else: the whole file as one ``bytes`` sample.
    """
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("r", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if suffix == ".txt":
        with path.open("r", encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]
    if suffix == ".pt":
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, torch.Tensor):
            return list(obj.unbind(0))
        if isinstance(obj, (list, tuple)):
            return list(obj)
        raise ValueError(f"{path}: a .pt sample file must hold a tensor or a list, got {type(obj).__name__}")
    if suffix == ".npy":
        import numpy as np

        return list(np.load(path, allow_pickle=False))
    return [path.read_bytes()]


def copy_into_cache(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` atomically (temporary file, then rename), keeping its mtime."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


def _default_cache_dir(source: Path) -> Path:
    digest = hashlib.sha1(str(source).encode()).hexdigest()[:16]
    return gpufleet_home() / "cache" / "data" / f"{source.name}-{digest}"


class FileDataset(IterableDataset):
    """Iterate over the samples of a directory of files, sharded over ranks x loader workers.

    Every epoch the file list is shuffled with ``seed + epoch`` (the same order on every rank)
    and file ``i`` goes to shard ``i % num_shards``, where a shard is one loader worker of one
    rank (``num_shards = world_size * num_workers``). Each sample of the directory is thus
    seen exactly once per epoch across all ranks and workers; ranks may get different numbers
    of samples when the files hold different numbers of samples. Files are read from a local
    cache: a file is copied there before it is read and the next ``prefetch_files`` files of
    the shard are copied in the background meanwhile.

    The position (epoch, file index within the shard, sample index within the file) is
    updated before each sample is yielded and returned by :meth:`state_dict`, so torchdata's
    ``StatefulDataLoader`` (and :class:`TimedDataLoader`) resume mid-epoch exactly. When an
    epoch ends, the next iteration starts the next epoch.

    Args:
        source: the directory (local or a mounted network share).
        pattern: glob pattern of the files, relative to ``source`` (``"**/*.jsonl"`` recurses).
        reader: turns a local file path into its samples; :func:`read_samples` by default.
        cache_dir: where files are copied; ``$GPUFLEET_HOME/cache/data/<name>-<hash>`` by
            default. ``False`` reads the source files in place (no copy).
        shuffle: shuffle the order of files every epoch.
        seed: seed of the shuffle; must be the same on every rank.
        rank: this process's rank (``RANK`` by default).
        world_size: number of ranks (``WORLD_SIZE`` by default).
        prefetch_files: number of upcoming files copied in the background.
        copy_file: how a file is copied into the cache (``copy_into_cache`` by default); a
            replacement must be atomic, e.g. to read from an object store.
        transform: applied to each sample before it is yielded.

    Raises:
        FileNotFoundError: ``source`` is not a directory or no file matches ``pattern``.
        ValueError: ``rank``/``world_size`` or ``prefetch_files`` are out of range.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        pattern: str = "*",
        reader: Reader | None = None,
        cache_dir: str | os.PathLike[str] | bool | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch_files: int = 2,
        copy_file: CopyFile | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__()
        self.source = Path(source).expanduser().resolve()
        if not self.source.is_dir():
            raise FileNotFoundError(f"dataset source {self.source} is not a directory")
        self.files = sorted(
            p.relative_to(self.source).as_posix()
            for p in self.source.glob(pattern)
            if p.is_file() and not p.name.startswith(".")
        )
        if not self.files:
            raise FileNotFoundError(f"no file in {self.source} matches the pattern {pattern!r}")
        self.rank = runtime.get_global_rank() if rank is None else rank
        self.world_size = runtime.get_world_size() if world_size is None else world_size
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={self.rank}, world_size={self.world_size}")
        if prefetch_files < 0:
            raise ValueError(f"prefetch_files must be >= 0, got {prefetch_files}")
        if cache_dir is False:
            self.cache_dir: Path | None = None
        elif cache_dir is None or cache_dir is True:
            self.cache_dir = _default_cache_dir(self.source)
        else:
            self.cache_dir = Path(cache_dir).expanduser().resolve()
        self.reader = reader or read_samples
        self.shuffle = shuffle
        self.seed = seed
        self.prefetch_files = prefetch_files
        self.copy_file = copy_file or copy_into_cache
        self.transform = transform
        # Position: the next sample to yield is sample `_sample` of file `_file` of this
        # shard's file list in epoch `_epoch`.
        self._epoch = 0
        self._file = 0
        self._sample = 0

    # -- sharding -----------------------------------------------------------------------
    def epoch_files(self, epoch: int) -> list[str]:
        """All files in the order of ``epoch`` (the same on every rank)."""
        files = list(self.files)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(files)
        return files

    def shard_files(self, epoch: int, shard: int, num_shards: int) -> list[str]:
        """The files shard ``shard`` of ``num_shards`` reads in ``epoch``."""
        return self.epoch_files(epoch)[shard::num_shards]

    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        num_workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * num_workers + worker_id, self.world_size * num_workers

    # -- caching ------------------------------------------------------------------------
    def local_path(self, name: str) -> Path:
        """The cached copy of file ``name`` (copied now when missing or out of date)."""
        src = self.source / name
        if self.cache_dir is None:
            return src
        dst = self.cache_dir / name
        st = src.stat()
        try:
            cached = dst.stat()
            if cached.st_size == st.st_size and int(cached.st_mtime) == int(st.st_mtime):
                return dst
        except FileNotFoundError:
            pass
        self.copy_file(src, dst)
        return dst

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        shard, num_shards = self._shard()
        files = self.shard_files(self._epoch, shard, num_shards)
        if not files and self._file == 0 and self._sample == 0:
            logger.warning(
                "shard %d of %d gets no file in epoch %d: %d files for %d ranks x workers",
                shard, num_shards, self._epoch, len(self.files), num_shards,
            )
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufleet-cache") if self.prefetch_files else None
        pending: dict[int, Future[Path]] = {}
        try:
            while self._file < len(files):
                index = self._file
                if pool is not None:
                    for ahead in range(index + 1, min(index + 1 + self.prefetch_files, len(files))):
                        if ahead not in pending:
                            pending[ahead] = pool.submit(self.local_path, files[ahead])
                future = pending.pop(index, None)
                path = future.result() if future is not None else self.local_path(files[index])
                samples = self.reader(path)
                for i, sample in enumerate(samples):
                    if i < self._sample:
                        continue
                    self._sample = i + 1
                    yield self.transform(sample) if self.transform is not None else sample
                self._file, self._sample = index + 1, 0
            self._epoch, self._file, self._sample = self._epoch + 1, 0, 0
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration."""
        self._epoch, self._file, self._sample = epoch, 0, 0

    @property
    def epoch(self) -> int:
        """The epoch being read (or about to be)."""
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch, file index within this shard, sample index within that file."""
        return {
            "epoch": self._epoch,
            "file": self._file,
            "sample": self._sample,
            "num_files": len(self.files),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position returned by :meth:`state_dict`.

        Raises:
            ValueError: the position was saved over another file list or seed.
        """
        if state.get("num_files") != len(self.files) or state.get("seed") != self.seed:
            raise ValueError(
                f"cannot resume: the position was saved for {state.get('num_files')} files with "
                f"seed {state.get('seed')}, but this dataset has {len(self.files)} files and seed "
                f"{self.seed}; resume over the same directory and seed, or start a new epoch"
            )
        self._epoch, self._file, self._sample = int(state["epoch"]), int(state["file"]), int(state["sample"])


class _TimedIterator:
    """Wraps a loader iterator and records the time each ``next()`` blocks."""

    def __init__(self, loader: TimedDataLoader, it: Iterator[Any]) -> None:
        self._loader = loader
        self._it = it

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        batch = next(self._it)  # StopIteration ends the epoch and is not counted
        end = time.perf_counter()
        self._loader._record(start, end)
        note_batch()  # a step for the hang watchdog and for faults given step=N
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


def _default_num_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_rank = cpus // max(1, runtime.get_local_world_size())
    return max(0, min(4, per_rank - 1))


class TimedDataLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` with good defaults and a data-wait timer.

    Defaults differ from ``torch.utils.data.DataLoader`` where training wants it:
    ``num_workers`` = up to 4 per rank (fewer when the machine has fewer cores), pinned
    memory when CUDA is available, persistent workers, ``prefetch_factor=4``, and a private
    ``torch.Generator`` (seeded from ``seed``) so creating an iterator never draws from the
    global RNG: a resumed run's random numbers stay identical to an uninterrupted one.

    Each ``next()`` is timed. :meth:`wait_stats` reports the time spent waiting for data and
    the time between batches, which together give the fraction of step time the
    accelerator was idle waiting for input.

    Args:
        dataset: a map-style or iterable dataset (e.g. :class:`FileDataset`).
        batch_size: samples per batch.
        num_workers: loader worker processes per rank (see above for the default).
        seed: seed of the loader's private generator (used when ``generator`` is not given).
        report_wait: on rank 0 of a tracked run (``$MLFLOW_RUN_ID`` set), log the wait of each
            step to MLflow as ``data/wait_seconds`` (averaged over a few seconds).
        **kwargs: any other ``StatefulDataLoader`` argument.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        num_workers: int | None = None,
        seed: int = 0,
        report_wait: bool = True,
        **kwargs: Any,
    ) -> None:
        self._report: Any = None
        if report_wait and runtime.is_main_process() and os.environ.get("MLFLOW_RUN_ID"):
            from .tracking.data_wait import log_data_wait

            self._report = log_data_wait
        if num_workers is None:
            num_workers = _default_num_workers()
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        if num_workers > 0:
            kwargs.setdefault("persistent_workers", True)
            kwargs.setdefault("prefetch_factor", 4)
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(seed)
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)
        self.reset_wait_stats()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._last_end: float | None = None
        return _TimedIterator(self, super().__iter__())

    def _record(self, start: float, end: float) -> None:
        wait = end - start
        self._steps += 1
        self._wait_total += wait
        self._wait_max = max(self._wait_max, wait)
        self._wait_last = wait
        if self._report is not None:
            self._report(wait, self._steps)
        if self._last_end is not None:  # a step spans one return of next() to the next
            self._step_total += end - self._last_end
            self._timed_wait_total += wait
        self._last_end = end

    def reset_wait_stats(self) -> None:
        """Start measuring afresh (e.g. after warm-up or at each logging interval)."""
        self._steps = 0
        self._wait_total = 0.0
        self._wait_max = 0.0
        self._wait_last = 0.0
        self._step_total = 0.0
        self._timed_wait_total = 0.0
        self._last_end = None

    def wait_stats(self) -> dict[str, float]:
        """How long the loop waited for data since the last reset.

        Returns:
            ``steps`` (batches returned), ``wait_s`` (total seconds blocked in ``next()``),
            ``wait_s_mean``, ``wait_s_max``, ``wait_s_last``, ``step_s`` (seconds from one
            batch to the next, summed; the first batch of each epoch starts no step) and
            ``wait_fraction`` (waiting time inside those steps / ``step_s``).
        """
        steps = self._steps
        return {
            "steps": float(steps),
            "wait_s": self._wait_total,
            "wait_s_mean": self._wait_total / steps if steps else 0.0,
            "wait_s_max": self._wait_max,
            "wait_s_last": self._wait_last,
            "step_s": self._step_total,
            "wait_fraction": self._timed_wait_total / self._step_total if self._step_total > 0 else 0.0,
        }
