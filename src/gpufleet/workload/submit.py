"""Turning a workload file into a plan (dry run) or a stored run with a running supervisor."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from ..private import private_dir, private_file_opener
from ..results import new_run_id
from .liveness import list_runs, process_start_time
from .schema import Problem, WorkloadConfig, WorkloadValidationError, load_workload
from .snapshot import check_code_source, list_files, snapshot
from .store import FAILED, PENDING, RunRecord, RunStore

logger = logging.getLogger(__name__)


def code_root(config: WorkloadConfig, workload_path: Path) -> Path | None:
    """The absolute code folder of a workload (relative paths start at the workload file)."""
    if config.code_source is None:
        return None
    root = Path(os.path.expanduser(config.code_source.root_path))
    if not root.is_absolute():
        root = workload_path.resolve().parent / root
    return root.resolve()


def load_and_check(path: str | Path, overrides: list[str] | None = None) -> tuple[WorkloadConfig, Path | None]:
    """Load, override and validate a workload file, and check its code source on disk."""
    p = Path(path)
    config, _ = load_workload(p, overrides)
    root = code_root(config, p)
    if root is not None:
        problems = check_code_source(root, config.code_source.include_paths if config.code_source else None)
        if problems:
            raise WorkloadValidationError(
                [Problem(m.split(": ", 1)[0], m.split(": ", 1)[1]) for m in problems], str(p)
            )
    return config, root


def local_gpu_problem(config: WorkloadConfig) -> str | None:
    """Why this machine cannot run a single-node GPU workload, or None when it can."""
    from .nodes import needs_cluster

    gpu_type = config.compute.gpu_type
    if gpu_type is None or needs_cluster(config):
        return None
    from ..errors import GpufleetError
    from ..launch.gpus import resolve_local

    try:
        resolve_local(config.compute.per_node, gpu_type)
    except GpufleetError as e:
        return str(e)
    return None


def plan(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """What ``run`` would do, resolved without starting anything or needing GPUs."""
    from .envs import env_hash
    from .nodes import RAY_EXECUTOR_MODULE, needs_cluster

    config, root = load_and_check(path, overrides)
    c = config.compute
    files = list_files(root, config.code_source.include_paths) if root and config.code_source else []
    out: dict[str, Any] = {
        "valid": True,
        "experiment_name": config.experiment_name,
        "accelerator_type": c.accelerator_type,
        "accelerator": "cpu" if c.gpu_type is None else c.gpu_type,
        "num_nodes": c.num_nodes,
        "accelerators_per_node": c.per_node,
        "world_size": c.num_accelerators,
        "cluster": c.cluster,
        "ray_driver": c.ray_driver,
        "command_runs": c.command_nodes,
        "executor": RAY_EXECUTOR_MODULE if needs_cluster(config) else "local",
        "code_root": str(root) if root else None,
        "code_files": len(files),
        "dependencies": config.environment.dependencies,
        "environment_hash": env_hash(config.environment.dependencies) if config.environment.dependencies else None,
        "max_attempts": config.max_retries + 1,
        "timeout_minutes": config.timeout_minutes,
        "parameters": config.parameters,
        "node_env": {
            "NUM_NODES": str(c.num_nodes),
            "NODE_RANK": "0.." + str(c.num_nodes - 1) if c.command_nodes > 1 else "0",
            "WORLD_SIZE": str(c.num_accelerators),
            "LOCAL_WORLD_SIZE": str(c.per_node),
            **config.env_strings(),
        },
        "command": config.command,
        "warnings": [],
    }
    problem = local_gpu_problem(config)
    if problem:
        out["warnings"].append(f"this machine could not run it now: {problem}")
    return out


def submit(
    path: str | Path,
    overrides: list[str] | None = None,
    idempotency_key: str | None = None,
    tracking: bool = True,
    home: str | Path | None = None,
) -> tuple[RunRecord, bool]:
    """Validate a workload, store a PENDING run, snapshot its code and start its supervisor.

    Returns ``(run, created)``; ``created`` is False when ``idempotency_key`` named an
    existing run, which is returned unchanged.
    """
    from ..errors import GPUUnavailableError
    from .nodes import check_executor_available
    from .runner import start_supervisor

    p = Path(path)
    config, root = load_and_check(p, overrides)
    store = RunStore(home)
    if idempotency_key is not None:
        existing = list_runs(store, states=None, limit=1, filters={"idempotency_key": idempotency_key})
        if existing:
            return existing[0], False
    check_executor_available(config)
    problem = local_gpu_problem(config)
    if problem:
        raise GPUUnavailableError(problem)
    resolved = config
    if config.code_source is not None and root is not None:
        resolved = config.model_copy(
            update={"code_source": config.code_source.model_copy(update={"root_path": str(root)})}
        )
    runs_dir = private_dir(store.runs_dir, "the workload runs folder")  # before anything is stored
    run_id = new_run_id(config.experiment_name)
    run_dir = runs_dir / run_id
    record = RunRecord(
        id=run_id,
        experiment=config.experiment_name,
        state=PENDING,
        created_at=_now(),
        config=resolved.model_dump(mode="json"),
        run_dir=str(run_dir),
        num_nodes=config.compute.num_nodes,
        world_size=config.compute.num_accelerators,
        max_attempts=config.max_retries + 1,
        tracking=tracking,
        idempotency_key=idempotency_key,
        workload_path=str(p.resolve()),
    )
    run, created = store.create_run(record)
    if not created:
        return run, False
    try:
        private_dir(run_dir, "the run folder")
        code_dir = private_dir(run_dir / "code", "the run's code snapshot")
        if root is not None and config.code_source is not None:
            snapshot(root, code_dir, config.code_source.include_paths)
        _write_private(run_dir / "hyperparameters.yaml", config.parameters)
        _write_private(run_dir / "workload.yaml", resolved.model_dump(mode="json"))
        proc = start_supervisor(run_id, store.home, run_dir)
    except Exception as e:
        store.finish_run(run_id, FAILED, message=f"could not start the run: {e}")
        raise
    try:
        started: float | None = process_start_time(proc.pid)
    except Exception:  # it already exited: the liveness check will see that
        started = None
    store.update_run(run_id, supervisor_pid=proc.pid, supervisor_started=started)
    return store.get(run_id), True


def _write_private(path: Path, document: Any) -> None:
    """Write ``document`` as YAML to a new 0600 file."""
    with open(path, "w", encoding="utf-8", opener=private_file_opener) as f:
        f.write(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))


def _now() -> float:
    import time

    return time.time()
