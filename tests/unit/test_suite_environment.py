"""What every process the suite starts finds on PATH (tests/conftest.py puts the test environment's
own tools first, as an activated environment does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gpufleet import distributed

ENV_NINJA = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "ninja")


def _ninja() -> str | None:
    return shutil.which("ninja")


def test_ranks_and_their_children_build_with_the_environments_ninja() -> None:
    """torch builds DeepSpeed's op with the `ninja` on PATH. Two ninja versions (the system's and
    the environment's) each read the other's build log as foreign and build the op again: two
    minutes of both cores per build on a 2-core machine. Every rank and subprocess sees one."""
    if not os.access(ENV_NINJA, os.X_OK):
        pytest.skip(f"the test environment has no {ENV_NINJA} (DeepSpeed's `ninja` dependency)")
    assert _ninja() == ENV_NINJA
    child = subprocess.run(["sh", "-c", "command -v ninja"], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == ENV_NINJA
    assert distributed(gpus=2, gpu_type="cpu")(_ninja).distributed() == [ENV_NINJA, ENV_NINJA]
