"""Tiny stand-ins for the recipes' models and datasets, built locally in their real formats.

Every recipe loads its model with ``from_pretrained(path_or_name)`` and its data with the
framework's real reader; in smoke mode the path points at what these helpers write: a tiny
model of the same architecture with random weights, a tokenizer trained in-process, and a
small generated dataset (chat / prompt-completion JSONL, COCO folder, image folder, ratings
CSV). Nothing is downloaded.
"""

from __future__ import annotations

from .data import (
    make_chat_jsonl,
    make_invoice_jsonl,
    make_prompt_completion_jsonl,
    make_ratings_csv,
    make_token_file,
)
from .lm import ARCH_OVERRIDES, make_tiny_causal_lm, make_tokenizer
from .vision import make_coco_folder, make_image_folder

__all__ = [
    "ARCH_OVERRIDES",
    "make_chat_jsonl",
    "make_coco_folder",
    "make_image_folder",
    "make_invoice_jsonl",
    "make_prompt_completion_jsonl",
    "make_ratings_csv",
    "make_tiny_causal_lm",
    "make_token_file",
    "make_tokenizer",
]
