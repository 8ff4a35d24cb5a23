"""Where to see an MLflow run: the tracking server's UI address, or the ``mlflow ui`` command for a local store."""

from __future__ import annotations

import shlex
from urllib.parse import urlsplit, urlunsplit

#: Where ``mlflow ui`` serves by default.
LOCAL_UI = "http://127.0.0.1:5000"


def _run_path(run_id: str, experiment_id: str | None) -> str:
    if experiment_id:
        return f"/#/experiments/{experiment_id}/runs/{run_id}"
    return f"/#/runs/{run_id}"  # the UI finds the experiment itself


def server_address(tracking_uri: str) -> str | None:
    """The UI address of an http(s) tracking server (without user and password), else None."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def ui_command(tracking_uri: str) -> str | None:
    """``mlflow ui --backend-store-uri URI`` for a local store (SQLite, a folder); None for a server or Databricks."""
    scheme = urlsplit(tracking_uri).scheme
    if scheme in ("http", "https") or tracking_uri.startswith("databricks") or scheme in ("uc",):
        return None
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}"


def run_link(tracking_uri: str | None, run_id: str, experiment_id: str | None = None) -> str:
    """How to open run ``run_id``: its UI address, or the command that serves the local store and the address then.

    ``http://mlflow:5000/#/experiments/3/runs/ab12...`` for a server;
    ``mlflow ui --backend-store-uri sqlite:///... (then http://127.0.0.1:5000/#/...)`` for a local store.
    """
    uri = tracking_uri or ""
    address = server_address(uri)
    if address is not None:
        return address + _run_path(run_id, experiment_id)
    command = ui_command(uri)
    if command is not None:
        return f"`{command}`, then {LOCAL_UI}{_run_path(run_id, experiment_id)}"
    return f"in the UI of {uri or 'the tracking store'}"


def run_line(tracking_uri: str | None, run_id: str, experiment_id: str | None = None,
             experiment_name: str | None = None) -> str:  # fmt: skip
    """The line printed when a tracked call or workload starts."""
    where = f" in experiment {experiment_name}" if experiment_name else ""
    return f"MLflow run {run_id}{where}: {run_link(tracking_uri, run_id, experiment_id)}"
