"""``ray_launch``: the ranks form a Ray cluster and the function drives a Ray Train job."""

from __future__ import annotations

import pytest

from gpufleet import ray_launch

pytestmark = [pytest.mark.ray, pytest.mark.slow]

pytest.importorskip("ray.train")

START_ARGS = ["--object-store-memory=100000000"]


def _train_two_workers(storage: str) -> dict[str, object]:
    import os

    import ray
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config: dict) -> None:
        import os
        import tempfile

        import ray.train
        import ray.train.torch

        torch.manual_seed(0)
        model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(32, 4), torch.randn(32, 1)
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        ctx = ray.train.get_context()
        metrics = {"loss": loss.item(), "world": ctx.get_world_size(), "rank": ctx.get_world_rank()}
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)

    trainer = TorchTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name="tiny"),
    )
    result = trainer.fit()
    return {
        "metrics": result.metrics,
        "checkpoint_files": os.listdir(result.checkpoint.path),
        "cpus": ray.cluster_resources().get("CPU"),
        "addresses": sorted({n["NodeManagerAddress"] for n in ray.nodes()}),
    }


def _fails_inside() -> None:
    import ray

    @ray.remote
    def boom() -> None:
        raise KeyError("missing-column")

    try:
        ray.get(boom.remote())
    except ray.exceptions.RayTaskError as e:
        raise LookupError(f"the Ray task failed: {e.cause!r}") from None


def test_ray_train_job_runs_inside(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)  # the suite's own loopback setting: off
    f = ray_launch(
        _train_two_workers, gpus=2, gpu_type="cpu", runs_dir=str(tmp_path / "runs"),
        ray_start_args=START_ARGS, timeout=240,
    )
    results = f.distributed(str(tmp_path / "ray_results"))
    assert len(results) == 2 and results[1] is None
    assert results[0]["cpus"] == 2.0
    assert results[0]["addresses"] == ["127.0.0.1"]  # the head registered loopback, not the network address
    metrics = results[0]["metrics"]
    assert metrics["world"] == 2 and metrics["loss"] > 0
    assert results[0]["checkpoint_files"] == ["model.pt"]


def test_driver_error_keeps_its_type_and_stops_ray(tmp_path):
    f = ray_launch(
        _fails_inside, gpus=1, gpu_type="cpu", runs_dir=str(tmp_path / "runs"),
        ray_start_args=START_ARGS, timeout=120,
    )
    with pytest.raises(LookupError, match="missing-column"):
        f.distributed()


def _cluster_cpus() -> float:
    import ray

    return ray.cluster_resources()["CPU"]


def test_remote_uses_the_existing_cluster_and_says_gpus_are_not_used(two_nodes, tmp_path):
    f = ray_launch(_cluster_cpus, remote=two_nodes.address, runs_dir=str(tmp_path / "runs"), timeout=120)
    assert f.distributed() == [2.0]  # the two 1-CPU raylets of the existing cluster
    with pytest.warns(UserWarning, match=r"gpus=2 and gpu_type='H100' are not used"):
        ray_launch(_cluster_cpus, gpus=2, gpu_type="H100", remote=two_nodes.address)
