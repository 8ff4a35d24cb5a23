"""Workload secrets: read at submit time, seen by the nodes, written nowhere, masked in the logs."""

from __future__ import annotations

import hashlib
import json
import secrets
import textwrap
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, cli_json, write_workload

CHECK = textwrap.dedent(
    """
    import hashlib, os, sys, time
    for name in ("API_TOKEN", "FILE_TOKEN"):
        value = os.environ[name]
        print(name, "sha256", hashlib.sha256(value.encode()).hexdigest(), flush=True)
        print(name, "printed:", value, flush=True)
        # a value cut in two writes still comes out masked
        sys.stdout.write(f"{name} in two writes: {value[:5]}"); sys.stdout.flush(); time.sleep(0.2)
        sys.stdout.write(value[5:] + " end\\n"); sys.stdout.flush()
    print("names:", os.environ["GPUFLEET_SECRETS"])
    """
)


def _files(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_a_secret_reaches_the_node_and_nothing_else(
    tmp_path: Path, home: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow")
    mlflow_dir = tmp_path / "mlflow"
    mlflow_dir.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{mlflow_dir / 'mlflow.db'}")
    env_value = "gf-env-" + secrets.token_hex(12)
    file_value = "gf-file-" + secrets.token_hex(12)
    monkeypatch.setenv("GF_TEST_SECRET_SOURCE", env_value)
    project = tmp_path / "project"
    project.mkdir()
    (project / "check.py").write_text(CHECK)
    (project / ".token").write_text(file_value + "\n")  # inside the code folder: must not be copied
    wl = write_workload(
        project,
        experiment_name="secrets",
        code_source={"root_path": "."},
        command="python check.py",
        secrets={"API_TOKEN": {"env": "GF_TEST_SECRET_SOURCE"}, "FILE_TOKEN": {"file": ".token"}},
        parameters={"lr": 0.1},
    )
    outputs = []
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch")
    outputs += [out, err]
    assert rc == 0, err + out
    run_id = out.splitlines()[0]
    for name, value in (("API_TOKEN", env_value), ("FILE_TOKEN", file_value)):  # the node saw each value
        assert f"{name} sha256 {hashlib.sha256(value.encode()).hexdigest()}" in out
        assert f"{name} printed: ***" in out
        assert f"{name} in two writes: *** end" in out
    assert "names: API_TOKEN,FILE_TOKEN" in out
    assert "MLflow run " in err

    for argv in (["get", run_id], ["list", "--all-status"], ["logs", run_id], ["logs", run_id, "--setup"],
                 ["logs", run_id, "--lines", "5"]):  # fmt: skip
        rc, text, more = cli(capsys, *argv)
        outputs += [text, more]
        rc, text, more = cli(capsys, *argv, "-o", "json")
        outputs += [text, more]
    run = cli_json(capsys, "get", run_id)
    assert run["config"]["secrets"] == {"API_TOKEN": {"env": "GF_TEST_SECRET_SOURCE"}, "FILE_TOKEN": {"file": ".token"}}
    snapshot = Path(run["run_dir"]) / "code"
    assert (snapshot / "check.py").exists() and not (snapshot / ".token").exists()

    from mlflow import MlflowClient

    (mlflow_id,) = [a["mlflow_run_id"] for a in run["attempts"]]
    client = MlflowClient()
    assert client.get_run(mlflow_id).data.params["lr"] == "0.1"  # the store was written
    assert any(a.path == "logs" for a in client.list_artifacts(mlflow_id))

    files = _files(home, mlflow_dir, snapshot)
    assert any(f.name == "node-0.log" for f in files) and any(f.name == "runs.db" for f in files)
    assert any(f.name.startswith("mlflow.db") for f in files) and any("mlartifacts" in f.parts for f in files)
    for value in (env_value, file_value):
        data = value.encode()
        leaked = [str(f) for f in files if data in f.read_bytes()]
        assert leaked == [], f"the secret is in {leaked}"
        assert not [text for text in outputs if value in text]


def test_unreadable_secrets_are_refused_before_anything_starts(
    tmp_path: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GF_TEST_UNSET", raising=False)
    wl = write_workload(tmp_path, secrets={"A_TOKEN": {"env": "GF_TEST_UNSET"}, "B_KEY": {"file": "missing.txt"}})
    rc, out, err = cli(capsys, "run", "-f", str(wl))
    assert rc == 2
    assert "secrets.A_TOKEN: the environment variable GF_TEST_UNSET is not set" in err
    assert "secrets.B_KEY: cannot read" in err and "missing.txt" in err
    assert store.list(states=None) == []
    # a dry run says so as a warning: the secret may be set only where the run is submitted
    plan = cli_json(capsys, "run", "--dry-run", "-f", str(wl))
    assert plan["secrets"] == {"A_TOKEN": "env GF_TEST_UNSET", "B_KEY": "file missing.txt"}
    assert any("secrets.A_TOKEN cannot be read now" in w for w in plan["warnings"])


def test_a_secret_value_written_in_the_workload_is_refused(
    tmp_path: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GF_TEST_SECRET", "hunter2-value")
    wl = write_workload(tmp_path, command="echo hunter2-value", secrets={"PASSWORD": {"env": "GF_TEST_SECRET"}})
    rc, out, err = cli(capsys, "run", "-f", str(wl))
    assert rc == 2 and "secrets.PASSWORD: its value also appears in the workload" in err
    assert "hunter2-value" not in err + out


def test_secret_looking_env_variables_are_warned_about(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path, env_variables={"HF_TOKEN": "hf_abc", "HF_HOME": "/tmp/hf"})
    plan = cli_json(capsys, "run", "--dry-run", "-f", str(wl))
    assert [w.split(" looks like")[0] for w in plan["warnings"]] == ["env_variables.HF_TOKEN"]
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking", "--watch")
    assert rc == 0
    assert "warning: env_variables.HF_TOKEN looks like a secret" in err
    assert "secrets: {HF_TOKEN: {env: HF_TOKEN}}" in err
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    assert "warning: env_variables.HF_TOKEN looks like a secret" in out


def test_secret_values_are_masked_in_a_stream_cut_anywhere() -> None:
    from gpufleet.launch.node.guard import Masker

    values = [b"abc-secret-1", b"abc-other"]
    text = b"x abc-secret-1 y abc-other z abc-sec"
    for size in range(1, len(text) + 1):
        masker = Masker(values)
        out = b"".join(masker.feed(text[i : i + size]) for i in range(0, len(text), size)) + masker.flush()
        assert out == b"x *** y *** z abc-sec", size


def test_secret_sources_are_checked_by_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, secrets={"1BAD": {"env": "X"}, "OK": {"env": "X", "file": "y"}, "WORLD_SIZE": {"env": "X"}})
    result = cli_json(capsys, "validate", "-f", str(wl))
    text = json.dumps(result)
    assert "'1BAD' is not a variable name" in text
    assert "OK: a secret's source is {env: VARIABLE} or {file: PATH}" in text
    assert "WORLD_SIZE is set by gpufleet" in text
