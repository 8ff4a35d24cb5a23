#!/usr/bin/env bash
# Set up gpufleet in .venv and run the main job: DDP training of the MLP recipe on every GPU
# of this machine, or on 2 CPU worker processes (gloo) where there is none.
#
#   scripts/demo.sh                 # arguments go to recipes/pytorch-ddp-mlp/train.py (--epochs 5, --cpu)
#   DEMO_REINSTALL=1 scripts/demo.sh   # install again even when .venv already has what the demo needs
#
# Without an NVIDIA GPU it installs CPU builds of torch (scripts/pip_install.sh says which build
# it took and from where). It ends with where everything is: the run id, the run folder, each
# rank's log, the `mlflow ui` command that opens the MLflow store in use (GPUFLEET_HOME,
# MLFLOW_TRACKING_URI), and how to put .venv's commands on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
step() { printf '==> %s\n' "$*"; }
. scripts/pip_install.sh

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
if [ "${DEMO_REINSTALL:-0}" != 1 ] && .venv/bin/python -c "import gpufleet, torch, mlflow" 2>/dev/null; then
  step ".venv already has gpufleet, torch and mlflow (DEMO_REINSTALL=1 installs again)"
  say_torch_build .venv/bin/python .venv/demo-install-report.json \
    "$( [ -f .venv/demo-install-report.json ] || echo .venv/demo-install.log)"
else
  step "installing gpufleet[torch,mlflow] into .venv: a minute or more the first time (torch is large); the installer's full output: .venv/demo-install.log"
  ensure_uv .venv/bin/python  # uv, or pip where uv cannot be had
  pip_install .venv/bin/python .venv/demo-install.log -e ".[torch,mlflow]"
fi
step "running recipes/pytorch-ddp-mlp: DDP training on every GPU here, else on 2 CPU worker processes"
status=0
.venv/bin/python recipes/pytorch-ddp-mlp/train.py "$@" || status=$?
venv_bin="$PWD/.venv/bin"
case ":$PATH:" in
  *":$venv_bin:"*) ;;
  *) printf '\n.venv is not active in this shell: `gpufleet` and `mlflow` are in %s. To use them in any shell:\n  source %q\n' \
       "$venv_bin" "$venv_bin/activate" ;;
esac
exit "$status"
