"""Remote tracebacks that read like local ones.

cloudpickle sends functions of ``__main__`` and of notebook cells by value, and names their code
``<dynamic-code>``: a rank's traceback would show neither the file nor the line. Here the caller
pickles the call keeping each code object's file name (a notebook cell's is renamed ``Cell
In[3]``, as IPython shows it) and collects the source of those files; the payload carries it and
the worker registers it in its ``linecache`` before it runs the call, so a rank's traceback has
the user's file, line and source text. In the traceback a rank sends back, each run of
gpufleet's own frames (the worker entry, say) is one line; ``GPUFLEET_FULL_TRACEBACK=1`` keeps
them whole.

The worker side (:func:`register_sources`, :func:`format_exception`) uses the standard library
only; :func:`dumps_call` imports cloudpickle.
"""

from __future__ import annotations

import io
import linecache
import marshal
import os
import sys
import traceback
import types
from collections.abc import Mapping
from typing import Any

from .node import envcontract

#: Set to 1 in a rank's environment to keep gpufleet's own frames in the traceback it sends back.
FULL_TRACEBACK_ENV = envcontract.FULL_TRACEBACK
#: Source files larger than this are not shipped (their frames keep file and line, no text).
MAX_SOURCE_BYTES = 2 * 2**20

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cell_names() -> dict[str, str]:
    """Notebook cells' file names -> ``Cell In[N]`` in an IPython kernel, else nothing."""
    if "IPython" not in sys.modules:
        return {}
    try:
        from IPython import get_ipython

        compiler = get_ipython().compile  # type: ignore[union-attr]
        return {name: f"Cell In[{number}]" for name, number in compiler._filename_map.items()}
    except Exception:  # not in a kernel, or an IPython without the map
        return {}


def _renamed(code: types.CodeType, names: Mapping[str, str]) -> types.CodeType:
    """``code`` (and the code objects nested in it) with file names replaced through ``names``."""
    consts = tuple(_renamed(c, names) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=names.get(code.co_filename, code.co_filename), co_consts=consts)


def dumps_call(obj: Any, protocol: int | None = None) -> tuple[bytes, dict[str, str]]:
    """cloudpickle ``obj``, keeping the file names of code sent by value; returns (bytes, sources).

    ``sources`` maps each such file name (as the worker will see it) to its source text, for
    the files whose source this process can read (a script, a notebook cell).
    """
    import pickle

    import cloudpickle

    cells = _cell_names()
    seen: set[str] = set()

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if type(o) is types.CodeType:
                # marshal keeps co_filename (cloudpickle's own reducer writes "<dynamic-code>")
                seen.add(o.co_filename)
                return marshal.loads, (marshal.dumps(_renamed(o, cells) if cells else o),)
            return super().reducer_override(o)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL if protocol is None else protocol).dump(obj)
    sources: dict[str, str] = {}
    for filename in sorted(seen):
        lines = linecache.getlines(filename)
        text = "".join(lines)
        if text and len(text) <= MAX_SOURCE_BYTES:
            sources[cells.get(filename, filename)] = text
    return buffer.getvalue(), sources


def register_sources(sources: Mapping[str, str]) -> None:
    """Put shipped sources in this process's ``linecache``, where tracebacks look for lines."""
    for filename, text in sources.items():
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        # mtime None: linecache.checkcache never drops the entry (IPython registers cells alike)
        linecache.cache[filename] = (len(text), None, lines, filename)


def _is_gpufleet(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _short(frame: traceback.FrameSummary) -> str:
    path = os.path.relpath(os.path.abspath(frame.filename), _PACKAGE_DIR)
    return f"{path} line {frame.lineno} in {frame.name}"


class _CollapsedStack(traceback.StackSummary):
    """A stack whose runs of gpufleet frames format as one line (the innermost frame stays whole)."""

    def format(self) -> list[str]:
        self._lines: dict[int, str | None] = {}
        frames = list(self)
        run: list[traceback.FrameSummary] = []
        for i, frame in enumerate(frames):
            if i < len(frames) - 1 and _is_gpufleet(frame.filename):
                run.append(frame)
                continue
            if run:
                for f in run[:-1]:
                    self._lines[id(f)] = None
                where = _short(run[0]) if len(run) == 1 else f"{_short(run[0])} ... {_short(run[-1])}"
                self._lines[id(run[-1])] = f"  [gpufleet, {len(run)} frame{'s' if len(run) > 1 else ''}: {where}]\n"
                run = []
        return super().format()

    def format_frame_summary(self, frame_summary: traceback.FrameSummary) -> str | None:  # type: ignore[override]
        if id(frame_summary) in self._lines:
            return self._lines[id(frame_summary)]
        return super().format_frame_summary(frame_summary)


def format_exception(exc: BaseException) -> str:
    """The traceback text of ``exc`` (its causes and contexts too) with gpufleet's frames collapsed."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    if os.environ.get(FULL_TRACEBACK_ENV) != "1":
        todo, seen = [te], set()
        while todo:
            t = todo.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            t.stack = _CollapsedStack(t.stack)
            todo.extend(x for x in (t.__cause__, t.__context__, *(t.exceptions or ())) if x is not None)
    return "".join(te.format())
