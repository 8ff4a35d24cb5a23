"""Run ids: an exact id, or a unique prefix of at least 6 characters; nothing else names a run."""

from __future__ import annotations

import json
import time

import pytest

from gpufleet.runs.store import PENDING, RunIdError, RunNotFoundError, RunRecord, RunStore
from tests.workload.helpers import cli

A = "20260101-000000-alpha-aaaaaa"
B = "20260101-000000-alpha-bbbbbb"
C = "20260102-000000-beta-cccccc"


@pytest.fixture
def runs(store: RunStore) -> RunStore:
    """Three PENDING runs just submitted (their supervisor may still be starting: nothing reaps them)."""
    for i, run_id in enumerate((A, B, C)):
        store.create_run(RunRecord(
            id=run_id, experiment="ids", state=PENDING, created_at=time.time() + i, config={},
            run_dir="/nonexistent", num_nodes=1, world_size=1, max_attempts=1,
        ))  # fmt: skip
    return store


def _untouched(store: RunStore) -> None:
    for run_id in (A, B, C):
        run = store.get(run_id)
        assert run.state == PENDING and not run.cancel_requested, run


def test_the_store_finds_exact_ids_and_unique_prefixes_only(runs: RunStore) -> None:
    assert runs.get(A).id == A
    assert runs.get("20260102").id == C
    with pytest.raises(RunIdError, match="ambiguous: it matches .*bbbbbb.*aaaaaa"):
        runs.get("20260101-000000-alpha")
    with pytest.raises(RunIdError, match="empty run id"):
        runs.get("")
    with pytest.raises(RunIdError, match="at least 6 characters"):
        runs.get("20260")
    with pytest.raises(RunNotFoundError, match="does not exist") as e:
        runs.get("aaaaaa")  # a suffix no longer names a run
    assert not isinstance(e.value, RunIdError)


@pytest.mark.parametrize("command", ["get", "logs", "wait", "cancel"])
@pytest.mark.parametrize(
    ("run_id", "code", "says"),
    [
        ("", 2, "empty run id"),
        ("2026", 2, "prefix must have at least 6 characters"),
        ("20260101-000000-alpha-", 2, "is ambiguous: it matches"),
        ("20261231", 1, "does not exist"),
        ("alpha-aaaaaa", 1, "does not exist"),
    ],
)
def test_commands_refuse_ids_that_do_not_name_one_run(
    runs: RunStore, capsys: pytest.CaptureFixture[str], command: str, run_id: str, code: int, says: str
) -> None:
    rc, out, err = cli(capsys, command, run_id)
    assert rc == code and says in err, (rc, out, err)
    assert "Traceback" not in err and out == ""
    if "ambiguous" in says:
        assert A in err and B in err and C not in err
    _untouched(runs)
    rc, out, err = cli(capsys, command, run_id, "-o", "json")
    assert rc == code and says in json.loads(out)["error"]
    _untouched(runs)


def test_cancel_of_an_empty_id_cancels_nothing(runs: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "cancel", "", "--no-wait")
    assert rc == 2 and "empty run id" in err
    _untouched(runs)
    # every id is checked before anything is canceled
    rc, out, err = cli(capsys, "cancel", A, "", "--no-wait")
    assert rc == 2 and "empty run id" in err
    _untouched(runs)


def test_a_unique_prefix_of_six_characters_or_more_names_its_run(runs: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "get", "20260102", "-o", "json")
    assert rc == 0 and json.loads(out)["id"] == C
    rc, out, err = cli(capsys, "get", "202601")  # six characters, but three runs
    assert rc == 2 and "ambiguous" in err
    rc, out, err = cli(capsys, "cancel", "20260102-000000-beta", "--no-wait", "-o", "json")
    assert rc == 0 and [r["id"] for r in json.loads(out)] == [C]
    assert runs.get(C).cancel_requested
    assert not runs.get(A).cancel_requested and not runs.get(B).cancel_requested
