"""The two ways the checkpoint modules reach torch.distributed: its import and a quiet DCP call.

Both the manager and the export read and write DCP checkpoints; this module is below both, so
neither imports the other for these helpers.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["import_torch_dist", "quiet_single_process"]


def import_torch_dist() -> Any:
    """``torch.distributed``, or an ImportError that names the extra to install."""
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("checkpoints need torch: pip install 'gpufleet[torch]'") from e
    return dist


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that a save/load without a process group is single-process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
