"""Turn raw invoices into chat examples for entity extraction (train / eval JSONL).

Input: one ``{"text": <invoice text>, "entities": {field: value}}`` per line. Output: one
``{"messages": [system, user, assistant]}`` per line, the assistant answering with the
entities as JSON, split into ``train.jsonl`` and ``eval.jsonl`` by a stable hash of the text.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml

SYSTEM = "extract the invoice fields and answer with json"
FIELDS = ("invoice_number", "vendor", "customer", "date", "total")


def load_parameters() -> dict[str, Any]:
    """The workload's parameters ($HYPERPARAMETERS_PATH), or an empty dict outside gpufleet."""
    path = os.environ.get("HYPERPARAMETERS_PATH")
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


def to_example(row: dict[str, Any]) -> dict[str, Any]:
    """One chat example: the invoice text in, the known fields as JSON out."""
    answer = json.dumps({k: row["entities"].get(k) for k in FIELDS})
    return {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": row["text"]},
        {"role": "assistant", "content": answer},
    ]}


def main() -> None:
    """Read, validate, convert and split; print the counts."""
    p = load_parameters()
    out = Path(p["prepared_dir"])
    out.mkdir(parents=True, exist_ok=True)
    eval_fraction = float(p.get("eval_fraction", 0.05))
    counts = {"train": 0, "eval": 0, "skipped": 0}
    with open(p["raw_invoices"], encoding="utf-8") as src, \
            (out / "train.jsonl").open("w", encoding="utf-8") as train, \
            (out / "eval.jsonl").open("w", encoding="utf-8") as evaluation:
        for line in src:
            if not line.strip():
                continue
            row = json.loads(line)
            if not row.get("text") or not isinstance(row.get("entities"), dict):
                counts["skipped"] += 1
                continue
            bucket = int(hashlib.sha256(row["text"].encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
            split = "eval" if bucket < eval_fraction else "train"
            (evaluation if split == "eval" else train).write(json.dumps(to_example(row)) + "\n")
            counts[split] += 1
    print("PREPARED " + json.dumps(counts))


if __name__ == "__main__":
    main()
