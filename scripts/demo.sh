#!/usr/bin/env bash
# Set up gpufleet in .venv and run the main job: DDP training of the MLP recipe on every GPU
# of this machine, or on 2 CPU worker processes (gloo) where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch>=2.6,<2.14 (the [torch] extra) keeps pip on the CPU build where one is available.
.venv/bin/python -m pip install -q -e ".[torch,mlflow]"
exec .venv/bin/python recipes/pytorch-ddp-mlp/train.py "$@"
