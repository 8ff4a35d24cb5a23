#!/usr/bin/env bash
# Create (or reuse) the separate Python environment of recipes that cannot share the main one.
#
#   bash scripts/recipe_env.sh NAME      # NAME: a file recipes/envs/NAME.txt (vision, axolotl)
#
# The environment goes to ${GPUFLEET_RECIPE_ENVS_DIR:-.venvs}/NAME with gpufleet installed
# editable plus the pinned requirements. A stamp file holding the requirements' hash makes a
# second call a no-op (it says which torch build the environment has); a changed requirements
# file rebuilds it. Without an NVIDIA GPU torch and torchvision are CPU builds where PyTorch's CPU
# index can be reached (scripts/torch_build.py); the build taken is said either way.
set -euo pipefail
. "$(dirname "$0")/pip_install.sh"

name="${1:?usage: scripts/recipe_env.sh NAME (one of: $(ls "$(dirname "$0")/../recipes/envs" | sed 's/\.txt$//' | tr '\n' ' '))}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
reqs="$repo/recipes/envs/$name.txt"
[ -f "$reqs" ] || { echo "recipe_env: no requirements file $reqs" >&2; exit 2; }
root="${GPUFLEET_RECIPE_ENVS_DIR:-$repo/.venvs}"
env_dir="$root/$name"
python="${PYTHON:-python3}"
hash="$(cat "$reqs" "$repo/pyproject.toml" | sha256sum | cut -c1-16)"
stamp="$env_dir/.gpufleet-recipe-env-$hash"

if [ -f "$stamp" ]; then
  echo "recipe_env: $env_dir is up to date ($hash)"
  PIP_INSTALL_PREFIX="recipe_env: " say_torch_build "$env_dir/bin/python" "$env_dir/pip-install-report.json" \
    "$( [ -f "$env_dir/pip-install-report.json" ] || echo "$env_dir/pip-install.log")"
  exit 0
fi
start=$(date +%s)
echo "recipe_env: building $env_dir from $reqs"
rm -rf "$env_dir"
mkdir -p "$root"
if uv=$(find_uv "$python"); then  # GPUFLEET_UV (scripts/test.sh passes its own) or uv on PATH
  "$uv" venv --quiet --seed --python "$python" "$env_dir"  # with pip, without running ensurepip
else
  "$python" -m venv "$env_dir"
  ensure_uv "$env_dir/bin/python"  # the installer: uv where it can be had
  find_uv "$env_dir/bin/python" >/dev/null || "$env_dir/bin/pip" install --quiet --upgrade pip
fi
# One resolve for everything, so pip never swaps torch for a CUDA build behind our back; without
# an NVIDIA GPU it takes CPU builds of torch and torchvision (scripts/pip_install.sh).
PIP_INSTALL_PREFIX="recipe_env: " pip_install "$env_dir/bin/python" "$env_dir/pip-install.log" -r "$reqs" -e "$repo"
touch "$stamp"
echo "recipe_env: $name ready in $(( $(date +%s) - start ))s ($(du -sh "$env_dir" | cut -f1))"
