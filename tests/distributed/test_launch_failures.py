"""Failure paths: every error the user sees, and no process of the run left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpufleet import distributed, runtime
from gpufleet.errors import (
    DistributedTimeoutError,
    GPUUnavailableError,
    LaunchConfigError,
    PayloadPicklingError,
    RemoteTraceback,
    RunCanceledError,
    WorkerExitError,
    WorkerGroupError,
    WorkerSignalError,
)
from tests.proc import leftover_worker_processes, run_processes

cpu2 = dict(gpus=2, gpu_type="cpu")


class TrainingDiverged(RuntimeError):
    """A user-defined exception type (importable by the workers)."""


def _raise_on_rank_1_while_rank_0_waits():
    import torch
    import torch.distributed as dist

    runtime.setup()
    if runtime.get_global_rank() == 1:
        time.sleep(0.3)
        raise TrainingDiverged("loss is nan at step 7")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here until it is stopped
    time.sleep(60)


def test_a_rank_raising_reraises_its_own_type_with_remote_traceback_and_summary():
    fn = distributed(**cpu2)(_raise_on_rank_1_while_rank_0_waits)
    t0 = time.monotonic()
    with pytest.raises(TrainingDiverged, match="loss is nan at step 7") as info:
        fn.distributed()
    assert time.monotonic() - t0 < 50  # rank 0 (blocked, then 60 s asleep) was stopped, not waited for
    exc = info.value
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "_raise_on_rank_1_while_rank_0_waits" in exc.__cause__.text
    assert exc.gpufleet_rank == 1
    group = exc.gpufleet_error
    assert group.root_cause.rank == 1
    assert group.failures[0].kind in ("stopped", "exception")
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert "rank 1 of 2 failed first" in notes and "rank 0" in notes
    assert not leftover_worker_processes()


def _all_raise_same():
    raise ValueError(f"bad config value {42}")


def test_identical_errors_on_several_ranks_are_grouped():
    with pytest.raises(ValueError) as info:
        distributed(gpus=3, gpu_type="cpu")(_all_raise_same).distributed()
    summary = info.value.gpufleet_error.summary()
    assert "failed first: ValueError: bad config value 42" in summary
    assert "(same error as the root cause)" in summary
    assert summary.count("bad config value 42") == 2  # root cause line + one grouped line


def _kill_self_on_rank_1():
    if runtime.get_global_rank() == 1:
        print("about to be killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_rank_killed_by_a_signal_is_reported_with_its_log_tail():
    with pytest.raises(WorkerSignalError) as info:
        distributed(**cpu2)(_kill_self_on_rank_1).distributed()
    err = info.value
    assert err.rank == 1 and err.root_cause.signal_name == "SIGKILL"
    text = str(err)
    assert "killed by signal SIGKILL" in text and "out-of-memory" in text
    assert "about to be killed" in text  # the tail of rank 1's log
    assert err.failures[0].kind == "stopped"
    assert not leftover_worker_processes()


def _segfault_on_rank_0():
    if runtime.get_global_rank() == 0:
        import ctypes

        ctypes.string_at(0)
    time.sleep(60)


def test_a_segfault_is_reported_with_the_python_stack():
    with pytest.raises(WorkerSignalError) as info:
        distributed(**cpu2)(_segfault_on_rank_0).distributed()
    assert info.value.root_cause.signal_name == "SIGSEGV"
    assert "_segfault_on_rank_0" in str(info.value)  # faulthandler's stack, from the log tail


def _exit_hard():
    if runtime.get_global_rank() == 0:
        os._exit(3)
    time.sleep(60)


def _sys_exit():
    sys.exit(0)


def test_a_rank_exiting_without_a_result_is_an_exit_error():
    with pytest.raises(WorkerExitError, match="exited with code 3"):
        distributed(**cpu2)(_exit_hard).distributed()


def test_sys_exit_inside_the_function_does_not_exit_the_caller():
    with pytest.raises(WorkerGroupError, match="SystemExit"):
        distributed(**cpu2)(_sys_exit).distributed()


def _hang():
    time.sleep(600)


def _hang_saying_so():
    # on stderr, the stream faulthandler dumps into: the line before the dump proves the rank
    # was inside this function when its stack was taken
    print(f"rank {runtime.get_global_rank()} entered _hang_saying_so", file=sys.stderr, flush=True)
    time.sleep(600)


_STACK_DUMP = "(most recent call first)"  # faulthandler's header of each thread's stack


def test_a_hang_hits_the_timeout_and_every_rank_is_stopped_with_its_stack_logged():
    # The timeout also covers the ranks' start-up: 8 s leaves a loaded machine ample time to
    # reach the function, and what is asserted holds however far each rank got.
    timeout = 8
    fn = distributed(gpus=2, gpu_type="cpu", timeout=timeout, grace_period_s=1)(_hang_saying_so)
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        fn.distributed()
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed < timeout + 120  # it ran until the timeout, then was stopped (not 600 s)
    err = info.value
    assert isinstance(err, TimeoutError)
    assert "timeout of 8 s" in str(err)
    assert sorted(err.failures) == [0, 1]  # every rank was stopped, and says why
    for rank, failure in err.failures.items():
        assert failure.kind == "stopped" and "still running at the timeout of 8 s" in failure.message
        log = open(failure.log_path).read()
        dump = log.find(_STACK_DUMP)
        assert dump >= 0, f"rank {rank}: no stack dumped into its log:\n{log}"
        entered = log.find(f"rank {rank} entered _hang_saying_so")
        if 0 <= entered < dump:  # it was in the function when its stack was taken
            assert "_hang_saying_so" in log[dump:], log
    assert not leftover_worker_processes()


def _spawn_grandchildren_then_fail():
    # one child in the rank's process group (like a DataLoader worker) and one that escapes it
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    time.sleep(0.5)
    if runtime.get_global_rank() == 1:
        raise RuntimeError("worker failed with children alive")
    time.sleep(60)


def test_grandchildren_are_stopped_too():
    handle = distributed(**cpu2)(_spawn_grandchildren_then_fail).submit()
    run_id = handle.run_id
    with pytest.raises(RuntimeError, match="children alive"):
        handle.result(timeout=60)
    assert run_processes(run_id) == []


class _Unrebuildable(Exception):
    def __init__(self, code, detail):  # two required args: default unpickling fails
        super().__init__(f"code {code}: {detail}")


def _raise_unrebuildable():
    raise _Unrebuildable(7, "disk full")


def test_an_exception_that_cannot_be_unpickled_still_reports_type_and_message():
    with pytest.raises((WorkerGroupError, _Unrebuildable)) as info:
        distributed(**cpu2)(_raise_unrebuildable).distributed()
    assert "_Unrebuildable" in str(info.value) or isinstance(info.value, _Unrebuildable)
    assert "code 7: disk full" in str(info.value)


def _return_lock():
    return threading.Lock()


def test_an_unpicklable_return_value_is_an_error_of_that_rank():
    import pickle

    with pytest.raises(pickle.PicklingError, match="return value of rank . .*cannot be pickled"):
        distributed(**cpu2)(_return_lock).distributed()


def _takes_lock(lock):
    return 1


def test_an_unpicklable_argument_fails_before_launch_naming_it():
    with pytest.raises(PayloadPicklingError, match=r"argument 'lock' \(a _thread.lock\)"):
        distributed(**cpu2)(_takes_lock).distributed(lock=threading.Lock())
    assert not leftover_worker_processes()


_GLOBAL_LOCK = threading.Lock()


def _uses_global_lock():
    with _GLOBAL_LOCK:
        return 1


def test_an_unpicklable_global_of_a_main_function_is_named(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import threading\nfrom gpufleet import distributed\nLOCK = threading.Lock()\n"
        "@distributed(gpus=2, gpu_type='cpu')\ndef f():\n    with LOCK:\n        return 1\n"
        "try:\n    f.distributed()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "PayloadPicklingError" in out.stdout and "global 'LOCK'" in out.stdout, out


def test_bad_arguments_and_settings_fail_before_anything_starts():
    fn = distributed(**cpu2)(_takes_lock)
    with pytest.raises(TypeError, match="missing a required argument: 'lock'.*nothing was launched"):
        fn.distributed()
    with pytest.raises(TypeError, match=r"_takes_lock.distributed\(...\)"):
        fn(1)
    with pytest.raises(LaunchConfigError, match="gpus must be a positive integer"):
        distributed(gpus=0, gpu_type="cpu")(_takes_lock)
    with pytest.raises(LaunchConfigError, match="unknown option.*nproc.*known options"):
        distributed(gpus=2, nproc=2)(_takes_lock)
    with pytest.raises(LaunchConfigError, match="timeout must be"):
        distributed(gpus=2, gpu_type="cpu", timeout=-1)(_takes_lock)
    assert fn.func(None) == 1  # the plain function stays callable in-process


def test_with_overrides_checks_settings_like_the_decorator():
    fn = distributed(**cpu2)(_takes_lock)
    for bad, match in (
        ({"log_ranks": 3}, "log_ranks must be 'all' or a list of rank numbers, got 3"),
        ({"timeout": float("nan")}, "timeout must be a positive, finite number"),
        ({"gpus": 0}, "gpus must be a positive integer"),
        ({"nproc": 2}, "unknown option.*nproc"),
    ):
        with pytest.raises(LaunchConfigError, match=match):
            fn.with_overrides(**bad)
        with pytest.raises(LaunchConfigError, match=match):
            distributed(**{**cpu2, **bad})(_takes_lock)
    assert fn.with_overrides(log_ranks=[0, 1]).options.log_ranks == (0, 1)


def test_gpus_on_a_machine_without_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("gpufleet.launch.gpus.list_gpus", lambda: [])
    with pytest.raises(GPUUnavailableError, match="gpu_type='cpu'"):
        distributed(gpus=2)(_takes_lock).distributed(1)


def test_cancel_stops_every_rank():
    handle = distributed(**cpu2)(_hang).submit()
    deadline = time.monotonic() + 60
    while ("RUNNING" != handle.status or len(run_processes(handle.run_id)) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(run_processes(handle.run_id)) >= 2
    handle.cancel()
    assert handle.done() and handle.status == "CANCELED"  # cancel() returns once the run has ended
    with pytest.raises(RunCanceledError, match="canceled"):
        handle.result(timeout=0)
    assert run_processes(handle.run_id) == []


INTERRUPT_SCRIPT = """
import faulthandler, signal, time
faulthandler.register(signal.SIGUSR1)  # the test asks for the caller's stacks if Ctrl-C is not handled
# As in a terminal or a notebook kernel: Ctrl-C raises KeyboardInterrupt. (A process started in
# the background by a non-interactive shell, as CI may start the tests, inherits SIGINT ignored.)
signal.signal(signal.SIGINT, signal.default_int_handler)
from gpufleet import distributed
def hang():
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("ready", flush=True)
    time.sleep(600)
try:
    distributed(gpus=2, gpu_type="cpu")(hang).distributed()
except KeyboardInterrupt:
    print("CAUGHT KeyboardInterrupt", flush=True)
"""


def _wait_for_children(pid: int, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        from tests.proc import processes_with_env

        if len(processes_with_env("GPUFLEET_PARENT_PID", str(pid))) >= n:
            return
        time.sleep(0.1)
    raise AssertionError("workers did not start")


def test_ctrl_c_stops_every_rank_and_raises_keyboardinterrupt(tmp_path):
    from tests.proc import processes_with_env

    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_children(proc.pid, 4)  # 2 ranks + their 2 children
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # where the caller is stuck, for the failure report
            time.sleep(1.0)
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"Ctrl-C was not handled within 30 s; the caller's stacks:\n{err}\n{out}") from None
        assert "CAUGHT KeyboardInterrupt" in out, err
        assert "stopping all 2 ranks" in err
        assert processes_with_env("GPUFLEET_PARENT_PID", str(proc.pid)) == []
    finally:
        proc.kill()


def test_workers_die_when_the_caller_is_killed(tmp_path):
    from tests.proc import processes_with_env

    script = tmp_path / "victim.py"
    script.write_text(INTERRUPT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_children(proc.pid, 4)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60  # each rank notices its parent's end within a second or so
    while processes_with_env("GPUFLEET_PARENT_PID", str(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_env("GPUFLEET_PARENT_PID", str(proc.pid)) == []


_ATTEMPTS_FILE_ENV = "GPUFLEET_TEST_ATTEMPT_FILE"


def _fail_first_attempt():
    if os.environ["GPUFLEET_ATTEMPT"] == "1":
        raise ConnectionError("transient failure")
    return int(os.environ["GPUFLEET_ATTEMPT"])


_FIRST_ATTEMPT_S = 6.0


def _fail_then_hang(marks: str, called_at: float):
    attempt = os.environ["GPUFLEET_ATTEMPT"]
    with open(os.path.join(marks, f"attempt-{attempt}-rank-{runtime.get_global_rank()}"), "w") as f:
        f.write(repr(time.time()))
    if attempt == "1":  # fails 6 s into the call (or at once, where its start took longer)
        time.sleep(max(0.0, called_at + _FIRST_ATTEMPT_S - time.time()))
        raise ConnectionError("transient failure")
    time.sleep(120)


def test_the_timeout_is_for_the_whole_call_not_for_each_retry(tmp_path, caplog):
    timeout = 16
    fn = distributed(gpus=2, gpu_type="cpu", timeout=timeout, grace_period_s=1, max_retries=3)(_fail_then_hang)
    called_at = time.time()
    with pytest.raises(DistributedTimeoutError) as info:
        fn.distributed(str(tmp_path), called_at)
    assert f"timeout of {timeout} s" in str(info.value)
    assert "ended FAILED; retry 1 of 3" in caplog.text  # the first attempt's failure was retried
    # The first attempt failed 6 s or more into the call, so a deadline per attempt would stop
    # the retry no sooner than 6 s plus a whole timeout after the call began; the call's own
    # deadline stops it a timeout after the call began.
    stopped = min(f.time for f in info.value.failures.values())
    assert stopped < called_at + timeout + _FIRST_ATTEMPT_S, (stopped - called_at)


def test_max_retries_relaunches_after_a_failure():
    assert distributed(max_retries=1, **cpu2)(_fail_first_attempt).distributed() == [2, 2]
    with pytest.raises(ConnectionError):
        distributed(max_retries=0, **cpu2)(_fail_first_attempt).distributed()


def _reads(f) -> str:
    return f.read()


def test_an_open_file_argument_is_refused_not_copied(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("rows")
    with open(path) as f, pytest.raises(PayloadPicklingError, match="argument 0 is an open file.*Pass its path"):
        distributed(**cpu2)(_reads).distributed(f)


def test_more_cpu_workers_than_cores_warns(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    with pytest.warns(RuntimeWarning, match="2 CPU workers on a machine with 1 cores"):
        assert distributed(**cpu2)(runtime.get_global_rank).distributed() == [0, 1]
