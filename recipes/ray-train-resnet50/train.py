"""Fine-tune torchvision ResNet-50 on an ImageFolder tree with Ray Train (one worker per GPU)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def load_parameters() -> dict[str, Any]:
    """The workload's parameters ($HYPERPARAMETERS_PATH), or an empty dict outside gpufleet."""
    path = os.environ.get("HYPERPARAMETERS_PATH")
    return yaml.safe_load(Path(path).read_text()) or {} if path else {}


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: DDP ResNet-50 over its shard of the images."""
    import ray.train
    import ray.train.torch
    import torch
    from torch import nn
    from torchvision import datasets, models, transforms

    tf = transforms.Compose([
        transforms.RandomResizedCrop(config["image_size"]),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    dataset = datasets.ImageFolder(config["data_dir"], transform=tf)
    loader = torch.utils.data.DataLoader(dataset, batch_size=config["batch_size"], shuffle=True, num_workers=2)
    loader = ray.train.torch.prepare_data_loader(loader)  # DistributedSampler + device placement

    weights = None if str(config["weights"]).lower() == "none" else config["weights"]
    model = models.resnet50(weights=weights)
    model.fc = nn.Linear(model.fc.in_features, len(dataset.classes))  # new head for these classes
    model = ray.train.torch.prepare_model(model)  # DDP on this worker's device
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    world = ray.train.get_context().get_world_size()

    for epoch in range(config["epochs"]):
        if world > 1:
            loader.sampler.set_epoch(epoch)
        model.train()
        seen, correct, total_loss, started = 0, 0, 0.0, time.perf_counter()
        for images, labels in loader:
            logits = model(images)
            loss = loss_fn(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            total_loss += loss.item() * len(labels)
        metrics = {
            "epoch": epoch,
            "loss": total_loss / max(seen, 1),
            "accuracy": correct / max(seen, 1),
            "images_per_second": seen * world / (time.perf_counter() - started),
        }
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ray.train.get_context().get_world_rank() == 0:
                torch.save(model.module.state_dict() if world > 1 else model.state_dict(), Path(tmp) / "model.pt")
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


def log_epochs(result: Any) -> None:
    """Each epoch's metrics (what rank 0 reported to Ray Train) into the attempt's MLflow run.

    The driver logs them: it has the run in its environment, which Ray Train's workers do not.
    """
    try:
        from gpufleet.tracking import log_metrics
    except ImportError:  # an interpreter without gpufleet: nothing is tracked here
        return
    try:
        frame = result.metrics_dataframe  # every report of rank 0, in order
    except Exception:  # a Ray Train without it: the final metrics only
        frame = None
    if frame is None:
        metrics = result.metrics or {}
        log_metrics({k: v for k, v in metrics.items() if k in ("loss", "accuracy", "images_per_second")},
                    step=int(metrics.get("epoch", 0)))
        return
    for row in frame.to_dict("records"):
        metrics = {k: row[k] for k in ("loss", "accuracy", "images_per_second") if k in row}
        log_metrics(metrics, step=int(row.get("epoch", 0)))


def main() -> None:
    """Start the Ray Train run on the cluster (or a local Ray instance) and print its result."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    params = load_parameters()
    config = {
        "data_dir": params.get("data_dir", "data/train"),
        "weights": params.get("weights", "IMAGENET1K_V2"),
        "image_size": int(params.get("image_size", 224)),
        "batch_size": int(params.get("batch_size", 64)),
        "epochs": int(params.get("epochs", 1)),
        "lr": float(params.get("lr", 1e-3)),
    }
    num_workers = params.get("num_workers") or int(os.environ.get("WORLD_SIZE", "1"))
    use_gpu = bool(params.get("use_gpu", True))
    address = os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:  # single machine: a local Ray instance (capped for small machines)
            ray.init(address="local", num_cpus=max(num_workers + 1, 2), include_dashboard=False,
                     object_store_memory=int(params.get("object_store_bytes", 300 * 2**20)))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": 1}),
        run_config=RunConfig(name="resnet50-finetune",
                             storage_path=str(Path(params.get("storage_path", "ray_results")).absolute())),
    )
    result = trainer.fit()
    log_epochs(result)
    summary = {"metrics": result.metrics, "checkpoint": result.checkpoint.path if result.checkpoint else None,
               "num_workers": num_workers}
    print("RESULT " + json.dumps(summary, default=str))
    out = params.get("result_file")
    if out:
        Path(out).write_text(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
