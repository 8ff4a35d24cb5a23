"""DDP's bucket layout handed to a new wrapper (checkpoint/ddp_buckets.py), in one CPU rank."""

from __future__ import annotations

from typing import Any

from gpufleet import distributed
from gpufleet.checkpoint.ddp_buckets import parse


def _facts() -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gpufleet import runtime
    from gpufleet.checkpoint.ddp_buckets import lay_out, layout_of

    runtime.setup()

    def model() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 40_000), torch.nn.ReLU(), torch.nn.Linear(40_000, 8))

    def step(ddp: Any) -> None:
        ddp(torch.randn(2, 8)).sum().backward()

    def buckets(ddp: Any) -> int:
        return len(ddp.reducer._get_zeros_like_grad_buckets())

    old = DistributedDataParallel(model())
    seen = []
    for _ in range(3):
        seen.append(layout_of(old))
        step(old)
    layout = layout_of(old)
    new = DistributedDataParallel(model())
    fresh = buckets(new)
    why_not = lay_out(new, layout)
    given = buckets(new)
    step(new)  # the new reducer reduces: every parameter gets its gradient
    grads = all(p.grad is not None for p in new.parameters())
    hooked = DistributedDataParallel(model())
    hooked.register_comm_hook(None, lambda _, bucket: torch.futures.Future().set_result(bucket.buffer()) or None)
    return {
        "seen": seen, "layout": layout, "fresh": fresh, "why_not": why_not, "given": given, "grads": grads,
        "again": lay_out(new, layout), "hooked": lay_out(hooked, layout), "none": lay_out(DistributedDataParallel(model()), None),
        "other": lay_out(DistributedDataParallel(torch.nn.Linear(2, 2)), layout),
    }  # fmt: skip


def test_a_new_wrapper_takes_the_runs_buckets_and_refuses_what_it_cannot_redo() -> None:
    (facts,) = distributed(_facts, gpus=1, gpu_type="cpu", timeout=120, tracking=False).distributed()
    # DDP records the layout it rebuilt at its second step once its third begins
    assert facts["seen"][:2] == [None, None] and facts["layout"] is not None and len(facts["layout"]) == 2
    assert sorted(i for b in facts["layout"] for i in b) == [0, 1, 2, 3]
    assert (facts["fresh"], facts["why_not"], facts["given"], facts["grads"]) == (1, None, 2, True)
    assert facts["again"] == "the wrapper has already run a step"
    assert facts["hooked"] == "the wrapper uses a registered comm hook"
    assert "no surviving rank knew" in facts["none"]
    assert "other parameters than the wrapper's 2" in facts["other"]


def test_a_layout_read_back_from_a_marker_is_lists_of_whole_numbers_or_nothing() -> None:
    assert parse([[3, 2], [1, 0]]) == [[3, 2], [1, 0]]
    for junk in (None, "3 2, 1 0", [], [[]], [[1, "2"]], [[1.0]], [[-1]], [[True]], {"a": 1}):
        assert parse(junk) is None, junk
