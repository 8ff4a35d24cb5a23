"""The error raised when a checkpoint cannot be saved or loaded."""

from __future__ import annotations

from ..errors import GpufleetError

__all__ = ["CheckpointError"]


class CheckpointError(GpufleetError, RuntimeError):
    """A checkpoint cannot be saved or loaded as asked.

    Also a ``RuntimeError``, so code that catches ``RuntimeError`` keeps working.
    """
