"""``python -m gpufleet.detached_run JOB_DIR``: the supervisor of a detached call (see :mod:`gpufleet.detach`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .api import DistributedFunction
from .detach import JOB_FILE, _JobFiles, _write_result


def main(argv: list[str] | None = None) -> int:
    """``python -m gpufleet.detached_run JOB_DIR``: run the call of a job folder to its end."""
    import cloudpickle

    from .runs.calls import adopt_origin
    from .runs.cancel import signal_reason
    from .states import CANCELED, FAILED, SUCCESS

    os.umask(0o077)
    job_dir = Path((argv or sys.argv[1:])[0])
    job = cloudpickle.loads((job_dir / JOB_FILE).read_bytes())
    sys.path.extend(p for p in job["sys_path"] if p not in sys.path)
    with contextlib.suppress(OSError):
        os.chdir(job["cwd"])
    adopt_origin(job["origin"])
    function = DistributedFunction(job["func"], job["options"])
    controller = None
    try:
        controller = function._controller(job["args"], job["kwargs"])
        controller.add_callback(_JobFiles(job_dir))

        def on_term(signum: int, _frame: Any) -> None:
            assert controller is not None
            controller.cancel(signal_reason(signum))

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGHUP, on_term)
        controller.start()
        values = controller.run()
        outcome: dict[str, Any] = {"state": SUCCESS, "values": values, "error": None}
    except BaseException as e:  # noqa: BLE001 - every end is written for the handle
        if controller is not None and controller.finished.is_set():
            state = controller.state  # the run's end, as its controller decided it
        else:  # the call could not be set up (its payload, a setting): nothing ran
            state = CANCELED if isinstance(e, KeyboardInterrupt) else FAILED
        outcome = {"state": state, "values": None, "error": e}
    _write_result(job_dir, outcome)
    print(f"gpufleet: detached call finished: {outcome['state']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
