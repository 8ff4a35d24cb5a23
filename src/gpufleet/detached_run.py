"""``python -m gpufleet.detached_run RUN_ID --home HOME``: the supervisor of a detached call.

A detached call (:mod:`gpufleet.detach`) is one stored run of kind ``call`` under the supervisor
core that a workload run has too (:mod:`gpufleet.runs.supervisor`: signals, heartbeat, cancel,
the outcome in the store). :class:`CallRun` is what differs: it reads the call from the run
folder's ``job.pkl``, runs it through the same controller as ``.distributed()`` with every
attempt under the run's one id (attempt N's ranks log into ``attempts/N/``; the attempts are rows
of the run, recorded by the call's :class:`~gpufleet.runs.calls.CallKind`), and writes the values
or the error into ``result.pkl`` for the handle before the run's end goes to the store.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from .handles import RESULT_FILE
from .runs.supervisor import Supervisor, supervise
from .states import CANCELED, FAILED, SUCCESS, RunState

JOB_FILE = "job.pkl"


class CallRun:
    """A detached call under its supervisor."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    def run(self) -> tuple[RunState, int | None, str | None]:
        import cloudpickle

        from .api import DistributedFunction
        from .runs.calls import CallKind, StoredCall
        from .runs.recorder import RunRecorder

        sup = self.sup
        job = cloudpickle.loads((sup.run_dir / JOB_FILE).read_bytes())
        sys.path.extend(p for p in job["sys_path"] if p not in sys.path)
        with contextlib.suppress(OSError):
            os.chdir(job["cwd"])
        function = DistributedFunction(job["func"], job["options"])
        kind = CallKind(function, str(sup.run.config.get("launcher", "local")), one_run=True)
        recorder = RunRecorder(kind, sup.store, run_id=sup.run.id, log=sup.log, max_attempts=sup.run.max_attempts)
        controller = None
        try:
            controller = function._controller(job["args"], job["kwargs"],
                                              stored=StoredCall(sup.run.id, sup.run_dir, recorder))  # fmt: skip
            sup.forward_cancel(controller)
            controller.start()
            outcome: dict[str, Any] = {"state": SUCCESS, "values": controller.run(), "error": None}
        except BaseException as e:  # noqa: BLE001 - every end is written for the handle
            if controller is not None and controller.finished.is_set():
                state = controller.state  # the run's end, as its controller decided it
            else:  # the call could not be set up (its payload, a setting): nothing ran
                state = CANCELED if isinstance(e, KeyboardInterrupt) else FAILED
            outcome = {"state": state, "values": None, "error": e}
        write_result(sup.run_dir, outcome)
        end = recorder.ends.get(controller.attempt) if controller is not None else None
        if end is not None:
            return end.state, end.exit_code, end.message
        error = outcome["error"]
        return outcome["state"], None, f"{type(error).__name__}: {error}" if error is not None else None

    def ended(self, state: RunState) -> None:
        """Nothing is left to close: each attempt's MLflow run ended with it."""


def write_result(run_dir: Path, outcome: dict[str, Any]) -> None:
    """Write the call's values (or error) for its handle; an error or value that does not pickle goes as text."""
    import cloudpickle

    from .results import write_atomic

    try:
        data = cloudpickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        error = outcome.get("error")
        data = pickle.dumps({"state": outcome["state"], "values": None, "error": None,
                             "error_text": f"{type(error).__name__}: {error}" if error is not None else
                             "the run's result could not be pickled"})  # fmt: skip
    write_atomic(run_dir / RESULT_FILE, data)


def main(argv: list[str] | None = None) -> int:
    """Entry of a detached call's supervisor process."""
    return supervise("python -m gpufleet.detached_run", lambda sup, _args: CallRun(sup), argv)


if __name__ == "__main__":
    sys.exit(main())
