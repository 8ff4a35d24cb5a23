"""The pydantic models of a workload file: strict fields, their checks and their help text.

One concern past 400 lines: every field of the workload file with its check and help text
(the checks reading other modules live in validation.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ...launch.node import envcontract
from .slurm import SlurmConfig

_GPU_TYPE_RE = re.compile(r"^GPU_([1-9][0-9]{0,3})x([A-Za-z][A-Za-z0-9-]{0,31})$")
_CPU_TYPE_RE = re.compile(r"^CPU_([1-9][0-9]{0,3})$")
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CLUSTER_RE = re.compile(r"^(auto|slurm|ray://[A-Za-z0-9.\-_\[\]:]+(:[0-9]{1,5})?|[A-Za-z0-9.\-_]+:[0-9]{1,5})$")

#: Variables gpufleet sets for every node; ``env_variables`` may not set them.
RESERVED_ENV = (
    envcontract.CODE_SOURCE_PATH,
    envcontract.NUM_NODES,
    envcontract.NODE_RANK,
    envcontract.WORLD_SIZE,
    envcontract.LOCAL_WORLD_SIZE,
    envcontract.MASTER_ADDR,
    envcontract.MASTER_PORT,
    "MLFLOW_RUN_ID",
    envcontract.HYPERPARAMETERS_PATH,
    envcontract.RUN_ID,
    envcontract.RUN_DIR,
    envcontract.ATTEMPT,
    envcontract.CHECKPOINT_DIR,
)



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ComputeConfig(_Strict):
    """Where and on what the workload runs."""

    accelerator_type: str = Field(
        description=(
            "Accelerators of one node: GPU_<n>x<TYPE> (n GPUs of TYPE per node, e.g. GPU_8xH100) "
            "or CPU_<n> (n CPU worker processes per node, e.g. CPU_2, for development and CI)."
        ),
        examples=["GPU_8xH100", "GPU_1xA10", "CPU_2"],
    )
    num_accelerators: int = Field(
        gt=0,
        le=100000,
        description=(
            "Total accelerators of the run (WORLD_SIZE). A multiple of the per-node count of "
            "accelerator_type; num_accelerators / per-node count = number of nodes."
        ),
        examples=[8, 16],
    )
    cluster: str | None = Field(
        default=None,
        description=(
            "Cluster to run on: a Ray cluster (ray://<head>:<port>, <head>:<port> or 'auto'), or 'slurm' "
            "(the Slurm cluster of this login node; see compute.slurm). Absent: this machine (one node only)."
        ),
        examples=["ray://head:10001", "slurm"],
    )
    slurm: SlurmConfig | None = Field(
        default=None,
        description="With cluster: slurm, the job's partition, account, qos, constraint, time and more sbatch options.",
        examples=[{"partition": "gpu", "time": "04:00:00"}],
    )

    ray_driver: bool = Field(
        default=False,
        description=(
            "The command is a Ray driver (Ray Train, Tune or Data) that places its own workers: it "
            "runs once instead of once per node, with RAY_ADDRESS set to the cluster, and gpufleet "
            "reserves nothing, so the driver's workers can take every accelerator. Without a "
            "cluster the command runs once on this machine as usual."
        ),
        examples=[True],
    )

    @field_validator("accelerator_type")
    @classmethod
    def _check_type(cls, v: str) -> str:
        if not (_GPU_TYPE_RE.match(v) or _CPU_TYPE_RE.match(v)):
            raise ValueError(
                f"{v!r} is not an accelerator type; use GPU_<n>x<TYPE> (e.g. GPU_8xH100) "
                "or CPU_<n> (e.g. CPU_2), n between 1 and 9999"
            )
        return v

    @field_validator("cluster")
    @classmethod
    def _check_cluster(cls, v: str | None) -> str | None:
        if v is not None and not _CLUSTER_RE.match(v):
            raise ValueError(
                f"{v!r} is not a Ray cluster address; use ray://<head>:<port>, <head>:<port> or 'auto' (or 'slurm': "
                "the Slurm cluster of this login node)"
            )
        return v

    @model_validator(mode="after")
    def _check_slurm(self) -> ComputeConfig:
        if self.slurm is not None and self.cluster != "slurm":
            raise ValueError("compute.slurm is given but compute.cluster is not 'slurm'; set cluster: slurm")
        if self.cluster == "slurm" and self.ray_driver:
            raise ValueError("compute.ray_driver needs a Ray cluster; on Slurm the command runs once per node")
        return self

    @property
    def per_node(self) -> int:
        """Accelerators (worker processes) per node."""
        m = _GPU_TYPE_RE.match(self.accelerator_type) or _CPU_TYPE_RE.match(self.accelerator_type)
        assert m is not None
        return int(m.group(1))

    @property
    def gpu_type(self) -> str | None:
        """The GPU model (``H100``), or ``None`` for CPU workers."""
        m = _GPU_TYPE_RE.match(self.accelerator_type)
        return m.group(2) if m else None

    @property
    def num_nodes(self) -> int:
        """Nodes the workload spans."""
        return self.num_accelerators // self.per_node

    @property
    def command_nodes(self) -> int:
        """How many times the command runs: once per node, or once for a Ray driver."""
        return 1 if self.ray_driver else self.num_nodes

    @field_validator("num_accelerators")
    @classmethod
    def _check_multiple(cls, v: int, info: ValidationInfo) -> int:
        accel = info.data.get("accelerator_type")
        m = (_GPU_TYPE_RE.match(accel) or _CPU_TYPE_RE.match(accel)) if isinstance(accel, str) else None
        if m is None:
            return v  # accelerator_type has its own error
        per = int(m.group(1))
        if v % per:
            lower = v - v % per
            hint = f"{lower} or {lower + per}" if lower else f"{per}"
            raise ValueError(
                f"{v} is not a multiple of the {per} accelerators per node of {accel}; use "
                f"{hint}, or an accelerator_type with fewer per node"
            )
        return v


class EnvironmentConfig(_Strict):
    """Extra Python packages for the run."""

    dependencies: list[str] = Field(
        default_factory=list,
        description=(
            "pip requirement specs installed into a per-run virtual environment layered on the "
            "current one (cached by the hash of the list and of the requirement files it names), "
            "e.g. ['trl==1.16.0', 'mypkg @ file:///w/mypkg.whl']. Items may also be pip options, "
            "one per item with its value: '-r requirements.txt' and '-c constraints.txt' (relative "
            "to code_source.root_path), '--index-url URL', '--extra-index-url URL', '--find-links "
            "URL_OR_FOLDER', '--trusted-host HOST', '--no-index', '--no-build-isolation', '--pre', "
            "'--prefer-binary'."
        ),
        examples=[["trl==1.16.0"], ["-r requirements.txt", "--extra-index-url https://download.pytorch.org/whl/cu126"]],
    )

    @field_validator("dependencies")
    @classmethod
    def _check_deps(cls, v: list[str]) -> list[str]:
        from packaging.requirements import InvalidRequirement, Requirement

        from ...launch.node.envs import FILE_OPTIONS, split_dependency

        bad = []
        for i, spec in enumerate(v):
            s = spec.strip()
            if not s:
                bad.append(f"[{i}] {spec!r}")
                continue
            if s.startswith("-"):
                try:
                    words = split_dependency(s)
                except ValueError as e:
                    bad.append(f"[{i}] {e}")
                    continue
                if words[0] in FILE_OPTIONS and (Path(words[1]).is_absolute() or ".." in Path(words[1]).parts
                                                 or words[1].startswith("~")):  # fmt: skip
                    bad.append(f"[{i}] {words[1]!r} must be a path relative to code_source.root_path (no '..')")
                continue
            if "/" in s or s.startswith("."):
                continue  # a local path or URL of a wheel / sdist
            try:
                Requirement(s)
            except InvalidRequirement:
                bad.append(f"[{i}] {spec!r}")
        if bad:
            raise ValueError(
                "not pip requirement specs such as 'trl==1.16.0' or 'name @ file:///path.whl', or "
                "allowed pip options such as '-r requirements.txt': " + ", ".join(bad)
            )
        return v


class CodeSourceConfig(_Strict):
    """The code that travels with the run."""

    root_path: str = Field(
        default=".",
        description=(
            "Folder whose snapshot travels with the run (relative to the workload file). Files "
            "ignored by .gitignore are left out. The command runs inside the snapshot "
            f"(${envcontract.CODE_SOURCE_PATH})."
        ),
        examples=[".", "../project"],
    )
    include_paths: list[str] | None = Field(
        default=None,
        description=(
            "Files or folders under root_path to snapshot (relative paths); absent: all of root_path."
        ),
        examples=[["train.py", "configs"]],
    )

    @field_validator("root_path")
    @classmethod
    def _check_root(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a folder path such as '.'")
        return v

    @field_validator("include_paths")
    @classmethod
    def _check_includes(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        bad = []
        for i, p in enumerate(v):
            parts = Path(p).parts
            if not p.strip() or Path(p).is_absolute() or ".." in parts or "\x00" in p:
                bad.append(f"[{i}] {p!r}")
        if bad:
            raise ValueError(
                "must be relative paths inside root_path (no absolute paths, no '..'): "
                + ", ".join(bad)
            )
        return v


_EnvValue = str | int | float | bool


class WorkloadConfig(_Strict):
    """A workload: what to run, on how many accelerators, with which code and parameters."""

    experiment_name: str = Field(
        description="MLflow experiment of the run: letters, digits, '_' and '-', at most 100 characters.",
        examples=["llama-sft"],
    )
    compute: ComputeConfig = Field(description="Accelerators and cluster.")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig, description="Extra Python packages for the run."
    )
    code_source: CodeSourceConfig | None = Field(
        default=None,
        description="Code snapshotted into the run; absent: the command runs in an empty folder.",
    )
    command: str = Field(
        description=(
            f"bash script run once per node, inside the code snapshot, with {envcontract.CODE_SOURCE_PATH}, "
            f"{envcontract.NUM_NODES}, {envcontract.NODE_RANK}, {envcontract.WORLD_SIZE}, "
            f"{envcontract.LOCAL_WORLD_SIZE}, {envcontract.MASTER_ADDR}, {envcontract.MASTER_PORT}, "
            f"MLFLOW_RUN_ID, {envcontract.HYPERPARAMETERS_PATH} and {envcontract.CHECKPOINT_DIR} set."
        ),
        examples=["torchrun --nproc_per_node=$LOCAL_WORLD_SIZE train.py"],
    )
    env_variables: dict[str, _EnvValue] = Field(
        default_factory=dict,
        description="Extra environment variables of every node (names [A-Za-z_][A-Za-z0-9_]*).",
        examples=[{"HF_HOME": "/tmp/hf"}],
    )
    secrets: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description=(
            "Environment variables of every node whose values are secrets, read when the run is "
            "submitted: NAME: {env: VARIABLE} (from the submitting shell) or NAME: {file: PATH} (a "
            "file's content without its last line end; relative to the workload file). The values "
            "are never written to the run store, the run folder, MLflow or any output, and are "
            "masked as *** in the node logs; a file inside the code folder is left out of the snapshot."
        ),
        examples=[{"HF_TOKEN": {"env": "HF_TOKEN"}, "WANDB_API_KEY": {"file": "~/.secrets/wandb"}}],
    )
    mlflow_run_name: str | None = Field(
        default=None,
        description=(
            "Name of the MLflow run of the first attempt (later attempts: <name>-attempt-<n>); "
            "absent: <run id>-attempt-<n>."
        ),
        examples=["sft-lr2e-5"],
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Hyperparameters, written as YAML to the file at ${envcontract.HYPERPARAMETERS_PATH}.",
        examples=[{"lr": 2.0e-5, "max_steps": 100}],
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        le=100,
        description=(
            "Extra attempts after a failed or timed-out attempt; each attempt is a new MLflow "
            f"run and sees the same {envcontract.CHECKPOINT_DIR}, so it can resume."
        ),
        examples=[1],
    )
    timeout_minutes: float | None = Field(
        default=None,
        gt=0,
        le=525600,
        description="Time limit of each attempt in minutes (TIMEDOUT when exceeded); absent: none.",
        examples=[120],
    )
    hang_timeout_minutes: float | None = Field(
        default=10,
        gt=0,
        le=525600,
        description=(
            "The hang watchdog's long limit: stop an attempt with a diagnosis (the rank missing from the "
            "collective the others wait in, each rank's line) once no rank made progress for this long. "
            "In the steady state a clear hang (a rank the others wait for that does nothing) is called "
            "sooner, after a limit learned from the steps (docs/hangs.md). Ranks report progress when "
            "they use gpufleet (runtime.setup(), its data loader, prepare()); null: off."
        ),
        examples=[10],
    )
    faults: list[str] = Field(
        default_factory=list,
        description=(
            "Faults injected on purpose to rehearse failures, e.g. 'kill:rank=1:step=30' (see docs/hangs.md); "
            "also `gpufleet run --inject-fault`."
        ),
        examples=[["kill:rank=1:step=30"]],
    )

    @field_validator("faults", mode="before")
    @classmethod
    def _check_faults(cls, v: Any) -> Any:
        from ...faults import fault_problems
        from .problems import ItemProblems

        if not isinstance(v, list):
            return v  # not a list: the field's type says so
        problems = fault_problems(v)  # every problem of every fault, one that is not a string too
        if problems:
            raise ItemProblems(problems)
        return v

    @field_validator("experiment_name")
    @classmethod
    def _check_experiment(cls, v: str) -> str:
        if not _EXPERIMENT_RE.match(v):
            raise ValueError(
                f"{v!r} is not allowed; use 1 to 100 letters, digits, '_' or '-'"
            )
        return v

    @field_validator("command")
    @classmethod
    def _check_command(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty bash script")
        if "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v

    @field_validator("env_variables")
    @classmethod
    def _check_env(cls, v: dict[str, _EnvValue]) -> dict[str, _EnvValue]:
        bad = [k for k in v if not _ENV_NAME_RE.match(k)]
        if bad:
            raise ValueError(
                f"invalid variable name(s) {', '.join(map(repr, bad))}; use [A-Za-z_][A-Za-z0-9_]*"
            )
        reserved = [k for k in v if k in RESERVED_ENV]
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)} {'is' if len(reserved) == 1 else 'are'} set by gpufleet "
                "for every node and cannot be overridden"
            )
        nul = [k for k, val in v.items() if isinstance(val, str) and "\x00" in val]
        if nul:
            raise ValueError(f"values must not contain NUL characters: {', '.join(nul)}")
        return v

    @field_validator("secrets")
    @classmethod
    def _check_secrets(cls, v: dict[str, dict[str, str]], info: ValidationInfo) -> dict[str, dict[str, str]]:
        from ...secrets import SECRETS_ENV, source_problems

        problems = [p for name, source in v.items() for p in source_problems(name, source)]
        reserved = [k for k in v if k in RESERVED_ENV or k == SECRETS_ENV]
        if reserved:
            problems.append(f"{', '.join(reserved)} {'is' if len(reserved) == 1 else 'are'} set by gpufleet")
        both = [k for k in v if k in (info.data.get("env_variables") or {})]
        if both:
            problems.append(f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} in env_variables too; keep "
                            "a secret in secrets only")  # fmt: skip
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @field_validator("mlflow_run_name")
    @classmethod
    def _check_run_name(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or len(v) > 200 or "\x00" in v):
            raise ValueError("must be 1 to 200 characters")
        return v

    @field_validator("parameters")
    @classmethod
    def _check_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            yaml.safe_dump(v)
        except yaml.YAMLError as e:
            raise ValueError(f"must be plain YAML data (numbers, strings, lists, maps): {e}") from None
        return v

    def env_strings(self) -> dict[str, str]:
        """``env_variables`` as strings (``true``/``false`` for booleans)."""
        out = {}
        for k, v in self.env_variables.items():
            out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
        return out


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field annotation (``X`` or ``X | None``), or None for plain values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
