"""Reading workload YAML safely: plain data only, no duplicate keys, bounded aliases.

:class:`WorkloadLoader` is a ``yaml.SafeLoader`` that also

* refuses duplicate mapping keys instead of keeping the last one;
* reads YAML 1.2 floats such as ``2e-5`` as numbers;
* refuses a recursive alias (``a: &x [*x]``), which would build a value that contains itself;
* refuses aliases that expand the document by more than :data:`MAX_ALIAS_VALUES` values
  ("billion laughs": a few lines of nested anchors that expand to millions of values);
* refuses tags that make anything but plain data (``!!binary``, ``!!set``, ``!!omap``,
  ``!!pairs``, ``!custom``), so a value means the same in ``validate``, the dry run and the run.

Each refusal names the field path and the line of the document.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ...errors import GpufleetError
from .problems import Problem, WorkloadValidationError, path_of

#: At most this many values may come from aliases (``*name``) beyond those written out.
MAX_ALIAS_VALUES = 10_000

_CORE = "tag:yaml.org,2002:"
#: Tags of plain data (and ``merge``/``value``, which the safe constructor handles itself).
_PLAIN_TAGS = frozenset(
    _CORE + t for t in ("null", "bool", "int", "float", "str", "timestamp", "seq", "map", "merge", "value")
)


class RefusedYAMLError(GpufleetError, yaml.MarkedYAMLError):
    """YAML that parses but is refused (recursive or exploding aliases, non-plain tags)."""

    def __init__(self, loc: tuple[Any, ...], message: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem=message, problem_mark=mark)
        self.loc = loc


class WorkloadLoader(yaml.SafeLoader):
    """A safe loader for workload files (see the module docstring for what it refuses)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._loc: list[Any] = []  # field path of the node being composed
        self._open_anchors: set[str] = set()  # anchors whose node is still being composed
        self._sizes: dict[int, int] = {}  # id(node) -> values it expands to, aliases followed
        self._written = 0  # nodes written out (not reached through an alias)

    def compose_document(self) -> Node | None:
        self._sizes, self._written = {}, 0
        return super().compose_document()

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        part = _part_of(parent, index)
        if part is not None:
            self._loc.append(part)
        try:
            if self.check_event(AliasEvent):
                event = self.peek_event()
                if event.anchor in self._open_anchors:
                    raise self._refuse(
                        f"recursive alias *{event.anchor}: it refers to the value that contains it; "
                        "write the value out instead",
                        event.start_mark,
                    )
                return super().compose_node(parent, index)
            anchor = self.peek_event().anchor
            if anchor is not None:
                self._open_anchors.add(anchor)
            try:
                node = super().compose_node(parent, index)
            finally:
                self._open_anchors.discard(anchor)
            self._check(node)
            return node
        finally:
            if part is not None:
                self._loc.pop()

    def _check(self, node: Node) -> None:
        """Refuse a non-plain tag, and record the node's expanded size, refusing a blow-up."""
        if node.tag not in _PLAIN_TAGS:
            tag = "!!" + node.tag[len(_CORE):] if node.tag.startswith(_CORE) else node.tag
            raise self._refuse(
                f"the tag {tag} is not allowed; values are plain YAML data (strings, numbers, "
                "true/false, null, lists and mappings)",
                node.start_mark,
            )
        self._written += 1
        size = 1
        if isinstance(node, SequenceNode):
            size += sum(self._sizes[id(child)] for child in node.value)
        elif isinstance(node, MappingNode):
            size += sum(self._sizes[id(k)] + self._sizes[id(v)] for k, v in node.value)
        self._sizes[id(node)] = size
        if size - self._written > MAX_ALIAS_VALUES:
            raise self._refuse(
                f"aliases (*name) expand this to {size:,} values from {self._written:,} written; "
                f"at most {MAX_ALIAS_VALUES:,} may come from aliases (an alias bomb?)",
                node.start_mark,
            )

    def _refuse(self, message: str, mark: yaml.Mark | None) -> RefusedYAMLError:
        return RefusedYAMLError(tuple(self._loc), message, mark)


def _part_of(parent: Node | None, index: Any) -> Any:
    """The path part of a child node: a sequence index, a mapping key, or None (root, a key)."""
    if isinstance(parent, SequenceNode):
        return index
    if isinstance(parent, MappingNode) and index is not None:
        return index.value if isinstance(index, ScalarNode) else "?"
    return None


def _construct_mapping(loader: WorkloadLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


WorkloadLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.2 floats: PyYAML (YAML 1.1) reads 2e-5 as a string; a learning rate should be a number.
WorkloadLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "workload") -> Any:
    """Parse YAML text, turning syntax errors into a :class:`WorkloadValidationError`."""
    try:
        return yaml.load(text, Loader=WorkloadLoader)  # noqa: S506 - a SafeLoader subclass
    except RefusedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise WorkloadValidationError([Problem(path_of(e.loc), f"{where}{e.problem}")], source) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or str(e)
        if e.context and e.context_mark and e.context_mark is not mark:
            cm = e.context_mark
            what += f" ({e.context} started at line {cm.line + 1}, column {cm.column + 1})"
        raise WorkloadValidationError(
            [Problem("", f"not valid YAML: {where}{what}")], source
        ) from None
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        raise WorkloadValidationError([Problem("", f"not valid YAML: {e}")], source) from None
