"""Peak memory of the caller and of each rank for one call with a large argument (512 MiB by default).

python benchmarks/argument_memory.py            # prints caller and rank peaks (ru_maxrss, MiB)
python benchmarks/argument_memory.py 1024       # a 1 GiB argument
"""

import os
import resource
import sys

from gpufleet import distributed


def f(blob):
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB peak of the rank


blob = os.urandom(int(sys.argv[1] if len(sys.argv) > 1 else 512) * 1024 * 1024)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = distributed(
    f,
    gpus=2,
    gpu_type="cpu",
    tracking=False,
    stream_logs=False,
    **({"hang_timeout": None} if "hang" in sys.argv else {}),
).distributed(blob)
print(
    f"caller peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (with the 512 MiB argument: {base:.0f} MiB before the call); rank peaks {[round(x) for x in out]} MiB"
)
