"""Loading a workload file: read it, parse its YAML, apply overrides, validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .models import WorkloadConfig
from .overrides import apply_overrides
from .problems import Problem, WorkloadValidationError
from .validation import validate_document
from .yaml_loader import parse_yaml


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
