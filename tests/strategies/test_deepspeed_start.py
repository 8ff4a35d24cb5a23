"""DeepSpeed's start is a long section: the hang watchdog never takes its op build for a hang.

On a new machine ``deepspeed.initialize`` builds DeepSpeed's ops (on CPU its shared-memory op,
a minute or more on two cores): one rank compiles while the others wait for it inside the same
call. The watchdog's fast path, learned from earlier steps of the same call (25 s), once called
that a hang; a section turns the fast path off while it lasts. A fake ``deepspeed`` module stands
in for DeepSpeed here: what is tested is what the rank's progress file (the watchdog's input)
says while ``initialize`` runs and after it returned or raised.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from gpufleet.launch import progress
from gpufleet.strategies import deepspeed as ds_strategy

CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def _sections(tmp_path) -> list[str]:
    path = tmp_path / "progress-0.json"
    progress.write_progress(path)
    return [s["name"] for s in json.loads(path.read_text())["sections"]]


@pytest.fixture
def fake_deepspeed(monkeypatch, tmp_path):
    seen: dict[str, list[str]] = {}

    def initialize(**kwargs):
        seen["during"] = _sections(tmp_path)
        if kwargs["config"].get("fail"):
            raise RuntimeError("the op build failed")
        engine = types.SimpleNamespace(device=torch.device("cpu"), zero_optimization_stage=lambda: 2)
        return engine, object(), None, None

    monkeypatch.setattr(ds_strategy, "import_deepspeed", lambda: types.SimpleNamespace(initialize=initialize))
    monkeypatch.setattr(ds_strategy, "DeepSpeedPreparedModel", lambda *a: a)
    progress.reset()
    yield seen
    progress.reset()


def test_deepspeed_initialize_runs_inside_a_section_that_ends_with_it(fake_deepspeed, tmp_path):
    plan = types.SimpleNamespace(deepspeed_config=dict(CONFIG), mixed_precision="no")
    ds_strategy.prepare_deepspeed(torch.nn.Linear(2, 2), None, plan, torch.device("cpu"))
    assert fake_deepspeed["during"] == ["deepspeed.initialize"]
    assert _sections(tmp_path) == []


def test_the_section_ends_when_deepspeed_initialize_raises(fake_deepspeed, tmp_path):
    plan = types.SimpleNamespace(deepspeed_config={**CONFIG, "fail": True}, mixed_precision="no")
    with pytest.raises(RuntimeError, match="the op build failed"):
        ds_strategy.prepare_deepspeed(torch.nn.Linear(2, 2), None, plan, torch.device("cpu"))
    assert fake_deepspeed["during"] == ["deepspeed.initialize"]
    assert _sections(tmp_path) == []
