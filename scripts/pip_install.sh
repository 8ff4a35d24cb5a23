# pip install into an environment, the one way scripts/demo.sh, scripts/test.sh and
# scripts/recipe_env.sh do it (sourced by them, not run):
#
#   ensure_uv PYTHON                 # uv (the installer) into PYTHON's environment, where it can be had
#   pip_install PYTHON LOG PIP_ARGS...
#
# - the installer: uv (`uv pip install`, several times faster than pip) where it can be had:
#   GPUFLEET_UV, `uv` on PATH or next to PYTHON (ensure_uv puts uv $GPUFLEET_UV_VERSION there with
#   pip); pip where it cannot, or with GPUFLEET_INSTALLER=pip. uv is given pip's configuration
#   (indexes, find-links, constraints: scripts/uv_args.py) and pip's "best version over every
#   index" rule, so both resolve alike; a pure wheel uv took for another Python minor (uv 0.13.9
#   took multiprocess's py310 wheel on 3.11, which fails there) is replaced by pip's choice
#   (scripts/wheel_tags.py);
# - the torch build: scripts/torch_build.py picks it (CPU builds from PyTorch's CPU index on a
#   machine without an NVIDIA GPU, when that index can be reached), a line says so before pip
#   starts and one after it says which build was taken, from where (PIP_INSTALL_PREFIX, default
#   "==> ", starts these lines);
# - progress: a line per package pip collects, downloads or builds, one when it installs and one
#   when it is done, and "... pip still working (N s)" whenever pip has been quiet for 15 s;
# - the installer's whole output goes to LOG, pip's --report next to it (LOG without .log,
#   -report.json; uv's choices are read from LOG); on failure the last lines of LOG are printed
#   and the installer's exit code is returned.

_pip_install_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GPUFLEET_UV_VERSION=${GPUFLEET_UV_VERSION:-0.13.9}

# pip's lines -> a line per phase, and a heartbeat when pip is quiet (15 s, PIP_INSTALL_QUIET_S).
# With "uv" as its argument: uv's lines instead (resolved, downloading, prepared, installed, errors).
_pip_progress() {
  local start=$SECONDS line pending="" quiet=${PIP_INSTALL_QUIET_S:-15} n tool=${1:-pip}
  local pattern='^ *(Collecting|Downloading|Using cached|Processing|Building wheel for|Installing collected packages|Successfully installed|ERROR)'
  [ "$tool" = uv ] && pattern='^(Resolved|Downloading|Building|Built|Prepared|Uninstalled|Installed|Audited|error|warning)'
  grep --line-buffered -E "$pattern" \
    | sed -u -e 's/^ */    /' -e 's/ (from .*)$//' \
    | while :; do
        if IFS= read -r -t "$quiet" line; then
          line=$pending$line pending=""  # a line that came in pieces, a heartbeat between them
          case $line in
            "    Installing collected packages: "*)
              n=$(( $(printf '%s' "$line" | tr -cd ',' | wc -c) + 1 ))
              case ", ${line#*: }, " in
                *", torch, "*) line="    installing $n package(s) into the environment (torch takes a minute or more) ..." ;;
                *) line="    installing $n package(s) into the environment ..." ;;
              esac ;;
            "    Successfully installed "*)
              n=$(printf '%s' "${line#    Successfully installed }" | wc -w)
              line="    installed $n package(s)" ;;
          esac
          printf '%s\n' "$line"
        elif [ $? -gt 128 ]; then
          pending=$pending$line  # what came of a line before the timeout (read keeps it in line)
          printf '    ... %s still working (%d s)\n' "$tool" $(( SECONDS - start ))
        else
          break
        fi
      done
}

# The lines saying which torch build PYTHON's environment has (REPORT: pip's --report of its
# install; UV_LOG, when uv installed it: uv's verbose output).
say_torch_build() {
  local line from=(--pip-report "$2")
  [ -n "${3:-}" ] && from=(--uv-log "$3")
  "$1" "$_pip_install_dir/torch_build.py" describe "${from[@]}" | while IFS= read -r line; do
    printf '%s%s\n' "${PIP_INSTALL_PREFIX-==> }" "$line"
  done
}

# The uv that installs into PYTHON's environment, unless GPUFLEET_INSTALLER=pip, when there is one.
find_uv() {
  [ "${GPUFLEET_INSTALLER:-uv}" != uv ] && return 1
  local candidate
  for candidate in "${GPUFLEET_UV:-}" "$(command -v uv 2>/dev/null)" "$(dirname "$1")/uv"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] && { printf '%s\n' "$candidate"; return 0; }
  done
  return 1
}

# Put uv into PYTHON's environment with pip when none is found; quietly nothing when it cannot be
# had (pip_install then uses pip).
ensure_uv() {
  find_uv "$1" >/dev/null && return 0
  [ "${GPUFLEET_INSTALLER:-uv}" != uv ] && return 0
  "$1" -m pip install --quiet --disable-pip-version-check "uv==$GPUFLEET_UV_VERSION" >/dev/null 2>&1 \
    || printf '%suv %s could not be installed: pip installs instead\n' "${PIP_INSTALL_PREFIX-==> }" "$GPUFLEET_UV_VERSION"
  return 0
}

pip_install() {
  local - python=$1 log=$2 status choice uv
  shift 2
  local report="${log%.log}-report.json" lines=()
  choice=$("$python" "$_pip_install_dir/torch_build.py" pip-args) || return
  mapfile -t lines <<<"$choice"
  printf '%s%s\n' "${PIP_INSTALL_PREFIX-==> }" "${lines[0]}"
  rm -f "$report"
  if uv=$(find_uv "$python"); then
    _uv_install "$uv" "$python" "$log" "${lines[@]:1}" "$@"
    return
  fi
  set +e
  PYTHONUNBUFFERED=1 "$python" -m pip install --progress-bar off --report "$report" "${lines[@]:1}" "$@" 2>&1 \
    | tee "$log" | _pip_progress
  status=${PIPESTATUS[0]}
  if [ "$status" != 0 ]; then
    echo "pip failed (exit code $status); its last lines (all of them in $log):" >&2
    tail -n 25 "$log" >&2
    return "$status"
  fi
  say_torch_build "$python" "$report"
}

# uv pip install with pip's configuration (scripts/uv_args.py); its verbose output to LOG.
# --compile-bytecode: the .pyc files pip writes as it installs, which uv leaves out by default.
# Without them the first process to import each module compiles it, and where
# PYTHONDONTWRITEBYTECODE is set every process does so again (every rank's `import torch`).
_uv_install() {
  local - uv=$1 python=$2 log=$3 status line args=() envs=()
  shift 3
  while IFS= read -r line; do
    case $line in
      env:*) envs+=("${line#env:}") ;;
      ?*) args+=("$line") ;;
    esac
  done < <("$python" "$_pip_install_dir/uv_args.py")
  printf '%sinstalling with %s (%s)\n' "${PIP_INSTALL_PREFIX-==> }" "$uv" "$("$uv" --version 2>/dev/null)"
  set +e
  { echo "$uv pip install --python $python -v --compile-bytecode ${args[*]} $*"
    env "${envs[@]}" "$uv" pip install --python "$python" -v --compile-bytecode "${args[@]}" "$@" 2>&1; } \
    | tee "$log" | _pip_progress uv
  status=${PIPESTATUS[0]}
  if [ "$status" != 0 ]; then
    echo "uv failed (exit code $status); its last lines (all of them in $log):" >&2
    grep -v '^DEBUG ' "$log" | tail -n 25 >&2
    return "$status"
  fi
  _pip_replaces_foreign_wheels "$python" "$log"
  say_torch_build "$python" "" "$log"
}

# uv can take a pure wheel built for another Python minor (multiprocess's py310 wheel on 3.11,
# which fails there); pip puts the one for this Python in its place (scripts/wheel_tags.py).
_pip_replaces_foreign_wheels() {
  local python=$1 log=$2 wrong=()
  mapfile -t wrong < <("$python" "$_pip_install_dir/wheel_tags.py")
  [ "${#wrong[@]}" -gt 0 ] && [ -n "${wrong[0]}" ] || return 0
  printf '%s%s: a wheel for another Python; pip installs the one for this Python\n' "${PIP_INSTALL_PREFIX-==> }" "${wrong[*]}"
  "$python" -m pip install --quiet --no-deps --force-reinstall "${wrong[@]}" >>"$log" 2>&1 \
    || printf '%spip could not replace %s (kept; see %s)\n' "${PIP_INSTALL_PREFIX-==> }" "${wrong[*]}" "$log"
  return 0
}
