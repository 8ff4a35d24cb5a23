"""Warm workers: the next call reuses the last call's ranks, isolated, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import nbformat
import pytest
from nbclient import NotebookClient

from gpufleet import distributed, errors, runtime, shutdown_workers

CPU = {"gpus": 2, "gpu_type": "cpu", "tracking": False, "stream_logs": False, "grace_period_s": 1.0, "timeout": 120}


@pytest.fixture(autouse=True)
def _no_warm_ranks_after_the_test():
    yield
    shutdown_workers()


def by_value(source: str, name: str):
    """A function defined as in a notebook cell (module ``__main__``: shipped by value)."""
    namespace = {"__name__": "__main__", "runtime": runtime}
    exec(textwrap.dedent(source), namespace)
    return namespace[name]


def _all_reduce_and_pid(x: int) -> tuple[int, float, int]:
    import torch
    import torch.distributed as dist

    runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    return os.getpid(), t.item(), x


def pids(results) -> list[int]:
    return [r[0] for r in results]


def test_second_and_third_calls_reuse_the_ranks():
    f = distributed(_all_reduce_and_pid, keep_warm=60, **CPU)
    first = f.distributed(1)
    second, third = f.distributed(2), f.distributed(3)
    assert [r[1:] for r in first] == [(3.0, 1), (3.0, 1)] and [r[2] for r in third] == [3, 3]
    assert pids(first) == pids(second) == pids(third)
    handles = [f.submit(4), None]
    assert pids(handles[0].result(timeout=60)) == pids(first)
    handles[1] = f.submit(5)
    assert pids(handles[1].result(timeout=60)) == pids(first)
    # each call is its own run: its own run id, folder and rank logs
    assert handles[0].run_id != handles[1].run_id and handles[0].run_dir != handles[1].run_dir
    assert all(os.path.exists(os.path.join(h.run_dir, "rank-0.log")) for h in handles)


def test_calls_are_isolated_and_an_edited_function_runs_its_new_code():
    first = by_value('''
        counter = 0
        def step():
            import os
            global counter
            counter += 1
            return os.getpid(), counter
    ''', "step")
    edited = by_value('''
        counter = 0
        def step():
            import os
            global counter
            counter += 100
            return os.getpid(), counter
    ''', "step")
    a = distributed(first, keep_warm=60, **CPU).distributed()
    b = distributed(first, keep_warm=60, **CPU).distributed()
    c = distributed(edited, keep_warm=60, **CPU).distributed()
    assert pids(a) == pids(b) == pids(c)
    assert [r[1] for r in b] == [1, 1]  # the global of call 1 is not seen by call 2
    assert [r[1] for r in c] == [100, 100]  # the edited cell's code ran


def _echo_large(blob: bytes) -> bytes:
    return blob[::-1] if runtime.get_global_rank() == 0 else b"ok"


def test_large_arguments_and_results_on_warm_ranks():
    f = distributed(_echo_large, keep_warm=60, **CPU)
    blob = os.urandom(100 * 1024 * 1024)
    for _ in range(2):
        out = f.distributed(blob)
        assert out[0] == blob[::-1] and out[1] == b"ok"


def _fails_on_call(n: int) -> int:
    if n == 2 and runtime.get_global_rank() == 1:
        raise ValueError("bad batch")
    return os.getpid()


def test_a_failing_call_discards_the_ranks():
    f = distributed(_fails_on_call, keep_warm=60, **CPU)
    first = f.distributed(1)
    with pytest.raises(ValueError, match="bad batch"):
        f.distributed(2)
    third = f.distributed(3)
    assert set(first).isdisjoint(third)  # the next call starts cold


def test_idle_ranks_stop_after_keep_warm():
    import psutil

    f = distributed(_all_reduce_and_pid, keep_warm=1, **CPU)
    first = pids(f.distributed(1))
    deadline = time.monotonic() + 60  # keep_warm=1, then the ranks exit
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in first):
        assert time.monotonic() < deadline, "idle warm ranks did not stop"
        time.sleep(0.2)
    assert set(pids(f.distributed(2))).isdisjoint(first)


def test_same_placement_shares_ranks_and_another_placement_does_not():
    f = distributed(_all_reduce_and_pid, keep_warm=60, **CPU)
    g = distributed(_fails_on_call, keep_warm=60, **CPU)  # another function, same placement
    a = pids(f.distributed(1))
    assert g.distributed(1) == a
    one = distributed(_all_reduce_and_pid, keep_warm=60, **{**CPU, "gpus": 1})
    assert set(pids(one.distributed(1))).isdisjoint(a)
    assert f.shutdown() >= 1


def _own_process_group(x: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()  # user code that tears its group down itself
    return os.getpid(), t.item()


def test_user_code_that_inits_and_destroys_its_process_group_still_works():
    f = distributed(_own_process_group, keep_warm=60, **CPU)
    a, b = f.distributed(1), f.distributed(2)
    assert [r[1] for r in a + b] == [2.0] * 4 and pids(a) == pids(b)


CALLER = textwrap.dedent("""
    import os, sys, time
    from gpufleet import distributed, runtime

    def pid_then_wait(wait, entered=None):
        import os, time
        if entered:
            open(entered + str(runtime.get_global_rank()), "w").close()
        time.sleep(wait)
        return os.getpid()

    f = distributed(pid_then_wait, gpus=2, gpu_type="cpu", tracking=False, stream_logs=False, keep_warm=60)
    print("PIDS", *f.distributed(0), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    try:
        f.distributed(60, sys.argv[2])
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
""")


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_killed_or_interrupted_caller_leaves_no_warm_rank(tmp_path, how):
    import psutil

    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    entered = tmp_path / "entered-"
    proc = subprocess.Popen([sys.executable, str(script), how, str(entered)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    ranks = [int(p) for p in line.split()[1:]]
    if how == "interrupt":
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"entered-{r}").exists() for r in (0, 1)):  # inside the second call
            assert time.monotonic() < deadline and proc.poll() is None, "the second call never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert "INTERRUPTED" in proc.stdout.read()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks):
        assert time.monotonic() < deadline, f"warm ranks left after the caller was {how}ed"
        time.sleep(0.2)


def test_the_same_notebook_cell_three_times_reuses_the_workers():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from gpufleet import distributed, runtime\n"
            "@distributed(gpus=2, gpu_type='cpu', tracking=False, stream_logs=False)\n"
            "def where():\n    import os\n    return os.getpid()\n"
        ),
        *[nbformat.v4.new_code_cell("print('PIDS', where.distributed())") for _ in range(3)],
        nbformat.v4.new_code_cell("import gpufleet; print('STOPPED', gpufleet.shutdown_workers())"),
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": root}}).execute()
    outs = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    seen = [o.strip() for o in outs[1:4]]
    assert seen[0].startswith("PIDS") and seen[0] == seen[1] == seen[2]  # keep_warm is on in a kernel
    assert "STOPPED 1" in outs[4]


def test_keep_warm_is_checked():
    for bad in (-1, float("nan"), "600"):
        with pytest.raises(errors.LaunchConfigError, match="keep_warm must be"):
            distributed(_all_reduce_and_pid, keep_warm=bad, **CPU)


# ------------------------------------------------------------------ warm ranks forget (what a call changed)


def _change_everything(tmp: str) -> int:
    import io
    import resource
    import signal
    import sys

    import torch

    torch.set_default_dtype(torch.float64)
    torch.add = lambda *a, **k: "patched"
    torch.Tensor.add = lambda *a, **k: "patched"
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)
    os.environ["LEFT_BY_A_CALL"] = "1"
    os.chdir(tmp)
    sys.path.append("/left/by/a/call")
    signal.signal(signal.SIGTERM, lambda *a: None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 64), hard))
    print("a partial line", end="", flush=True)  # the end-of-job mark then follows on the same line
    sys.stdout = io.StringIO()  # and the next prints go nowhere the caller sees
    return os.getpid()


def _process_state() -> tuple:
    import resource
    import signal
    import sys

    import torch

    return (
        os.getpid(), str(torch.get_default_dtype()), torch.add(torch.ones(1), 1).tolist(),
        torch.ones(1).add(1).tolist(), torch.get_num_threads(), torch.initial_seed() == 1234, torch.is_grad_enabled(),
        os.environ.get("LEFT_BY_A_CALL"), os.getcwd(), "/left/by/a/call" in sys.path,
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, resource.getrlimit(resource.RLIMIT_NOFILE),
        sys.stdin.readline(), sys.stdout is sys.__stdout__,
    )  # fmt: skip


def test_a_warm_call_starts_from_the_state_of_a_cold_rank(tmp_path):
    # seen: the dtype, a patched torch.add, threads, environment, cwd, sys.path, handlers and limits of
    # one call were the next call's; stdin.readline() hung; a replaced sys.stdout cost 10 s per call
    cold = [r[1:] for r in distributed(_process_state, keep_warm=False, **CPU).distributed()]
    change = distributed(_change_everything, keep_warm=60, **{**CPU, "timeout": 60})
    first = change.distributed(str(tmp_path))
    state = distributed(_process_state, keep_warm=60, **{**CPU, "timeout": 60})
    warm = state.distributed()
    assert [r[0] for r in warm] == first  # the same ranks, kept (not discarded after a 10 s wait)
    assert [r[1:] for r in warm] == cold
    assert change.distributed(str(tmp_path)) == first  # and they keep serving


def _timed_fault_then_return() -> int:
    return os.getpid()


def _sleep_past_the_fault(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_a_fault_timer_of_one_call_never_fires_in_the_next():
    first = distributed(_timed_fault_then_return, keep_warm=60, **CPU).distributed()  # the ranks, warm
    faulty = distributed(_timed_fault_then_return, keep_warm=60, faults=["kill:rank=1:after=4"], **CPU)
    assert faulty.distributed() == first  # returns before its fault is due
    later = distributed(_sleep_past_the_fault, keep_warm=60, **CPU).distributed(5.0)
    assert later == first


def _leave_a_thread_and_children(marker: str) -> tuple[int, int, int]:
    import subprocess
    import sys
    import threading

    def chatter() -> None:
        while True:
            print(marker, flush=True)
            time.sleep(0.05)

    threading.Thread(target=chatter, daemon=True).start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    return os.getpid(), child.pid, helper.pid


def test_a_call_that_leaves_threads_or_children_gets_fresh_ranks_and_its_children_stop():
    import psutil

    f = distributed(_leave_a_thread_and_children, keep_warm=60, **CPU)
    first = f.distributed("LEFT-BEHIND-THREAD")
    children = [pid for r in first for pid in r[1:]]
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in children):
        assert time.monotonic() < deadline, "the children a call left are still running"
        time.sleep(0.1)
    handle = distributed(_all_reduce_and_pid, keep_warm=60, **CPU).submit(1)
    second = handle.result(timeout=60)
    assert set(pids(second)).isdisjoint(r[0] for r in first)  # replaced: the thread could not be stopped
    logs = "".join(open(os.path.join(handle.run_dir, f"rank-{r}.log")).read() for r in range(2))
    assert "LEFT-BEHIND-THREAD" not in logs


KILLED_KERNEL = textwrap.dedent("""
    import os, sys, time
    from gpufleet import distributed

    def helper_then_wait(path):
        import os, subprocess, sys, time
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        with open(path + ".tmp", "w") as f:
            f.write(str(helper.pid))
        os.replace(path + ".tmp", path)
        time.sleep(60)

    f = distributed(helper_then_wait, gpus=1, gpu_type="cpu", tracking=False, stream_logs=False, keep_warm=60)
    f.distributed(sys.argv[1])
""")


def test_a_killed_kernel_leaves_no_setsid_helper_and_no_control_folder(tmp_path):
    import psutil

    runs = tmp_path / "home" / "runs"
    script = tmp_path / "kernel.py"
    script.write_text(KILLED_KERNEL)
    marker = tmp_path / "helper.pid"
    env = {**os.environ, "GPUFLEET_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, str(script), str(marker)], env=env)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the call did not start its helper"
        time.sleep(0.1)
    helper = int(marker.read_text())
    assert list(runs.glob("gpufleet-warm-*"))
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while psutil.pid_exists(helper) and psutil.Process(helper).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the call's setsid helper outlived its killed kernel"
        time.sleep(0.1)
    deadline = time.monotonic() + 15
    while list(runs.glob("gpufleet-warm-*")):
        assert time.monotonic() < deadline, "the killed kernel's warm control folder stayed"
        time.sleep(0.1)
    # a folder whose caller died before its ranks could remove it goes at the next start of warm ranks
    stale = runs / "gpufleet-warm-stale"
    stale.mkdir()
    (stale / "owner.lock").touch()
    distributed(_all_reduce_and_pid, keep_warm=60, runs_dir=str(runs), **CPU).distributed(1)
    assert not stale.exists()


IDLE_KERNEL = textwrap.dedent("""
    import os, sys, time
    from gpufleet import distributed

    def pid():
        return os.getpid()

    f = distributed(pid, gpus=2, gpu_type="cpu", tracking=False, stream_logs=False, keep_warm=600)
    print("PIDS", *f.distributed(), *f.distributed(), flush=True)  # two calls on the same warm ranks
    time.sleep(600)  # the kernel idles: its warm ranks wait for the next job
""")


def test_an_idle_kernel_killed_leaves_no_warm_ranks_and_no_control_folder(tmp_path):
    # seen: the ranks were gone in 1.1 s, their control folder (owner.lock, stack files) stayed
    # until the next warm start: idle ranks end when their job pipe closes, before their parent
    # watch would remove it
    import psutil

    runs = tmp_path / "home" / "runs"
    script = tmp_path / "kernel.py"
    script.write_text(IDLE_KERNEL)
    env = {**os.environ, "GPUFLEET_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 4 and pids[:2] == pids[2:], line  # the second call ran on the warm ranks
        assert len(list(runs.glob("gpufleet-warm-*"))) == 1
    finally:
        proc.kill()
        proc.communicate()
    ranks = [psutil.Process(p) for p in pids[:2] if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"warm ranks outlived their killed kernel: {alive}"
    assert not list(runs.glob("gpufleet-warm-*")), "the killed kernel's warm control folder stayed"


def _pid_after(seconds: float, entered: str | None = None) -> int:
    if entered:
        open(entered + str(runtime.get_global_rank()), "w").close()
    time.sleep(seconds)
    return os.getpid()


def test_a_cancel_keeps_warm_ranks_that_come_back_from_it(tmp_path):
    # seen: cancel() discarded the warm ranks, so the next call started cold (2.1 s)
    f = distributed(_pid_after, keep_warm=60, **{**CPU, "grace_period_s": 10.0})  # the time to come back
    first = f.distributed(0.0)
    entered = str(tmp_path / "entered-")
    handle = f.submit(60.0, entered)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(entered + str(r)) for r in (0, 1)):  # both ranks inside the call
        assert time.monotonic() < deadline and not handle.done(), "the call never started on its ranks"
        time.sleep(0.05)
    handle.cancel()
    with pytest.raises(errors.RunCanceledError):
        handle.result(timeout=30)
    assert f.distributed(0.0) == first  # the interrupted call's ranks serve the next one
