"""SFT with a plain PyTorch loop: FSDP2 via gpufleet.strategies, packed sequences, DCP checkpoints.

Chat examples are tokenized with the model's chat template and packed best-fit into sequences
of ``seq_len`` tokens with TRL's ``pack_dataset``; ``position_ids`` (from its ``seq_lengths``)
restart at every packed example, so attention kernels that read them keep examples apart.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml


def load_parameters() -> dict[str, Any]:
    """The workload's parameters ($HYPERPARAMETERS_PATH), or an empty dict outside gpufleet."""
    path = os.environ.get("HYPERPARAMETERS_PATH")
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


def packed_dataset(tokenizer: Any, train_file: str, seq_len: int) -> Any:
    """Tokenize chat examples and pack them into ``seq_len``-token rows (input_ids, seq_lengths)."""
    from datasets import load_dataset
    from trl import pack_dataset

    raw = load_dataset("json", data_files=train_file, split="train")
    tokenized = raw.map(
        lambda ex: {"input_ids": tokenizer.apply_chat_template(ex["messages"], tokenize=True, return_dict=False)},
        remove_columns=raw.column_names,
    )
    return pack_dataset(tokenized, seq_length=seq_len, strategy="bfd")


def main() -> None:
    """Train; every rank resumes from the newest complete checkpoint; rank 0 prints a RESULT line."""
    import torch
    from torch.nn import functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpufleet import runtime
    from gpufleet.checkpoint import CheckpointManager
    from gpufleet.strategies import prepare
    from gpufleet.tracking import log_metrics

    p = load_parameters()
    device = runtime.setup()
    cuda = device.type == "cuda"
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    seq_len, micro = int(p.get("seq_len", 4096)), int(p.get("micro_batch_size", 1))
    tokenizer = AutoTokenizer.from_pretrained(p["model"])
    model = AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(p.get("learning_rate", 1e-5)), weight_decay=0.0)
    prepared = prepare(model.to(device), optimizer, strategy="fsdp2", mixed_precision="bf16" if cuda else "no",
                       activation_checkpointing=bool(p.get("activation_checkpointing", cuda)) and cuda)
    ckpt_root = p.get("checkpoint_dir") or os.environ.get("GPUFLEET_CHECKPOINT_DIR", "checkpoints")
    manager = CheckpointManager(ckpt_root, model=prepared.unwrap(), optimizer=prepared.optimizer, keep_last=2)
    start = manager.resume() or 0
    rows = packed_dataset(tokenizer, p["train_file"], seq_len)
    max_steps, every = int(p.get("max_steps", 100)), int(p.get("checkpoint_every", 100))

    def batch(step: int) -> dict[str, torch.Tensor]:
        # Rows chosen from the step and rank: a resumed attempt reads the same data it would have.
        g = torch.Generator().manual_seed(step)
        order = torch.randperm(len(rows), generator=g).tolist()
        picks = [order[(rank * micro + i) % len(rows)] for i in range(micro)]

        def padded(values_of: Any, fill: int) -> torch.Tensor:
            out = torch.full((micro, seq_len), fill, dtype=torch.long)
            for i, j in enumerate(picks):
                values = values_of(rows[j])[:seq_len]
                out[i, : len(values)] = torch.tensor(values)
            return out.to(device)

        def positions(row: dict[str, Any]) -> list[int]:  # restart at every packed example
            return [pos for n in row["seq_lengths"] for pos in range(n)]

        return {"input_ids": padded(lambda r: r["input_ids"], tokenizer.pad_token_id or 0),
                "position_ids": padded(positions, 0),
                "labels": padded(lambda r: r["input_ids"], -100)}

    started, losses, tokens = time.perf_counter(), [], 0
    for step in range(start, max_steps):
        b = batch(step)
        logits = prepared(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), b["labels"][:, 1:].flatten(), ignore_index=-100)
        prepared.backward(loss)
        prepared.clip_grad_norm(1.0)
        prepared.step()
        prepared.zero_grad()
        losses.append(loss.item())
        tokens += int((b["labels"] != -100).sum()) * world
        log_metrics({"loss": losses[-1]}, step=step + 1)  # rank 0's loss into the attempt's MLflow run
        if every > 0 and ((step + 1) % every == 0 or step + 1 == max_steps):  # 0: no checkpoints
            manager.save(step + 1)
    manager.close()
    if rank == 0:
        seconds = time.perf_counter() - started
        summary = {
            "world_size": world, "strategy": prepared.strategy, "resumed_from": start, "steps": max_steps,
            "packed_rows": len(rows), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "checkpoints": [c.path.name for c in manager.checkpoints()],
        }
        print("RESULT " + json.dumps(summary))
        Path(ckpt_root, "result.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
    from gpufleet import runtime

    runtime.finish()  # ends the process group and exits without Python's teardown, where gloo can abort the rank
