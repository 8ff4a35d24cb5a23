"""A test that waits for a recipe environment raises that build to the tests' priority.

scripts/test.sh builds the environments at nice 10 so that the tests come first; a build a test
waits for must not sit behind other work while the test's worker idles.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.recipes.nb import raise_build_priority

CHILD = textwrap.dedent(
    """
    import threading, time
    for _ in range(3):  # an installer's worker threads, started before the test waits
        threading.Thread(target=time.sleep, args=(300,), daemon=True).start()
    print("up", flush=True)
    time.sleep(300)
    """
)


def _nice_of_threads(proc: psutil.Process) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, t.id) for t in proc.threads()]


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root (CI runs as root)")
def test_the_build_a_test_waits_for_runs_at_the_tests_priority(tmp_path: Path) -> None:
    script = tmp_path / "recipe_env.sh"  # stands for scripts/recipe_env.sh NAME: a shell and its installer
    script.write_text(f'#!/bin/bash\n"{sys.executable}" -c "$CHILD"\n')
    script.chmod(0o755)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    env = {**os.environ, "CHILD": CHILD}
    build = subprocess.Popen(["nice", "-n", "10", str(script), "vision"], env=env, stdout=subprocess.PIPE, text=True)
    # another environment's build: left as it is
    elsewhere = subprocess.Popen(["nice", "-n", "10", str(script), "trl"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert build.stdout.readline().strip() == "up" and elsewhere.stdout.readline().strip() == "up"
        shell = psutil.Process(build.pid)
        installer = shell.children()[0]
        assert set(_nice_of_threads(installer)) == {ours + 10} and len(installer.threads()) == 4

        raised = raise_build_priority("vision")

        assert raised == 5  # the shell, and the installer's 4 threads
        assert _nice_of_threads(shell) == [ours]
        assert set(_nice_of_threads(installer)) == {ours}
        other_installer = psutil.Process(elsewhere.pid).children()[0]
        assert set(_nice_of_threads(other_installer)) == {ours + 10}
        assert raise_build_priority("vision") == 0  # nothing left to raise
    finally:
        for proc in (build, elsewhere):
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait(10)
