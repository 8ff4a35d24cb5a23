#!/usr/bin/env bash
# Set up gpufleet with every extra and the test tools in .venv, build the recipes' separate
# environments (cached by the hash of their requirements), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -e ".[all,test]"
scripts/setup_browser.sh  # Chromium for the live panel's browser test (root and apt only; else it skips)
if [ -x scripts/recipe_env.sh ] && [ "${GPUFLEET_SKIP_RECIPE_ENVS:-0}" != "1" ]; then
  for env_name in $(ls recipes/envs 2>/dev/null | sed -n 's/\.txt$//p'); do
    scripts/recipe_env.sh "$env_name"
  done
  export GPUFLEET_RECIPE_ENVS=1
fi
exec .venv/bin/python -m pytest "$@"
