"""How ``gpufleet run`` hands a run's supervisor what must not touch the disk.

The supervisor is a detached process (``python -m gpufleet.workload.runner``, started by
:func:`gpufleet.runs.supervisor.start_supervisor`). Secret values
and the first attempt's MLflow run reach it through a pipe on its stdin, one JSON document
ending with a ``complete`` mark, never through a file or its command line. ``gpufleet run``
starts the supervisor before the document is ready (MLflow is still opening the run) and writes
it once; the supervisor reads it just before the first attempt. A pipe closed before the
document is whole means ``gpufleet run`` ended first (:class:`HandoffMissing`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from typing import Any

from ..errors import GpufleetError


def hand_over(proc: subprocess.Popen[bytes], handoff: dict[str, Any]) -> None:
    """Write the handoff to a supervisor started with ``handoff_follows`` and close the pipe."""
    if proc.stdin is None:
        return
    document = {**handoff, HANDOFF_COMPLETE: True}
    try:
        proc.stdin.write(json.dumps(document).encode())
    except BrokenPipeError:  # it died at once: the liveness check records that
        pass
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()


#: The key that ends every handoff: a pipe closed without it means `gpufleet run` ended first.
HANDOFF_COMPLETE = "complete"


class Handoff:
    """The handoff on this process's stdin, read once, when first needed.

    At start, the pipe moves to a descriptor no child inherits and stdin becomes /dev/null, so
    the nodes (and the environment builder) get nothing of it.
    """

    def __init__(self) -> None:
        self._fd: int | None = os.dup(0)  # not inheritable
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        self._data: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        """The handoff; raises :class:`HandoffMissing` when the pipe closed before it was whole."""
        if self._data is None:
            assert self._fd is not None
            with os.fdopen(self._fd, "rb") as pipe:
                self._fd = None
                data = pipe.read()
            try:
                handoff = json.loads(data or b"{}")
            except ValueError:
                handoff = {}
            if not isinstance(handoff, dict) or not handoff.pop(HANDOFF_COMPLETE, False):
                raise HandoffMissing(
                    "gpufleet run ended before it handed the run over (its secrets, its MLflow run): "
                    "the run did not start; submit it again"
                )
            self._data = handoff
        return self._data


class HandoffMissing(GpufleetError):
    """The submitting command ended before it wrote the whole handoff."""
