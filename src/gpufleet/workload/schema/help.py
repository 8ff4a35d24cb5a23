"""Describing the workload schema: the JSON schema, every field path, and help for one field."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from .models import WorkloadConfig, submodel


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
            sub = submodel(field.annotation)
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
            sub = submodel(field.annotation)
            if sub is None:
                raise KeyError(f"{'.'.join(parts[: i + 1])} has no sub-fields")
            model = sub
    sub = submodel(field.annotation)
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
    text = text or str(annotation).replace("typing.", "")
    return text.replace(f"{WorkloadConfig.__module__}.", "")
