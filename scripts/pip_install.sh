# pip install into an environment, the one way scripts/demo.sh, scripts/test.sh and
# scripts/recipe_env.sh do it (sourced by them, not run):
#
#   pip_install PYTHON LOG PIP_ARGS...
#
# - the torch build: scripts/torch_build.py picks it (CPU builds from PyTorch's CPU index on a
#   machine without an NVIDIA GPU, when that index can be reached), a line says so before pip
#   starts and one after it says which build was taken, from where (PIP_INSTALL_PREFIX, default
#   "==> ", starts these lines);
# - progress: a line per package pip collects, downloads or builds, one when it installs and one
#   when it is done, and "... pip still working (N s)" whenever pip has been quiet for 15 s;
# - pip's whole output goes to LOG, its --report next to it (LOG without .log, -report.json); on
#   failure the last lines of LOG are printed and pip's exit code is returned.

_pip_install_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# pip's lines -> a line per phase, and a heartbeat when pip is quiet (15 s, PIP_INSTALL_QUIET_S).
_pip_progress() {
  local start=$SECONDS line quiet=${PIP_INSTALL_QUIET_S:-15} n
  grep --line-buffered -E '^ *(Collecting|Downloading|Using cached|Processing|Building wheel for|Installing collected packages|Successfully installed|ERROR)' \
    | sed -u -e 's/^ */    /' -e 's/ (from .*)$//' \
    | while :; do
        if IFS= read -r -t "$quiet" line; then
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
          printf '    ... pip still working (%d s)\n' $(( SECONDS - start ))
        else
          break
        fi
      done
}

# The lines saying which torch build PYTHON's environment has (REPORT: pip's --report of its install).
say_torch_build() {
  local line
  "$1" "$_pip_install_dir/torch_build.py" describe --pip-report "$2" | while IFS= read -r line; do
    printf '%s%s\n' "${PIP_INSTALL_PREFIX-==> }" "$line"
  done
}

pip_install() {
  local - python=$1 log=$2 status choice
  shift 2
  local report="${log%.log}-report.json" lines=()
  choice=$("$python" "$_pip_install_dir/torch_build.py" pip-args) || return
  mapfile -t lines <<<"$choice"
  printf '%s%s\n' "${PIP_INSTALL_PREFIX-==> }" "${lines[0]}"
  rm -f "$report"
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
