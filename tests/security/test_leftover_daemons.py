"""Low items: a double-forked daemon with an empty environment, and a workload's child after a supervisor SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gpufleet import distributed
from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, write_workload

CPU = {"gpus": 1, "gpu_type": "cpu", "tracking": False, "stream_logs": False}
# forks twice (sh -c '... &' exits at once), a session of its own, nothing in its environment
DAEMON = "setsid env -i /bin/sh -c 'echo $$ > {pidfile}; exec sleep 300' > /dev/null 2>&1 < /dev/null &"
# the rank or node waits until the daemon is up, however slow the machine (else it may be stopped first)
WAIT = "\nwhile [ ! -s {pidfile} ]; do sleep 0.05; done"


def _pid_from(path: Path, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # the test fails; nothing stays behind it
            return False
        time.sleep(0.1)
    return True


def _start_daemon(pidfile: str) -> str:
    import subprocess

    subprocess.run(["/bin/sh", "-c", DAEMON.format(pidfile=pidfile) + WAIT.format(pidfile=pidfile)], check=True)
    return "started"


def test_a_double_forked_daemon_with_an_empty_environment_does_not_outlive_the_call(tmp_path):
    pidfile = tmp_path / "daemon.pid"
    assert distributed(_start_daemon, **CPU).distributed(str(pidfile)) == ["started"]
    pid = _pid_from(pidfile)
    assert _gone_within(pid, 30), "the daemon outlived the call"


def test_a_double_forked_daemon_does_not_outlive_the_workload(tmp_path, store: RunStore, capsys):
    pidfile = tmp_path / "daemon.pid"
    wl = write_workload(tmp_path, command=DAEMON.format(pidfile=pidfile) + WAIT.format(pidfile=pidfile) + "\necho done")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, out + err
    assert _gone_within(_pid_from(pidfile), 30), "the daemon outlived the workload"


def test_a_workloads_children_die_with_a_killed_supervisor_without_a_cli_read(tmp_path, store: RunStore, capsys):
    pidfile, setsid_file = tmp_path / "daemon.pid", tmp_path / "setsid.pid"
    command = (DAEMON.format(pidfile=pidfile) + f"\nsetsid /bin/sh -c 'echo $$ > {setsid_file}; exec sleep 300' &"
               "\nsleep 300")  # fmt: skip
    wl = write_workload(tmp_path, command=command)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.strip().splitlines()[-1]
    daemon, own_session = _pid_from(pidfile), _pid_from(setsid_file)
    supervisor = store.get(run_id).supervisor_pid
    os.kill(supervisor, signal.SIGKILL)
    # no gpufleet command reads the store meanwhile: the node's guard alone must stop them
    assert _gone_within(daemon, 30) and _gone_within(own_session, 30)
