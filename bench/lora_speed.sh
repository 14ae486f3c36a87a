#!/usr/bin/env bash
# A LoRA step against a full fine-tuning step of the same model, batch and ranks: a fresh
# model of MODEL_CONFIG's shape (a Hugging Face config.json; default configs/models/
# llama-100m.json), fp32, AdamW, ZeRO stage 2 over RANKS thread ranks (default 2),
# micro-batch MICRO (default 2) of CONTEXT tokens (default 128), STEPS steps (default 5);
# LoRA r 16, alpha 32 on every linear layer. The two runs alternate REPEATS times (default
# 2) so that both sides see the machine alike. Each run's step time is the median of its
# steps after the first (the metrics lines' tokens/s, a step's own time without the
# validation after it); each pair prints LoRA's step as a fraction of full fine-tuning's.
# Token data and tokenizer: bench/lora_data.sh's (bench/lora_memory.sh uses the same), under $WORK.
# Usage: [RANKS=2] [MICRO=2] [STEPS=5] [REPEATS=2] bench/lora_speed.sh [MODEL_CONFIG] [CONTEXT]
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(realpath "${1:-configs/models/llama-100m.json}")"
context="${2:-128}"
ranks="${RANKS:-2}" micro="${MICRO:-2}" steps="${STEPS:-5}" repeats="${REPEATS:-2}"
work="${WORK:-/tmp/zerotrain-bench-lora}"
cargo build -q
bin="$PWD/target/debug/zerotrain"
mkdir -p "$work"
source bench/lora_data.sh
lora_data "$bin" "$work"
config() {
  local name="$1" lora="$2"
  cat > "$work/speed-$name.json" <<EOF
{"train_batch_size": $((ranks * micro)), "train_micro_batch_size_per_gpu": $micro,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
 "zero_optimization": {"stage": 2},
 "zerotrain": {"backend": "threads", "world_size": $ranks, "eval_every": 100000, "checkpoint_every": 100000$lora},
 "model": {"hf_config": "$model", "tokenizer": "$work/tokenizer.json", "block_size": $context}}
EOF
}
config full ""
config lora ', "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}'
# The median step time (ms) of a run's metrics lines after the first.
step_ms() {
  python3 - "$1" "$((ranks * micro * context))" <<'EOF'
import json, statistics, sys
rates = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])][1:]
print(f"{statistics.median(int(sys.argv[2]) / r * 1000 for r in rates):.0f}")
EOF
}
for repeat in $(seq "$repeats"); do
  declare -A ms=()
  for name in full lora; do
    rm -rf "$work/speed-run-$name"
    "$bin" train --config "$work/speed-$name.json" --data "$work/data.tokens" --steps "$steps" \
      --samples off --out "$work/speed-run-$name" > "$work/speed-$name.log" 2>&1 \
      || { echo "$name: failed"; tail -20 "$work/speed-$name.log"; exit 1; }
    ms[$name]=$(step_ms "$work/speed-run-$name/metrics.jsonl")
  done
  ratio=$(awk -v l="${ms[lora]}" -v f="${ms[full]}" 'BEGIN {printf "%.2f", l / f}')
  echo "repeat $repeat: step (median of steps 2..$steps) full fine-tuning ${ms[full]} ms, LoRA ${ms[lora]} ms: ${ratio}x"
  unset ms
done
