"""pip's configuration as uv arguments, so that an install by uv sees the indexes pip would see.

Used by scripts/pip_install.sh; standard library only (it runs with an environment's own python,
before that environment has packages). uv reads neither pip.conf nor PIP_* variables, so

    python scripts/uv_args.py      # stdout: uv pip install arguments, one a line

asks the environment's pip (``python -m pip config list``: pip.conf files and PIP_* variables,
the variables winning over the files as in pip) for the settings that change where packages come
from or which versions are allowed, and prints them as uv's flags:

- ``index-url`` -> ``--index-url``; ``extra-index-url`` and ``find-links`` (several, space-separated)
  -> one ``--extra-index-url`` / ``--find-links`` each; ``constraint`` -> ``--constraint``;
  ``no-index`` -> ``--no-index``;
- ``cert`` -> ``env:SSL_CERT_FILE=...`` and ``timeout`` / ``default-timeout`` ->
  ``env:UV_HTTP_TIMEOUT=...`` (lines that pip_install.sh exports instead of passing on);
- always ``--index-strategy unsafe-best-match``: pip takes the best version over every index,
  where uv's default takes a package from the first index that has it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# Where pip looks, lowest precedence first (pip: global < user < site < environment variables).
_SCOPES = ("global", "install", "user", "site", ":env:")


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """pip's effective settings by name (``extra-index-url`` -> its value), from ``pip config list``."""
    done = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          env=None, timeout=60)  # fmt: skip
    found: dict[tuple[int, str], str] = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        scope, _, name = key.rpartition(".")
        rank = _SCOPES.index(scope) if scope in _SCOPES else 0
        found[(rank, name)] = _unquote(value)
    settings: dict[str, str] = {}
    for (_, name), value in sorted(found.items()):
        settings[name] = value  # a higher scope overrides
    return settings


def _unquote(value: str) -> str:
    try:
        parts = shlex.split(value)
    except ValueError:
        return value
    return parts[0] if len(parts) == 1 else value


def uv_args(settings: dict[str, str]) -> list[str]:
    """uv pip install's arguments (and ``env:NAME=VALUE`` lines) for pip's ``settings``."""
    args = ["--index-strategy", "unsafe-best-match"]
    if settings.get("index-url"):
        args += ["--index-url", settings["index-url"]]
    for flag, name in (("--extra-index-url", "extra-index-url"), ("--find-links", "find-links"),
                       ("--constraint", "constraint")):  # fmt: skip
        for value in settings.get(name, "").split():
            args += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if settings.get("cert"):
        args.append(f"env:SSL_CERT_FILE={settings['cert']}")
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout:
        args.append(f"env:UV_HTTP_TIMEOUT={timeout}")
    return args


def main() -> int:
    print("\n".join(uv_args(pip_settings())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
