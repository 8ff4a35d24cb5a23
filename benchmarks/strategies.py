"""Benchmark: gpufleet's prepare() vs plain PyTorch/torchrun for 1 GPU, DDP, FSDP2, ZeRO-2, ZeRO-3.

Trains the same GPT-style model (bf16, sequence 1024) both ways in the same run and prints
tokens/s, MFU and peak memory per GPU, the ratio gpufleet / plain, DDP scaling, and the
advisor's estimate next to each measured peak.

    python benchmarks/strategies.py                      # GPUs: 350M GPT, 2 GPUs
    python benchmarks/strategies.py --size 1b --compile  # 1.0B GPT, torch.compile on both sides
    python benchmarks/strategies.py --cpu                # tiny model on 2 CPU processes (gloo)
    python benchmarks/strategies.py --only ddp,fsdp2     # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CASES = ["single", "ddp", "fsdp2", "zero2", "zero3"]
COMPILED_CASES = ("single", "ddp", "fsdp2")  # ZeRO runs eager on both sides
ADVISOR_TECHNIQUE = {"single": "ddp", "ddp": "ddp", "fsdp2": "fsdp2", "zero2": "zero2", "zero3": "zero3"}


def gpufleet_rank(
    strategy: str, size: str, seq_len: int, micro_batch: int, warmup: int, steps: int, compiled: bool = False, ddp: dict | None = None
) -> dict:
    """One rank of the gpufleet run: the same model and loop, through prepare()."""
    import torch
    from plain_strategies import (
        GPT,
        batches,
        flops_per_token,
        make_config,
        make_loss,
        make_optimizer,
        measure,
    )

    from gpufleet import runtime
    from gpufleet.strategies import prepare

    device = runtime.setup()
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    torch.manual_seed(0)
    cfg = make_config(size, seq_len)
    model = GPT(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, cfg)
    data = batches(cfg, micro_batch, device, seed=rank)
    options: dict = {}
    compiled = compiled and strategy in COMPILED_CASES
    loss_fn = make_loss(compiled)
    if strategy in ("single", "ddp"):
        options.update(strategy="ddp", compile=compiled, **(ddp or {}))
    elif strategy == "fsdp2":
        options.update(strategy="fsdp2", compile=compiled)
    else:
        options.update(strategy="deepspeed", zero_stage=int(strategy[-1]), micro_batch_size=micro_batch, overlap_comm=True)
    prepared = prepare(model, lambda params: make_optimizer(params, device), mixed_precision="bf16", **options)

    def step() -> torch.Tensor:
        x, y = next(data)
        loss = loss_fn(prepared(x), y)
        prepared.backward(loss)
        prepared.step()
        prepared.zero_grad()
        return loss.detach()

    return asdict(measure(step, cfg, micro_batch, world, device, warmup, steps, fpt, strategy, num_params))


def run_plain(strategy: str, world: int, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """The plain torchrun script, in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            str(HERE / "plain_strategies.py"), "--strategy", strategy, "--size", args.size,
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", out,
        ] + (["--compile"] if args.compile else [])
        if args.ddp_bucket_mb is not None:
            cmd += ["--ddp-bucket-mb", str(args.ddp_bucket_mb)]
        if args.ddp_static_graph:
            cmd.append("--ddp-static-graph")
        if args.ddp_comm_hook:
            cmd += ["--ddp-comm-hook", args.ddp_comm_hook]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"plain {strategy} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def run_gpufleet(strategy: str, world: int, args: argparse.Namespace, env: dict[str, str]) -> dict:
    from gpufleet import distributed

    fn = distributed(
        gpus=world,
        gpu_type="cpu" if args.cpu else None,
        timeout=args.timeout,
        env=env,
        stream_logs=False,
    )(gpufleet_rank)
    ddp = {"bucket_cap_mb": args.ddp_bucket_mb, "static_graph": args.ddp_static_graph, "comm_hook": args.ddp_comm_hook}
    return fn.distributed(strategy, args.size, args.seq_len, args.micro_batch, args.warmup, args.steps, args.compile, ddp)[0]


def advisor_estimate(strategy: str, world: int, args: argparse.Namespace) -> float:
    import torch
    from plain_strategies import GPT, make_config

    from gpufleet.strategies import advise

    with torch.device("meta"):
        model = GPT(make_config(args.size, args.seq_len))
    advice = advise(model, gpus=world, gpu_memory="141GB", seq_len=args.seq_len, micro_batch=args.micro_batch,
                    precision="bf16", optimizer="adamw", activation_checkpointing=False,
                    compiled=args.compile and strategy in COMPILED_CASES)
    return advice.estimates[ADVISOR_TECHNIQUE[strategy]].total_gib


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny model on CPU processes (gloo)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--size", default=None, help="tiny, 350m, 760m, 1b (default 350m; tiny with --cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 1024 (64 with --cpu)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 16 (2 with --cpu)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block and the loss on both sides (1 GPU, DDP, FSDP2)")
    parser.add_argument("--ddp-bucket-mb", type=float, default=None, help="DDP bucket_cap_mb on both sides (default: torch's 25)")
    parser.add_argument("--ddp-static-graph", action="store_true", help="DDP static_graph=True on both sides")
    parser.add_argument("--ddp-comm-hook", choices=["bf16", "fp16"], default=None, help="DDP all-reduces gradients in 16 bits, both sides")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma list of {','.join(CASES)}")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.size = args.size or ("tiny" if args.cpu else "350m")
    args.seq_len = args.seq_len or (64 if args.cpu else 1024)
    args.micro_batch = args.micro_batch or (2 if args.cpu else 16)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 5)
    args.steps = args.steps if args.steps is not None else (3 if args.cpu else 20)
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {CASES}")

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    launch_env = {k: env[k] for k in ("PYTHONPATH", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES") if k in env}

    rows = []
    started = time.time()
    for case in cases:
        world = 1 if case == "single" else args.gpus
        t0 = time.time()
        plain = run_plain(case, world, args, env)
        ours = run_gpufleet(case, world, args, launch_env)
        estimate = advisor_estimate(case, world, args)
        rows.append({"case": case, "world": world, "plain": plain, "gpufleet": ours, "advisor_gib": estimate})
        print(f"{case}: plain {plain['tokens_per_s']:.0f} tok/s, gpufleet {ours['tokens_per_s']:.0f} tok/s ({time.time() - t0:.0f} s)", flush=True)

    single = next((r for r in rows if r["case"] == "single"), None)
    print()
    print(f"model {args.size} ({rows[0]['plain']['num_params'] / 1e6:.0f}M params), seq {args.seq_len}, micro-batch {args.micro_batch}, bf16, "
          f"{args.steps} timed steps, {'CPU' if args.cpu else 'GPU'}"
          f"{', torch.compile (1 GPU, DDP, FSDP2)' if args.compile else ''}"
          f"; DDP: bucket {args.ddp_bucket_mb or 25} MB, static_graph={args.ddp_static_graph}, comm_hook={args.ddp_comm_hook}")
    header = f"{'case':7} {'ranks':>5} | {'plain tok/s':>12} {'gpufleet tok/s':>14} {'ratio':>6} | {'MFU plain':>9} {'MFU gf':>7} | " \
             f"{'peak plain':>10} {'peak gf':>8} {'advisor':>8} {'adv/meas':>8} | {'scaling':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        p, g = r["plain"], r["gpufleet"]
        ratio = g["tokens_per_s"] / p["tokens_per_s"]
        measured = g["peak_mem_gib"]
        adv_ratio = r["advisor_gib"] / measured if measured else None
        scaling = None
        if single and r["case"] != "single":
            scaling = g["tokens_per_s"] / (single["gpufleet"]["tokens_per_s"] * r["world"])
        print(
            f"{r['case']:7} {r['world']:>5} | {p['tokens_per_s']:>12.0f} {g['tokens_per_s']:>14.0f} {ratio:>6.3f} | "
            f"{fmt(p['mfu'], '.3f'):>9} {fmt(g['mfu'], '.3f'):>7} | {fmt(p['peak_mem_gib'], '.2f'):>10} {fmt(measured, '.2f'):>8} "
            f"{r['advisor_gib']:>8.2f} {fmt(adv_ratio, '.2f'):>8} | {fmt(scaling, '.3f'):>7}"
        )
    print(f"(peak = torch.cuda.max_memory_allocated, GiB per GPU; scaling = tokens/s / (1-GPU tokens/s x ranks); total {time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
