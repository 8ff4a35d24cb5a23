#!/usr/bin/env bash
# The two 8B CLI recipes at their real architecture's size on 2 GPUs (random-initialised weights;
# nothing is downloaded): Llama-3.1-8B shape under FSDP2, Qwen3-8B shape under DeepSpeed ZeRO-3.
# The vocabulary is the local tokenizer's (a few hundred words) instead of the 128k/152k of the
# real checkpoints, so the models have about 7B parameters instead of 8B.
#
#   bash recipes/run_gpu_full_size.sh [OUT_DIR]      # about 6 minutes on 2 x H200
#   ONLY=fsdp-llama31-8b-sft bash recipes/run_gpu_full_size.sh   # just one of them
#
# Needs: torch (CUDA), transformers, trl, peft, accelerate, datasets, deepspeed, and gpufleet.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/gpufleet-gpu-full}"
source "$repo/recipes/_smoke/gpu_common.sh"

build() {  # name arch config...: a bf16 model of the real shape, initialised on the GPU
  local dest="$out/$1" arch="$2"; shift 2
  [ -f "$dest/config.json" ] && return 0
  "$py" -c "import sys, json; sys.path.insert(0, '.'); from _smoke import make_tiny_causal_lm; \
make_tiny_causal_lm(sys.argv[1], sys.argv[2], dtype='bfloat16', device='cuda', **json.loads(sys.argv[3]))" "$arch" "$dest" "$*"
}
"$py" -c "import sys; sys.path.insert(0, '.'); from _smoke import make_chat_jsonl, make_invoice_jsonl; \
make_chat_jsonl(sys.argv[1] + '/chat.jsonl', num_rows=2000); make_invoice_jsonl(sys.argv[1] + '/invoices.jsonl', num_rows=2000)" "$out"

if selected fsdp-llama31-8b-sft; then
  build llama-8b llama '{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192}'
  wl fsdp-llama31-8b-sft parameters.model="$out/llama-8b" parameters.train_file="$out/chat.jsonl" \
    parameters.output_dir="$out/llama-fsdp" parameters.max_steps=20 parameters.per_device_batch_size=4 \
    parameters.gradient_accumulation_steps=1 parameters.max_length=2048 parameters.logging_steps=5 parameters.save_steps=1000
fi
if selected trl-zero3-qwen3-8b-invoices; then
  build qwen3-8b qwen3 '{"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192}'
  wl trl-zero3-qwen3-8b-invoices parameters.model="$out/qwen3-8b" parameters.raw_invoices="$out/invoices.jsonl" \
    parameters.prepared_dir="$out/invoices-prepared" parameters.output_dir="$out/invoices-out" parameters.max_steps=20 \
    parameters.max_length=2048 parameters.eval_steps=1000 parameters.logging_steps=5
fi
echo "== done; logs in $out"
