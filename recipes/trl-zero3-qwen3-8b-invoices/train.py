"""Full SFT for invoice entity extraction with TRL's SFTTrainer and DeepSpeed ZeRO-3 (run under torchrun)."""

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


def accelerate_multi_process_on_cpu() -> None:
    """On CPU workers only: let Accelerate count the DeepSpeed processes on gloo.

    Accelerate 1.15 sees one process when DeepSpeed runs without an accelerator, and its
    metric gathers then fail; GPUs never take this path.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
        "gloo", DistributedType.MULTI_CPU)


def main() -> None:
    """Train on the prepared chat examples, evaluate, save the full 16-bit weights."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    p = load_parameters()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        accelerate_multi_process_on_cpu()
    ds_config = json.loads(Path(__file__).with_name("ds_zero3.json").read_text())
    ds_config["zero_optimization"]["offload_optimizer"]["device"] = p.get("offload_optimizer", "none")
    prepared = Path(p["prepared_dir"])
    output_dir = p["output_dir"]
    args = SFTConfig(  # before from_pretrained, so ZeRO-3 partitions the model while it loads
        output_dir=output_dir,
        max_steps=int(p.get("max_steps", 100)),
        per_device_train_batch_size=int(p.get("per_device_batch_size", 1)),
        gradient_accumulation_steps=int(p.get("gradient_accumulation_steps", 1)),
        learning_rate=float(p.get("learning_rate", 1e-5)),
        lr_scheduler_type="cosine",
        max_length=int(p.get("max_length", 2048)),
        assistant_only_loss=False,
        bf16=cuda,
        gradient_checkpointing=cuda,
        deepspeed=ds_config,
        optim="adamw_torch",
        eval_strategy="steps" if (prepared / "eval.jsonl").stat().st_size else "no",
        eval_steps=int(p.get("eval_steps", 100)),
        logging_steps=int(p.get("logging_steps", 10)),
        save_strategy="no",
        report_to=p.get("report_to", "mlflow" if os.environ.get("MLFLOW_RUN_ID") else "none"),
    )
    tokenizer = AutoTokenizer.from_pretrained(p["model"])
    model = AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    data = load_dataset("json", data_files={"train": str(prepared / "train.jsonl"),
                                            "eval": str(prepared / "eval.jsonl")})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data["train"],
                         eval_dataset=data["eval"] if len(data["eval"]) else None, processing_class=tokenizer)
    started = time.perf_counter()
    result = trainer.train()
    eval_metrics = trainer.evaluate() if len(data["eval"]) else {}
    trainer.save_model(output_dir)
    if trainer.is_world_process_zero():
        tokens = next((h["num_tokens"] for h in reversed(trainer.state.log_history) if "num_tokens" in h), 0)
        summary = {
            "world_size": trainer.args.world_size, "steps": result.global_step, "train_loss": result.training_loss,
            "eval_loss": eval_metrics.get("eval_loss"), "wrapper": type(trainer.model_wrapped).__name__,
            "zero_stage": trainer.model_wrapped.zero_optimization_stage(),
            "seconds": round(time.perf_counter() - started, 2),
            "tokens_per_second": round(tokens / max(result.metrics["train_runtime"], 1e-9), 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        }
        print("RESULT " + json.dumps(summary))
        Path(output_dir, "result.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
    from gpufleet import runtime

    runtime.finish()  # ends the process group and exits without Python's teardown, where gloo can abort the rank
