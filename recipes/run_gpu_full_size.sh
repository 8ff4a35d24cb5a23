#!/usr/bin/env bash
# Every language-model recipe at the largest size of its real architecture that fits two GPUs
# (random-initialised bf16 weights built on the GPU; nothing is downloaded), printing each
# recipe's RESULT: throughput and peak memory per GPU.
#
#   bash recipes/run_gpu_full_size.sh [OUT_DIR]                    # every recipe below, in turn
#   ONLY=fsdp-llama31-8b-sft bash recipes/run_gpu_full_size.sh     # just one of them
#
#   recipe                        shape on 2 GPUs (real model)        strategy
#   fsdp-llama31-8b-sft           Llama-3.1-8B                        FSDP2, full SFT
#   trl-zero3-qwen3-8b-invoices   Qwen3-8B                            DeepSpeed ZeRO-3, full SFT
#   fsdp2-qwen-27b-packing        Qwen3-14B (27-32B needs > 2 GPUs)   FSDP2, full SFT, packing
#   trl-lora-sft-ddp              GPT-OSS-20B (bf16 experts)          DDP, LoRA
#   trl-lora-sft-fsdp2-moe        Qwen3-30B-A3B (128 experts)         FSDP2, LoRA
#   unsloth-lora-sft-ddp          Llama-3.2-3B                        DDP, LoRA (Unsloth)
#   ray-train-qwen25-3b-sft       Qwen2.5-3B                          Ray Train DDP, full SFT
#   axolotl-qlora-ddp             OLMo-2-7B                           DDP, QLoRA (Axolotl, 4-bit)
#
# The vocabulary is the local tokenizer's (a few hundred words) instead of the 100k-200k of the real
# checkpoints, so each model has its real layers but 0.3-1.2B fewer embedding parameters. Each chat
# row has two messages of 950 words (about 1,910 tokens): sequences near the 2,048 of the runs.
# Models are written under MODELS_DIR (default /tmp/gpufleet-models) and removed after their run
# (KEEP_MODELS=1 keeps them); the largest is about 61 GB.
#
# Needs: torch (CUDA), transformers, trl, peft, accelerate, datasets, deepspeed, nbclient, ipykernel,
# and gpufleet; Ray for the Ray Train recipe, Unsloth and Axolotl (+ bitsandbytes) for theirs: each
# runs with PYTHON, and the separate stacks are picked with PYTHON=... per call (see recipes/envs).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/gpufleet-gpu-full}"
models="${MODELS_DIR:-/tmp/gpufleet-models}"
source "$repo/recipes/_smoke/gpu_common.sh"
mkdir -p "$models"

build() {  # name arch json-config: a bf16 model of the real shape, initialised on the GPU
  local dest="$models/$1"
  [ -f "$dest/config.json" ] && return 0
  echo "   building $1 ($2)"
  "$py" -c "import sys, json; sys.path.insert(0, '.'); from _smoke import make_tiny_causal_lm; \
make_tiny_causal_lm(sys.argv[1], sys.argv[2], dtype='bfloat16', device='cuda', **json.loads(sys.argv[3]))" "$2" "$dest" "$3"
}
done_with() { [ "${KEEP_MODELS:-0}" = 1 ] || rm -rf "${models:?}/$1"; }
"$py" -c "import sys; sys.path.insert(0, '.'); from _smoke import make_chat_jsonl, make_invoice_jsonl; \
make_chat_jsonl(sys.argv[1] + '/chat.jsonl', num_rows=2000, words_per_message=950); make_invoice_jsonl(sys.argv[1] + '/invoices.jsonl', num_rows=2000)" "$out"

if selected fsdp-llama31-8b-sft; then
  build llama-8b llama '{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192}'
  wl fsdp-llama31-8b-sft parameters.model="$models/llama-8b" parameters.train_file="$out/chat.jsonl" \
    parameters.output_dir="$out/llama-fsdp" parameters.max_steps=20 parameters.per_device_batch_size=4 \
    parameters.gradient_accumulation_steps=1 parameters.max_length=2048 parameters.logging_steps=5 parameters.save_steps=1000
  done_with llama-8b; rm -rf "$out/llama-fsdp"
fi
if selected trl-zero3-qwen3-8b-invoices; then
  build qwen3-8b qwen3 '{"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192}'
  wl trl-zero3-qwen3-8b-invoices parameters.model="$models/qwen3-8b" parameters.raw_invoices="$out/invoices.jsonl" \
    parameters.prepared_dir="$out/invoices-prepared" parameters.output_dir="$out/invoices-out" parameters.max_steps=20 \
    parameters.max_length=2048 parameters.eval_steps=1000 parameters.logging_steps=5
  done_with qwen3-8b; rm -rf "$out/invoices-out"
fi
if selected fsdp2-qwen-27b-packing; then  # 13.2B x (bf16 weights, grads, AdamW) / 2 GPUs: about 62 GiB each
  build qwen3-14b qwen3 '{"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192}'
  wl fsdp2-qwen-27b-packing parameters.model="$models/qwen3-14b" parameters.train_file="$out/chat.jsonl" \
    parameters.checkpoint_dir="$out/qwen-packing" parameters.max_steps=12 parameters.seq_len=8192 parameters.checkpoint_every=0
  done_with qwen3-14b
fi
if selected trl-lora-sft-ddp; then  # a whole bf16 copy per GPU (about 40 GB)
  build gpt-oss-20b gpt_oss '{"hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]}'
  nb trl-lora-sft-ddp MODEL="$models/gpt-oss-20b" DATA="$out/chat.jsonl" MAX_STEPS=12 BATCH_SIZE=2 MAX_LENGTH=2048
  done_with gpt-oss-20b
fi
if selected trl-lora-sft-fsdp2-moe; then  # 30.5B, sharded: about 30 GB of weights per GPU
  build qwen3-30b-a3b qwen3_moe '{"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true, "max_position_embeddings": 8192}'
  nb trl-lora-sft-fsdp2-moe MODEL="$models/qwen3-30b-a3b" DATA="$out/chat.jsonl" MAX_STEPS=12 BATCH_SIZE=2 MAX_LENGTH=2048
  done_with qwen3-30b-a3b
fi
if selected unsloth-lora-sft-ddp; then
  build llama-3b llama '{"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": true, "max_position_embeddings": 8192}'
  nb unsloth-lora-sft-ddp MODEL="$models/llama-3b" DATA="$out/chat.jsonl" MAX_STEPS=20 BATCH_SIZE=4 MAX_LENGTH=2048
  done_with llama-3b
fi
if selected ray-train-qwen25-3b-sft; then
  build qwen2-3b qwen2 '{"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": true, "max_position_embeddings": 8192}'
  wl ray-train-qwen25-3b-sft parameters.model="$models/qwen2-3b" parameters.train_file="$out/chat.jsonl" \
    parameters.output_dir="$out/ray-qwen" parameters.max_steps=20 parameters.per_device_batch_size=4 parameters.max_length=2048
  done_with qwen2-3b; rm -rf "$out/ray-qwen"
fi
if selected axolotl-qlora-ddp; then  # loaded in 4-bit (NF4) by bitsandbytes: about 5 GB of weights per GPU
  build olmo2-7b olmo2 '{"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096}'
  nb axolotl-qlora-ddp MODEL="$models/olmo2-7b" DATA="$out/chat.jsonl" MAX_STEPS=10
  done_with olmo2-7b
fi
echo "== done; logs in $out"
smoke_exit
