"""YAML limits: alias bombs, recursive aliases and non-plain tags are refused the same way
by ``validate``, ``run --dry-run`` and ``run``, with a clear message and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.workload.schema import (
    MAX_ALIAS_VALUES,
    WorkloadValidationError,
    apply_overrides,
    load_workload,
    validate_document,
)
from tests.workload.helpers import cli, cli_process

HEAD = """\
experiment_name: limits
compute: {accelerator_type: CPU_1, num_accelerators: 1}
command: "true"
"""


def _bomb(levels: int = 9) -> str:
    """Nested anchors, each level ten aliases of the one before: 10**levels values."""
    lines = ["parameters:", "  l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return HEAD + "\n".join(lines) + "\n"


REFUSED = {
    "alias_bomb": (_bomb(), ["parameters.l3", "alias bomb", f"at most {MAX_ALIAS_VALUES:,} may come from aliases"]),
    "recursive_alias": (HEAD + "parameters:\n  a: &x [*x]\n", ["parameters.a[0]", "recursive alias *x"]),
    "recursive_map_alias": (HEAD + "parameters: &p\n  self: *p\n", ["parameters.self", "recursive alias *p"]),
    "binary_tag": (HEAD + "parameters:\n  blob: !!binary aGVsbG8=\n", ["parameters.blob", "line 5", "the tag !!binary is not allowed"]),
    "set_tag": (HEAD + "parameters:\n  s: !!set {a, b}\n", ["parameters.s", "the tag !!set is not allowed"]),
    "python_tag": (HEAD + "parameters:\n  p: !!python/object/apply:os.system [echo]\n", ["parameters.p", "is not allowed"]),
    "local_tag": (HEAD.replace('"true"', "!shell true"), ["command", "the tag !shell is not allowed"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("command", [["validate"], ["run", "--dry-run"], ["run", "--no-tracking"]], ids=" ".join)
def test_refused_through_the_cli(
    name: str, command: list[str], tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, expected = REFUSED[name]
    wl = tmp_path / "workload.yaml"
    wl.write_text(text)
    rc, out, err = cli(capsys, *command, "-f", str(wl))
    assert rc == 2, (out, err)
    assert "Traceback" not in out + err
    assert "is invalid (1 problem)" in err
    for part in expected:
        assert part in err, f"{part!r} not in:\n{err}"
    assert not (home / "workloads").exists()  # nothing was started


def test_alias_bomb_in_a_fresh_process(tmp_path: Path, home: Path) -> None:
    wl = tmp_path / "workload.yaml"
    wl.write_text(_bomb(levels=30))  # 10**30 values if expanded
    for command in (["validate"], ["run", "--dry-run"], ["run"]):
        proc = cli_process(*command, "-f", str(wl), env={"GPUFLEET_HOME": str(home)}, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
        assert "alias bomb" in proc.stderr


def test_aliases_within_the_limit_still_work(tmp_path: Path) -> None:
    many = "[" + ", ".join(["0"] * (MAX_ALIAS_VALUES // 2 - 1)) + "]"  # MAX_ALIAS_VALUES // 2 values
    text = HEAD + (
        "parameters:\n  common: &common {lr: 1.0e-4, steps: [1, 2, 3]}\n  a: *common\n  b: [*common, *common]\n"
        f"  many: &many {many}\n  again: *many\n  date: 2024-01-01\n  text: !!str 123\n"
    )
    wl = tmp_path / "workload.yaml"
    wl.write_text(text)
    config, _ = load_workload(wl)
    p = config.parameters
    assert p["a"] == p["common"] == {"lr": 1e-4, "steps": [1, 2, 3]} and p["b"] == [p["common"]] * 2
    assert p["again"] == p["many"] and p["text"] == "123"
    wl.write_text(text.replace("again: *many", "again: [*many, *many]"))  # just over the limit
    with pytest.raises(WorkloadValidationError, match="alias bomb"):
        load_workload(wl)


def test_override_values_are_limited_too() -> None:
    base = {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1", "num_accelerators": 1}, "command": "true"}
    # a value that is not plain YAML data is kept as its text, like any value that is not YAML
    doc = apply_overrides(base, ["parameters.a=&x [*x]", "parameters.b=!!binary aGVsbG8="])
    assert validate_document(doc).parameters == {"a": "&x [*x]", "b": "!!binary aGVsbG8="}
