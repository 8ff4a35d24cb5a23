"""gpufleet's default MLflow store is created whole or not at all, and repaired when it is not whole."""

from __future__ import annotations

import errno
import sqlite3
import warnings

import pytest

pytest.importorskip("mlflow")

from gpufleet.tracking import start_tracked_run  # noqa: E402
from gpufleet.tracking import store as store_module  # noqa: E402


@pytest.fixture
def default_store(tmp_path, monkeypatch):
    """A private GPUFLEET_HOME whose default store is used (no MLflow URI set)."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store_module._ready.clear()
    yield tmp_path / "mlflow.db"
    store_module._ready.clear()


def _open_and_end(name: str):
    run = start_tracked_run("store-test", name, system_metrics=False)
    run.end("SUCCESS")
    return run


def test_a_store_whose_creation_was_cut_short_is_moved_aside_and_rebuilt(default_store, caplog):
    assert _open_and_end("first").enabled
    db = sqlite3.connect(default_store)
    db.execute("DROP TABLE runs")  # as if the disk filled up while MLflow created its tables
    db.commit()
    db.close()
    store_module._ready.clear()  # a later process
    run = _open_and_end("after-the-disk-was-freed")
    assert run.enabled, "tracking must work again once the store can be written"
    moved = list(default_store.parent.glob("mlflow.db.incomplete-*"))
    assert len(moved) == 1 and str(moved[0]) in caplog.text


def test_a_failed_creation_leaves_no_store_behind_and_says_why(default_store, monkeypatch):
    real_build = store_module._build

    def disk_full(path, artifact_root):
        path.write_bytes(b"SQLite format 3\x00 half")  # what a cut-short creation leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "_build", disk_full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _open_and_end("disk-full")
    assert not run.enabled
    text = " ".join(str(w.message) for w in caught)
    assert "No space left on device" in text and str(default_store) in text
    assert not default_store.exists() and not list(default_store.parent.glob("mlflow.db.creating-*"))
    monkeypatch.setattr(store_module, "_build", real_build)  # space was freed
    assert _open_and_end("after").enabled


def test_creating_the_store_prints_no_migration_chatter(default_store, capfd):
    assert _open_and_end("quiet").enabled
    out, err = capfd.readouterr()
    assert "Creating initial MLflow database tables" not in out + err
    assert oct(default_store.stat().st_mode & 0o777) == oct(0o600)
