"""``gpufleet advise``: per-GPU memory of each parallelism technique and a recommendation."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parsers"]

_LABELS = {
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "zero3_offload": "ZeRO-3+offload",
}


def add_parsers(subparsers: Any) -> None:
    """Register the ``advise`` command."""
    p = subparsers.add_parser(
        "advise",
        help="estimate per-GPU memory for DDP, FSDP2 and ZeRO and recommend one",
        description="Estimate per-GPU memory of DDP, FSDP2, ZeRO-1/2/3 and ZeRO-3 + offload, and recommend a technique.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model-params", help="parameter count, e.g. 7B, 350M, 1.5e9")
    what.add_argument("--model", help="a local Hugging Face model folder or config.json (nothing is downloaded)")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs in the run (default 1)")
    p.add_argument(
        "--gpu-memory", default="80GB",
        help="memory of one GPU as its maker labels it, e.g. 80GB, 141GB (default 80GB); GB means GiB "
        "(2^30 bytes) here, as on GPU labels (an 80GB H100 has about 80 GiB); MB means MiB",
    )  # fmt: skip
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, lion, adam8bit, sgd-nomomentum (default adamw)")
    p.add_argument("--precision", default="bf16", help="bf16, fp16 or no (default bf16)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (activations are left out without it)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward (default 1)")
    ac = p.add_mutually_exclusive_group()
    ac.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_const", const=True, default=None)
    ac.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const", const=False)
    p.add_argument("--compile", action="store_true", help="the model runs under torch.compile (smaller activations)")
    p.add_argument("--num-layers", type=int, default=None, help="blocks, when only --model-params is given")
    p.add_argument("--hidden-size", type=int, default=None, help="width, when only --model-params is given")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary, when only --model-params is given")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="table (default) or json")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from .advisor import advise
    from .config import StrategyConfigError

    try:
        advice = advise(
            args.model,
            model_params=args.model_params,
            gpus=args.gpus,
            gpu_memory=args.gpu_memory,
            optimizer=args.optimizer,
            precision=args.precision,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            activation_checkpointing=args.activation_checkpointing,
            compiled=args.compile,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            vocab_size=args.vocab_size,
        )
    except (StrategyConfigError, ImportError, OSError) as e:
        print(f"gpufleet advise: error: {e}", file=sys.stderr)
        return 2
    if args.output == "json":
        sys.stdout.write(json.dumps(advice.to_dict(), indent=2) + "\n")
        return 0
    _print_table(advice, args.gpu_memory)
    return 0


def _print_table(advice: Any, gpu_memory: str) -> None:
    from rich.console import Console
    from rich.table import Table

    inputs, shape = advice.inputs, advice.model
    title = (
        f"{shape.num_params / 1e9:.2f}B parameters on {inputs['gpus']} x {inputs['gpu_memory_gib']:g} GiB, "
        f"{inputs['precision']}, {inputs['optimizer']}"
        + (f", seq {inputs['seq_len']} x micro-batch {inputs['micro_batch']}" if inputs["seq_len"] else "")
        + (", activation checkpointing" if advice.activation_checkpointing else "")
    )
    table = Table(title=title, title_justify="left")
    for col in ("technique", "params", "grads", "optimizer", "buffers", "activations", "total / GPU", "CPU / rank", "fits"):
        table.add_column(col, justify="left" if col == "technique" else "right")
    for name, e in advice.estimates.items():
        label = _LABELS[name] + (" *" if name == advice.recommendation else "")
        table.add_row(
            label,
            f"{e.params_gib:.1f}",
            f"{e.grads_gib:.1f}",
            f"{e.optimizer_gib:.1f}",
            f"{e.buffers_gib:.1f}",
            f"{e.activations_gib:.1f}",
            f"{e.total_gib:.1f}",
            f"{e.cpu_gib:.1f}" if e.cpu_gib else "-",
            "yes" if e.fits else "no",
        )
    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1; the CLI ends quietly with 141, as git does
            raise BrokenPipeError

    console = _Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    console.print(
        f"GiB per GPU (1 GiB = 2^30 bytes); --gpu-memory {gpu_memory} read as {inputs['gpu_memory_gib']:g} GiB "
        f"(GB means GiB here, as on GPU labels); usable {inputs['usable_gib']:g} GiB (90 % of each GPU)."
    )
    console.print(f"[bold]recommendation: {advice.recommendation}[/bold] - {advice.reason}")
    for note in advice.notes:
        console.print(f"note: {note}")
