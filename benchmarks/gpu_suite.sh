#!/usr/bin/env bash
# The GPU measurements recorded in docs/benchmarks.md, in the order they were run.
#   benchmarks/gpu_suite.sh OUTDIR launch|strategies|strategies-ddp|checkpoint|recipes|engines
# Needs a machine with 2+ NVIDIA GPUs (engines: 1) and gpufleet importable (PYTHONPATH=src works).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUTDIR PART}
part=${2:?PART: launch, strategies, strategies-ddp, checkpoint, recipes or engines}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 GPUFLEET_HOME=${GPUFLEET_HOME:-/tmp/gpufleet-home}
py=${PYTHON:-python3}
step() { echo; echo "=== $* ($(date +%T))"; }
case "$part" in
  launch)
    step nvidia-smi; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    step doctor; $py -m gpufleet.cli doctor
    step hello; $py benchmarks/hello_gpus.py
    step gpu tests; $py -m pytest -q -m gpu tests/gpu tests/tracking/test_gpu_metrics.py -p no:cacheprovider 2>&1 | tail -15
    step mlp recipe; $py recipes/pytorch-ddp-mlp/train.py --epochs 40 2>&1 | tail -4
    step launch latency; $py benchmarks/launch_latency.py --gpus 2 --rounds 3 --json "$out/launch_latency.json"
    step data wait; timeout 120 $py benchmarks/data_wait.py 2>&1 | tail -20
    ;;
  checkpoint)
    step checkpoint; timeout 420 $py benchmarks/checkpoint.py --gpus 2 --saves 1 --dir /tmp/ckpt-bench --json "$out/checkpoint.json" > "$out/checkpoint.log" 2>&1; tail -25 "$out/checkpoint.log"
    ;;
  strategies)
    # 1.0B GPT, micro-batch 32, torch.compile on both sides (about 8 minutes)
    step strategies; timeout 590 $py benchmarks/strategies.py --gpus 2 --size 1b --micro-batch 32 --steps 30 --compile \
      --ddp-bucket-mb 100 --ddp-static-graph --json "$out/strategies.json" 2>&1 | grep -v Warning | tail -14
    ;;
  strategies-ddp)
    # DDP scaling with twice the work per all-reduce (about 3 minutes)
    step strategies-ddp; timeout 590 $py benchmarks/strategies.py --gpus 2 --size 1b --micro-batch 64 --steps 20 --compile \
      --ddp-bucket-mb 100 --ddp-static-graph --only single,ddp --json "$out/strategies-ddp.json" 2>&1 | grep -v Warning | tail -10
    ;;
  recipes)
    step recipes; bash recipes/run_gpu_smoke.sh "$out" 2>&1 | tail -60
    ;;
  engines)
    # the local engine on one GPU: a call, warm ranks, the lease hand-off, two workloads on one GPU, a detached
    # call (its handle from another process, gpufleet wait), a workload recipe
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    case "$name" in *H200*) acc=GPU_1xH200 ;; *) acc=GPU_1xH100 ;; esac
    step hello; $py benchmarks/hello_gpus.py 2>&1 | tail -2
    step warm; $py - <<'PY'
import os, time
from gpufleet import distributed, shutdown_workers
def where():
    import torch
    x = torch.ones(1024, 1024, device="cuda")
    return os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.get_device_name(0), float((x @ x).sum())
f = distributed(where, gpus=1, keep_warm=60)
for i in range(2):
    t = time.perf_counter(); r = f.distributed(); print(f"call {i + 1}: {r} in {time.perf_counter() - t:.2f} s")
print("warm groups stopped:", shutdown_workers())
PY
    step lease hand-off; timeout 300 $py benchmarks/lease_handoff.py --gpu --rounds 3 2>&1 | tail -8
    step two workloads on one GPU
    mkdir -p "$out/wl"
    printf 'experiment_name: lease-check\ncompute: {accelerator_type: %s, num_accelerators: 1}\ncommand: |\n  python3 -c "import os, torch, time; x = torch.ones(4096, 4096, device=\x27cuda\x27); print(\x27gpus\x27, os.environ[\x27CUDA_VISIBLE_DEVICES\x27], float((x @ x).sum())); time.sleep(8)"\n' "$acc" > "$out/wl/w.yaml"
    a=$(cd "$out/wl" && $py -m gpufleet.cli run -f w.yaml --no-tracking | tail -1); sleep 3
    b=$(cd "$out/wl" && $py -m gpufleet.cli run -f w.yaml --no-tracking | tail -1); sleep 4
    $py -m gpufleet.cli ps 2>&1 | tail -5
    for r in $a $b; do $py -m gpufleet.cli logs "$r" --follow 2>&1 | tail -2; $py -m gpufleet.cli get "$r" 2>&1 | grep -i state; done
    step detached call; rid=$($py - <<'PY'
import os, sys, time
from gpufleet import distributed
def where():
    import torch
    x = torch.ones(1024, 1024, device="cuda")
    return os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.get_device_name(0), float((x @ x).sum())
t = time.perf_counter(); h = distributed(where, gpus=1, tracking=False).submit(detach=True)
print(f"submitted in {time.perf_counter() - t:.2f} s", file=sys.stderr); print(h.run_id)
PY
)
    t0=$(date +%s.%N); $py -m gpufleet.cli wait "$rid"; rc=$?
    echo "wait rc=$rc after $($py -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$t0") s"
    $py -c "import sys; from gpufleet import run_handle; h = run_handle(sys.argv[1]); print(h.status, h.result(60))" "$rid"
    $py -m gpufleet.cli get "$rid" -o json | $py -c "import json, sys; r = json.load(sys.stdin); print(r['state'], r['placement'], [(a['attempt'], a['state']) for a in r['attempts']])"
    step workload recipe; ONLY=fsdp2-qwen-27b-packing ACCELERATOR=$acc NUM_ACCELERATORS=1 bash recipes/run_gpu_smoke.sh "$out/smoke" 2>&1 | tail -4
    ;;
esac
