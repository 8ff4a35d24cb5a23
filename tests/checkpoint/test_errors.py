"""The checkpoint error is a gpufleet error and still a RuntimeError."""

from __future__ import annotations

import pytest

from gpufleet.checkpoint import CheckpointError
from gpufleet.errors import GpufleetError


def test_checkpoint_error_is_a_gpufleet_error_and_a_runtime_error() -> None:
    assert issubclass(CheckpointError, GpufleetError)
    assert issubclass(CheckpointError, RuntimeError)
    with pytest.raises(GpufleetError, match="torn"):
        raise CheckpointError("checkpoint step-3 is torn")


def test_checkpoint_error_is_the_one_the_top_level_package_exports() -> None:
    import gpufleet

    assert gpufleet.CheckpointError is CheckpointError
