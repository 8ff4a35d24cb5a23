"""The shape of the source tree that docs/design.md promises: the run model below its front doors, no import cycle.

Read from the source (``ast``), nothing is imported: an import inside a function counts as much
as one at the top of a module for the layer rule, and only top-level imports (those that run
when the module is imported) count for cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "gpufleet"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The gpufleet modules a source file imports (``from . import x`` resolved to the module or package)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks do not run
        nodes = [n for n in nodes if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
        nodes = [sub for n in nodes for sub in ([n] if isinstance(n, ast.Import | ast.ImportFrom) else
                                                 [s for s in ast.walk(n) if isinstance(s, ast.Import | ast.ImportFrom)
                                                  and not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)])]  # fmt: skip
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gpufleet"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("gpufleet"):  # `from pkg import mod` imports pkg.mod; `from mod import name`, mod
                found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_run_model_imports_none_of_its_front_doors() -> None:
    """``gpufleet.runs`` is read and written by calls and workloads; it never reaches back into either."""
    front_doors = ("gpufleet.workload", "gpufleet.api", "gpufleet.detach", "gpufleet.detached_run")
    runs = [p for p in _sources() if _module_name(p).startswith("gpufleet.runs")]
    assert len(runs) >= 8, runs
    wrong = {
        _module_name(p): sorted(m for m in _imports(p, top_level_only=False) if m.startswith(front_doors))
        for p in runs
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def _names_in_strings(path: Path, text: str) -> bool:
    """Whether a string of the code (docstrings aside) holds ``text``, e.g. a module run by ``-m``."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and text in n.value and id(n) not in docstrings
               for n in ast.walk(tree))  # fmt: skip


def test_the_launch_core_and_its_engines_import_no_front_door() -> None:
    """``gpufleet.launch`` serves calls and workloads alike: it never imports either front door, and
    an engine never imports another engine."""
    front_doors = ("gpufleet.workload", "gpufleet.api", "gpufleet.detach", "gpufleet.detached_run", "gpufleet.ray_launch")
    launch = [p for p in _sources() if _module_name(p).startswith("gpufleet.launch")]
    assert len(launch) >= 30, launch
    wrong = {}
    for p in launch:
        name, imported = _module_name(p), _imports(p, top_level_only=False)
        engine = name.split(".")[3] if name.startswith("gpufleet.launch.engines.") else None
        others = tuple(f"gpufleet.launch.engines.{e}" for e in ("local", "ray", "slurm") if e != engine)
        bad = sorted(m for m in imported if m.startswith(front_doors) or (engine and m.startswith(others)))
        if bad or _names_in_strings(p, "gpufleet.workload"):
            wrong[name] = bad or ["a string names gpufleet.workload (a module run by name, say)"]
    assert wrong == {}


def test_no_import_cycle_runs_when_a_module_is_imported() -> None:
    """The top-level imports of src/ form no cycle (imports inside functions are how a lazy edge is kept)."""
    modules = {_module_name(p): p for p in _sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _imports(path, top_level_only=True):
            while target and target not in modules:  # `from pkg import name` where name is not a module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_ranks_find_the_package_where_it_is_installed() -> None:
    """A rank's PYTHONPATH and a Ray job's uploaded module are the installed package, from any engine's depth."""
    import gpufleet
    from gpufleet.launch.spec import package_dir, package_parent

    assert package_dir() == Path(gpufleet.__file__).resolve().parent
    assert (Path(package_parent()) / "gpufleet" / "__init__.py").is_file()
