"""The workload YAML: strict pydantic models, friendly errors, overrides and field help."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from ..errors import GpufleetError

_GPU_TYPE_RE = re.compile(r"^GPU_([1-9][0-9]{0,3})x([A-Za-z][A-Za-z0-9-]{0,31})$")
_CPU_TYPE_RE = re.compile(r"^CPU_([1-9][0-9]{0,3})$")
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CLUSTER_RE = re.compile(r"^(auto|ray://[A-Za-z0-9.\-_\[\]:]+(:[0-9]{1,5})?|[A-Za-z0-9.\-_]+:[0-9]{1,5})$")

#: Variables gpufleet sets for every node; ``env_variables`` may not set them.
RESERVED_ENV = (
    "CODE_SOURCE_PATH",
    "NUM_NODES",
    "NODE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MLFLOW_RUN_ID",
    "HYPERPARAMETERS_PATH",
    "GPUFLEET_RUN_ID",
    "GPUFLEET_RUN_DIR",
    "GPUFLEET_ATTEMPT",
    "GPUFLEET_CHECKPOINT_DIR",
)


class WorkloadValidationError(GpufleetError):
    """A workload document is invalid; ``problems`` lists every problem with its field path."""

    def __init__(self, problems: list[Problem], source: str = "workload") -> None:
        self.problems = problems
        self.source = source
        lines = [f"{source} is invalid ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Problem:
    """One validation problem: where (a dotted field path) and what is wrong / allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<document>'}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


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
            "Ray cluster to run on: ray://<head>:<port>, <head>:<port> or 'auto'. Absent: this "
            "machine (one node only)."
        ),
        examples=["ray://head:10001"],
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
                f"{v!r} is not a Ray cluster address; use ray://<head>:<port>, <head>:<port> or 'auto'"
            )
        return v

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
            "current one (cached by the hash of the list), e.g. ['trl==1.16.0', 'mypkg @ file:///w/mypkg.whl']."
        ),
        examples=[["trl==1.16.0"]],
    )

    @field_validator("dependencies")
    @classmethod
    def _check_deps(cls, v: list[str]) -> list[str]:
        from packaging.requirements import InvalidRequirement, Requirement

        bad = []
        for i, spec in enumerate(v):
            s = spec.strip()
            if not s or s.startswith("-"):
                bad.append(f"[{i}] {spec!r} (pip options are not allowed, only requirement specs)")
                continue
            if "/" in s or s.startswith("."):
                continue  # a local path or URL of a wheel / sdist
            try:
                Requirement(s)
            except InvalidRequirement:
                bad.append(f"[{i}] {spec!r}")
        if bad:
            raise ValueError(
                "not pip requirement specs such as 'trl==1.16.0' or 'name @ file:///path.whl': "
                + ", ".join(bad)
            )
        return v


class CodeSourceConfig(_Strict):
    """The code that travels with the run."""

    root_path: str = Field(
        default=".",
        description=(
            "Folder whose snapshot travels with the run (relative to the workload file). Files "
            "ignored by .gitignore are left out. The command runs inside the snapshot "
            "($CODE_SOURCE_PATH)."
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
            "bash script run once per node, inside the code snapshot, with CODE_SOURCE_PATH, "
            "NUM_NODES, NODE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
            "MLFLOW_RUN_ID, HYPERPARAMETERS_PATH and GPUFLEET_CHECKPOINT_DIR set."
        ),
        examples=["torchrun --nproc_per_node=$LOCAL_WORLD_SIZE train.py"],
    )
    env_variables: dict[str, _EnvValue] = Field(
        default_factory=dict,
        description="Extra environment variables of every node (names [A-Za-z_][A-Za-z0-9_]*).",
        examples=[{"HF_HOME": "/tmp/hf"}],
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Hyperparameters, written as YAML to the file at $HYPERPARAMETERS_PATH.",
        examples=[{"lr": 2.0e-5, "max_steps": 100}],
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        le=100,
        description=(
            "Extra attempts after a failed or timed-out attempt; each attempt is a new MLflow "
            "run and sees the same GPUFLEET_CHECKPOINT_DIR, so it can resume."
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


# ---------------------------------------------------------------- errors


_TYPE_NAMES = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)",
    "model_attributes_type": "a mapping (key: value)",
    "int_from_float": "an integer",
}


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _path_of(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).isprintable() and str(part).strip() and "." not in str(part):
            out += ("." if out else "") + str(part)
        else:  # a key with dots, spaces or control characters: quoted, on one line
            out += f"[{str(part)!r}]"
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that owns the field at ``loc`` (None past a free-form mapping)."""
    model: type[BaseModel] = WorkloadConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        sub = _submodel(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _problems_from(err: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    for e in err.errors(include_url=False):
        loc = tuple(e.get("loc", ()))
        etype = e.get("type", "")
        # a union (str | int | ...) reports one error per member: keep the first, clear one
        loc = tuple(p for p in loc if p not in ("str", "int", "float", "bool", "function-after[_check_type(), str]"))
        if etype == "extra_forbidden" and loc:
            key = loc[-1]
            owner = _model_at(loc[:-1])
            allowed = list(owner.model_fields) if owner else []
            hint = ""
            close = difflib.get_close_matches(str(key), allowed, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
            msg = f"unknown key {str(key)!r}{hint}; allowed keys: {', '.join(allowed)}"
            problems.append(Problem(_path_of(loc[:-1]), msg))
            continue
        if etype == "missing":
            problems.append(Problem(_path_of(loc), "required field is missing"))
            continue
        if etype in _TYPE_NAMES and loc[:1] == ("env_variables",) and len(loc) == 2:
            msg = f"expected a string, number or true/false, got {_describe(e.get('input'))}"
        elif etype in _TYPE_NAMES:
            msg = f"expected {_TYPE_NAMES[etype]}, got {_describe(e.get('input'))}"
        elif etype == "value_error":
            msg = str(e.get("ctx", {}).get("error") or e.get("msg"))
        else:
            msg = str(e.get("msg")).replace("Input should be", "must be")
            if "input" in e and etype not in ("greater_than", "less_than_equal", "greater_than_equal"):
                msg += f", got {_describe(e['input'])}"
            elif "input" in e:
                msg += f", got {e['input']!r}"
        problems.append(Problem(_path_of(loc), msg))
    # identical problems from union members collapse into one
    seen: set[tuple[str, str]] = set()
    unique = []
    for p in problems:
        if p.path in {q.path for q in unique} and "expected" in p.message:
            continue
        if (p.path, p.message) not in seen:
            seen.add((p.path, p.message))
            unique.append(p)
    return unique


# ---------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.2 floats: PyYAML (YAML 1.1) reads 2e-5 as a string; a learning rate should be a number.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "workload") -> Any:
    """Parse YAML text, turning syntax errors into a :class:`WorkloadValidationError`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or str(e)
        if e.context and e.context_mark and e.context_mark is not mark:
            cm = e.context_mark
            what += f" ({e.context} started at line {cm.line + 1}, column {cm.column + 1})"
        raise WorkloadValidationError(
            [Problem("", f"not valid YAML: {where}{what}")], source
        ) from None
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        raise WorkloadValidationError([Problem("", f"not valid YAML: {e}")], source) from None


def validate_document(doc: Any, source: str = "workload") -> WorkloadConfig:
    """Validate a parsed document; every problem is reported at once."""
    if doc is None:
        raise WorkloadValidationError(
            [Problem("", "the document is empty; required keys: experiment_name, compute, command")],
            source,
        )
    if not isinstance(doc, dict):
        raise WorkloadValidationError(
            [Problem("", f"expected a mapping of keys at the top level, got {_describe(doc)}")],
            source,
        )
    bad_keys = [k for k in doc if not isinstance(k, str)]
    if bad_keys:
        raise WorkloadValidationError(
            [Problem("", f"keys must be strings, got {', '.join(map(repr, bad_keys))}")], source
        )
    try:
        return WorkloadConfig.model_validate(doc)
    except ValidationError as e:
        raise WorkloadValidationError(_problems_from(e), source) from None
    except RecursionError:
        raise WorkloadValidationError([Problem("", "the document is nested too deeply")], source) from None


def load_workload(
    path: str | Path, overrides: list[str] | None = None
) -> tuple[WorkloadConfig, dict[str, Any]]:
    """Read, override and validate a workload file; returns the config and the raw document."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadValidationError([Problem("", f"file not found: {p}")], str(p)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadValidationError([Problem("", f"cannot read {p}: {e}")], str(p)) from None
    doc = parse_yaml(text, str(p))
    if overrides:
        if not isinstance(doc, dict):
            doc = validate_document(doc, str(p))  # raises the top-level problem
        doc = apply_overrides(doc, overrides, str(p))
    return validate_document(doc, str(p)), doc


# ---------------------------------------------------------------- overrides


_FREE_FORM = {"parameters": "any", "env_variables": "str"}


def _field_kind(path: list[str]) -> str:
    """How an override value of ``path`` is typed: 'str', 'yaml' or 'any'; raises KeyError."""
    model: type[BaseModel] = WorkloadConfig
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            allowed = ", ".join(model.model_fields)
            where = ".".join(path[:i]) or "the top level"
            raise KeyError(f"unknown key {part!r} under {where}; allowed keys: {allowed}")
        if model is WorkloadConfig and part in _FREE_FORM:
            return _FREE_FORM[part] if i < len(path) - 1 else "yaml"
        sub = _submodel(field.annotation)
        if i == len(path) - 1:
            return "str" if field.annotation in (str, str | None) else "yaml"
        if sub is None:
            raise KeyError(f"{'.'.join(path[: i + 1])} has no sub-fields")
        model = sub
    return "yaml"


def _parse_value(raw: str, kind: str) -> Any:
    if kind == "str":
        return raw
    if not raw.strip():
        return ""
    try:
        return yaml.load(raw, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return raw


def apply_overrides(doc: dict[str, Any], overrides: list[str], source: str = "workload") -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to a raw document; values are typed by their field.

    Strings fields take the value verbatim; numbers, booleans, lists and free-form
    ``parameters`` values are read as YAML (``lr=1e-4`` is a float, ``tags=[a,b]`` a list).
    """
    out = _deep_copy(doc)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(Problem(item, "an override is key.path=value"))
            continue
        key, raw = item.split("=", 1)
        path = [p for p in key.strip().split(".")]
        if not all(path):
            problems.append(Problem(key, "an override path is dot-separated keys such as compute.num_accelerators"))
            continue
        try:
            kind = _field_kind(path)
        except KeyError as e:
            problems.append(Problem(key, str(e.args[0])))
            continue
        value = _parse_value(raw, kind)
        target = out
        for part in path[:-1]:
            nxt = target.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                target[part] = nxt
            target = nxt
        target[path[-1]] = value
    if problems:
        raise WorkloadValidationError(problems, f"{source} overrides")
    return out


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---------------------------------------------------------------- schema and help


def json_schema() -> dict[str, Any]:
    """The JSON schema of a workload file, for editors (yaml-language-server) and tools."""
    schema = WorkloadConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "gpufleet workload"
    return schema


def field_paths() -> list[str]:
    """Every field path of the workload schema, in declaration order."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            out.append(path)
            sub = _submodel(field.annotation)
            if sub is not None:
                walk(sub, path + ".")

    walk(WorkloadConfig, "")
    return out


def explain(path: str) -> dict[str, Any]:
    """Help for one field: description, type, whether required, default, examples."""
    parts = path.split(".")
    model: type[BaseModel] = WorkloadConfig
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            allowed = ", ".join(model.model_fields)
            close = difflib.get_close_matches(part, list(model.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(f"no field {part!r} at {'.'.join(parts[:i]) or 'the top level'}{hint}; fields there: {allowed}")
        if i < len(parts) - 1:
            sub = _submodel(field.annotation)
            if sub is None:
                raise KeyError(f"{'.'.join(parts[: i + 1])} has no sub-fields")
            model = sub
    sub = _submodel(field.annotation)
    info: dict[str, Any] = {
        "path": path,
        "description": field.description or (sub.__doc__ or "").strip(),
        "type": _type_name(field.annotation),
        "required": field.is_required(),
    }
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
        info["default"] = default.model_dump() if isinstance(default, BaseModel) else default
    if field.examples:
        info["examples"] = field.examples
    if sub is not None:
        info["fields"] = list(sub.model_fields)
    constraints = [str(m) for m in field.metadata]
    if constraints:
        info["constraints"] = constraints
    return info


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "").replace("gpufleet.workload.schema.", "")
