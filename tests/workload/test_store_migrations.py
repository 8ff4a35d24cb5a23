"""The run store's schema version: an old store opens and upgrades; a newer one is refused."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from gpufleet.runs.migrations import _V1, SCHEMA_VERSION
from gpufleet.runs.store import RunStore, StoreError
from tests.workload.helpers import cli


def _old_store(home: Path) -> Path:
    """A store as gpufleet wrote it before schema versions: version-1 tables, user_version 0, one workload run."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = home / "runs.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = WAL")
    db.executescript(_V1 + ";")
    db.execute(
        "INSERT INTO runs (id, experiment, state, created_at, config, run_dir, num_nodes, world_size, max_attempts) "
        "VALUES ('20250101-000000-old-abc123', 'old', 'SUCCESS', 1.0, ?, '/nowhere', 1, 2, 1)",
        (json.dumps({"compute": {"accelerator_type": "CPU_2"}}),),
    )
    db.execute("INSERT INTO attempts (run_id, attempt, state, started_at, log_dir) "
               "VALUES ('20250101-000000-old-abc123', 1, 'SUCCESS', 1.0, '/nowhere/attempts/1')")  # fmt: skip
    db.commit()
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    db.close()
    return path


def test_a_store_of_the_first_schema_opens_and_is_upgraded(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _old_store(home)
    store = RunStore(home)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert {"kind", "origin", "placement"} <= {r[1] for r in db.execute("PRAGMA table_info(runs)")}
    db.close()
    run = store.get("20250101-000000-old-abc123")
    assert (run.kind, run.origin, run.placement, run.world_size) == ("workload", {}, {}, 2)
    assert [(a.attempt, a.recoveries) for a in run.attempts] == [(1, [])]
    RunStore(home)  # opening it again changes nothing
    code, out, _ = cli(capsys, "list", "--all-status", "--home", str(home))
    assert code == 0 and "20250101-000000-old-abc123\tSUCCESS\tworkload\told" in out


def test_a_store_newer_than_the_code_is_refused(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    RunStore(home)
    db = sqlite3.connect(home / "runs.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=rf"schema version {SCHEMA_VERSION + 1}, written by a newer gpufleet"):
        RunStore(home)
    code, _, err = cli(capsys, "list", "--home", str(home))
    assert code == 2 and "Upgrade gpufleet" in err
    db = sqlite3.connect(home / "runs.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1  # untouched
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # the fixture reads the store at the end
    db.commit()
    db.close()
