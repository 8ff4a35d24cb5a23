"""Turning a workload file into a plan (dry run) or a stored run with a running supervisor.

One concern past 400 lines: the way from a workload file to a submitted run (validation, the
plan, the code snapshot's listing, the stored record, the first MLflow run and the handoff).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..launch.node import envcontract
from ..private import private_dir, private_file_opener
from ..results import new_run_id
from ..runs.liveness import list_runs, process_start_time
from ..runs.store import FAILED, PENDING, RunRecord, RunStore
from .schema import Problem, WorkloadConfig, WorkloadValidationError, load_workload
from .snapshot import check_code_source, list_files, scan, snapshot

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
    """Load, override and validate a workload file, and check its code source on disk: every
    problem at once (the folder and files on disk too, when the rest of the file is wrong)."""
    p = Path(path)
    try:
        config, _ = load_workload(p, overrides)
    except WorkloadValidationError as e:
        if e.document is None:  # not read or not parsed: nothing more can be checked
            raise
        raise WorkloadValidationError(e.problems + _disk_problems(_valid_parts(e.document), p), e.source) from None
    problems = _disk_problems(config, p)
    if problems:
        raise WorkloadValidationError(problems, str(p))
    return config, code_root(config, p)


def _valid_parts(doc: Any) -> Any:
    """The ``code_source`` and ``environment`` of a document that is wrong elsewhere, each as
    validated, or None where it is wrong itself (its problems are reported already)."""
    from types import SimpleNamespace

    from pydantic import ValidationError

    from .schema import CodeSourceConfig, EnvironmentConfig

    parts: dict[str, Any] = {"code_source": None, "environment": None}
    doc = doc if isinstance(doc, dict) else {}
    for key, model in (("code_source", CodeSourceConfig), ("environment", EnvironmentConfig)):
        if key in doc and doc[key] is not None:
            try:
                parts[key] = model.model_validate(doc[key])
            except (ValidationError, RecursionError):
                pass
        elif key == "environment":
            parts[key] = EnvironmentConfig()
    if doc.get("code_source") is not None and parts["code_source"] is None:
        parts["environment"] = None  # requirement files are read from a code folder not known yet
    return SimpleNamespace(**parts)


def _disk_problems(config: Any, path: Path) -> list[Problem]:
    """The code folder and requirement files as they are on disk (``config``: a workload, or the
    parts of one that are valid)."""
    root = code_root(config, path)
    problems: list[str] = []
    if root is not None:
        problems = check_code_source(root, config.code_source.include_paths if config.code_source else None)
    if not problems and config.environment is not None:
        problems = requirement_file_problems(config, root)
    return [Problem(*m.split(": ", 1)) for m in problems]


def requirement_files(config: WorkloadConfig) -> list[tuple[int, str]]:
    """``(index, path)`` of each requirement file (``-r`` / ``-c``) of ``environment.dependencies``."""
    from ..launch.node.envs import FILE_OPTIONS, split_dependency

    out = []
    for i, item in enumerate(config.environment.dependencies):
        words = split_dependency(item)
        if words[0] in FILE_OPTIONS:
            out.append((i, words[1]))
    return out


def requirement_file_problems(config: WorkloadConfig, root: Path | None, files: list[str] | None = None) -> list[str]:
    """Requirement files that are not under the code folder (or, given its ``files``, not in its snapshot)."""
    problems = []
    for i, rel in requirement_files(config):
        where = f"environment.dependencies[{i}]"
        if root is None:
            problems.append(f"{where}: {rel!r} is read from the code folder, but the workload has no code_source")
        elif not (root / rel).is_file():
            problems.append(f"{where}: requirement file {rel!r} does not exist under {root}")
        elif files is not None and Path(rel).as_posix().removeprefix("./") not in files:
            problems.append(f"{where}: requirement file {rel!r} is not part of the code snapshot (.gitignore or "
                            "code_source.include_paths leave it out)")  # fmt: skip
    return problems


def config_warnings(config: WorkloadConfig) -> list[str]:
    """What to tell before running a workload: ``env_variables`` whose names look like secrets."""
    from ..tracking.runs import looks_secret

    return [
        f"env_variables.{name} looks like a secret: its value is stored with the run (run store, workload.yaml, "
        f"`gpufleet get`); pass it as a secret instead: secrets: {{{name}: {{env: {name}}}}}"
        for name in config.env_variables
        if looks_secret(name)
    ]


def read_secrets(config: WorkloadConfig, workload_path: Path) -> dict[str, str]:
    """The values of the workload's secrets (files relative to the workload file's folder).

    Raises :class:`WorkloadValidationError` naming each secret that cannot be read, and each
    whose value also appears in the workload (it would be stored with it).
    """
    from ..secrets import SecretError, read_secret

    base = workload_path.resolve().parent
    values, problems = {}, []
    for name, source in config.secrets.items():
        try:
            values[name] = read_secret(name, source, base)
        except SecretError as e:
            problems.append(Problem(f"secrets.{name}", str(e).removeprefix(f"secret {name}: ")))
    stored = json.dumps(config.model_dump(mode="json"))
    for name, value in values.items():
        if len(value) >= 4 and value in stored:
            problems.append(Problem(f"secrets.{name}", "its value also appears in the workload (command, "
                                    "env_variables or parameters), which is stored with the run; remove it there"))  # fmt: skip
    if problems:
        raise WorkloadValidationError(problems, str(workload_path))
    return values


def local_gpu_problem(config: WorkloadConfig) -> str | None:
    """Why this machine cannot run a single-node GPU workload, or None when it can."""
    from .nodes import needs_cluster

    c = config.compute
    gpu_type = c.gpu_type
    if gpu_type is None or needs_cluster(config):
        return None
    from ..errors import GpufleetError
    from ..launch.gpus import gpu_type_matches, list_gpus

    try:
        found = list_gpus()
    except GpufleetError as e:
        return str(e)
    asks = f"compute.accelerator_type {c.accelerator_type} asks for {c.per_node} {gpu_type} GPU(s)"
    elsewhere = "or give compute.cluster to run it on a Ray cluster"
    if not found:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"{asks}, but no NVIDIA GPU is visible on this machine"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                + f"; to run it on {c.per_node} CPU worker(s) set accelerator_type: CPU_{c.per_node} "
                f"(`--override compute.accelerator_type=CPU_{c.per_node}`), {elsewhere}")  # fmt: skip
    names = sorted({g.name for g in found})
    if not all(gpu_type_matches(gpu_type, g.name) for g in found):
        return (f"{asks}, but this machine has {', '.join(names)}: name the type present in accelerator_type "
                f"(GPU_{c.per_node}x<TYPE>), {elsewhere}")  # fmt: skip
    if c.per_node > len(found):
        return (f"{asks}, but this machine has {len(found)} ({names[0]}): ask for at most {len(found)} "
                f"(accelerator_type: GPU_{len(found)}x{gpu_type}, num_accelerators: {len(found)}), {elsewhere}")  # fmt: skip
    return None


def plan(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """What ``run`` would do, resolved without starting anything or needing GPUs."""
    from ..launch.node.envs import env_hash
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
        "executor": ("gpufleet.workload.slurm_executor" if c.cluster == "slurm" else RAY_EXECUTOR_MODULE)
        if needs_cluster(config) else "local",
        "code_root": str(root) if root else None,
        "code_files": len(files),
        "dependencies": config.environment.dependencies,
        "environment_hash": env_hash(config.environment.dependencies, root) if config.environment.dependencies else None,
        "max_attempts": config.max_retries + 1,
        "timeout_minutes": config.timeout_minutes,
        "parameters": config.parameters,
        "node_env": {
            envcontract.NUM_NODES: str(c.num_nodes),
            envcontract.NODE_RANK: "0.." + str(c.num_nodes - 1) if c.command_nodes > 1 else "0",
            envcontract.WORLD_SIZE: str(c.num_accelerators),
            envcontract.LOCAL_WORLD_SIZE: str(c.per_node),
            **config.env_strings(),
        },
        "command": config.command,
        "secrets": {name: " ".join(next(iter(source.items()))) for name, source in config.secrets.items()},
        "warnings": config_warnings(config),
    }
    problems = requirement_file_problems(config, root, files)
    if problems:
        raise WorkloadValidationError([Problem(*m.split(": ", 1)) for m in problems], str(path))
    try:
        read_secrets(config, Path(path))
    except WorkloadValidationError as e:  # they may be set only where the run is submitted
        out["warnings"] += [f"{p.path} cannot be read now: {p.message}" for p in e.problems]
    problem = local_gpu_problem(config)
    if problem:
        out["warnings"].append(f"this machine could not run it now: {problem}")
    return out


@dataclass
class Submission:
    """What ``gpufleet run`` did: the run, whether it is new, its first MLflow run, what to warn about."""

    run: RunRecord
    created: bool
    mlflow_line: str | None = None
    warnings: list[str] = field(default_factory=list)
    #: ``{"attempt": 1, "run_id", "link"}`` of the first attempt's MLflow run, when it was opened.
    mlflow_run: dict[str, Any] | None = None


def submit(
    path: str | Path,
    overrides: list[str] | None = None,
    idempotency_key: str | None = None,
    tracking: bool = True,
    home: str | Path | None = None,
) -> tuple[RunRecord, bool]:
    """Validate a workload, store a PENDING run, snapshot its code and start its supervisor.

    Returns ``(run, created)``; ``created`` is False when ``idempotency_key`` named an
    existing run, which is returned unchanged. See :func:`submit_run`.
    """
    done = submit_run(path, overrides, idempotency_key, tracking, home)
    return done.run, done.created


def submit_run(
    path: str | Path,
    overrides: list[str] | None = None,
    idempotency_key: str | None = None,
    tracking: bool = True,
    home: str | Path | None = None,
) -> Submission:
    """Validate a workload, store a PENDING run, snapshot its code and start its supervisor.

    The secrets are read now and handed to the supervisor through a pipe; the code version of
    the code folder is stored with the run; with tracking on, the first attempt's MLflow run is
    opened now, so that its id and link can be shown at once.
    """
    from ..codeversion import code_version
    from ..errors import GPUUnavailableError
    from ..runs.supervisor import start_supervisor
    from .attempts import CODE_VERSION_KEY, MLFLOW_KEY
    from .executors import check_executor_available
    from .handoff import hand_over

    p = Path(path)
    config, root = load_and_check(p, overrides)
    store = RunStore(home)
    if idempotency_key is not None:
        existing = list_runs(store, states=None, limit=1, filters={"idempotency_key": idempotency_key})
        if existing:
            return Submission(existing[0], False)
    check_executor_available(config)
    problem = local_gpu_problem(config)
    if problem:
        raise GPUUnavailableError(problem)
    secrets = read_secrets(config, p)  # in memory from here on; never stored
    resolved = config
    if config.code_source is not None and root is not None:
        resolved = config.model_copy(
            update={"code_source": config.code_source.model_copy(update={"root_path": str(root)})}
        )
    entries = None  # the files to copy, listed (and refused) before anything is stored
    if root is not None and config.code_source is not None:
        entries = _snapshot_entries(config, root, p)
    runs_dir = private_dir(store.runs_dir, "the workload runs folder")  # before anything is stored
    run_id = new_run_id(config.experiment_name)
    run_dir = runs_dir / run_id
    stored = resolved.model_dump(mode="json")
    version = code_version(root) if root is not None else None
    if version is not None:
        stored[CODE_VERSION_KEY] = version
    # MLflow (importing it, opening its store: about 2 s on a small machine) opens the first
    # attempt's run in a thread while the run is stored, its code copied and its supervisor starts.
    opening = _FirstMlflowRun(config, run_id, version) if tracking else None
    record = RunRecord(
        id=run_id,
        experiment=config.experiment_name,
        state=PENDING,
        created_at=_now(),
        config=stored,
        run_dir=str(run_dir),
        num_nodes=config.compute.num_nodes,
        world_size=config.compute.num_accelerators,
        max_attempts=config.max_retries + 1,
        tracking=tracking,
        idempotency_key=idempotency_key,
        workload_path=str(p.resolve()),
    )
    try:
        run, created = store.create_run(record)
    except BaseException:
        if opening is not None:
            opening.end("FAILED")
        raise
    if not created:
        if opening is not None:
            opening.end("CANCELED")  # another submission with this key won the race
        return Submission(run, False)
    try:
        private_dir(run_dir, "the run folder")
        code_dir = private_dir(run_dir / "code", "the run's code snapshot")
        if root is not None and config.code_source is not None and entries is not None:
            snapshot(root, code_dir, config.code_source.include_paths, entries=entries)
        _write_private(run_dir / "hyperparameters.yaml", config.parameters)
        _write_private(run_dir / "workload.yaml", resolved.model_dump(mode="json"))
        proc = start_supervisor("gpufleet.workload.runner", run_id, store.home, run_dir, handoff_follows=bool(secrets) or opening is not None)
    except BaseException as e:
        store.finish_run(run_id, FAILED, message=f"could not start the run: {e}")
        if opening is not None:
            opening.end("FAILED")
        raise
    handoff: dict[str, Any] = {"secrets": secrets} if secrets else {}
    tracked, handed = None, False
    try:
        tracked = opening.result() if opening is not None else None  # the supervisor waits for it
        if tracked is not None:
            from ..tracking.links import server_address

            uri = str(tracked.tracking_uri)
            stored[MLFLOW_KEY] = {"tracking_uri": server_address(uri) or uri, "experiment_id": tracked.experiment_id,
                                  "experiment": tracked.experiment_name}  # fmt: skip
            handoff["mlflow_run"] = {"run_id": tracked.run_id, "tracking_uri": uri,
                                     "experiment_id": tracked.experiment_id, "experiment_name": tracked.experiment_name}  # fmt: skip
            store.update_run(run_id, config=stored)  # before the handoff: the supervisor reads the run after it
        hand_over(proc, handoff)
        handed = True
        if tracked is not None:
            tracked.release()  # the supervisor logs into it and ends it
    except BaseException:  # interrupted (Ctrl-C): the supervisor reads an unfinished handoff and ends the run
        if not handed:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if tracked is not None:
                tracked.end("CANCELED")
        raise
    line = first = None
    if tracked is not None:
        from ..tracking.links import run_line, run_link

        line = run_line(tracked.tracking_uri, str(tracked.run_id), tracked.experiment_id, tracked.experiment_name)
        link = run_link(tracked.tracking_uri, str(tracked.run_id), tracked.experiment_id)
        first = {"attempt": 1, "run_id": tracked.run_id, "link": link}
    try:
        started: float | None = process_start_time(proc.pid)
    except Exception:  # it already exited: the liveness check will see that
        started = None
    store.update_run(run_id, supervisor_pid=proc.pid, supervisor_started=started)
    return Submission(store.get(run_id), True, line, config_warnings(config), first)


class _FirstMlflowRun:
    """The first attempt's MLflow run, being opened in a thread (see :func:`_open_first_mlflow_run`)."""

    def __init__(self, config: WorkloadConfig, run_id: str, version: dict[str, Any] | None) -> None:
        self._tracked: Any = None
        self._thread = threading.Thread(
            target=self._open, args=(config, run_id, version), name="gpufleet-mlflow", daemon=True
        )
        self._thread.start()

    def _open(self, config: WorkloadConfig, run_id: str, version: dict[str, Any] | None) -> None:
        try:
            self._tracked = _open_first_mlflow_run(config, run_id, version)
        except Exception as e:  # noqa: BLE001 - tracking trouble never stops a submission
            logger.warning("MLflow tracking is off for run %s: %s", run_id, e)

    def result(self) -> Any:
        """The opened run, or None (tracking off, MLflow missing or unreachable)."""
        self._thread.join()
        return self._tracked

    def end(self, state: str) -> None:
        """End the run (once opened) because the submission did not go through."""
        tracked = self.result()
        if tracked is not None:
            tracked.end(state)


def _open_first_mlflow_run(config: WorkloadConfig, run_id: str, version: dict[str, Any] | None) -> Any:
    """The first attempt's MLflow run, opened here (None when tracking is off or MLflow cannot be used)."""
    from ..tracking import tracking_enabled

    if not tracking_enabled():
        return None
    from .attempts import open_attempt_run

    tracked = open_attempt_run(config, run_id, 1, version, system_metrics=False)
    return tracked if tracked.enabled else None


def _snapshot_entries(config: WorkloadConfig, root: Path, workload_path: Path) -> list[Any]:
    """The files the run's code snapshot will copy: the code folder without the files secrets are
    read from. Raises (nothing stored yet) when the folder cannot be copied (a link leaving it,
    a limit passed) or a requirement file it names is missing.
    """
    from ..secrets import secret_files

    assert config.code_source is not None
    hidden = set(secret_files(config.secrets, workload_path.resolve().parent))
    real = root.resolve()
    entries = [e for e in scan(root, config.code_source.include_paths) if (real / e.rel).resolve() not in hidden]
    problems = requirement_file_problems(config, root, [e.rel for e in entries])
    if problems:
        raise WorkloadValidationError([Problem(*m.split(": ", 1)) for m in problems], str(workload_path))
    return entries


def _write_private(path: Path, document: Any) -> None:
    """Write ``document`` as YAML to a new 0600 file."""
    with open(path, "w", encoding="utf-8", opener=private_file_opener) as f:
        f.write(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))


def _now() -> float:
    import time

    return time.time()
