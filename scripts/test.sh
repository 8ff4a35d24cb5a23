#!/usr/bin/env bash
# Set up gpufleet with every extra and the test tools in .venv, then run the whole test suite.
# The recipes' separate environments (cached by the hash of their requirements) build in the
# background meanwhile; the tests that run in them come last and wait for their build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. scripts/pip_install.sh  # CPU builds of torch without an NVIDIA GPU; says which build it took
pip_install .venv/bin/python .venv/test-install.log -e ".[all,test]"
scripts/setup_browser.sh  # Chromium for the live panel's browser test (root and apt only; else it skips)
build_recipe_envs() {  # each environment's output in LOGS/NAME.log, its exit status in LOGS/NAME.rc
  for env_name in $(ls recipes/envs 2>/dev/null | sed -n 's/\.txt$//p'); do
    local status=0
    nice -n 10 scripts/recipe_env.sh "$env_name" >"$1/$env_name.log" 2>&1 || status=$?  # the tests first
    echo "$status" >"$1/$env_name.rc"
  done
}
builder=""
if [ -x scripts/recipe_env.sh ] && [ "${GPUFLEET_SKIP_RECIPE_ENVS:-0}" != "1" ]; then
  build_logs="${GPUFLEET_RECIPE_ENVS_DIR:-$PWD/.venvs}/build-logs"
  mkdir -p "$build_logs" && rm -f "$build_logs"/*.rc
  set -m  # the build gets a process group of its own, so that a stop ends all of it
  build_recipe_envs "$build_logs" &
  builder=$!
  set +m
  trap 'kill -- -"$builder" 2>/dev/null || true; exit 130' INT TERM
  echo "test.sh: the recipe environments build in the background (logs: $build_logs)"
  export GPUFLEET_RECIPE_ENVS=1 GPUFLEET_RECIPE_ENV_LOGS="$build_logs"
fi
[ -x scripts/slurm_local.sh ] && scripts/slurm_local.sh ensure  # Slurm's packages for tests/slurm (root + apt only)
status=0
.venv/bin/python -m pytest "$@" || status=$?
[ -z "$builder" ] || wait "$builder" || true  # pytest's summary stays the last line printed
exit "$status"
