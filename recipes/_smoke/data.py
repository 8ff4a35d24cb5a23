"""Small generated datasets in the formats the recipes read for real."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from .words import WORDS, sentence


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def make_chat_jsonl(
    path: str | Path, num_rows: int = 64, seed: int = 0, system: bool = False, words_per_message: int | None = None
) -> str:
    """Write a conversational SFT dataset: one ``{"messages": [...]}`` object per line.

    Args:
        words_per_message: when given, every user and assistant message has exactly this many words
            (one token each with the local tokenizer), so rows fill long sequences; otherwise 4-12.

    Returns:
        The path written, as a string.
    """
    rng = random.Random(seed)

    def text() -> str:
        if words_per_message is None:
            return sentence(rng)
        return " ".join(rng.choice(WORDS) for _ in range(words_per_message))

    rows = []
    for _ in range(num_rows):
        messages = [{"role": "system", "content": "answer the question"}] if system else []
        messages += [
            {"role": "user", "content": text()},
            {"role": "assistant", "content": text()},
        ]
        rows.append({"messages": messages})
    return _write_jsonl(Path(path), rows)


def make_prompt_completion_jsonl(path: str | Path, num_rows: int = 64, seed: int = 0) -> str:
    """Write a prompt-completion SFT dataset: ``{"prompt": ..., "completion": ...}`` per line."""
    rng = random.Random(seed)
    rows = [{"prompt": sentence(rng), "completion": sentence(rng)} for _ in range(num_rows)]
    return _write_jsonl(Path(path), rows)


def make_invoice_jsonl(path: str | Path, num_rows: int = 64, seed: int = 0) -> str:
    """Write raw invoices: ``{"text": <invoice text>, "entities": {field: value}}`` per line.

    The entity-extraction recipe's data-preparation step turns these into chat examples.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        entities = {
            "invoice_number": str(1000 + i),
            "vendor": rng.choice(WORDS[40:60]),
            "customer": rng.choice(WORDS[60:80]),
            "date": f"{rng.randint(1, 9)} {rng.randint(1, 9)} {rng.randint(0, 9)}",
            "total": str(rng.randint(1, 9)),
        }
        text = (
            f"invoice number {entities['invoice_number']} vendor {entities['vendor']} "
            f"customer {entities['customer']} date {entities['date']} {sentence(rng, 2, 6)} "
            f"total amount {entities['total']}"
        )
        rows.append({"text": text, "entities": entities})
    return _write_jsonl(Path(path), rows)


def make_ratings_csv(
    path: str | Path, num_users: int = 50, num_items: int = 40, num_ratings: int = 800, seed: int = 0
) -> str:
    """Write a ratings table in the MovieLens layout (``userId,movieId,rating,timestamp``).

    Users prefer items whose id has the same parity as theirs, so a model can learn something.
    """
    rng = random.Random(seed)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["userId", "movieId", "rating", "timestamp"])
        for _ in range(num_ratings):
            user, item = rng.randrange(num_users), rng.randrange(num_items)
            base = 4.5 if user % 2 == item % 2 else 1.5
            rating = min(5.0, max(0.5, round(base + rng.uniform(-0.5, 0.5), 1)))
            writer.writerow([user, item, rating, 1_700_000_000 + rng.randrange(10_000_000)])
    return str(p)


def make_token_file(path: str | Path, num_tokens: int = 20_000, vocab_size: int = 256, seed: int = 0) -> str:
    """Write a flat ``uint16`` token file (the nanoGPT ``train.bin`` layout) of a repeating pattern.

    The tokens follow a simple rule (next = current + 1 modulo a small cycle, with noise), so
    a language model's loss visibly falls within a few steps.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    base = np.arange(num_tokens) % min(vocab_size, 64)
    noise = rng.integers(0, vocab_size, size=num_tokens)
    tokens = np.where(rng.random(num_tokens) < 0.1, noise, base).astype(np.uint16)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(p)
    return str(p)
