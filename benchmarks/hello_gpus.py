"""Hello world on every GPU: each rank returns its rank after an NCCL all-reduce.

    python benchmarks/hello_gpus.py            # every visible GPU
"""

from __future__ import annotations

import time

from gpufleet import distributed, runtime


def hello() -> dict:
    import torch
    import torch.distributed as dist

    dev = runtime.setup()
    t = torch.tensor([1.0], device=dev)
    dist.all_reduce(t)
    return {"rank": runtime.get_global_rank(), "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "world": t.item()}


if __name__ == "__main__":
    t0 = time.perf_counter()
    results = distributed(gpus=None, tracking=False)(hello).distributed()
    for r in results:
        print(r)
    print(f"{len(results)} ranks answered in {time.perf_counter() - t0:.2f} s (whole call)")
