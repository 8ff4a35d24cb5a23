"""Checkpoints that resume exactly: DCP shards per rank, ``step-N`` folders, keep-last-K,
asynchronous saves, resume from the newest checkpoint that loads, export for inference.

Importing this package does not import torch; torch is loaded when a manager is created.
"""

from __future__ import annotations

from .deepspeed_engine import is_deepspeed_engine
from .errors import CheckpointError
from .export import export_checkpoint, load_model_state_dict
from .integrity import SkippedCheckpoint
from .layout import CheckpointInfo, latest_complete, list_checkpoints
from .manager import CheckpointManager

__all__ = [
    "CheckpointManager",
    "CheckpointError",
    "CheckpointInfo",
    "SkippedCheckpoint",
    "export_checkpoint",
    "load_model_state_dict",
    "list_checkpoints",
    "latest_complete",
    "is_deepspeed_engine",
]
