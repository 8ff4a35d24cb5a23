"""Export a checkpoint's model weights to one consolidated folder for inference."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import layout
from .torch_dist import quiet_single_process

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "load_model_state_dict"]

_MODEL_PREFIX = "model."


def _load_dcp_model(path: Path) -> dict[str, torch.Tensor]:
    """Read the full (unsharded) model tensors of a DCP checkpoint into this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not state:
        raise layout_error(path, "holds no model weights")
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {k[len(_MODEL_PREFIX):]: v for k, v in state.items()}


def _load_deepspeed_model(path: Path) -> dict[str, torch.Tensor]:
    """Consolidate a DeepSpeed checkpoint's weights (ZeRO partitions merged in fp32)."""
    import torch

    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise ImportError("exporting a DeepSpeed checkpoint needs deepspeed: pip install 'gpufleet[deepspeed]'") from e
    if any(path.glob("*optim_states.pt")):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name))
    states = sorted(path.glob("mp_rank_*_model_states.pt"))
    if not states:
        raise layout_error(path, "holds no DeepSpeed model states")
    return dict(torch.load(states[0], map_location="cpu", weights_only=False)["module"])


def layout_error(path: Path, what: str) -> ValueError:
    return ValueError(f"cannot export {path}: it {what}")


def load_model_state_dict(checkpoint: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full model state dict of a complete checkpoint folder, in this process.

    Raises:
        ValueError: the folder is not a complete checkpoint.
    """
    path = Path(checkpoint)
    marker = layout.read_marker(path)
    if marker is None:
        raise layout_error(path, "is not a complete checkpoint (no marker)")
    if marker.get("format", "dcp") == "deepspeed":
        return _load_deepspeed_model(path)
    return _load_dcp_model(path)


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "save_pretrained"):
        model = model.module
    return model


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model: Any = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the model weights of a complete checkpoint to ``out_dir`` for inference.

    Without ``model`` the folder gets ``model.safetensors`` (full tensors, names as in the
    model's ``state_dict``). With a Hugging Face ``PreTrainedModel`` (unwrapped, unsharded,
    e.g. built with ``from_config``) the weights are loaded into it and it is written with
    ``save_pretrained`` (config plus safetensors), loadable with ``from_pretrained``. Any
    other ``model`` gets the weights loaded (strictly, as a check) and ``model.safetensors``.

    Args:
        checkpoint: a ``step-N`` folder written by :class:`CheckpointManager`.
        out_dir: the folder to write (created).
        model: see above.
        dtype: cast floating-point weights to this dtype.

    Returns:
        ``out_dir``.
    """
    from safetensors.torch import save_file

    path = Path(checkpoint)
    out = Path(out_dir)
    state = load_model_state_dict(path)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    marker = layout.read_marker(path) or {}
    if model is not None:
        target = _unwrap(model)
        if dtype is not None:
            target.to(dtype)
        target.load_state_dict(state, strict=True)
        if hasattr(target, "save_pretrained"):
            target.save_pretrained(str(out))
            logger.info("exported %s to %s (save_pretrained)", path, out)
            return out
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "step": str(marker.get("step", ""))})
    with open(out / "export.json", "w", encoding="utf-8") as f:
        json.dump({"checkpoint": str(path.resolve()), "step": marker.get("step"), "num_tensors": len(tensors)}, f, indent=1)
    logger.info("exported %s to %s", path, out)
    return out
