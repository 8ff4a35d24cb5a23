"""A multi-node workload's node command dies with the Ray actor that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.workload.helpers import tiny_wheel

ACTOR = textwrap.dedent(
    """
    import sys, time
    from gpufleet.launch.engines.ray.actor import NodeCommand

    node = NodeCommand("guard-test", 0)
    node.start("sleep 300 & echo $! > " + sys.argv[1] + "; wait", {}, sys.argv[2], {})
    print("started", flush=True)
    time.sleep(600)
    """
)


def _pid_from(marker: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text())
        time.sleep(0.05)
    raise AssertionError("the node command did not start")


def test_the_node_command_stops_when_its_actor_process_is_killed(tmp_path: Path) -> None:
    script, marker = tmp_path / "actor.py", tmp_path / "sleep.pid"
    script.write_text(ACTOR)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    actor = subprocess.Popen([sys.executable, str(script), str(marker), str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert actor.stdout is not None and actor.stdout.readline().strip() == "started"
        sleeper = psutil.Process(_pid_from(marker))
        assert sleeper.is_running()
        actor.send_signal(signal.SIGKILL)  # as when Ray kills the actor or its raylet dies
        actor.wait()
        gone, alive = psutil.wait_procs([sleeper], timeout=60)
        assert not alive, "the node's command kept running after its actor was killed"
    finally:
        actor.kill()
        actor.wait()
        try:
            psutil.Process(int(marker.read_text())).kill()
        except (psutil.Error, ValueError, FileNotFoundError):
            pass


def _run_node(node, command: str, env: dict[str, str], cwd: str) -> tuple[int, str]:
    """Start ``command`` in a NodeCommand, collect its output until it exits; exit code and output."""
    node.start(command, env, cwd, {})
    out, deadline = b"", time.monotonic() + 120
    report = {"exit_code": None}
    while time.monotonic() < deadline:
        report = node.poll(0.5)
        out += b"".join(line for _, line in report["lines"])
        if report["exit_code"] is not None:
            break
    node.stop(1.0)
    return report["exit_code"], out.decode()


def test_a_node_without_the_run_folder_runs_in_the_code_ray_shipped(tmp_path: Path, monkeypatch) -> None:
    """No shared storage: the run's code folder is missing on the node, Ray's copy is used."""
    from gpufleet.launch.engines.ray.actor import SHIPPED_CODE_ENV, NodeCommand

    shipped = tmp_path / "ray-working-dir"  # where Ray unpacks runtime_env working_dir
    shipped.mkdir()
    (shipped / "train.py").write_text("print('hello from the snapshot')\n")
    monkeypatch.chdir(shipped)
    missing = str(tmp_path / "home-on-the-submitter" / "runs" / "r1" / "code")
    node = NodeCommand("shipped-test", 1)
    with pytest.raises(FileNotFoundError, match="is not on node .*storage every node mounts"):
        node.start("true", {}, missing, {})  # without a shipped copy: the clear error
    monkeypatch.setenv(SHIPPED_CODE_ENV, "1")
    code, text = _run_node(node, f'pwd; echo "code=$CODE_SOURCE_PATH"; {sys.executable} train.py',
                           {"CODE_SOURCE_PATH": missing}, missing)
    assert code == 0, text
    assert f"{shipped}\n" in text and f"code={shipped}" in text and "hello from the snapshot" in text


def test_a_node_without_the_run_environment_builds_it_from_the_dependencies(tmp_path: Path, monkeypatch) -> None:
    """No shared storage: the node builds the run's environment itself, once per dependency list."""
    import json

    from gpufleet.launch.engines.ray.actor import NodeCommand

    wheel = tiny_wheel(tmp_path)
    env = {
        "GPUFLEET_SUPERVISOR_BIN": str(tmp_path / "submitter" / "envs" / "abc" / "bin"),  # not on this node
        "GPUFLEET_DEPENDENCIES": json.dumps([f"gfnodedemo @ {wheel.as_uri()}"]),
        "GPUFLEET_HOME": str(tmp_path / "node-home"),
    }
    command = 'python -c "import gfnodedemo, sys; print(gfnodedemo.VALUE, sys.prefix)"'
    code, text = _run_node(NodeCommand("deps-test", 1), command, env, str(tmp_path))
    assert code == 0, text
    envs = tmp_path / "node-home" / "envs"
    built = [p for p in envs.iterdir() if p.is_dir()]
    assert len(built) == 1 and f"installed on this node {built[0]}" in text, text
    assert "building environment" in text  # pip's output is in the node's log
    code, text = _run_node(NodeCommand("deps-test", 1), command, env, str(tmp_path))
    assert code == 0 and "reusing environment" in text and f"installed on this node {built[0]}" in text, text

    env["GPUFLEET_DEPENDENCIES"] = json.dumps(["gfnodedemo @ file:///nonexistent/gfnodedemo-0.1-py3-none-any.whl"])
    code, text = _run_node(NodeCommand("deps-test", 1), command, env, str(tmp_path))
    assert code == 97 and "could not build the run's environment on this node" in text, text
