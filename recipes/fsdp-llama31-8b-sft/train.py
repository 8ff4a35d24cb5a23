"""Full SFT of a causal LM with TRL's SFTTrainer and Hugging Face's FSDP switch (run under torchrun)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from trl import SFTConfig


def load_parameters() -> dict[str, Any]:
    """The workload's parameters ($HYPERPARAMETERS_PATH), or an empty dict outside gpufleet."""
    path = os.environ.get("HYPERPARAMETERS_PATH")
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


def sft_config(p: dict[str, Any], output_dir: str, layer_classes: list[str], cuda: bool) -> SFTConfig:
    """Build the SFTConfig: FSDP per decoder layer, activation checkpointing through ``fsdp_config`` only.

    Transformers refuses ``gradient_checkpointing`` (on by default in ``SFTConfig``) together with FSDP's
    ``activation_checkpointing``; under FSDP the latter is the one to use (no extra all-gather in backward),
    so ``gradient_checkpointing`` is always off here.

    Args:
        p: The workload's parameters.
        output_dir: Where checkpoints and the final model go.
        layer_classes: Class names of the decoder layers FSDP wraps (``model._no_split_modules``).
        cuda: Whether training runs on GPUs (bf16, FSDP, activation checkpointing) or on CPU workers.

    Returns:
        The ``trl.SFTConfig`` the trainer runs with.
    """
    from trl import SFTConfig

    return SFTConfig(
        output_dir=output_dir,
        max_steps=int(p.get("max_steps", 100)),
        per_device_train_batch_size=int(p.get("per_device_batch_size", 1)),
        gradient_accumulation_steps=int(p.get("gradient_accumulation_steps", 1)),
        learning_rate=float(p.get("learning_rate", 1e-5)),
        lr_scheduler_type="cosine",
        warmup_steps=int(p.get("warmup_steps", 0)),
        max_length=int(p.get("max_length", 2048)),
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,  # FSDP's activation_checkpointing below does it (on GPUs)
        fsdp=True,  # sharding on GPUs; Accelerate runs plain DDP on CPU workers
        fsdp_config={
            "version": int(p.get("fsdp_version", 2)),
            "transformer_layer_cls_to_wrap": layer_classes,
            "activation_checkpointing": bool(p.get("activation_checkpointing", cuda)) and cuda,
            "state_dict_type": "SHARDED_STATE_DICT",
            "reshard_after_forward": True,
        },
        logging_steps=int(p.get("logging_steps", 10)),
        save_strategy="steps",
        save_steps=int(p.get("save_steps", 500)),
        save_total_limit=2,
        report_to=p.get("report_to", "mlflow" if os.environ.get("MLFLOW_RUN_ID") else "none"),
    )


def main() -> None:
    """Load model and chat data, shard with FSDP, train, save; rank 0 prints a RESULT line."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    p = load_parameters()
    cuda = torch.cuda.is_available()
    if not cuda:
        # Accelerate names a CPU worker's device `cpu:0`, and the Trainer reads a checkpoint's
        # optimizer state to that device on resume, which torch refuses ("don't know how to restore
        # data location ... (tagged with cpu:0)"): plain `cpu`, Accelerate's own override
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    tokenizer = AutoTokenizer.from_pretrained(p["model"])
    model = AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    dataset = load_dataset("json", data_files=p["train_file"], split="train")
    output_dir = p.get("output_dir") or os.path.join(os.environ.get("GPUFLEET_CHECKPOINT_DIR", "."), "sft")
    args = sft_config(p, output_dir, list(model._no_split_modules), cuda)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    resume = latest_checkpoint(output_dir)  # a retried attempt (or a longer run) continues from it
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(output_dir)
    if trainer.is_world_process_zero():
        tokens = next((h["num_tokens"] for h in reversed(trainer.state.log_history) if "num_tokens" in h), 0)
        summary = {
            "world_size": trainer.args.world_size, "steps": result.global_step, "train_loss": result.training_loss,
            "wrapper": type(trainer.model_wrapped).__name__, "seconds": round(time.perf_counter() - started, 2),
            "tokens_per_second": round(tokens / max(result.metrics["train_runtime"], 1e-9), 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "resumed_from": Path(resume).name if resume else None,
        }
        print("RESULT " + json.dumps(summary))
        Path(output_dir, "result.json").write_text(json.dumps(summary))


def latest_checkpoint(output_dir: str) -> str | None:
    """The Trainer's newest ``checkpoint-<step>`` folder in ``output_dir`` (None: none yet)."""
    steps = [(int(c.name.split("-")[1]), c) for c in Path(output_dir).glob("checkpoint-*") if c.name.split("-")[1].isdigit()]
    return str(max(steps)[1]) if steps else None


if __name__ == "__main__":
    main()
    from gpufleet import runtime

    runtime.finish()  # ends the process group and exits without Python's teardown, where gloo can abort the rank
