"""Shared fixtures of the checkpoint tests: a data directory and an uninterrupted reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.helpers import TOTAL, N, train_on_2
from tests.checkpoint.training import make_data


@pytest.fixture(scope="package")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data")
    make_data(path)
    return path


@pytest.fixture(scope="package")
def straight(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> list[dict]:
    """The reference: TOTAL steps on 2 ranks without interruption."""
    ckpt = tmp_path_factory.mktemp("straight") / "ckpt"
    return train_on_2.distributed(str(ckpt), str(data_dir), TOTAL, save_every=N)

