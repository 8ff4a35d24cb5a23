"""One local engine for both payloads: a call's ranks and a workload's node command go through the same code.

Each test runs once per payload, as the two front doors build them: a call's
:class:`LocalWorkerGroup` (its ranks run ``python -m gpufleet.launch.worker``) and a workload's
:class:`WorkloadNodeGroup` (its node runs the command under the node guard). A spy on
:class:`LocalEngine` proves that both were placed, started, stopped and released by it. The GPUs
are fake (``GPUFLEET_FAKE_GPUS=2``): the lease code of real ones, in a private lease folder.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest

from gpufleet.errors import GPUUnavailableError
from gpufleet.launch.engines.local.engine import LocalEngine
from gpufleet.launch.engines.local.group import LocalPlacement, LocalWorkerGroup
from gpufleet.launch.failures import STOPPED
from gpufleet.launch.group import WorkerGroup
from gpufleet.launch.leasing.leases import GpuRequest, gpu_uses
from gpufleet.launch.logstream import LogConfig
from gpufleet.launch.spec import LaunchSpec, Payload
from gpufleet.results import RunDir, new_run_id
from gpufleet.workload.nodes import WorkloadNodeGroup
from tests.groups import run_group, until

PAYLOADS = ("call", "workload")
SEEN = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "GPUFLEET_RUN_ID", "WORLD_SIZE")

#: What both payloads run (the call as a function, the node as ``python -c``): write the
#: environment, then end as ``mode`` says (``ok``; ``fail``: exit code 3; ``hang``: until stopped).
PROBE = f"""
import json, os, sys, time
def probe(out, mode):
    with open(os.path.join(out, "env.json"), "w") as f:
        json.dump({{k: os.environ.get(k) for k in {SEEN!r}}}, f)
    if mode == "fail":
        os._exit(3)
    while mode == "hang":
        time.sleep(0.1)
"""


def _probe(out: str, mode: str) -> None:
    scope: dict[str, Any] = {}
    exec(PROBE, scope)  # noqa: S102 - the same code the node command runs
    scope["probe"](out, mode)


@pytest.fixture(autouse=True)
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")
    monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """What the local engine was asked to do: ``(method, payload of the unit or holder kind)``."""
    seen: list[tuple[str, str]] = []
    real = {name: getattr(LocalEngine, name) for name in ("rendezvous", "start", "stop_processes", "release")}

    def spy(name: str) -> Any:
        def method(self: LocalEngine, *args: Any, **kwargs: Any) -> Any:
            what = self.holder
            if name == "start":
                what = "workload" if args[0].command is not None else "call"
            seen.append((name.replace("_processes", ""), what))  # stop() stops the processes of its units
            return real[name](self, *args, **kwargs)

        return method

    for name in real:
        monkeypatch.setattr(LocalEngine, name, spy(name))
    return seen


def _group(payload: str, tmp_path: Path, mode: str) -> tuple[WorkerGroup, Path]:
    run_id = new_run_id(f"engine-{payload}")
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    run_dir = RunDir.create(str(tmp_path / "runs"), run_id)
    if payload == "call":
        call = cloudpickle.dumps((_probe, (str(out), mode), {}))
        spec = LaunchSpec(run_id, 1, use_gpus=True, env={}, payload=Payload(call, tuple(p for p in sys.path if p)))
        placement = LocalPlacement(True, gpu_request=GpuRequest(count=1, wait_s=0))
        return LocalWorkerGroup(spec, run_dir, placement, LogConfig(enabled=False), grace_period_s=1.0), out
    engine = LocalEngine(run_id, GpuRequest(count=1, wait_s=0), holder="workload", report_after_s=0.0)
    spec = LaunchSpec(run_id, 1, num_nodes=1, use_gpus=True, env={"GPUFLEET_RUN_DIR": str(run_dir.path)})
    command = f"{sys.executable} -c {_quote(PROBE + f'probe({str(out)!r}, {mode!r})')}"
    group = WorkloadNodeGroup(spec, run_dir, engine, command, str(tmp_path), num_command_nodes=1,
                              local_world_size=1, inherited_env=os.environ)  # fmt: skip
    return group, out


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _holders() -> dict[int, tuple[str, str] | None]:
    return {u.gpu.index: (u.holder.run_id, u.holder.kind) if u.holder else None for u in gpu_uses()}


def _gpus_free() -> bool:
    return all(h is None for h in _holders().values())


@pytest.fixture
def groups() -> Iterator[list[WorkerGroup]]:
    made: list[WorkerGroup] = []
    yield made
    for g in made:  # a test that failed half-way leaves nothing running
        g.stop("test over", 0.5)
        g.close(False)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_both_payloads_run_on_the_leased_gpu_with_the_contract_and_give_it_back(
    payload: str, tmp_path: Path, engine_calls: list[tuple[str, str]], groups: list[WorkerGroup]
) -> None:
    group, out = _group(payload, tmp_path, "ok")
    groups.append(group)
    status = run_group(group, poll_s=0.05)
    assert status.succeeded and not status.failures, status.failures
    env = json.loads((out / "env.json").read_text())
    leased = str(group.engine.gpu_indices[0]) if payload == "call" else str(group.executor.gpu_indices[0])
    assert env["CUDA_VISIBLE_DEVICES"] == leased and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", env
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0, env
    assert env["GPUFLEET_RUN_ID"] == group.run_id and env["WORLD_SIZE"] == "1", env
    assert _holders()[int(leased)] == (group.run_id, payload)  # held while the attempt lasts, named by kind
    group.close(True)
    until("the lease goes back once the unit is gone", _gpus_free)
    assert [c for c in engine_calls if c[0] != "release"][:2] == [("rendezvous", payload), ("start", payload)]
    assert ("release", payload) in engine_calls


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_failing_unit_is_a_failure_with_its_exit_code_on_both_payloads(
    payload: str, tmp_path: Path, engine_calls: list[tuple[str, str]], groups: list[WorkerGroup]
) -> None:
    group, _ = _group(payload, tmp_path, "fail")
    groups.append(group)
    status = run_group(group, poll_s=0.05)
    failure = status.failures[0]
    assert failure.exit_code == 3 and failure.rank == 0, failure
    group.close(False)
    assert _gpus_free()
    assert ("start", payload) in engine_calls and ("release", payload) in engine_calls


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_stop_ends_the_unit_and_its_children_and_frees_the_gpu_on_both_payloads(
    payload: str, tmp_path: Path, engine_calls: list[tuple[str, str]], groups: list[WorkerGroup]
) -> None:
    group, out = _group(payload, tmp_path, "hang")
    groups.append(group)
    group.start()
    until("the unit runs", lambda: (out / "env.json").exists())
    leader = group.pids[0] if payload == "call" else group.nodes[0].pid
    tree = [leader] + [c.pid for c in psutil.Process(leader).children(recursive=True)]
    status = group.stop("canceled by the test", 1.0)
    assert status.failures[0].kind == STOPPED and status.failures[0].message == "canceled by the test"
    assert not [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    group.close(False)
    assert _gpus_free()
    assert ("stop", payload) in engine_calls


def test_a_second_unit_waits_for_the_gpu_the_first_holds_whatever_its_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: list[WorkerGroup]
) -> None:
    """One lease path: a workload and a call that want the last free GPU see each other."""
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "1")
    first, out = _group("workload", tmp_path / "a", "hang")
    groups.append(first)
    first.start()
    until("the node runs", lambda: (out / "env.json").exists())
    second, _ = _group("call", tmp_path / "b", "ok")
    groups.append(second)
    with pytest.raises(GPUUnavailableError, match=first.run_id):
        second.start()  # no wait: the request's wait_s is 0
