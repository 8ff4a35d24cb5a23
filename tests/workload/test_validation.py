"""Validation: the bad-YAML corpus, overrides, dry run, schema and field help, and a fuzz."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet.workload.schema import (
    RESERVED_ENV,
    WorkloadConfig,
    WorkloadValidationError,
    apply_overrides,
    field_paths,
    load_workload,
    parse_yaml,
    validate_document,
)
from tests.workload.helpers import cli, cli_json, write_workload

BAD = Path(__file__).parent / "bad_yaml"
CORPUS = sorted(BAD.glob("*.yaml"))


def test_corpus_is_not_empty() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_bad_yaml_reports_expected_messages(path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = [
        line.split("# expect:", 1)[1].strip()
        for line in path.read_text().splitlines()
        if line.startswith("# expect:")
    ]
    assert expected, f"{path.name} has no '# expect:' line"
    rc, out, err = cli(capsys, "validate", "-f", str(path))
    assert rc == 2
    assert "Traceback" not in err
    for text in expected:
        assert text in err, f"{path.name}: {text!r} not in:\n{err}"
    report = cli_json(capsys, "validate", "-f", str(path))
    assert report["valid"] is False and report["problems"]
    assert all(p["message"] for p in report["problems"])


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(WorkloadValidationError) as info:
        load_workload(BAD / "many_errors.yaml")
    paths = sorted(p.path for p in info.value.problems)
    assert paths == ["command", "env_variables", "max_retries", "parameters", "timeout_minutes"]


def test_valid_workload_and_dry_run(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    wl = write_workload(
        tmp_path,
        compute={"accelerator_type": "GPU_8xH100", "num_accelerators": 8},
        code_source={"root_path": ".", "include_paths": ["train.py"]},
        parameters={"lr": "2e-5"},
    )
    # a learning rate written 2e-5 (YAML 1.2 style) is a number
    wl.write_text(wl.read_text().replace("'2e-5'", "2e-5"))
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    assert rc == 0, err
    assert "1 node(s) x 8 H100 = world size 8, executor local" in out
    plan = cli_json(capsys, "run", "-f", str(wl), "--dry-run")  # no GPU needed for a dry run
    assert plan["num_nodes"] == 1 and plan["world_size"] == 8 and plan["code_files"] == 1
    assert plan["parameters"] == {"lr": 2e-5}
    assert any("GPU" in w for w in plan["warnings"])  # this machine has none
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--dry-run")
    assert rc == 0 and "world size 8" in out
    assert not (home / "workloads").exists()  # a dry run starts nothing
    rc, out, err = cli(capsys, "run", "-f", str(wl))  # a real run needs the GPUs
    assert rc == 1 and "no NVIDIA GPU is visible" in err


def test_overrides_are_typed_by_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, compute={"accelerator_type": "CPU_2", "num_accelerators": 2})
    config, _ = load_workload(
        wl,
        [
            "compute.num_accelerators=4",
            "experiment_name=123",
            "parameters.lr=1e-4",
            "parameters.tags=[a, b]",
            "env_variables.SEED=7",
            "max_retries=2",
            "timeout_minutes=1.5",
        ],
    )
    assert config.compute.num_accelerators == 4 and config.compute.num_nodes == 2
    assert config.experiment_name == "123"  # a string field keeps the text
    assert config.parameters == {"lr": 1e-4, "tags": ["a", "b"]}
    assert config.env_strings() == {"SEED": "7"}
    assert config.max_retries == 2 and config.timeout_minutes == 1.5
    rc, out, err = cli(capsys, "validate", "-f", str(wl), "--override", "compute.gpus=2",
                       "--override", "max_retries=lots", "--override", "nonsense")  # fmt: skip
    assert rc == 2
    assert "compute.gpus: unknown key 'gpus' under compute; allowed keys: accelerator_type" in err
    assert "nonsense: an override is key.path=value" in err
    rc, out, err = cli(capsys, "validate", "-f", str(wl), "--override", "max_retries=lots")
    assert rc == 2 and "max_retries: expected an integer, got str 'lots'" in err


def test_multi_node_needs_the_ray_executor(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, compute={"accelerator_type": "CPU_2", "num_accelerators": 4})
    plan = cli_json(capsys, "run", "-f", str(wl), "--dry-run")
    assert plan["num_nodes"] == 2 and plan["executor"] == "gpufleet.workload.ray_executor"
    if importlib.util.find_spec("gpufleet.workload.ray_executor") is not None:
        pytest.skip("the Ray executor is installed; its own tests cover multi-node runs")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 1
    assert "needs 2 nodes (4 x CPU_2)" in err and "no multi-node executor" in err
    assert not (home / "workloads").exists()


def test_schema_and_field_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "schema")
    schema = json.loads(out)
    assert schema["title"] == "gpufleet workload"
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"experiment_name", "compute", "command"}
    info = cli_json(capsys, "validate", "--explain", "compute.accelerator_type")
    assert info["required"] is True and "GPU_<n>x<TYPE>" in info["description"]
    assert cli_json(capsys, "schema", "--explain", "code_source")["type"] == "CodeSourceConfig | None"
    rc, out, _ = cli(capsys, "schema", "--explain", "max_retries")
    assert rc == 0 and "default: 0" in out and "optional" in out
    rc, out, err = cli(capsys, "schema", "--explain", "compute.acelerator_type")
    assert rc == 2 and "did you mean 'accelerator_type'?" in err
    fields = cli_json(capsys, "schema", "--fields")
    assert [f["path"] for f in fields] == field_paths()
    assert all(f["description"] for f in fields)


# ------------------------------------------------------------------ fuzz

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=20), st.sampled_from(["GPU_8xH100", "CPU_2", "CPU_0", "GPU_x", "ray://h:1", "auto", "."]),
)  # fmt: skip
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(0, 3)), inner, max_size=3),
    ),
    max_leaves=8,
)
_known = st.sampled_from(
    ["experiment_name", "compute", "environment", "code_source", "command", "env_variables",
     "parameters", "max_retries", "timeout_minutes", "accelerator_type", "num_accelerators",
     "cluster", "dependencies", "root_path", "include_paths"]
)  # fmt: skip
_compute = st.fixed_dictionaries(
    {},
    optional={
        "accelerator_type": st.one_of(st.sampled_from(["GPU_8xH100", "CPU_2", "GPU_2xA10", "CPU_1"]), _scalars),
        "num_accelerators": st.one_of(st.integers(-2, 40), _scalars),
        "cluster": st.one_of(st.none(), st.sampled_from(["ray://head:10001", "auto", "x y"]), _scalars),
    },
)
_documents = st.one_of(
    _values,
    st.fixed_dictionaries(
        {},
        optional={
            "experiment_name": st.one_of(st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), _scalars),
            "compute": st.one_of(_compute, _values),
            "command": st.one_of(st.just("echo hi"), _scalars),
            "environment": st.one_of(st.fixed_dictionaries({"dependencies": st.lists(st.text(max_size=12), max_size=3)}), _values),
            "code_source": st.one_of(st.fixed_dictionaries({"root_path": st.text(max_size=5)}, optional={"include_paths": st.lists(st.text(max_size=6), max_size=2)}), _values),
            "env_variables": st.dictionaries(st.text(max_size=8), _scalars, max_size=3),
            "parameters": st.one_of(st.dictionaries(st.text(max_size=8), _values, max_size=3), _values),
            "max_retries": st.one_of(st.integers(-1, 200), _scalars),
            "timeout_minutes": st.one_of(st.floats(-1, 1e7), _scalars),
        },
    ).flatmap(lambda d: st.dictionaries(_known, _values, max_size=2).map(lambda extra: {**extra, **d})),
)

_no_nul = st.text(max_size=12).filter(lambda s: "\x00" not in s)
_valid_compute = st.integers(1, 8).flatmap(
    lambda per: st.fixed_dictionaries(
        {
            "accelerator_type": st.sampled_from([f"GPU_{per}xH100", f"CPU_{per}", f"GPU_{per}xA10"]),
            "num_accelerators": st.integers(1, 4).map(lambda k: k * per),
        },
        optional={"cluster": st.sampled_from(["ray://head:10001", "auto", "head:6379"])},
    )
)
_valid_documents = st.fixed_dictionaries(
    {
        "experiment_name": st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
        "compute": _valid_compute,
        "command": _no_nul.filter(lambda s: s.strip()),
    },
    optional={
        "parameters": st.dictionaries(st.text(max_size=8), _values, max_size=3),
        "max_retries": st.integers(0, 100),
        "timeout_minutes": st.floats(0.01, 1000),
        "env_variables": st.dictionaries(
            st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True).filter(lambda k: k not in RESERVED_ENV),
            st.one_of(_no_nul, st.integers(), st.booleans()),
            max_size=3,
        ),
        "environment": st.fixed_dictionaries(
            {"dependencies": st.lists(st.sampled_from(["trl==1.16.0", "numpy>=1", "x @ file:///w/x.whl"]), max_size=2)}
        ),
        "code_source": st.fixed_dictionaries(
            {"root_path": st.sampled_from([".", "src", "/abs"])},
            optional={"include_paths": st.lists(st.sampled_from(["a.py", "conf/x.yaml"]), max_size=2)},
        ),
    },
)


def _mutate(doc: dict, edits: list[tuple[str, object]]) -> dict:
    out = dict(doc)
    for key, value in edits:
        parts = key.split(".")
        target = out
        for part in parts[:-1]:
            nxt = target.get(part)
            if not isinstance(nxt, dict):
                break
            target = dict(nxt)
            out[part] = target
        else:
            if value == "<delete>":
                target.pop(parts[-1], None)
            else:
                target[parts[-1]] = value
    return out


_mutated_documents = st.builds(
    _mutate,
    _valid_documents,
    st.lists(
        st.tuples(st.sampled_from(field_paths() + ["extra", "compute.extra"]), st.one_of(st.just("<delete>"), _values)),
        min_size=1,
        max_size=2,
    ),
)
_documents = st.one_of(_valid_documents, _mutated_documents, _documents)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=_documents, as_text=st.booleans())
def test_fuzzed_documents_validate_or_fail_clearly(doc: object, as_text: bool) -> None:
    try:
        if as_text:
            try:
                text = yaml.safe_dump(doc, allow_unicode=True)
            except yaml.YAMLError:
                return
            config = validate_document(parse_yaml(text))
        else:
            config = validate_document(doc)
    except WorkloadValidationError as e:
        assert e.problems
        for p in e.problems:
            assert isinstance(p.path, str) and p.message.strip()
            assert "Traceback" not in p.message
        assert str(e).count("\n") == len(e.problems)
        return
    assert isinstance(config, WorkloadConfig)
    assert config.compute.num_accelerators % config.compute.per_node == 0
    # a valid config round-trips through its stored (JSON) form
    assert WorkloadConfig.model_validate(config.model_dump(mode="json")) is not None


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_fuzzed_text_never_raises_anything_else(text: str) -> None:
    try:
        validate_document(parse_yaml(text))
    except WorkloadValidationError as e:
        assert e.problems


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.text(max_size=30), max_size=4))
def test_fuzzed_overrides_never_raise_anything_else(items: list[str]) -> None:
    base = {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1", "num_accelerators": 1}, "command": "true"}
    try:
        validate_document(apply_overrides(base, items))
    except WorkloadValidationError as e:
        assert e.problems


def test_validate_lists_disk_problems_with_the_others_and_advises_in_workload_terms(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "0")  # a machine without GPUs, wherever the test runs
    gpus = {"accelerator_type": "GPU_2xH100", "num_accelerators": 2}
    wl = write_workload(tmp_path, experiment_name="bad name", compute=gpus, max_retries=-1,
                        code_source={"root_path": "missing"})  # fmt: skip
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    assert rc == 2 and "invalid (3 problems)" in err, err
    assert "experiment_name: 'bad name' is not allowed" in err and "max_retries: must be greater" in err
    assert f"code_source.root_path: folder {str(tmp_path / 'missing')!r} does not exist" in err
    (tmp_path / "train.py").write_text("print('hi')\n")
    wl = write_workload(tmp_path, compute=gpus, code_source={"root_path": ".", "include_paths": ["train.py", "conf"]})
    rc, out, err = cli(capsys, "validate", "-f", str(wl), "--override", "max_retries=lots")
    assert rc == 2 and "max_retries: expected an integer" in err and "code_source.include_paths[1]: 'conf' does not exist" in err
    wl = write_workload(tmp_path, compute=gpus, code_source={"root_path": "."})
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    assert rc == 0, err
    assert ("no NVIDIA GPU is visible on this machine; to run it on 2 CPU worker(s) set accelerator_type: CPU_2 "
            "(`--override compute.accelerator_type=CPU_2`)") in out  # fmt: skip
    assert "gpu_type" not in out  # the decorator's argument means nothing in a workload
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "1")
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    assert rc == 0 and "but this machine has Fake GPU: name the type present in accelerator_type" in out
    assert "gpu_type" not in out
