"""Asynchronous DCP saves: pinned staging buffers kept from one save to the next, and the
thread that waits for a save in flight and then marks it complete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["PendingSave", "make_stager", "kept_stager_class"]


class PendingSave:
    """An asynchronous save in flight; a thread waits for it, then calls ``on_done``."""

    def __init__(self, step: int, path: Path, future: Any, on_done: Callable[[], None]) -> None:
        self.step = step
        self.path = path
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(future, on_done), name=f"gpufleet-ckpt-{step}", daemon=True
        )
        self._thread.start()

    def _run(self, future: Any, on_done: Callable[[], None]) -> None:
        try:
            future.result()
            on_done()
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.error = e

    def join(self) -> None:
        """Wait for the save; raise :class:`CheckpointError` when it failed."""
        self._thread.join()
        if self.error is not None:
            raise CheckpointError(f"asynchronous save of step {self.step} to {self.path} failed: {self.error}") from self.error


def make_stager(pinned_staging: bool | None) -> Any:
    """The stager of asynchronous saves: pinned host buffers reused by every save, or None.

    ``pinned_staging=None`` means on when CUDA is available. None is returned when pinning is
    off or this torch has no DCP ``DefaultStager`` (DCP then stages without pinned memory).
    """
    import torch

    if pinned_staging is None:
        pinned_staging = torch.cuda.is_available()
    if not pinned_staging:
        return None
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401 - probes for it
    except ImportError:
        logger.warning("this torch has no DCP DefaultStager: asynchronous saves stage without pinned memory")
        return None
    # Synchronous staging: save() returns once the state is copied, so training may change
    # the weights right away; the files are written in the background.
    return kept_stager_class()(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=torch.cuda.is_available(),  # DCP refuses it without CUDA
        )
    )


_KEPT_STAGER: Any = None


def kept_stager_class() -> Any:
    """DCP's ``DefaultStager`` whose pinned buffers survive every save.

    DCP's stager keeps the pinned host copies of the tensors it staged and reuses them on the
    next save, but torch 2.11 throws them away after each save: ``DefaultStager._stage`` closes
    its inner ``StateDictStager`` once the copy is done, which frees the pinned buffers (each save
    would pin the whole state again) and empties its copy table (the next save fails with
    ``KeyError: <class 'type'>``). Later releases keep them, but their ``async_save`` may close
    the stager it is given. This subclass ignores both closes; the manager frees the buffers
    with ``release()``.
    """
    global _KEPT_STAGER
    if _KEPT_STAGER is None:
        from torch.distributed.checkpoint.staging import DefaultStager

        class KeptStager(DefaultStager):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                inner = self._state_dict_stager
                self._inner_close = inner.close
                inner.close = lambda: None  # torch 2.11 calls it after every save

            def close(self) -> None:
                """Keep the buffers for the next save (see :func:`kept_stager_class`)."""

            def release(self) -> None:
                """Free the pinned buffers."""
                self._inner_close()
                DefaultStager.close(self)

        _KEPT_STAGER = KeptStager
    return _KEPT_STAGER
