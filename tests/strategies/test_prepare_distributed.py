"""One training loop under DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 on 2 CPU ranks (gloo).

All strategies run inside one launch (one rank function) to keep the suite fast.

Tolerance of the loss-parity checks: everything runs in float32; the only difference between
one process over the global batch and 2 ranks over half of it each is the order of the
floating-point sums (mean of 8 vs the average of two means of 4, all-reduce / reduce-scatter
order, DeepSpeed's flat fp32 partitions). That changes results by a few ulps (float32 eps is
1.2e-7) per operation; over 6 AdamW steps with clipping the measured gap stays below 1e-6
relative, so ``rtol=1e-5`` (about 80 ulps) is tight enough to catch a real difference (a
wrong gradient average, a missed accumulation step or a clip at another norm moves the loss
by 1e-3 or more) without flaking on summation order.
"""

from __future__ import annotations

import pytest
import torch

from gpufleet import distributed
from tests.strategies.models import TinyNet, make_data

NUM_STEPS = 6
GLOBAL_BATCH = 8
LR = 1e-2
MAX_NORM = 0.5
RTOL = 1e-5
ATOL = 1e-6

PARITY_CASES = {
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2_checkpointing_offload": {
        "strategy": "fsdp2", "activation_checkpointing": True, "reshard_after_forward": False, "cpu_offload": True,
    },
    # torch.compile block by block; aot_eager traces forward and backward through dynamo and
    # AOTAutograd (what inductor would compile) without needing minutes of C++ compilation
    "ddp_compiled": {"strategy": "ddp", "compile": {"backend": "aot_eager"}},
    "fsdp2_compiled": {"strategy": "fsdp2", "compile": {"backend": "aot_eager"}},
    "fsdp2_checkpointing_compiled": {
        "strategy": "fsdp2", "activation_checkpointing": True, "compile": {"backend": "aot_eager"},
    },
    "zero1": {"strategy": "deepspeed", "zero_stage": 1, "gradient_clipping": MAX_NORM},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2, "gradient_clipping": MAX_NORM},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3, "gradient_clipping": MAX_NORM},
    "zero3_offload": {
        "strategy": "deepspeed", "zero_stage": 3, "gradient_clipping": MAX_NORM, "offload_optimizer": "cpu", "offload_param": "cpu",
    },
}


def _train(options: dict, accumulation: int, facts: dict | None = None) -> tuple[list[float], dict]:
    """The one training loop; returns the global mean loss per optimizer step and the state dict."""
    import torch.distributed as dist

    from gpufleet.strategies import prepare

    rank, world = dist.get_rank(), dist.get_world_size()
    x_all, y_all = make_data(NUM_STEPS, GLOBAL_BATCH)
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    prepared = prepare(model, optimizer, mixed_precision="no", gradient_accumulation_steps=accumulation, **options)
    if facts is not None:
        facts["compiled_blocks"] = sum(getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks)
        facts["compiled_root"] = getattr(model, "_compiled_call_impl", None) is not None
    per_rank = GLOBAL_BATCH // world
    micro = per_rank // accumulation
    losses = []
    for step in range(NUM_STEPS):
        x = x_all[step, rank * per_rank : (rank + 1) * per_rank]
        y = y_all[step, rank * per_rank : (rank + 1) * per_rank]
        step_loss = torch.zeros(())
        for m in range(accumulation):
            xb, yb = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
            loss = torch.nn.functional.mse_loss(prepared(xb).float(), yb)
            prepared.backward(loss)
            prepared.clip_grad_norm(MAX_NORM)
            prepared.step()
            prepared.zero_grad()
            step_loss += loss.detach() / accumulation
        assert prepared.optimizer_stepped
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    return losses, prepared.state_dict()


def _precision_facts() -> dict:
    """What each library was actually told to do under bf16 / fp16."""
    from gpufleet.strategies import DeepSpeedConfig, prepare

    facts: dict = {}
    x = torch.randn(4, 8)

    def record(prepared, key: str) -> None:
        seen = {}

        def hook(module, args, output):
            seen["weight"] = module.weight.dtype
            seen["output"] = output.dtype

        handle = prepared.unwrap().blocks[0].fc.register_forward_hook(hook)
        loss = prepared(x).float().pow(2).mean()
        prepared.backward(loss)
        prepared.step()
        prepared.zero_grad()
        handle.remove()
        facts[key] = {"weight_in_forward": str(seen["weight"]), "output": str(seen["output"]), "loss_finite": bool(torch.isfinite(loss))}

    for strategy in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        m = TinyNet()
        p = prepare(m, torch.optim.AdamW(m.parameters()), strategy=strategy, mixed_precision="bf16")
        record(p, f"{strategy}-bf16")
        facts[f"{strategy}-bf16"]["stored_weight"] = str(p.unwrap().blocks[0].fc.weight.dtype)
    torch.manual_seed(0)
    m = TinyNet()
    p = prepare(m, torch.optim.AdamW(m.parameters()), strategy="ddp", mixed_precision="fp16")
    record(p, "ddp-fp16")
    facts["ddp-fp16"]["scaler"] = type(p.scaler).__name__
    torch.manual_seed(0)
    m = TinyNet()
    p = prepare(m, torch.optim.AdamW(m.parameters()), mixed_precision="bf16", config=DeepSpeedConfig(zero_stage=2))
    record(p, "deepspeed-bf16")
    facts["deepspeed-bf16"]["engine_bf16"] = bool(p.model.bfloat16_enabled())
    facts["deepspeed-bf16"]["config_bf16"] = p.plan.deepspeed_config["bf16"]["enabled"]
    return facts


def _comm_hook_facts() -> dict:
    """Gradients after backward with DDP's 16-bit all-reduce vs the exact fp32 average.

    fp16 on CPU: torch allows the bf16 hook only on NCCL, which gpufleet says before wrapping.
    """
    import torch.distributed as dist

    from gpufleet.strategies import prepare

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyNet()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))
    try:
        prepare(TinyNet(), None, strategy="ddp", comm_hook="bf16")
        bf16_refusal = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        bf16_refusal = f"{type(e).__name__}: {e}"
    prepared = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="ddp", comm_hook="fp16")
    prepared.backward(prepared(x).pow(2).mean())
    reference = TinyNet()
    reference.load_state_dict(model.state_dict())
    reference(x).pow(2).mean().backward()
    exact = [p.grad.clone() for p in reference.parameters()]
    for g in exact:
        dist.all_reduce(g)
        g /= world
    got = [p.grad for p in model.parameters()]
    return {
        "bf16_refusal": bf16_refusal,
        "fp16_representable": all(torch.equal(g, g.half().float()) for g in got),
        "exact_is_fp16_representable": all(torch.equal(g, g.half().float()) for g in exact),
        # error relative to each tensor's largest gradient (tiny entries are fp16 subnormals)
        "max_rel_error": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, exact, strict=True)),
    }


def _conflict_in_worker() -> str:
    """A batch-size conflict that only shows with the real world size, raised inside prepare()."""
    from gpufleet.strategies import DeepSpeedConfig, StrategyConfigError, prepare

    m = TinyNet()
    try:
        prepare(m, torch.optim.AdamW(m.parameters()), gradient_accumulation_steps=1, config=DeepSpeedConfig(train_batch_size=4, micro_batch_size=4))
    except StrategyConfigError as e:
        return str(e)
    return "no error"


@distributed(gpus=2, gpu_type="cpu", timeout=600)
def run_all() -> dict:
    from gpufleet import runtime

    runtime.setup()
    out: dict = {"parity": {}, "accumulation": {}, "state": {}, "facts": {}}
    for name, options in PARITY_CASES.items():
        out["facts"][name] = {}
        losses, state = _train(options, accumulation=1, facts=out["facts"][name])
        out["parity"][name] = losses
        out["state"][name] = {k: v.float() for k, v in state.items()}
    for name in ("ddp", "fsdp2", "zero2"):
        out["accumulation"][name] = _train(PARITY_CASES[name], accumulation=2)[0]
    out["precision"] = _precision_facts()
    out["conflict"] = _conflict_in_worker()
    out["comm_hook"] = _comm_hook_facts()
    return out


def _single_process_reference() -> tuple[list[float], dict]:
    """The same model and data in one plain process over the whole global batch."""
    x_all, y_all = make_data(NUM_STEPS, GLOBAL_BATCH)
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(NUM_STEPS):
        loss = torch.nn.functional.mse_loss(model(x_all[step]), y_all[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_all.distributed()


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    return _single_process_reference()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_loss_curve_matches_single_process(results, reference, name):
    ref_losses, _ = reference
    assert ref_losses[-1] < ref_losses[0]  # the model learns: the curve means something
    for rank_result in results:
        assert rank_result["parity"][name] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_full_state_dict_matches_single_process(results, reference, name):
    _, ref_state = reference
    state = results[0]["state"][name]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    # every rank gets the same full state dict
    for key in ref_state:
        torch.testing.assert_close(results[1]["state"][name][key], state[key])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero2"])
def test_gradient_accumulation_equals_the_larger_batch(results, reference, name):
    ref_losses, _ = reference
    assert results[0]["accumulation"][name] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_compiled", "fsdp2_compiled"])
def test_compile_compiles_each_block_not_the_whole_model(results, name):
    facts = results[0]["facts"][name]
    assert facts == {"compiled_blocks": 3, "compiled_root": False}
    assert results[0]["facts"]["ddp"] == {"compiled_blocks": 0, "compiled_root": False}


@pytest.mark.slow
def test_fp16_comm_hook_all_reduces_gradients_in_16_bits(results):
    facts = results[0]["comm_hook"]
    assert facts["fp16_representable"]  # what the fp16 all-reduce produced, cast back
    assert not facts["exact_is_fp16_representable"]  # an fp32 all-reduce would not be
    assert facts["max_rel_error"] < 2e-3  # and it is still the average (fp16 has 11 bits of mantissa)
    assert facts["bf16_refusal"].startswith("StrategyConfigError: comm_hook='bf16' needs NCCL on CUDA GPUs")


@pytest.mark.slow
def test_bf16_reaches_ddp_autocast(results):
    facts = results[0]["precision"]["ddp-bf16"]
    assert facts["output"] == "torch.bfloat16"  # autocast ran the matmul in bf16
    assert facts["stored_weight"] == "torch.float32"  # master weights stay fp32
    assert facts["loss_finite"]


@pytest.mark.slow
def test_fp16_on_ddp_uses_a_grad_scaler(results):
    facts = results[0]["precision"]["ddp-fp16"]
    assert facts["output"] == "torch.float16"
    assert facts["scaler"] == "GradScaler"
    assert facts["loss_finite"]


@pytest.mark.slow
def test_bf16_reaches_fsdp2_mixed_precision_policy(results):
    facts = results[0]["precision"]["fsdp2-bf16"]
    assert facts["weight_in_forward"] == "torch.bfloat16"  # all-gathered in param_dtype
    assert facts["stored_weight"] == "torch.float32"  # sharded parameters stay fp32
    assert facts["loss_finite"]


@pytest.mark.slow
def test_bf16_reaches_deepspeed(results):
    facts = results[0]["precision"]["deepspeed-bf16"]
    assert facts["engine_bf16"] is True
    assert facts["config_bf16"] is True
    assert facts["weight_in_forward"] == "torch.bfloat16"
    assert facts["loss_finite"]  # fp32 inputs were cast to the engine's dtype


@pytest.mark.slow
def test_batch_size_conflict_is_raised_inside_prepare_with_the_real_world_size(results):
    message = results[0]["conflict"]
    assert "train_batch_size=4" in message
    assert "world size (2)" in message
    assert "set train_batch_size to 8" in message
