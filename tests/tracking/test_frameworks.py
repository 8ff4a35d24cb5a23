"""Hugging Face Trainer (report_to="mlflow") and Lightning's MLFlowLogger log into the call's run."""

from __future__ import annotations

import os
import uuid

import pytest

from gpufleet import distributed

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

CPU = {"gpus": 2, "gpu_type": "cpu", "stream_logs": False, "timeout": 240}


def hf_train(output_dir: str) -> str:
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (8, 12))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, logging_steps=1,
        report_to=["mlflow"], use_cpu=True, save_strategy="no", disable_tqdm=True,
        learning_rate=1e-3, run_name="hf-tiny-llama",
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return os.environ.get("RANK", "")


def lightning_train() -> int:
    import os

    import lightning as L
    import torch
    from lightning.pytorch.loggers import MLFlowLogger

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    logger = MLFlowLogger(run_id=os.environ["MLFLOW_RUN_ID"], tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    return trainer.global_rank


@pytest.mark.slow
def test_hf_trainer_report_to_mlflow_logs_into_the_call_run(tmp_path) -> None:
    pytest.importorskip("transformers")
    exp = f"test-hf-{uuid.uuid4().hex[:8]}"
    handle = distributed(hf_train, experiment_name=exp, **CPU).submit(str(tmp_path / "out"))
    assert handle.result(timeout=300) == ["0", "1"]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    assert [r.info.run_id for r in runs] == [handle.mlflow_run_id]  # no extra run from the Trainer
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3  # logging_steps=1, max_steps=3
    assert run.data.params["learning_rate"] == "0.001"  # the Trainer's own parameters
    assert run.data.params["gpufleet.world_size"] == "2"


@pytest.mark.slow
def test_lightning_mlflow_logger_logs_into_the_call_run() -> None:
    pytest.importorskip("lightning")
    exp = f"test-pl-{uuid.uuid4().hex[:8]}"
    handle = distributed(lightning_train, experiment_name=exp, **CPU).submit()
    assert handle.result(timeout=300) == [0, 1]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    assert [r.info.run_id for r in runs] == [handle.mlflow_run_id]
    history = client.get_metric_history(handle.mlflow_run_id, "train_loss")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["gpufleet.status"] == "SUCCESS"
