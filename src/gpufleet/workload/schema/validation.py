"""Validating a parsed workload document, with pydantic's errors turned into field-path problems.

Every problem is reported at once: unknown keys (with the allowed ones and a close match),
missing fields, wrong types and the models' own checks, each as ``path: message``.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .models import WorkloadConfig, submodel
from .problems import Problem, WorkloadValidationError, describe, path_of

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


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that owns the field at ``loc`` (None past a free-form mapping)."""
    model: type[BaseModel] = WorkloadConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        sub = submodel(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


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
            problems.append(Problem(path_of(loc[:-1]), msg))
            continue
        if etype == "missing":
            problems.append(Problem(path_of(loc), "required field is missing"))
            continue
        if etype in _TYPE_NAMES and loc[:1] == ("env_variables",) and len(loc) == 2:
            msg = f"expected a string, number or true/false, got {describe(e.get('input'))}"
        elif etype in _TYPE_NAMES:
            msg = f"expected {_TYPE_NAMES[etype]}, got {describe(e.get('input'))}"
        elif etype == "value_error":
            msg = str(e.get("ctx", {}).get("error") or e.get("msg"))
        else:
            msg = str(e.get("msg")).replace("Input should be", "must be")
            if "input" in e and etype not in ("greater_than", "less_than_equal", "greater_than_equal"):
                msg += f", got {describe(e['input'])}"
            elif "input" in e:
                msg += f", got {e['input']!r}"
        problems.append(Problem(path_of(loc), msg))
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


def validate_document(doc: Any, source: str = "workload") -> WorkloadConfig:
    """Validate a parsed document; every problem is reported at once."""
    if doc is None:
        raise WorkloadValidationError(
            [Problem("", "the document is empty; required keys: experiment_name, compute, command")],
            source,
        )
    if not isinstance(doc, dict):
        raise WorkloadValidationError(
            [Problem("", f"expected a mapping of keys at the top level, got {describe(doc)}")],
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
