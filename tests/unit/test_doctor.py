"""`gpufleet doctor`: what it checks, what it tells the user to do, and its exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet import doctor
from gpufleet.cli import main


def test_a_healthy_cpu_machine_passes_with_a_gpu_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "[ok]   Python 3." in out and "[ok]   torch 2." in out and "gloo yes" in out
    assert "[warn] no NVIDIA GPU visible: use gpu_type='cpu'" in out
    assert main(["doctor", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"]["gloo"] is True and report["gpus"] == []
    assert {c["status"] for c in report["checks"]} <= {"ok", "warn"}


def test_an_unwritable_home_fails_and_says_what_to_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GPUFLEET_HOME", str(blocker / "home"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] state folder" in out and "is NOT writable (set GPUFLEET_HOME)" in out


def test_a_missing_extra_is_a_warning_with_its_install_command(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "deepspeed" else real(dist))
    monkeypatch.setattr(doctor, "checkout_root", lambda: None)  # an install from PyPI
    assert main(["doctor"]) == 0
    assert "[warn] extra [deepspeed] not installed (pip install 'gpufleet[deepspeed]')" in capsys.readouterr().out


def test_inside_a_checkout_the_install_command_is_the_checkouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "deepspeed" else real(dist))
    checkout = Path(doctor.__file__).resolve().parents[2]  # these tests run from gpufleet's own source
    assert doctor.checkout_root() == checkout
    monkeypatch.chdir(checkout)
    assert main(["doctor"]) == 0
    assert "[warn] extra [deepspeed] not installed (pip install -e '.[deepspeed]')" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)  # elsewhere: the checkout's path
    assert main(["doctor", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["extras"]["deepspeed"]["hint"] == f"pip install -e '{checkout}[deepspeed]'"
