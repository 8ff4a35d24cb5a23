"""The model's shape for the memory advisor: parameters, layers, width, vocabulary, block size.

Read from an ``nn.Module`` (counted, meta tensors are fine), a Hugging Face config (object,
local folder or ``config.json``: built on the meta device, nothing downloaded) or a bare
parameter count (the GPT-3 family's shape of that size is assumed for what is not given).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from .options import StrategyConfigError

__all__ = ["ModelShape", "model_shape", "parse_count"]

# (params, layers, hidden) of the GPT-3 paper's model family: a shape for a bare parameter count
_STANDARD_SHAPES = [
    (125e6, 12, 768), (350e6, 24, 1024), (760e6, 24, 1536), (1.3e9, 24, 2048), (2.7e9, 32, 2560),
    (6.7e9, 32, 4096), (13e9, 40, 5120), (30e9, 60, 6656), (70e9, 80, 8192), (175e9, 96, 12288),
    (405e9, 126, 16384),
]
_DEFAULT_VOCAB = 32000
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(value: str | int | float) -> int:
    """``"7B"``, ``"350M"``, ``"1.5b"``, ``"7e9"`` or a number -> a parameter count."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise StrategyConfigError(f"the parameter count must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(value).lower())
    if not m or float(m.group(1)) <= 0:
        raise StrategyConfigError(f"cannot read a parameter count from {value!r}; write e.g. 7B, 350M or 1.5e9")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about the model.

    Attributes:
        num_params: all parameters (tied weights counted once).
        num_layers: transformer blocks.
        hidden_size: model width.
        vocab_size: vocabulary (for the logits' memory).
        block_params: parameters of one block (the unit FSDP2/ZeRO-3 gather).
        source: where the numbers come from.
        guessed: which fields were guessed from the parameter count.
    """

    num_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    block_params: int
    source: str
    guessed: tuple[str, ...] = ()

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks (embeddings, head, final norm)."""
        return max(0, self.num_params - self.num_layers * self.block_params)


def _standard_shape(num_params: int) -> tuple[int, int]:
    best = min(_STANDARD_SHAPES, key=lambda s: abs(math.log(s[0]) - math.log(num_params)))
    return best[1], best[2]


def _shape_from_counts(
    num_params: int,
    num_layers: int | None,
    hidden_size: int | None,
    vocab_size: int | None,
    block_params: int | None = None,
    source: str = "parameter count",
) -> ModelShape:
    guessed = []
    if num_layers is None or hidden_size is None:
        std_layers, std_hidden = _standard_shape(num_params)
        if num_layers is None:
            num_layers, guessed = std_layers, [*guessed, "num_layers"]
        if hidden_size is None:
            hidden_size, guessed = std_hidden, [*guessed, "hidden_size"]
    if vocab_size is None:
        vocab_size, guessed = _DEFAULT_VOCAB, [*guessed, "vocab_size"]
    if block_params is None:
        embeddings = vocab_size * hidden_size
        block_params = max(1, (num_params - embeddings) // max(1, num_layers))
    return ModelShape(num_params, num_layers, hidden_size, vocab_size, int(block_params), source, tuple(guessed))


def _config_value(cfg: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(cfg, name, None)
        if value is None and hasattr(cfg, "get_text_config"):
            value = getattr(cfg.get_text_config(), name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _shape_of_module(model: Any, source: str) -> ModelShape:
    """Count a module's parameters (meta tensors are fine) and find its blocks."""
    from .fsdp import find_block_classes

    num_params = sum(p.numel() for p in model.parameters())
    try:
        classes = find_block_classes(model)
        blocks = [m for m in model.modules() if isinstance(m, classes)]
    except StrategyConfigError:
        blocks = []
    cfg = getattr(model, "config", None)
    hidden = _config_value(cfg, "hidden_size", "n_embd", "d_model") if cfg is not None else None
    vocab = _config_value(cfg, "vocab_size") if cfg is not None else None
    layers = len(blocks) or (_config_value(cfg, "num_hidden_layers", "n_layer") if cfg is not None else None)
    block_params = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=None)
    if vocab is None:
        # a plain PyTorch language model: the token embedding is the largest embedding table
        tables = [m.num_embeddings for m in model.modules() if type(m).__name__ == "Embedding"]
        vocab = max(tables, default=None)
    if hidden is None and blocks:
        # the width of a block: the most common input size of its linear layers
        widths = [getattr(m, "in_features", None) for m in blocks[0].modules()]
        widths = [w for w in widths if w]
        hidden = max(set(widths), key=widths.count) if widths else None
    return _shape_from_counts(num_params, layers, hidden, vocab, block_params, source)


def _load_hf_config(path: str) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ImportError("reading a Hugging Face config needs transformers: pip install 'gpufleet[hf]'") from e
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise StrategyConfigError(f"{path} has no 'model_type'; give a Hugging Face config.json or its folder")
        return AutoConfig.for_model(model_type, **data)
    raise StrategyConfigError(f"model {path!r} is neither a folder nor a file; give a local Hugging Face model folder or config.json")


def _shape_of_hf_config(cfg: Any, source: str) -> ModelShape:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            model = AutoModel.from_config(cfg)
    return _shape_of_module(model, source)


def model_shape(model: Any = None, model_params: Any = None, **shape: Any) -> ModelShape:
    """The :class:`ModelShape` of an ``nn.Module``, a HF config (object, folder, json) or a count."""
    if model is not None:
        if isinstance(model, (str, os.PathLike)):
            return _shape_of_hf_config(_load_hf_config(os.fspath(model)), f"Hugging Face config {os.fspath(model)}")
        if hasattr(model, "parameters") and callable(model.parameters):
            return _shape_of_module(model, f"module {type(model).__name__}")
        if hasattr(model, "to_dict") and hasattr(model, "model_type"):
            return _shape_of_hf_config(model, f"Hugging Face config {type(model).__name__}")
        raise StrategyConfigError(
            f"model must be an nn.Module, a Hugging Face config, or the path of a model folder / config.json; got {type(model).__name__}"
        )
    if model_params is None:
        raise StrategyConfigError("say which model: give model_params (e.g. '7B') or a model (module, HF config or path)")
    return _shape_from_counts(parse_count(model_params), shape.get("num_layers"), shape.get("hidden_size"), shape.get("vocab_size"))
