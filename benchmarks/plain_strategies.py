"""Plain PyTorch baseline: a GPT trained with DDP, FSDP2 or DeepSpeed ZeRO under torchrun.

No gpufleet code here: this is the reference that ``benchmarks/strategies.py`` compares
against in the same run. It also holds the model, data and timing helpers both scripts share.

    torchrun --standalone --nproc_per_node=2 benchmarks/plain_strategies.py --strategy fsdp2 --out r.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

H200_BF16_PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100/H200 SXM

SIZES = {
    # name: (layers, hidden, heads, vocab)
    "tiny": (2, 64, 4, 512),
    "350m": (24, 1024, 16, 50304),
    "760m": (24, 1536, 16, 50304),
    "1b": (18, 2048, 16, 50304),
}


@dataclass
class GPTConfig:
    """Shape of the GPT-style model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int


class Block(nn.Module):
    """Pre-norm transformer block: causal SDPA attention + GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h, bias=False)
        self.out = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, a ModuleList of blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_config(size: str, seq_len: int) -> GPTConfig:
    layers, hidden, heads, vocab = SIZES[size]
    return GPTConfig(layers, hidden, heads, vocab, seq_len)


def flops_per_token(model: nn.Module, cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 N (N without the position embeddings) + 12 L h s attention."""
    n = sum(p.numel() for p in model.parameters()) - cfg.seq_len * cfg.hidden_size
    return 6 * n + 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_len


def batches(cfg: GPTConfig, micro_batch: int, device: torch.device, seed: int):
    """Endless random token batches (inputs, targets), different per rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    while True:
        t = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=g)
        t = t.to(device, non_blocking=True)
        yield t[:, :-1], t[:, 1:]


@dataclass
class Result:
    """One measured configuration."""

    strategy: str
    world_size: int
    tokens_per_s: float
    mfu: float | None
    peak_mem_gib: float | None
    step_s: float
    loss: float
    num_params: int


def measure(step_fn, cfg: GPTConfig, micro_batch: int, world: int, device, warmup: int, steps: int, fpt: float, strategy: str, num_params: int) -> Result:
    """Time ``steps`` calls of ``step_fn`` after ``warmup``; tokens/s over all ranks, MFU, peak memory."""
    import torch.distributed as dist

    for _ in range(warmup):
        loss = step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    loss_value = float(loss)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    tokens = steps * micro_batch * cfg.seq_len * world
    tps = tokens / elapsed
    peak = None
    mfu = None
    if device.type == "cuda":
        peak_t = torch.tensor(torch.cuda.max_memory_allocated() / 1024**3, device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = float(peak_t)
        mfu = tps * fpt / (H200_BF16_PEAK_FLOPS * world)
    return Result(strategy, world, tps, mfu, peak, elapsed / steps, loss_value, num_params)


def deepspeed_config(stage: int, micro_batch: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "overlap_comm": True},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def make_loss(compiled: bool):
    """Cross-entropy over fp32 logits; compiled, it never materialises the fp32 copy."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return torch.compile(loss_fn) if compiled else loss_fn


def compile_blocks(model: GPT) -> None:
    """torch.compile each transformer block in place (communication still overlaps backward)."""
    for block in model.blocks:
        block.compile()


def make_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp2", "zero2", "zero3"], required=True)
    parser.add_argument("--size", choices=list(SIZES), default="350m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block and the loss (not with ZeRO)")
    parser.add_argument("--ddp-bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default: torch's 25)")
    parser.add_argument("--ddp-static-graph", action="store_true", help="DDP static_graph=True")
    parser.add_argument("--ddp-comm-hook", choices=["bf16", "fp16"], default=None, help="all-reduce gradients in 16 bits")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = make_config(args.size, args.seq_len)
    model = GPT(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, cfg)
    data = batches(cfg, args.micro_batch, device, seed=rank)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    compiled = args.compile and args.strategy not in ("zero2", "zero3")
    loss_fn = make_loss(compiled)

    if args.strategy in ("zero2", "zero3"):
        import deepspeed

        model.to(device)  # DeepSpeed would move it too
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=make_optimizer(model.parameters(), device),
            config=deepspeed_config(int(args.strategy[-1]), args.micro_batch, world),
        )

        def step() -> torch.Tensor:
            x, y = next(data)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
    else:
        model.to(device)
        if compiled:
            compile_blocks(model)
        if args.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (world,))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
            wrapped, ctx = model, nullcontext
        elif args.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ddp_kwargs = {"static_graph": args.ddp_static_graph}
            if args.ddp_bucket_mb is not None:
                ddp_kwargs["bucket_cap_mb"] = args.ddp_bucket_mb
            wrapped = DistributedDataParallel(
                model, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=True, **ddp_kwargs
            )
            if args.ddp_comm_hook:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                hook = default_hooks.bf16_compress_hook if args.ddp_comm_hook == "bf16" else default_hooks.fp16_compress_hook
                wrapped.register_comm_hook(state=None, hook=hook)
            ctx = lambda: autocast  # noqa: E731
        else:
            wrapped, ctx = model, lambda: autocast  # noqa: E731
        optimizer = make_optimizer(wrapped.parameters(), device)

        def step() -> torch.Tensor:
            x, y = next(data)
            with ctx():
                logits = wrapped(x)
            loss = loss_fn(logits, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

    result = measure(step, cfg, args.micro_batch, world, device, args.warmup, args.steps, fpt, args.strategy, num_params)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(asdict(result), f)
    assert math.isfinite(result.loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
