#!/usr/bin/env bash
# Run every recipe on 2 GPUs for ~30-60 s each with random-initialised weights
# of the real architectures (nothing is downloaded), printing throughput and peak memory.
#
#   bash recipes/run_gpu_smoke.sh [OUT_DIR]        # about 6-8 minutes on 2 x H200
#   VISION_PYTHON=... AXOLOTL_PYTHON=... bash recipes/run_gpu_smoke.sh   # + RetinaNet, Unsloth, Axolotl (~4 min)
#   ONLY="trl-lora-sft-fsdp2-moe fsdp-llama31-8b-sft" bash recipes/run_gpu_smoke.sh   # just these recipes
#
# Needs: torch (CUDA), transformers, trl, peft, accelerate, datasets, deepspeed, lightning, ray,
# nbclient, ipykernel, and gpufleet installed (pip install -e .).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/gpufleet-gpu-smoke}"
source "$repo/recipes/_smoke/gpu_common.sh"

echo "== building random-initialised models of the real architectures (scaled to fit 2 GPUs)"
"$py" - "$out" <<'PY'
import sys
sys.path.insert(0, ".")
from _smoke import make_chat_jsonl, make_tiny_causal_lm, make_ratings_csv, make_token_file, make_invoice_jsonl
out = sys.argv[1]
mid = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=8, max_position_embeddings=4096)
make_tiny_causal_lm("llama", f"{out}/llama-1b", **mid)                         # Llama-3.2-1B-like (vocab aside)
make_tiny_causal_lm("qwen2", f"{out}/qwen2-1b", **mid)
make_tiny_causal_lm("qwen3", f"{out}/qwen3-1b", **{**mid, "head_dim": 128})
make_tiny_causal_lm("gpt_oss", f"{out}/gpt-oss-small", hidden_size=1024, intermediate_size=1024,
                    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                    num_local_experts=16, num_experts_per_tok=4,
                    layer_types=["sliding_attention", "full_attention"] * 4)
make_tiny_causal_lm("qwen3_moe", f"{out}/qwen3-moe-small", hidden_size=1024, intermediate_size=2048,
                    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)
# long chat rows so each step carries real work
make_chat_jsonl(f"{out}/chat.jsonl", num_rows=4000)
make_invoice_jsonl(f"{out}/invoices.jsonl", num_rows=4000)
make_ratings_csv(f"{out}/ratings.csv", num_users=100000, num_items=20000, num_ratings=2_000_000)
make_token_file(f"{out}/tokens.bin", num_tokens=20_000_000, vocab_size=8192)
PY

nb trl-lora-sft-ddp MODEL="$out/gpt-oss-small" DATA="$out/chat.jsonl" MAX_STEPS=30 BATCH_SIZE=8 MAX_LENGTH=1024
nb trl-lora-sft-fsdp2-moe MODEL="$out/qwen3-moe-small" DATA="$out/chat.jsonl" MAX_STEPS=30 BATCH_SIZE=8 MAX_LENGTH=1024
nb trl-full-sft-zero3 MODEL="$out/llama-1b" DATA="$out/chat.jsonl" MAX_STEPS=30 BATCH_SIZE=8 MAX_LENGTH=1024
nb lightning-two-tower DATA="$out/ratings.csv" MAX_EPOCHS=2 BATCH_SIZE=8192 EMBEDDING_DIM=128
nb pytorch-fsdp2-transformer DATA="$out/tokens.bin" MAX_STEPS=200 CHECKPOINT_EVERY=100 BATCH_SIZE=32

wl fsdp-llama31-8b-sft parameters.model="$out/llama-1b" parameters.train_file="$out/chat.jsonl" \
  parameters.output_dir="$out/llama-fsdp" parameters.max_steps=30 parameters.per_device_batch_size=4 \
  parameters.gradient_accumulation_steps=1 parameters.max_length=1024 parameters.logging_steps=5 parameters.save_steps=1000
wl fsdp2-qwen-27b-packing parameters.model="$out/qwen2-1b" parameters.train_file="$out/chat.jsonl" \
  parameters.checkpoint_dir="$out/qwen-packing" parameters.max_steps=40 parameters.seq_len=4096 parameters.checkpoint_every=20
wl trl-zero3-qwen3-8b-invoices parameters.model="$out/qwen3-1b" parameters.raw_invoices="$out/invoices.jsonl" \
  parameters.prepared_dir="$out/invoices-prepared" parameters.output_dir="$out/invoices-out" parameters.max_steps=30 \
  parameters.max_length=1024 parameters.eval_steps=1000 parameters.logging_steps=5
wl ray-train-qwen25-3b-sft parameters.model="$out/qwen2-1b" parameters.train_file="$out/chat.jsonl" \
  parameters.output_dir="$out/ray-qwen" parameters.max_steps=30 parameters.max_length=1024

# Recipes of the separate environments. Each runs with the interpreter named below (default: the
# one above) and is skipped, with the reason, when that interpreter lacks the framework.
has() { "$1" -c "import $2" >/dev/null 2>&1; }
vision_py="${VISION_PYTHON:-$py}"     # torchvision + pycocotools (+ unsloth for the Unsloth recipe)
axolotl_py="${AXOLOTL_PYTHON:-$py}"   # axolotl 0.19.0 + bitsandbytes (CUDA)
if ! selected pytorch-ddp-retinanet; then :
elif has "$vision_py" "torchvision, pycocotools"; then
  "$vision_py" -c "import sys; sys.path.insert(0, '.'); from _smoke import make_coco_folder; make_coco_folder(sys.argv[1], num_images=512, size=640, num_categories=8)" "$out/coco"
  py="$vision_py" nb pytorch-ddp-retinanet DATA="$out/coco" IMAGE_SIZE=640 BATCH_SIZE=16 MAX_STEPS=40 NUM_WORKERS=6
else echo "== pytorch-ddp-retinanet skipped: $vision_py lacks torchvision or pycocotools (pip install pycocotools==2.0.11)"; fi
if ! selected unsloth-lora-sft-ddp; then :
elif has "$vision_py" unsloth; then  # the Llama-3.2-1B-like model above; MODEL=<a 3B Llama folder> for the real size
  py="$vision_py" nb unsloth-lora-sft-ddp MODEL="$out/llama-1b" DATA="$out/chat.jsonl" MAX_STEPS=30 BATCH_SIZE=8 MAX_LENGTH=1024
else echo "== unsloth-lora-sft-ddp skipped: $vision_py lacks unsloth (recipes/envs/vision.txt; VISION_PYTHON=...)"; fi
if ! selected axolotl-qlora-ddp; then :
elif has "$axolotl_py" "axolotl, bitsandbytes"; then  # a 1.1B OLMo-2 in 4-bit (QLoRA); MODEL=<OLMo-2 7B folder> for the real size
  "$axolotl_py" -c "import sys; sys.path.insert(0, '.'); from _smoke import make_tiny_causal_lm; make_tiny_causal_lm('olmo2', sys.argv[1], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)" "$out/olmo2-1b"
  py="$axolotl_py" nb axolotl-qlora-ddp MODEL="$out/olmo2-1b" DATA="$out/chat.jsonl" MAX_STEPS=30 MICRO_BATCH_SIZE=8 SEQUENCE_LEN=1024
else echo "== axolotl-qlora-ddp skipped: $axolotl_py lacks axolotl or bitsandbytes (recipes/envs/axolotl.txt; AXOLOTL_PYTHON=...)"; fi
echo "== done; logs and executed notebooks in $out"
smoke_exit
