"""A process that leases fake GPUs (``python -m tests.leases.holder RUN_ID COUNT WAIT_S [HOLD_S]``).

Prints ``GOT i,j`` once it holds them, then holds them until its stdin closes (or ``HOLD_S``
seconds pass); with ``$LEASE_MARKERS`` set, it also claims each GPU by creating a marker file
there exclusively while it holds it, and prints ``DOUBLE i`` when a marker was already there
(two holders of one GPU at once). ``GPUUnavailableError`` prints ``UNAVAILABLE message``.
``$LEASE_RETRY_S`` sets how long a waiting holder pauses between tries when nobody let go.
"""

from __future__ import annotations

import os
import sys
import time

from gpufleet.errors import GPUUnavailableError
from gpufleet.launch.leasing import leases


def main() -> int:
    run_id, count, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    hold = float(sys.argv[4]) if len(sys.argv) > 4 else None
    leases.REPORT_AFTER_S = 0.0
    if os.environ.get("LEASE_RETRY_S"):
        leases.RETRY_S = float(os.environ["LEASE_RETRY_S"])  # how often it would look without a release
    try:
        lease = leases.acquire(leases.GpuRequest(count=count, wait_s=wait), leases.Holder(run_id, "call"),
                               on_wait=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    except GPUUnavailableError as e:
        print(f"UNAVAILABLE {e}", flush=True)
        return 3
    markers = os.environ.get("LEASE_MARKERS")
    claimed = []
    if markers:
        for i in lease.indices:
            path = os.path.join(markers, f"gpu-{i}")
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                claimed.append(path)
            except FileExistsError:
                print(f"DOUBLE {i}", flush=True)
    print("GOT " + ",".join(map(str, lease.indices)), flush=True)
    if hold is not None:
        time.sleep(hold)
    else:
        sys.stdin.read()
    for path in claimed:
        os.unlink(path)
    lease.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
