"""A tracked call's first call on a new store prints nothing of MLflow's table creation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CALL = textwrap.dedent(
    """
    from gpufleet import distributed

    @distributed(gpus=1, gpu_type="cpu")
    def one():
        return 1

    print(one.distributed())
    """
)


def test_a_new_sqlite_store_of_the_users_is_created_without_migration_lines(tmp_path: Path) -> None:
    for uri in (f"sqlite:///{tmp_path / 'mine.db'}", None):  # the user's own store, then gpufleet's default one
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLEET_TRACKING"))}
        env["GPUFLEET_HOME"] = str(tmp_path / "home")
        if uri:
            env["MLFLOW_TRACKING_URI"] = uri
        done = subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "[1]", done.stderr
        for noise in ("Creating initial MLflow database tables", "Updating database tables", "alembic"):
            assert noise not in done.stderr, done.stderr
        assert "gpufleet: MLflow run " in done.stderr  # the one line a call says about its run
    assert (tmp_path / "mine.db").exists() and (tmp_path / "home" / "mlflow.db").exists()
