"""``--override key.path=value``: set fields of a raw workload document, typed by the field."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from .models import WorkloadConfig, submodel
from .problems import Problem, WorkloadValidationError
from .yaml_loader import WorkloadLoader

_FREE_FORM = {"parameters": "any", "env_variables": "str", "secrets": "any"}


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
        sub = submodel(field.annotation)
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
        return yaml.load(raw, Loader=WorkloadLoader)  # noqa: S506 - a SafeLoader subclass
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
