"""What one lost rank costs: replace it in place, or restart the group from a checkpoint.

One DDP training run (an MLP, AdamW, dropout, data drawn per step and rank) of ``--steps`` steps
runs four ways on CPU workers (gloo):

- ``uninterrupted``: the reference (gpufleet, no fault);
- ``replace``: gpufleet, ``recovery="replace"``, rank ``--rank`` SIGKILLed as step ``--kill-at`` begins
  (a new process starts cold for it);
- ``replace-spare``: the same with ``spares=1``: a warm spare (imports done) takes the rank;
- ``restart``: gpufleet today, ``max_retries=1``, a checkpoint every ``--save-every`` steps, the same
  kill: every rank restarts and resumes from the newest checkpoint, which is also what the other
  launchers do;
- ``torchrun``: plain ``torchrun --max-restarts=1`` (its rendezvous on 127.0.0.1) on the same loop
  with its own ``torch.save`` checkpoints (model, optimizer, each rank's RNG) every
  ``--save-every`` steps; the rank SIGKILLs itself as step ``--kill-at`` begins.

Each rank appends ``(step, time, pid, loss)`` as each step ends. The table shows, per way:
``recovery_s`` (the dead rank's last completed step to the interrupted step completed on every
rank: detection, restart or replacement, state hand-over and the re-run step), ``steps_lost``
(steps computed twice), ``survivors_restarted`` (ranks other than the dead one whose process
changed), ``bit_identical`` (final parameters equal the reference's) and ``goodput``: useful
step time over wall time for a run of 1 step per second with one such failure every
``--fail-every`` steps (1800: every 30 minutes), with each way's steady cost per step (the boundary
snapshots of ``replace``, measured against the uninterrupted run) counted too. The last line is
one JSON object for the ``replace`` way, with the ``replace-spare`` way's under ``with_spare``.

    python benchmarks/recovery.py --cpu                      # 2 ranks
    python benchmarks/recovery.py --cpu --workers 4 --rank 0
    python benchmarks/recovery.py --cpu --strategy fsdp2     # the shard copies (every 5 steps)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

LOOP = textwrap.dedent(
    """
    import json, os, time
    from pathlib import Path

    def build(hidden):
        import torch
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                   torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def batch(step, rank):
        import torch
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, 32, generator=g)
        return x, x.sum(1, keepdim=True).sin()

    def train_step(model, opt, step, rank):
        import torch
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def record(out, step, loss):
        out.write(json.dumps({"step": step, "t": time.time(), "pid": os.getpid(), "loss": loss}) + "\\n")
        out.flush()

    def params(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def full_params(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in sd.items()}
    """
)

GPUFLEET = LOOP + textwrap.dedent(
    """
    def train(ckpt_dir, records, steps, hidden, save_every, strategy, replica_every):
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from gpufleet import runtime
        from gpufleet.checkpoint import CheckpointManager

        runtime.setup()
        rank = dist.get_rank()
        if strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            model = build(hidden)
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer)
            model = fully_shard(model)
        else:
            model = DistributedDataParallel(build(hidden))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ckpt = CheckpointManager(ckpt_dir, model=model, optimizer=opt, replica_every=replica_every)
        torch.manual_seed(100 + rank)
        start = ckpt.resume() or 0
        with open(Path(records) / f"rank{rank}.jsonl", "a") as out:
            for step in ckpt.steps(start + 1, steps + 1):
                record(out, step, train_step(model, opt, step, rank))
                if save_every and step % save_every == 0:
                    ckpt.save(step)
        ckpt.close()
        return full_params(model)
    """
)

#: How long a torchrun try may take (a run takes about 10 s on 2 cores).
TORCHRUN_LIMIT_S = 120

TORCHRUN = LOOP + textwrap.dedent(
    """
    def main():
        import signal, sys
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        ckpt_dir, records = Path(sys.argv[1]), Path(sys.argv[2])
        steps, hidden, save_every, kill_rank, kill_at = (int(a) for a in sys.argv[3:8])
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DistributedDataParallel(build(hidden))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(100 + rank)
        complete = [int(d.name) for d in ckpt_dir.glob("*") if len(list(d.glob("rank*.pt"))) == world]
        start = max(complete, default=0)
        if start:  # the newest checkpoint every rank finished: model, optimizer, this rank's RNG
            state = torch.load(ckpt_dir / str(start) / f"rank{rank}.pt", weights_only=False)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            torch.set_rng_state(state["rng"])
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        with open(records / f"rank{rank}.jsonl", "a") as out:
            for step in range(start + 1, steps + 1):
                if first and rank == kill_rank and step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # as step kill_at begins, like gpufleet's fault
                record(out, step, train_step(model, opt, step, rank))
                if save_every and step % save_every == 0:
                    folder = ckpt_dir / str(step)
                    folder.mkdir(parents=True, exist_ok=True)
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}
                    torch.save(state, folder / f".rank{rank}.tmp")
                    os.replace(folder / f".rank{rank}.tmp", folder / f"rank{rank}.pt")
        torch.save(params(model.module), records / f"params{rank}.pt")
        dist.destroy_process_group()

    main()
    """
)


def _torchrun(work: Path, args: argparse.Namespace) -> tuple[list[list[dict]] | None, list[dict] | None, int, str]:
    """The same run under plain ``torchrun --max-restarts=1`` with its own checkpoints (loopback only),
    and how many tries failed first: its restart round sometimes cannot connect its gloo group
    ("connectFullMesh failed ... Connection refused") or never rendezvouses (a try is stopped after
    ``TORCHRUN_LIMIT_S``); at most ``--torchrun-tries`` tries. Records and parameters None when every try failed,
    with the last one's output."""
    import shutil
    import signal
    import socket
    import subprocess

    import psutil
    import torch

    script = work / "torchrun_loop.py"
    script.write_text(TORCHRUN)
    records = work / "torchrun"
    failed, last = 0, ""
    for _ in range(args.torchrun_tries):
        shutil.rmtree(records, ignore_errors=True)
        shutil.rmtree(work / "ckpt-torchrun", ignore_errors=True)
        records.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={args.workers}",
                   "--max-restarts=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(script),
                   str(work / "ckpt-torchrun"), str(records), str(args.steps), str(args.hidden), str(args.save_every),
                   str(args.rank), str(args.kill_at)]  # fmt: skip
        log = work / "torchrun.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=TORCHRUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failed, last = failed + 1, f"no end within {TORCHRUN_LIMIT_S} s"
            continue
        finally:  # a worker torchrun left running after a failed round (its own session) must not load the next
            for leftover in psutil.process_iter(["cmdline"]):
                if str(script) in (leftover.info["cmdline"] or []):
                    leftover.kill()
        if proc.returncode != 0:
            failed, last = failed + 1, log.read_text()[-8000:]
            continue
        params = [torch.load(records / f"params{r}.pt") for r in range(args.workers)]
        return _records(records, args.workers), params, failed, ""
    return None, None, failed, last


def _records(folder: Path, workers: int) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in (folder / f"rank{r}.jsonl").read_text().splitlines()] for r in range(workers)]


def _gpufleet(work: Path, name: str, args: argparse.Namespace, **options: Any) -> tuple[list[list[dict]], list[dict]]:
    sys.path.insert(0, str(work))
    from bench_loop import train  # type: ignore[import-not-found]

    from gpufleet import distributed

    records = work / name
    records.mkdir()
    fn = distributed(train, gpus=args.workers, gpu_type="cpu", tracking=False, timeout=600, live=False, **options)
    save_every = args.save_every if options.get("max_retries") else 0  # only the restart way reads checkpoints
    params = fn.distributed(str(work / f"ckpt-{name}"), str(records), args.steps, args.hidden, save_every,
                            args.strategy, args.replica_every)  # fmt: skip
    return _records(records, args.workers), params


def _step_s(records: list[list[dict]]) -> float:
    """The median time between two steps' ends on rank 0 (its first steps left out)."""
    times = [r["t"] for r in records[0]][3:]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def _measure(records: list[list[dict]], params: list[dict], reference: list[dict], args: argparse.Namespace,
             steady_s: float, base_step_s: float) -> dict[str, Any]:  # fmt: skip
    import torch

    dead = records[args.rank]
    killed_after = max(r["t"] for r in dead if r["step"] == args.kill_at - 1 and r["pid"] == dead[0]["pid"])
    redone = max(r["t"] for rank in records for r in rank if r["step"] == args.kill_at)
    steps_lost = sum(len(rank) for rank in records) // len(records) - args.steps
    restarted = sum(1 for r, rank in enumerate(records) if r != args.rank and len({x["pid"] for x in rank}) > 1)
    identical = all(torch.equal(params[r][k], reference[r][k]) for r in range(len(params)) for k in reference[r])
    recovery_s = redone - killed_after - base_step_s  # the re-run step itself is not lost time
    overhead_s = max(0.0, steady_s - base_step_s)  # what each step costs more (the boundary snapshots)
    useful = float(args.fail_every)  # seconds of useful steps at 1 step/s between two failures
    wall = useful * (1 + overhead_s) + max(recovery_s, 0.0) + steps_lost * 1.0
    return {"recovery_s": round(recovery_s, 3), "steps_lost": steps_lost, "bit_identical": identical,
            "survivors_restarted": restarted, "goodput": round(useful / wall, 4),
            "step_overhead_ms": round(overhead_s * 1000, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU workers with gloo (the only mode for now)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=1, help="the rank that is killed")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's width (512: about 1 M parameters)")
    parser.add_argument("--fail-every", type=int, default=1800, help="steps (at 1 step/s) between two failures")
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp",
                        help="fsdp2: the shards are copied to the next rank every --replica-every steps (no torchrun way)")
    parser.add_argument("--replica-every", type=int, default=5)
    parser.add_argument("--torchrun-tries", type=int, default=5,
                        help="tries of the plain torchrun way, whose restart round often fails (0: leave it out)")
    args = parser.parse_args()
    if not args.cpu:
        parser.error("recovery='replace' runs on CPU workers for now: pass --cpu")
    os.environ.setdefault("GPUFLEET_TRACKING", "0")
    with tempfile.TemporaryDirectory(prefix="gpufleet-recovery-") as tmp:
        work = Path(tmp)
        (work / "bench_loop.py").write_text(GPUFLEET)
        kill = [f"kill:rank={args.rank}:step={args.kill_at}"]
        ref_records, reference = _gpufleet(work, "uninterrupted", args)
        base = _step_s(ref_records)
        ways = {
            "replace": _gpufleet(work, "replace", args, recovery="replace", faults=kill),
            "replace-spare": _gpufleet(work, "replace-spare", args, recovery="replace", spares=1, faults=kill),
            "restart": _gpufleet(work, "restart", args, max_retries=1, faults=kill),
        }
        torchrun_failed, torchrun_error = 0, ""
        if args.strategy == "ddp" and args.torchrun_tries > 0:
            records, params, torchrun_failed, torchrun_error = _torchrun(work, args)
            if records is not None and params is not None:
                ways["torchrun"] = (records, params)
        steady = _gpufleet(work, "replace-steady", args, recovery="replace")
        rows = {}
        for name, (records, params) in ways.items():
            steady_s = _step_s(steady[0]) if name.startswith("replace") else base
            rows[name] = _measure(records, params, reference, args, steady_s, base)
    print(f"one {args.strategy.upper()} run of {args.steps} steps on {args.workers} CPU workers (gloo), rank {args.rank} SIGKILLed "
          f"as step {args.kill_at} begins; checkpoints every {args.save_every} steps (restart); "
          f"step {base * 1000:.1f} ms")  # fmt: skip
    head = ["way", "recovery_s", "steps_lost", "survivors_restarted", "bit_identical", "goodput", "step_overhead_ms"]
    print("  ".join(f"{h:>19}" for h in head))
    for name, row in rows.items():
        print("  ".join(f"{str(v):>19}" for v in [name, *(row[h] for h in head[1:])]))
    replace = rows["replace"]
    print(f"replace (warm spare / cold) vs restart: recovery {rows['replace-spare']['recovery_s']:.2f} s / "
          f"{replace['recovery_s']:.2f} s vs {rows['restart']['recovery_s']:.2f} s"
          + (f" (torchrun {rows['torchrun']['recovery_s']:.2f} s)" if "torchrun" in rows else "") + ", "
          f"{replace['steps_lost']} vs {rows['restart']['steps_lost']} steps lost")  # fmt: skip
    if torchrun_error:
        print(f"torchrun: every one of its {torchrun_failed} tries failed in its restart round; the last said:\n"
              + "\n".join(line for line in torchrun_error.splitlines() if "Error" in line or "failed with" in line)[-1500:])  # fmt: skip
    elif torchrun_failed:
        print(f"torchrun: {torchrun_failed} tries before the one measured failed in their restart round (gloo "
              f"could not connect its group, or no end within {TORCHRUN_LIMIT_S} s)")  # fmt: skip
    print(json.dumps({"strategy": args.strategy, "workers": args.workers, "killed_rank": args.rank, **replace,
                      "with_spare": rows["replace-spare"]}))  # fmt: skip


if __name__ == "__main__":
    main()
