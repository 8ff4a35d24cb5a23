"""Secrets of a run: values read when it starts, handed to its processes in their environment only.

A secret is named by the variable it becomes (``HF_TOKEN``) and read from one source:
``{"env": "NAME"}`` (a variable of the submitting process) or ``{"file": "PATH"}`` (a file's
content, without its last line end; ``~`` is expanded, a relative path starts at ``base_dir``).
The values never go into a file gpufleet writes, the run store, MLflow or printed output;
gpufleet masks them as ``***`` in the logs it copies, and in the error messages it stores (the
run store's message, MLflow's ``error.txt``: :func:`mask_env_secrets`), where a failing call's
own exception may quote one (``raise PermissionError(f"401 for {token}")``). The names of the variables that hold
secrets travel in :data:`SECRETS_ENV` (names only), so the processes that copy a node's
output know what to mask.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from .errors import GpufleetError
from .launch.node import envcontract

__all__ = [
    "MASK",
    "SECRETS_ENV",
    "SecretError",
    "mask",
    "mask_env_secrets",
    "read_secrets",
    "secret_files",
    "source_problems",
]

#: Names (comma-separated) of the environment variables of a process that hold secrets.
SECRETS_ENV = envcontract.SECRETS
MASK = "***"
MAX_SECRET_BYTES = 1 << 20
SOURCES = ("env", "file")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SecretError(GpufleetError, ValueError):
    """A secret cannot be read: its variable is not set, its file is missing or unreadable."""


def source_problems(name: str, source: object) -> list[str]:
    """What is wrong with the name or source of one secret (empty when nothing is)."""
    problems = []
    if not isinstance(name, str) or not _NAME_RE.match(name):
        problems.append(f"{name!r} is not a variable name; use [A-Za-z_][A-Za-z0-9_]*")
    if (
        not isinstance(source, Mapping) or len(source) != 1 or next(iter(source)) not in SOURCES
        or not isinstance(next(iter(source.values())), str) or not next(iter(source.values())).strip()
    ):  # fmt: skip
        problems.append(
            f"{name}: a secret's source is {{env: VARIABLE}} or {{file: PATH}} (one of them, a non-empty string), "
            f"got {source!r}"
        )
    return problems


def _path(value: str, base_dir: Path | None) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() or base_dir is None else base_dir / path


def read_secret(name: str, source: Mapping[str, str], base_dir: Path | None = None) -> str:
    """The value of one secret; raises :class:`SecretError` naming the source (never a value)."""
    kind, where = next(iter(source.items()))
    if kind == "env":
        value = os.environ.get(where)
        if value is None:
            raise SecretError(f"secret {name}: the environment variable {where} is not set")
    else:
        from .smallfiles import read_small_file

        path = _path(where, base_dir)
        try:
            data = read_small_file(path, MAX_SECRET_BYTES)  # a FIFO or /dev/zero is refused, not read
        except OSError as e:
            raise SecretError(f"secret {name}: cannot read {path}: {e.strerror or e}") from None
        try:
            value = data.decode("utf-8")
        except UnicodeDecodeError:
            raise SecretError(f"secret {name}: {path} is not UTF-8 text") from None
        value = (
            value[:-2] if value.endswith("\r\n") else value[:-1] if value.endswith("\n") else value
        )
    if not value:
        raise SecretError(
            f"secret {name}: its {'variable ' + where if kind == 'env' else 'file ' + where} is empty"
        )
    if "\x00" in value:
        raise SecretError(
            f"secret {name}: its value holds a NUL character, which no environment variable can"
        )
    return value


def read_secrets(
    secrets: Mapping[str, Mapping[str, str]], base_dir: Path | None = None
) -> dict[str, str]:
    """Every secret's value, by name; raises :class:`SecretError` for the first that cannot be read."""
    for name, source in secrets.items():
        problems = source_problems(name, source)
        if problems:
            raise SecretError("; ".join(problems))
    return {name: read_secret(name, source, base_dir) for name, source in secrets.items()}


def secret_files(
    secrets: Mapping[str, Mapping[str, str]], base_dir: Path | None = None
) -> list[Path]:
    """The files the secrets are read from, resolved (a code snapshot must not copy them)."""
    out = []
    for source in secrets.values():
        if isinstance(source, Mapping) and isinstance(source.get("file"), str):
            out.append(_path(source["file"], base_dir).resolve())
    return out


def secret_env(values: Mapping[str, str]) -> dict[str, str]:
    """The environment that hands ``values`` to a process: the variables, and their names in :data:`SECRETS_ENV`."""
    if not values:
        return {}
    return {**values, SECRETS_ENV: ",".join(sorted(values))}


def mask(text: str, values: Iterable[str]) -> str:
    """``text`` with every occurrence of each value replaced by :data:`MASK` (longest values first)."""
    for value in sorted({v for v in values if v}, key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


def env_secret_values(env: Mapping[str, str]) -> list[str]:
    """The secret values of an environment made by :func:`secret_env` (those :data:`SECRETS_ENV` names)."""
    names = [n for n in env.get(SECRETS_ENV, "").split(",") if n]
    return [env[n] for n in names if env.get(n)]


def mask_env_secrets(text: str, env: Mapping[str, str]) -> str:
    """``text`` with the secrets of ``env`` (a run's environment, see :func:`secret_env`) masked."""
    values = env_secret_values(env)
    return mask(text, values) if values else text
