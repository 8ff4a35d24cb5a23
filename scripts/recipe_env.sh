#!/usr/bin/env bash
# Create (or reuse) the separate Python environment of recipes that cannot share the main one.
#
#   bash scripts/recipe_env.sh NAME      # NAME: a file recipes/envs/NAME.txt (vision, axolotl)
#
# The environment goes to ${GPUFLEET_RECIPE_ENVS_DIR:-.venvs}/NAME with gpufleet installed
# editable plus the pinned requirements. A stamp file holding the requirements' hash makes a
# second call a no-op; a changed requirements file rebuilds it.
set -euo pipefail

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
  exit 0
fi
start=$(date +%s)
echo "recipe_env: building $env_dir from $reqs"
rm -rf "$env_dir"
mkdir -p "$root"
"$python" -m venv "$env_dir"
"$env_dir/bin/pip" install --quiet --upgrade pip
# One resolve for everything, so pip never swaps torch for a CUDA build behind our back.
"$env_dir/bin/pip" install --quiet -r "$reqs" -e "$repo"
touch "$stamp"
echo "recipe_env: $name ready in $(( $(date +%s) - start ))s ($(du -sh "$env_dir" | cut -f1))"
