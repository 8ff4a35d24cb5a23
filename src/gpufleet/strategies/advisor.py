"""The memory advisor: per-GPU memory of DDP, FSDP2 and ZeRO-1/2/3 (+ offload), and a choice.

The formulas are documented in ``docs/strategies.md``. In short, with ``P`` parameters,
``N`` GPUs and ``K`` bytes of optimizer state per parameter (AdamW: 8, fp32 moments):

* DDP (torch autocast, fp32 weights): ``(4 + 4 + K) P`` + a 2-byte autocast copy of the weights.
* FSDP2 (``MixedPrecisionPolicy``): ``(4 + 4 + K) P / N`` + the gathered blocks in flight.
* ZeRO (DeepSpeed, 16-bit weights + fp32 master): stage 1 ``2P + 2P + (4 + K) P/N``,
  stage 2 ``2P + (2 + 4 + 4 + K) P/N`` (fp32 gradient partition for the step), stage 3 all of it
  over ``N``; with offload the sharded states live in CPU memory.
* Activations (flash/SDPA attention): ``34 s b h`` bytes per layer in 16-bit (``66`` in fp32),
  ``2 s b h`` per layer with activation checkpointing plus one layer's worth, and the logits
  ``10 s b V`` (16-bit logits, their fp32 copy and its gradient). With ``torch.compile``
  (blocks and loss) the fp32 logits are never materialised: ``4 s b V``; the per-layer term
  stays ``34 s b h`` (measured on H200 with a 1B GPT at micro-batch 32 and 64).

Plain Python: the model's shape (counted with torch/transformers on the meta device when a
model object, a Hugging Face config or a local model folder is given) comes from
:mod:`.model_shape`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import StrategyConfigError, normalize_precision
from .model_shape import ModelShape, model_shape, parse_count

__all__ = [
    "Advice",
    "MemoryEstimate",
    "ModelShape",
    "advise",
    "parse_count",
    "parse_memory",
    "optimizer_state_bytes",
    "TECHNIQUES",
]

GIB = 1024**3
TECHNIQUES = ("ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload")
HEADROOM = 0.90  # share of GPU memory the estimate may use (CUDA context, allocator slack)
_DS_REDUCE_BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size (elements)
_DS_PREFETCH_BUCKET = 5e7  # DeepSpeed's default stage3_prefetch_bucket_size (elements)
_OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "lion": 4, "adam8bit": 2, "sgd-nomomentum": 0}
_MEM_UNITS = {"": GIB, "b": 1, "kb": 1024, "kib": 1024, "mb": 1024**2, "mib": 1024**2, "gb": GIB, "gib": GIB, "tb": 1024**4, "tib": 1024**4}


def parse_memory(value: str | int | float) -> float:
    """``"80GB"``, ``"80GiB"``, ``"24576MB"`` or a number (GiB) -> bytes.

    GPU makers' "80GB" is 80 GiB of device memory, so GB and GiB both mean 1024**3 here.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise StrategyConfigError(f"GPU memory must be positive, got {value!r}")
        return float(value) * GIB
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(value).lower())
    if not m or m.group(2) not in _MEM_UNITS or float(m.group(1)) <= 0:
        raise StrategyConfigError(f"cannot read a memory size from {value!r}; write e.g. 80GB, 141GiB or 24576MB")
    return float(m.group(1)) * _MEM_UNITS[m.group(2)]


def optimizer_state_bytes(optimizer: str) -> int:
    """Bytes of optimizer state per parameter (AdamW: two fp32 moments = 8)."""
    key = optimizer.lower().replace("_", "").replace("torch.optim.", "")
    if key not in _OPTIMIZER_BYTES:
        raise StrategyConfigError(f"unknown optimizer {optimizer!r}; known: {', '.join(_OPTIMIZER_BYTES)}")
    return _OPTIMIZER_BYTES[key]


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one technique, in GiB.

    Attributes:
        technique: ddp, fsdp2, zero1, zero2, zero3 or zero3_offload.
        params_gib: parameters kept on the GPU.
        grads_gib: gradients.
        optimizer_gib: optimizer state (with fp32 master weights where the technique keeps them).
        buffers_gib: gathered blocks, communication buckets and 16-bit working copies.
        activations_gib: activations of one micro-batch (0 without a sequence length).
        total_gib: the sum: the estimated peak allocated memory.
        cpu_gib: memory each rank keeps in host RAM (offload).
        fits: whether ``total_gib`` fits in the usable GPU memory.
    """

    technique: str
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    buffers_gib: float
    activations_gib: float
    total_gib: float
    cpu_gib: float
    fits: bool


@dataclass(frozen=True)
class Advice:
    """The advisor's answer: one estimate per technique and the recommended technique.

    Attributes:
        recommendation: ``ddp``, ``fsdp2``, ``zero3_offload`` or ``none`` (nothing fits).
        reason: why, in one or two sentences, with the numbers.
        activation_checkpointing: whether the recommendation needs activation checkpointing.
        estimates: the per-technique estimates (with the activation checkpointing setting of
            the recommendation).
        model: the model shape used.
        inputs: the other inputs (GPUs, memory, precision, optimizer, sequence, micro-batch).
        notes: caveats (guessed shapes, activations left out).
    """

    recommendation: str
    reason: str
    activation_checkpointing: bool
    estimates: dict[str, MemoryEstimate]
    model: ModelShape
    inputs: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``recommendation`` first)."""
        return {
            "recommendation": self.recommendation,
            "reason": self.reason,
            "activation_checkpointing": self.activation_checkpointing,
            "estimates": {k: asdict(v) for k, v in self.estimates.items()},
            "model": {**asdict(self.model), "root_params": self.model.root_params},
            "inputs": self.inputs,
            "notes": self.notes,
        }


# --- the estimate


def _activation_bytes(
    shape: ModelShape, precision: str, seq_len: int | None, micro_batch: int, checkpointing: bool, compiled: bool = False
) -> float:
    if not seq_len:
        return 0.0
    half = precision != "no"
    sbh = seq_len * micro_batch * shape.hidden_size
    per_layer = 34 * sbh if half else 66 * sbh
    if checkpointing:
        layers = shape.num_layers * 2 * sbh + per_layer  # block inputs + one block recomputed
    else:
        layers = shape.num_layers * per_layer
    logits = seq_len * micro_batch * shape.vocab_size * ((4 if compiled else 10) if half else 8)
    return float(layers + logits)


def _estimates(
    shape: ModelShape, gpus: int, precision: str, opt_bytes: int, act: float, usable: float
) -> dict[str, MemoryEstimate]:
    p, n, half = shape.num_params, gpus, precision != "no"
    block, root = shape.block_params, shape.root_params
    w = 2 if half else 4  # bytes of a working (compute-dtype) weight or gradient
    bucket = min(_DS_REDUCE_BUCKET, p) * w
    gathered = 2 * max(block, root) * w  # the largest unit gathered, and the next one prefetched
    rows: dict[str, tuple[float, float, float, float, float]] = {}
    # torch-native: fp32 weights; autocast keeps a 16-bit copy of the weights during forward
    rows["ddp"] = (4 * p, 4 * p, opt_bytes * p, (2 * p if half else 0), 0)
    # FSDP2: fp32 shards; gathered 16-bit blocks (2 in flight) + their unsharded grads (16-bit + fp32 for the reduce);
    # the root (embeddings, head) stays gathered from forward to backward
    fsdp_buffers = 2 * block * w + block * (w + 4) + root * (w + w + 4) if n > 1 else (2 * p if half else 0)
    rows["fsdp2"] = (4 * p / n, 4 * p / n, opt_bytes * p / n, fsdp_buffers, 0)
    # DeepSpeed ZeRO: 16-bit weights/grads, fp32 master + optimizer state, fp32 grad partition for the step
    master = (4 if half else 0) + opt_bytes
    fp32_grads = 4 * p / n if half else 0
    rows["zero1"] = (w * p, w * p, master * p / n + fp32_grads, bucket, 0)
    rows["zero2"] = (w * p, w * p / n, master * p / n + fp32_grads, bucket, 0)
    rows["zero3"] = (w * p / n, w * p / n, master * p / n + fp32_grads, bucket + gathered + _DS_PREFETCH_BUCKET * w, 0)
    cpu = (w * p + w * p + master * p) / n + fp32_grads
    rows["zero3_offload"] = (0, 0, 0, bucket + gathered + _DS_PREFETCH_BUCKET * w, cpu)
    out = {}
    for name in TECHNIQUES:
        params, grads, optim, buffers, cpu_bytes = rows[name]
        total = params + grads + optim + buffers + act
        out[name] = MemoryEstimate(
            technique=name,
            params_gib=round(params / GIB, 3),
            grads_gib=round(grads / GIB, 3),
            optimizer_gib=round(optim / GIB, 3),
            buffers_gib=round(buffers / GIB, 3),
            activations_gib=round(act / GIB, 3),
            total_gib=round(total / GIB, 3),
            cpu_gib=round(cpu_bytes / GIB, 3),
            fits=total <= usable,
        )
    return out


def advise(
    model: Any = None,
    *,
    model_params: str | int | None = None,
    gpus: int = 1,
    gpu_memory: str | float = "80GB",
    optimizer: str = "adamw",
    precision: str = "bf16",
    seq_len: int | None = None,
    micro_batch: int = 1,
    activation_checkpointing: bool | None = None,
    compiled: bool = False,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
) -> Advice:
    """Estimate per-GPU memory of each technique and recommend one.

    Args:
        model: an ``nn.Module``, a Hugging Face config, or the path of a local model folder /
            ``config.json`` (parameters are counted on the meta device: nothing is downloaded).
        model_params: instead of ``model``, a parameter count such as ``"7B"``.
        gpus: number of GPUs (ranks) in the run.
        gpu_memory: memory of one GPU (``"80GB"``; a number means GiB).
        optimizer: adamw, adam, sgd, lion, adam8bit or sgd-nomomentum.
        precision: bf16, fp16 or no.
        seq_len: sequence length; without it activations are left out.
        micro_batch: sequences per GPU per forward.
        activation_checkpointing: ``None`` tries without, then with; ``True``/``False`` fixes it.
        compiled: the blocks and the loss run under ``torch.compile`` (smaller activations).
        num_layers, hidden_size, vocab_size: the shape, when only a count is given (else the
            GPT-3 family's shape of that size is assumed).

    Returns:
        An :class:`Advice`; ``recommendation`` is ddp, fsdp2, zero3_offload or none.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise StrategyConfigError(f"gpus must be a positive integer, got {gpus!r}")
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise StrategyConfigError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise StrategyConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    prec = normalize_precision(precision) or "bf16"
    opt_bytes = optimizer_state_bytes(optimizer)
    memory = parse_memory(gpu_memory)
    usable = HEADROOM * memory
    shape = model_shape(model, model_params, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    inputs = {
        "gpus": gpus,
        "gpu_memory_gib": round(memory / GIB, 2),
        "usable_gib": round(usable / GIB, 2),
        "optimizer": optimizer,
        "optimizer_state_bytes_per_param": opt_bytes,
        "precision": prec,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "compiled": bool(compiled),
    }
    notes = []
    if shape.guessed:
        notes.append(f"guessed from the parameter count: {', '.join(shape.guessed)} (give them for a closer estimate)")
    if not seq_len:
        notes.append("activations are not included: give seq_len (and micro_batch) to include them")

    def run(checkpointing: bool) -> dict[str, MemoryEstimate]:
        act = _activation_bytes(shape, prec, seq_len, micro_batch, checkpointing, bool(compiled))
        return _estimates(shape, gpus, prec, opt_bytes, act, usable)

    tries = [activation_checkpointing] if activation_checkpointing is not None else [False, True]
    if not seq_len:
        tries = tries[:1]
    # cheapest first: sharding costs less than recomputation, which costs less than offload
    order: list[tuple[str, bool | None]] = []
    for technique_group in (("ddp", "fsdp2"), ("zero3_offload",)):
        for ac in tries:
            order += [(t, ac) for t in technique_group]
    computed = {ac: run(bool(ac)) for ac in tries}
    chosen = None
    for name, ac in order:
        if name == "fsdp2" and gpus == 1:
            continue  # nothing to shard over
        if computed[ac][name].fits:
            chosen = (name, bool(ac), computed[ac])
            break
    if chosen is None:
        ac = bool(tries[-1])
        est = run(ac)
        best = min(est.values(), key=lambda e: e.total_gib)
        reason = (
            f"nothing fits: the smallest estimate is {best.technique} at {best.total_gib:.1f} GiB per GPU "
            f"and {usable / GIB:.1f} GiB are usable. Add GPUs, lower micro_batch or seq_len"
            + ("" if ac else ", or turn on activation checkpointing")
        )
        return Advice("none", reason, ac, est, shape, inputs, notes)
    name, ac, est = chosen
    e = est[name]
    ac_text = " with activation checkpointing" if ac else ""
    if name == "ddp":
        reason = (
            f"the whole model with its gradients and optimizer state fits on each GPU{ac_text} "
            f"({e.total_gib:.1f} of {usable / GIB:.1f} usable GiB): DDP is the simplest and fastest"
            + (" (one GPU: plain training)" if gpus == 1 else ", one all-reduce per step")
        )
    elif name == "fsdp2":
        reason = (
            f"DDP needs {est['ddp'].total_gib:.1f} GiB per GPU, more than the {usable / GIB:.1f} usable; "
            f"FSDP2 shards parameters, gradients and optimizer state over {gpus} GPUs: "
            f"{e.total_gib:.1f} GiB{ac_text}"
        )
    else:
        reason = (
            f"even fully sharded the model needs {est['zero3'].total_gib:.1f} GiB per GPU "
            f"({est['fsdp2'].total_gib:.1f} with FSDP2); DeepSpeed ZeRO-3 with parameter and optimizer "
            f"offload keeps {e.cpu_gib:.1f} GiB per rank in CPU memory and {e.total_gib:.1f} GiB on the GPU{ac_text}"
        )
    return Advice(name, reason, ac, est, shape, inputs, notes)
