"""Capture and restore the random number generators of one process."""

from __future__ import annotations

import logging
import random
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's, torch's CPU and every CUDA generator of this process."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back into a state returned by :func:`capture_rng_state`."""
    import torch

    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning(
                "the checkpoint holds %d CUDA generator states but this process sees %s GPUs; "
                "CUDA random numbers are not restored",
                len(state["cuda"]),
                torch.cuda.device_count() if torch.cuda.is_available() else 0,
            )
