"""SFT of a causal LM with TRL inside Ray Train's TorchTrainer (one DDP worker per GPU)."""

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


def train_loop(p: dict[str, Any]) -> None:
    """One Ray Train worker: TRL SFTTrainer, with Ray's reporting callback and trainer preparation."""
    import ray.train
    import torch
    from datasets import load_dataset
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(p["model"])
    model = AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    dataset = load_dataset("json", data_files=p["train_file"], split="train")
    args = SFTConfig(
        output_dir=p["output_dir"], max_steps=int(p["max_steps"]),
        per_device_train_batch_size=int(p["per_device_batch_size"]), learning_rate=float(p["learning_rate"]),
        lr_scheduler_type="cosine", max_length=int(p["max_length"]), bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=cuda, logging_steps=1, save_strategy="steps", save_steps=int(p["max_steps"]),
        report_to="none", ddp_find_unused_parameters=False,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.add_callback(RayTrainReportCallback())  # metrics + checkpoints to Ray Train
    trainer = prepare_trainer(trainer)
    started = time.perf_counter()
    result = trainer.train()
    tokens = next((h["num_tokens"] for h in reversed(trainer.state.log_history) if "num_tokens" in h), 0)
    summary = {
        "final_train_loss": result.training_loss, "steps": result.global_step,
        "wrapper": type(trainer.model_wrapped).__name__, "seconds": time.perf_counter() - started,
        "tokens_per_second": tokens / max(result.metrics["train_runtime"], 1e-9),  # TRL counts every rank's
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    ray.train.report(summary)
    # Ray Train's Result keeps the metrics of the last checkpoint only; rank 0 leaves the summary for
    # the driver next to the outputs (shared storage on several nodes, like the checkpoints).
    if ray.train.get_context().get_world_rank() == 0:
        Path(p["output_dir"]).mkdir(parents=True, exist_ok=True)
        Path(p["output_dir"], "train_summary.json").write_text(json.dumps(summary))


def log_summary(summary: dict[str, Any]) -> None:
    """The run's numbers into the attempt's MLflow run (the driver has it in its environment;
    Ray Train's workers, where the Trainer logs, do not)."""
    try:
        from gpufleet.tracking import log_metrics
    except ImportError:  # an interpreter without gpufleet: nothing is tracked here
        return
    keys = ("final_train_loss", "steps", "seconds", "tokens_per_second", "peak_memory_gib")
    log_metrics({k: summary[k] for k in keys if isinstance(summary.get(k), (int, float))})


def main() -> None:
    """Start the TorchTrainer on this node's Ray (or the cluster in RAY_ADDRESS) and print its result."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    p = load_parameters()
    num_workers = int(p.get("num_workers") or os.environ.get("WORLD_SIZE", "1"))
    use_gpu = bool(p.get("use_gpu", True))
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            ray.init(address="local", num_cpus=num_workers + 1, include_dashboard=False,
                     object_store_memory=int(p.get("object_store_bytes", 300 * 2**20)))
    trainer = TorchTrainer(
        train_loop, train_loop_config=p,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": 1}),
        run_config=RunConfig(name="qwen25-sft", storage_path=str(Path(p["output_dir"], "ray").absolute())),
    )
    result = trainer.fit()
    final = Path(p["output_dir"], "train_summary.json")
    summary = {**result.metrics, **(json.loads(final.read_text()) if final.exists() else {}), "num_workers": num_workers}
    print("RESULT " + json.dumps(summary, default=str))
    log_summary(summary)
    Path(p["output_dir"]).mkdir(parents=True, exist_ok=True)
    Path(p["output_dir"], "result.json").write_text(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
