"""Whether the caller is an interactive IPython / Jupyter kernel (warm workers and GPU waits default on it)."""

from __future__ import annotations

import sys


def interactive() -> bool:
    """Whether this process is an interactive IPython / Jupyter kernel."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        return ipython.get_ipython() is not None
    except Exception:  # noqa: BLE001
        return False
