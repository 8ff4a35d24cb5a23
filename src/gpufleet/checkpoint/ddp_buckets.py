"""A new DDP wrapper's gradient buckets laid out as the run's were: after a rank is replaced in
place, and after a resume from a checkpoint.

DDP all-reduces gradients in buckets. A new ``DistributedDataParallel`` puts every parameter in one
bucket for its first step, then rebuilds its buckets in the order the gradients became ready
(about 25 MB each, the first 1 MB). After a replacement (or a restart) every rank builds a new
wrapper, so the first step after it would reduce one bucket where the uninterrupted run reduced
several.
With more than two ranks the ring all-reduce then adds each element's contributions in another
order, and the parameters differ in their last bits from the run's.

So each survivor remembers the layout its wrapper rebuilt (:func:`layout_of`, read once from DDP's
own record of it, on the training thread), and a checkpoint's marker keeps it (:func:`parse` reads
it back); at the join, or the resume, every rank's new wrapper gets that layout before its first
step (:func:`lay_out`): its reducer is made again as DDP makes it when it is unpickled, with the
given buckets. The wrapper still rebuilds after that step from the ready order, which gives the
same layout. Where the wrapper is one this cannot redo faithfully (mixed precision, a comm hook,
the Python reducer) it is left as it is and the reason is returned: the run goes on, equal to the
uninterrupted one up to the last bits.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_ddp", "lay_out", "layout_of", "parse"]

Layout = list[list[int]]


def is_ddp(model: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def layout_of(wrapper: Any) -> Layout | None:
    """The buckets ``wrapper`` rebuilt (lists of parameter indices, in the order they are reduced);
    None before DDP has recorded them (it does at the step after its rebuild)."""
    if not getattr(wrapper, "_has_rebuilt_buckets", False):
        return None
    try:
        text = wrapper._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    except Exception:  # noqa: BLE001 - a torch without that record: no layout to hand on
        return None
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return [[int(i) for i in bucket.split()] for bucket in text.split(",")]
    except ValueError:
        return None


def parse(value: Any) -> Layout | None:
    """A layout read back from a checkpoint's marker: lists of whole numbers, else None (not used)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(b, list) and b and all(type(i) is int and i >= 0 for i in b) for b in value):
        return None
    return [list(b) for b in value]


def lay_out(wrapper: Any, layout: Layout | None) -> str | None:
    """Give the new ``wrapper`` the buckets ``layout`` for its first step; None when done, else why not."""
    import torch.distributed as dist

    if layout is None:
        return "no surviving rank knew the run's bucket layout (DDP records it at its third step)"
    if getattr(wrapper, "_has_rebuilt_buckets", True) or getattr(wrapper, "_lazy_init_ran", False):
        return "the wrapper has already run a step"
    for attr, why in (("mixed_precision", "DDP's own mixed precision"), ("_use_python_reducer", "the Python reducer"),
                      ("_comm_hooks", "a registered comm hook")):  # fmt: skip
        if getattr(wrapper, attr, None):
            return f"the wrapper uses {why}"
    parameters, expect_sparse = wrapper._build_params_for_reducer()
    if sorted(i for bucket in layout for i in bucket) != list(range(len(parameters))):
        return f"the run's layout names other parameters than the wrapper's {len(parameters)}"
    first = int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024))
    limits = [first] + [int(wrapper.bucket_bytes_cap)] * (len(layout) - 1)
    computed = dist._compute_bucket_assignment_by_size

    def given(*_: Any, **__: Any) -> tuple[Layout, list[int]]:
        # DDP reverses what this returns (its guess at the ready order); the layout is that order already
        return [list(b) for b in reversed(layout)], list(reversed(limits))

    def make_reducer() -> None:
        wrapper._ddp_init_helper(parameters, expect_sparse, wrapper._build_debug_param_to_name_mapping(parameters),
                                 wrapper.static_graph)  # fmt: skip

    wrapper._remove_autograd_hooks()  # the old reducer's, on the same parameters
    dist._compute_bucket_assignment_by_size = given
    try:
        make_reducer()
    except Exception as e:  # noqa: BLE001 - a torch whose DDP differs: the reducer DDP makes itself
        dist._compute_bucket_assignment_by_size = computed
        make_reducer()  # a wrapper without a reducer would not reduce at all: if this fails, the join fails
        return f"its reducer could not be made with the run's layout ({type(e).__name__}: {e})"
    finally:
        dist._compute_bucket_assignment_by_size = computed
    if wrapper.static_graph:  # as DDP does when it makes its reducer again (``__setstate__``)
        wrapper.reducer._set_static_graph()
        wrapper.logger._set_static_graph()
    return None
