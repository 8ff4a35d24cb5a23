"""Reading workload YAML: a safe loader that refuses duplicate keys and reads YAML 1.2 floats."""

from __future__ import annotations

import re
from typing import Any

import yaml

from .problems import Problem, WorkloadValidationError


class WorkloadLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: WorkloadLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
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


WorkloadLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.2 floats: PyYAML (YAML 1.1) reads 2e-5 as a string; a learning rate should be a number.
WorkloadLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "workload") -> Any:
    """Parse YAML text, turning syntax errors into a :class:`WorkloadValidationError`."""
    try:
        return yaml.load(text, Loader=WorkloadLoader)  # noqa: S506 - a SafeLoader subclass
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
