"""One environment contract: every variable name gpufleet sets or reads is written in one module.

``src/gpufleet/launch/node/envcontract.py`` names them; the rest of the source uses its constants.
Read from the source (``ast``), nothing is imported: a string of the code (docstrings and comments
aside), a part of an f-string or a keyword argument's name that holds ``GPUFLEET_`` or is a
torchrun variable is a literal copy of the contract, and only the contract may hold those. Inside
a rank, ``gpufleet.runtime`` is the one reader of the torchrun variables.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "gpufleet"
CONTRACT = PACKAGE / "launch" / "node" / "envcontract.py"

#: What torchrun sets for its workers (and gpufleet's launchers for their ranks).
TORCHRUN = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NUM_NODES", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
})  # fmt: skip
GROUPS = ("torchrun", "launcher -> rank", "supervisor/actor -> node", "user settings", "test hooks")

#: Code that runs where gpufleet cannot be imported, so it writes the names itself: the
#: ``sitecustomize`` that arms faults as Python starts, and the templates of an exported workload.
#: Each name it writes must be one of the contract.
EXEMPT_FILES = ("fault_boot/sitecustomize.py",)
EXEMPT_TEMPLATES = {"workload/export.py": ("ENTRY", "COMMAND")}

#: Readers of torchrun variables in ``os.environ`` beside ``gpufleet.runtime``: the Slurm task
#: that builds a rank's environment from Slurm's, and the ``sitecustomize`` that runs before gpufleet.
ENVIRON_READERS = ("runtime.py", "launch/engines/slurm/node.py", "fault_boot/sitecustomize.py")


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != CONTRACT)


def _contract() -> dict[str, str]:
    """The contract's constants: name -> value (tuples of names left out)."""
    tree = ast.parse(CONTRACT.read_text(), str(CONTRACT))
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}  # fmt: skip


def _names_in(text: str) -> list[str]:
    """The contract names a string of the code writes: ``GPUFLEET_...`` anywhere, a torchrun name whole."""
    return re.findall(r"GPUFLEET_\w+", text) + ([text] if text in TORCHRUN else [])


def _strings(tree: ast.AST, skip: frozenset[int] = frozenset()) -> list[tuple[int, str]]:
    """(line, text) of every string of the code and keyword argument name; docstrings (a string
    that is a statement on its own) and the nodes in ``skip`` (by id) left out."""
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.value.lineno, node.arg))
    return found


def _template_nodes(tree: ast.Module, names: tuple[str, ...]) -> list[ast.AST]:
    return [n.value for n in tree.body if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in names for t in n.targets)]  # fmt: skip


def _literals() -> dict[str, list[tuple[int, str]]]:
    """Per file: (line, name) of each literal copy of a contract name outside the exemptions."""
    found: dict[str, list[tuple[int, str]]] = {}
    for path in _sources():
        rel = _rel(path)
        if rel in EXEMPT_FILES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        skip = frozenset(id(s) for t in _template_nodes(tree, EXEMPT_TEMPLATES.get(rel, ())) for s in ast.walk(t))
        hits = [(line, name) for line, text in _strings(tree, skip) for name in _names_in(text)]
        if hits:
            found[rel] = sorted(hits)
    return found


def _environ_key(node: ast.AST, torchrun_constants: set[str]) -> str | None:
    """The torchrun name ``node`` stands for: a literal, or a constant of the contract (``envcontract.RANK``)."""
    if isinstance(node, ast.Constant) and node.value in TORCHRUN:
        return str(node.value)
    if isinstance(node, ast.Attribute) and node.attr in torchrun_constants:
        return node.attr
    if isinstance(node, ast.Name) and node.id in torchrun_constants:
        return node.id
    return None


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"  # fmt: skip


def _environ_reads() -> dict[str, list[tuple[int, str]]]:
    """Per file: (line, name) of each read of a torchrun variable from this process's ``os.environ``."""
    torchrun_constants = {name for name, value in _contract().items() if value in TORCHRUN}
    found: dict[str, list[tuple[int, str]]] = {}
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        keys: list[tuple[int, ast.AST]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and _is_environ(node.value):
                keys.append((node.lineno, node.slice))
            elif isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and _is_environ(node.func.value)
                 and node.func.attr in ("get", "pop", "setdefault"))
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "getenv"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os")):  # fmt: skip
                keys.append((node.lineno, node.args[0]))
            elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                    and any(_is_environ(c) for c in node.comparators):  # fmt: skip
                keys.append((node.lineno, node.left))
        hits = sorted((line, name) for line, key in keys if (name := _environ_key(key, torchrun_constants)))
        if hits:
            found[_rel(path)] = hits
    return found


def test_the_contract_is_names_only() -> None:
    """Constants and nothing else (no import: the node helpers load it by path), each value once,
    each with its ``#:`` line, in the five groups; the torchrun names as torchrun writes them."""
    text = CONTRACT.read_text()
    tree = ast.parse(text, str(CONTRACT))
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    assert [ast.unparse(n) for n in body if not isinstance(n, ast.Assign)] == []
    lines = text.splitlines()
    headings = [(i + 1, line[2:].partition(":")[0]) for i, line in enumerate(lines) if line.startswith("# ")]
    assert tuple(h for _, h in headings) == GROUPS
    contract = _contract()
    assert len(set(contract.values())) == len(contract), Counter(contract.values()).most_common(3)
    uncommented = [n.targets[0].id for n in body if not lines[n.lineno - 2].startswith("#:")]  # type: ignore[attr-defined]
    assert uncommented == []
    first_gpufleet_group = headings[1][0]
    for node in body:
        value = node.value  # type: ignore[attr-defined]
        if isinstance(value, ast.Constant) and value.value.startswith("GPUFLEET_"):
            assert node.lineno > first_gpufleet_group, ast.unparse(node)
        if isinstance(value, ast.Constant) and value.value in TORCHRUN:
            assert node.lineno < first_gpufleet_group, ast.unparse(node)
    assert {contract[name] for name in TORCHRUN if name in contract} == TORCHRUN
    assert {name: contract[name] for name in TORCHRUN} == {name: name for name in TORCHRUN}


def test_no_literal_copy_of_a_contract_name_outside_the_contract() -> None:
    """A ``GPUFLEET_...`` or torchrun name written as a string (or ``env.update(NAME=...)``) anywhere
    else in the source is a second copy of the contract: use the constant."""
    assert _literals() == {}, "use the constants of gpufleet/launch/node/envcontract.py"


def test_the_exempt_code_writes_contract_names_only() -> None:
    """What must write names itself (it runs without gpufleet) writes the contract's names, so a
    renamed variable breaks this test rather than the exported workload."""
    values = set(_contract().values())
    written: dict[str, set[str]] = {}
    for rel in (*EXEMPT_FILES, *EXEMPT_TEMPLATES):
        path = PACKAGE / rel
        tree = ast.parse(path.read_text(), str(path))
        nodes = _template_nodes(tree, EXEMPT_TEMPLATES[rel]) if rel in EXEMPT_TEMPLATES else [tree]
        assert nodes, rel
        texts = [s for node in nodes for _, s in _strings(node)]
        written[rel] = {w for t in texts for w in re.findall(r"\bGPUFLEET_\w+", t)}
        written[rel] |= {w for t in texts for w in re.findall(r"\b[A-Z][A-Z_]+\b", t) if w in TORCHRUN}
        assert written[rel], f"{rel} writes no contract name: drop its exemption"
    assert {rel: sorted(names - values) for rel, names in written.items() if names - values} == {}


def test_runtime_is_the_one_reader_of_the_torchrun_variables() -> None:
    """Inside a rank the torchrun variables come from ``gpufleet.runtime`` (one place for their
    defaults and errors); elsewhere only what runs before gpufleet or builds a rank's environment reads them."""
    reads = _environ_reads()
    assert {rel: hits for rel, hits in reads.items() if rel not in ENVIRON_READERS} == {}, \
        "read them through gpufleet.runtime"  # fmt: skip
    assert [rel for rel in ENVIRON_READERS if rel not in reads] == [], "it reads none: drop it from ENVIRON_READERS"
