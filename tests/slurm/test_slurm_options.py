"""The decorator's Slurm settings are checked before anything is submitted (no cluster needed)."""

from __future__ import annotations

import pytest

from gpufleet import distributed
from gpufleet.errors import LaunchConfigError


def noop() -> None:
    pass


def test_wrong_slurm_settings_are_refused_with_every_problem() -> None:
    with pytest.raises(LaunchConfigError) as info:
        distributed(noop, gpus=2, gpu_type="cpu", remote="slurm",
                    slurm={"partiton": "gpu", "time": "soon", "sbatch_args": ["--ntasks=9"]})  # fmt: skip
    text = str(info.value)
    assert "unknown key 'partiton'" in text and "allowed keys:" in text and "partition" in text
    assert "time 'soon' is not a Slurm time limit" in text
    assert "--ntasks is set by gpufleet" in text


def test_slurm_settings_need_remote_slurm() -> None:
    with pytest.raises(LaunchConfigError, match="remote='slurm'"):
        distributed(noop, gpus=2, gpu_type="cpu", slurm={"partition": "gpu"})
