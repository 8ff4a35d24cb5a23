# Shared by recipes/run_gpu_smoke.sh and recipes/run_gpu_full_size.sh: sourced, not run.
# Before sourcing: repo (the checkout) and out (where logs go). Sets py, the environment and the
# working directory (recipes/), and defines `selected NAME`, `nb FOLDER ENV=VALUE...` and
# `wl FOLDER OVERRIDE...`. Each recipe that fails is counted in `failed`; `smoke_exit` (the scripts'
# last line) prints them and exits 1 when any failed.
# ACCELERATOR (default GPU_2xH200) is the accelerator type the workloads are submitted with, and
# NUM_ACCELERATORS (default 2) how many GPUs each recipe takes.
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONPATH="$repo/src:${PYTHONPATH:-}"
py="${PYTHON:-python}"
accelerator="${ACCELERATOR:-GPU_2xH200}"
num="${NUM_ACCELERATORS:-2}"
cd "$repo/recipes" || exit 1

failed=()
smoke_exit() {
  if [ ${#failed[@]} -gt 0 ]; then echo "== FAILED: ${failed[*]}"; exit 1; fi
  echo "== every selected recipe ran"
}

selected() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }

wl() {  # a workload folder, then overrides: `gpufleet run --watch` on $num accelerators, RESULT line or log tail
  local name="$1"; shift
  selected "$name" || return 0
  echo "== $name (gpufleet run, $accelerator)"
  local start=$(date +%s) args=()
  for o in "$@"; do args+=(--override "$o"); done
  (cd "$name" && gpufleet run -f workload.yaml --watch --no-tracking --override compute.accelerator_type="$accelerator" \
     --override compute.num_accelerators="$num" --override 'environment.dependencies=[]' "${args[@]}") > "$out/$name.log" 2>&1 \
    && grep -h "RESULT " "$out/$name.log" | tail -1 \
    || { echo "FAILED (see $out/$name.log)"; tail -20 "$out/$name.log"; failed+=("$name"); }
  echo "   wall $(( $(date +%s) - start ))s"
}

nb() {  # notebook, then env assignments
  local name="$1"; shift
  selected "$name" || return 0
  echo "== $name"
  local start=$(date +%s)
  env GPUS="$num" OUTPUT_DIR="$out/$name" "$@" "$py" _smoke/run_notebook.py "$name"/*.ipynb --out "$out/$name.executed.ipynb" \
    > "$out/$name.log" 2>&1 && "$py" -c "import json,sys; r=json.load(open(sys.argv[1])); r=r.get('second', r) if isinstance(r, dict) else r; print(json.dumps(r[0]))" "$out/$name/results.json" \
    || { echo "FAILED (see $out/$name.log)"; tail -20 "$out/$name.log"; failed+=("$name"); }
  echo "   wall $(( $(date +%s) - start ))s"
}
