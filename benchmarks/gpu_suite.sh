#!/usr/bin/env bash
# The GPU measurements recorded in docs/benchmarks.md, in the order they were run.
#   benchmarks/gpu_suite.sh OUTDIR launch|strategies|strategies-ddp|checkpoint|recipes
# Needs a machine with 2+ NVIDIA GPUs and gpufleet importable (PYTHONPATH=src works).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUTDIR PART}
part=${2:?PART: launch, strategies, strategies-ddp, checkpoint or recipes}
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
esac
