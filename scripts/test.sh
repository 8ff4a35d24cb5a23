#!/usr/bin/env bash
# Set up gpufleet with every extra and the test tools in .venv, then run the whole test suite.
# The recipes' separate environments (cached by the hash of their requirements) build in the
# background meanwhile; the tests that run in them come last and wait for their build.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python may keep what it compiles: with PYTHONDONTWRITEBYTECODE (set in some CI environments)
# each of the suite's hundreds of processes compiles gpufleet's modules and the tests anew
unset PYTHONDONTWRITEBYTECODE
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. scripts/pip_install.sh  # CPU builds of torch without an NVIDIA GPU; says which build it took
phase_start=$SECONDS
phase() { echo "test.sh: $1 took $(( SECONDS - phase_start )) s"; phase_start=$SECONDS; }
ensure_uv .venv/bin/python  # uv, the installer, where it can be had (pip where not, or GPUFLEET_INSTALLER=pip)
pip_install .venv/bin/python .venv/test-install.log -e ".[all,test]"
GPUFLEET_UV=$(find_uv .venv/bin/python) && export GPUFLEET_UV  # the recipe environments use the same uv
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
phase "installing, and the browser's and Slurm's packages"
# Two phases. First every test but those of a machine-wide cluster, on pytest-xdist workers, one
# per core up to 2 (GPUFLEET_TEST_WORKERS=N for N, 0 for one process), each with a GPUFLEET_HOME of
# its own; `--dist loadgroup` keeps each module on one worker (tests/conftest.py). Then the tests
# of Ray's and Slurm's clusters (marker `cluster`), with the machine to themselves (a Ray node whose
# agent does not start within Ray's fixed 15 s is lost on a busy machine): Ray's on one worker,
# Slurm's on the other (each cluster is one xdist group); both mostly wait on their cluster.
# A `-m` of the caller's runs one pytest with it.
# torch's JIT extensions (DeepSpeed's shared-memory op: two minutes of both cores to build) build
# once for the whole run, in a folder of its own that both phases share (tests/conftest.py keeps a
# folder given here); removed at the end
own_ext_dir=""
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
  own_ext_dir=$(mktemp -d "${TMPDIR:-/tmp}/gpufleet-test-torch-ext-XXXXXX")
  export TORCH_EXTENSIONS_DIR=$own_ext_dir
fi
cores=$(nproc 2>/dev/null || echo 1)
workers=${GPUFLEET_TEST_WORKERS:-$(( cores < 2 ? 0 : 2 ))}
case $workers in ''|*[!0-9]*) echo "test.sh: GPUFLEET_TEST_WORKERS=$workers is not a number of workers (e.g. 2, or 0 for one process)" >&2; exit 2 ;; esac
xdist=()
[ "$workers" -gt 0 ] && xdist=(-n "$workers" --dist loadgroup)
own_marks=0
for arg in "$@"; do case $arg in -m|-m*) own_marks=1 ;; esac; done
status=0
if [ "$own_marks" = 1 ]; then
  .venv/bin/python -m pytest "${xdist[@]}" "$@" || status=$?
else
  first=0 second=0
  .venv/bin/python -m pytest "${xdist[@]}" -m "not cluster" "$@" || first=$?
  phase "pytest, all but the clusters' tests"
  .venv/bin/python -m pytest "${xdist[@]}" -m cluster "$@" || second=$?
  phase "pytest, the clusters' tests (Ray, Slurm)"
  # 5: that phase had no test to run (a path without cluster tests, or only those)
  if [ "$first" = 5 ] && [ "$second" = 5 ]; then status=5
  elif [ "$first" != 0 ] && [ "$first" != 5 ]; then status=$first
  elif [ "$second" != 0 ] && [ "$second" != 5 ]; then status=$second
  fi
fi
[ -z "$own_ext_dir" ] || rm -rf "$own_ext_dir"
[ -z "$builder" ] || wait "$builder" || true  # pytest's summary stays the last line printed
exit "$status"
