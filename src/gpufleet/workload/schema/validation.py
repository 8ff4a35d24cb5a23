"""Validating a parsed workload document, with pydantic's errors turned into field-path problems.

Every problem is reported at once: unknown keys (with the allowed ones and a close match),
missing fields, wrong types and the models' own checks, each as ``path: message``.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .models import WorkloadConfig, submodel
from .problems import ItemProblems, Problem, WorkloadValidationError, describe, path_of

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
        elif etype == "value_error" and isinstance(e.get("ctx", {}).get("error"), ItemProblems):
            problems += [Problem(path_of((*loc, i)), m) for i, m in e["ctx"]["error"].items]
            continue
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
        config = WorkloadConfig.model_validate(doc)
    except ValidationError as e:
        raise WorkloadValidationError(_problems_from(e) + fault_fit_problems(doc), source, doc) from None
    except RecursionError:
        raise WorkloadValidationError([Problem("", "the document is nested too deeply")], source) from None
    problems = fault_fit_problems(doc)
    if problems:
        raise WorkloadValidationError(problems, source, doc)
    return config


def fault_fit_problems(doc: dict[str, Any]) -> list[Problem]:
    """Faults that could never fire in this workload: a rank it does not have, an attempt it never
    makes, any fault of a Ray driver (its workers are Ray's, not the command's). Read from the
    document itself, so that they are reported with its other problems; faults, ranks or retries
    that are invalid themselves have their own problems and are left out here."""
    from ...errors import LaunchConfigError
    from ...faults import Fault, fit_problems, parse_fault

    specs = doc.get("faults")
    if not isinstance(specs, list) or not specs:
        return []
    faults: dict[int, Fault] = {}
    for i, spec in enumerate(specs):
        with contextlib.suppress(LaunchConfigError, TypeError):  # a wrong fault has its own problem
            faults[i] = parse_fault(spec)
    compute = doc.get("compute") if isinstance(doc.get("compute"), dict) else {}
    if compute.get("ray_driver") is True:
        return [Problem("faults", "faults are not injected into a Ray driver's workers (compute.ray_driver: true): "
                                  "they would never fire; rehearse them without ray_driver, or remove them")]  # fmt: skip
    world = compute.get("num_accelerators")
    retries = doc.get("max_retries", 0)
    world = world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None
    attempts = retries + 1 if isinstance(retries, int) and not isinstance(retries, bool) and 0 <= retries <= 100 else None
    indices = list(faults)
    return [Problem(f"faults[{indices[i]}]", message) for i, message in fit_problems(faults.values(), world, attempts)]
