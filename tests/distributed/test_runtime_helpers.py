"""runtime.barrier() and runtime.setup() as a user's training code calls them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from gpufleet import distributed, runtime


def _arrive_then_leave(delay_s: float) -> tuple[float, float]:
    runtime.setup()
    if runtime.get_global_rank() == 1:
        time.sleep(delay_s)
    arrived = time.time()
    runtime.barrier()
    return arrived, time.time()


def test_barrier_holds_every_rank_until_the_last_arrives():
    (arrived0, left0), (arrived1, left1) = distributed(gpus=2, gpu_type="cpu")(_arrive_then_leave).distributed(1.5)
    assert arrived1 - arrived0 > 1.0  # rank 1 came late ...
    assert left0 >= arrived1  # ... and rank 0 waited for it


def _collective_backends() -> dict:
    import torch
    import torch.distributed as dist

    dev = runtime.setup(backend="cpu:gloo,cuda:nccl")
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"device": str(dev), "sum": t.item(), "backend": str(dist.get_backend())}


def test_a_gpu_backend_string_runs_unchanged_on_cpu_workers():
    # "cpu:gloo,cuda:nccl" (written for async checkpoints on GPUs) on a torch without NCCL
    results = distributed(gpus=2, gpu_type="cpu")(_collective_backends).distributed()
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert all(r["device"] == "cpu" and "gloo" in r["backend"] for r in results)


def test_setup_outside_a_launch_is_a_one_rank_group_and_barrier_a_no_op():
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from gpufleet import runtime
        runtime.barrier()  # no group yet: nothing to wait for
        dev = runtime.setup()
        t = torch.full((1,), 3.0)
        dist.all_reduce(t)
        runtime.barrier()
        print(dev, dist.get_world_size(), runtime.get_global_rank(), t.item())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "1", "0", "3.0"]


def test_a_torchrun_rank_that_never_ends_its_group_has_it_ended_at_exit(tmp_path):
    # A gloo group left to Python's teardown can abort a rank after its work (SIGABRT, "terminate
    # called without an active exception"), failing the attempt. The exit handler that runs last
    # (registered first) sees whether setup()'s own handler ended the group before it.
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(
        """
        import atexit, os, sys
        import torch, torch.distributed as dist
        from gpufleet import runtime

        def report():  # registered before setup(): runs after setup()'s handler
            with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.txt"), "w") as f:
                f.write("still up" if dist.is_initialized() else "ended")

        atexit.register(report)
        runtime.setup()
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0
        # no destroy_process_group(): the rank just returns
        """
    ))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)] == ["ended", "ended"]


def test_finish_ends_a_rank_whose_library_keeps_a_gloo_sub_group_alive(tmp_path):
    # A library that keeps a sub-group (DeepSpeed does) keeps its gloo threads alive after the
    # group is destroyed; left to Python's teardown, such a thread can abort a rank that trained to
    # its end. finish() ends the group, joins the rank's own threads, runs its exit handlers,
    # flushes stdout and exits with the rank's code, without that teardown.
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(
        """
        import atexit, os, sys, threading, time
        import torch, torch.distributed as dist
        from gpufleet import runtime

        out = sys.argv[1]
        rank = os.environ["RANK"]

        def gloo_threads():
            names = []
            for tid in os.listdir("/proc/self/task"):
                try:
                    names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
                except OSError:
                    pass
            return sum(n == "pt_gloo_runloop" for n in names)

        def report():
            with open(os.path.join(out, f"rank-{rank}.txt"), "w") as f:
                f.write(f"{'still up' if dist.is_initialized() else 'ended'} {gloo_threads() > 0}")

        def write_late():
            time.sleep(0.5)
            open(os.path.join(out, f"thread-{rank}.txt"), "w").write("written")

        atexit.register(report)
        runtime.setup()
        kept = dist.new_group([0, 1])  # as a library keeps its groups
        t = torch.ones(1)
        dist.all_reduce(t, group=kept)
        threading.Thread(target=write_late).start()
        print(f"rank {rank} sum {t.item()}", end="")  # no newline, no flush: finish() flushes
        runtime.finish(int(sys.argv[2]))
        raise SystemExit(99)  # never reached
        """
    ))

    def torchrun(code: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
             "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--tee=1",
             str(script), str(tmp_path), str(code)],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    proc = torchrun(0)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the group was ended before the exit handlers ran, while the kept sub-group's threads still lived
    assert [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)] == ["ended True", "ended True"]
    assert [(tmp_path / f"thread-{r}.txt").read_text() for r in (0, 1)] == ["written", "written"]
    assert "rank 0 sum 2.0" in proc.stdout and "rank 1 sum 2.0" in proc.stdout

    proc = torchrun(3)
    assert proc.returncode != 0
    assert "exitcode  : 3" in proc.stdout + proc.stderr, proc.stderr[-3000:]
