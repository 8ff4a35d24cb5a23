"""The workload file: its pydantic models, validation with every problem at once, and help.

One concern per module; this package re-exports the public names:

* :mod:`.models` — the strict pydantic models of a workload (``WorkloadConfig`` ...);
* :mod:`.problems` — ``Problem`` and ``WorkloadValidationError`` (path + message, all at once);
* :mod:`.validation` — ``validate_document``: pydantic errors turned into problems;
* :mod:`.yaml_loader` — ``parse_yaml``: a safe loader that refuses duplicate keys, recursive
  and exploding aliases and non-plain tags;
* :mod:`.overrides` — ``apply_overrides``: ``--override key.path=value``;
* :mod:`.loading` — ``load_workload``: read, parse, override, validate a file;
* :mod:`.help` — ``json_schema``, ``field_paths`` and ``explain`` for editors and ``--explain``.
"""

from __future__ import annotations

from .help import explain, field_paths, json_schema
from .loading import load_workload
from .models import (
    RESERVED_ENV,
    CodeSourceConfig,
    ComputeConfig,
    EnvironmentConfig,
    WorkloadConfig,
)
from .overrides import apply_overrides
from .problems import Problem, WorkloadValidationError
from .validation import validate_document
from .yaml_loader import MAX_ALIAS_VALUES, parse_yaml

__all__ = [
    "MAX_ALIAS_VALUES",
    "RESERVED_ENV",
    "CodeSourceConfig",
    "ComputeConfig",
    "EnvironmentConfig",
    "Problem",
    "WorkloadConfig",
    "WorkloadValidationError",
    "apply_overrides",
    "explain",
    "field_paths",
    "json_schema",
    "load_workload",
    "parse_yaml",
    "validate_document",
]
