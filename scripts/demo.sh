#!/usr/bin/env bash
# Set up gpufleet in .venv and run the main job: DDP training of the MLP recipe on every GPU
# of this machine, or on 2 CPU worker processes (gloo) where there is none.
#
#   scripts/demo.sh                 # arguments go to recipes/pytorch-ddp-mlp/train.py (--epochs 5, --cpu)
#   DEMO_REINSTALL=1 scripts/demo.sh   # run pip even when .venv already has what the demo needs
#
# It ends with where everything is: the run id, the run folder, each rank's log, and the
# `mlflow ui` command that opens the MLflow store in use (GPUFLEET_HOME, MLFLOW_TRACKING_URI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
step() { printf '==> %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
if [ "${DEMO_REINSTALL:-0}" != 1 ] && .venv/bin/python -c "import gpufleet, torch, mlflow" 2>/dev/null; then
  step ".venv already has gpufleet, torch and mlflow (DEMO_REINSTALL=1 installs again)"
else
  # torch>=2.6,<2.14 (the [torch] extra) keeps pip on the CPU build where one is available.
  log=.venv/demo-install.log
  step "installing gpufleet[torch,mlflow] into .venv: a few minutes the first time (torch is large); pip's full output: $log"
  set +e
  .venv/bin/python -m pip install --progress-bar off -e ".[torch,mlflow]" 2>&1 | tee "$log" \
    | grep --line-buffered -E '^ *(Collecting|Downloading|Using cached|Building|Installing|Successfully|ERROR)' \
    | sed -u -e 's/^ */    /' -e 's/ (from .*)$//'
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" != 0 ]; then
    echo "pip failed (exit code $status); its last lines (all of them in $log):" >&2
    tail -n 25 "$log" >&2
    exit "$status"
  fi
fi
step "running recipes/pytorch-ddp-mlp: DDP training on every GPU here, else on 2 CPU worker processes"
exec .venv/bin/python recipes/pytorch-ddp-mlp/train.py "$@"
