"""Check an Axolotl config with Axolotl's own loader before spending GPU time on it.

Usage (in the ``axolotl`` environment)::

    python validate_config.py olmo2_7b_qlora.yml [--base-model PATH_OR_NAME] [--output-dir DIR]

``axolotl.cli.config.load_cfg`` is what ``axolotl train`` runs first: it validates the YAML
against Axolotl's schema, reads the base model's config and normalises the settings. The
script prints the settings that decide memory and speed as one JSON line and exits 0, or
prints Axolotl's error and exits 1. ``--base-model`` replaces ``base_model`` (a local folder
when the hub cannot be reached).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

KEYS = (
    "base_model", "model_config_type", "adapter", "load_in_4bit", "lora_r", "lora_alpha", "optimizer",
    "sequence_len", "micro_batch_size", "gradient_accumulation_steps", "bf16", "gradient_checkpointing",
)


def main(argv: list[str] | None = None) -> int:
    """Load and validate the config; print a summary (exit 0) or the error (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="Axolotl YAML config")
    parser.add_argument("--base-model", default=None, help="replace base_model (hub name or local folder)")
    parser.add_argument("--output-dir", default=None, help="replace output_dir (load_cfg writes debug.log there)")
    args = parser.parse_args(argv)
    os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
    from axolotl.cli.config import load_cfg

    overrides = {k: v for k, v in {"base_model": args.base_model, "output_dir": args.output_dir}.items() if v}
    try:
        cfg = load_cfg(args.config, **overrides)
    except Exception as exc:  # Axolotl raises pydantic ValidationError, ValueError, OSError, ...
        print(f"INVALID {args.config}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print("VALID " + json.dumps({k: cfg.get(k) for k in KEYS}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
