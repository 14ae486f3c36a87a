#!/usr/bin/env bash
# A LoRA run's memory per process with the frozen base sharded at stage 3: TinyLlama-1.1B's
# shape (configs/models/llama-1b.json; a checkpoint of random bf16 weights that
# bench/random_checkpoint.py writes once under $WORK), LoRA r 16 on every linear layer,
# bf16, context 512, micro-batch 1, NPROC processes (`zerotrain launch`; default 2), STEPS
# steps (default 2). Three runs: the bf16 base's shards in memory, on NVMe (max_in_cpu 0; swap files under
# $NVME, default /tmp/zerotrain-bench-swap), and in NF4 in memory (`quantize: "nf4"`).
# For each: every process's peak resident size (VmHWM, sampled every 0.2 s until it ends),
# the engine's count of the frozen bytes rank 0 holds (the summary's `frozen` column), and
# the run's seconds and tokens/s (the first step, which reads or draws the base, included),
# and, as each step's metrics line is written, the seconds since the start and the bytes
# each process has read from storage so far (/proc/PID/io `read_bytes`: the swap files
# are read with O_DIRECT, so every byte read from NVMe is counted, none served by the page
# cache). $WORK/NAME.rss keeps each process's resident size and bytes read over time
# (seconds, pid, KiB, bytes).
# Usage: [VARIANTS="nvme nf4"] [NPROC=1] bench/lora_memory.sh [MODEL_CONFIG] [STEPS] [CONTEXT]; another model shape by its
# Hugging Face config.json.
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(realpath "${1:-configs/models/llama-1b.json}")"
steps="${2:-2}"
context="${3:-512}"
nproc="${NPROC:-2}"
nvme="${NVME:-/tmp/zerotrain-bench-swap}"
work="${WORK:-/tmp/zerotrain-bench-lora}"
cargo build -q
bin="$PWD/target/debug/zerotrain"
mkdir -p "$work"
ckpt="$work/ckpt-$(basename "$model" .json)"
if [ ! -f "$ckpt/model.safetensors" ]; then
  python3 bench/random_checkpoint.py "$model" "$ckpt"
fi
source bench/lora_data.sh
lora_data "$bin" "$work"
config() {
  local name="$1" offload="$2" quantize="$3"
  cat > "$work/$name.json" <<EOF
{"train_batch_size": $nproc, "train_micro_batch_size_per_gpu": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
 "bf16": {"enabled": true},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100000$offload},
 "activation_checkpointing": {},
 "zerotrain": {"world_size": $nproc, "eval_every": 100000, "checkpoint_every": 100000, "comm_timeout_s": 1800,
   "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"$quantize}},
 "model": {"hf_dir": "$ckpt", "tokenizer": "$work/tokenizer.json", "block_size": $context}}
EOF
}
config memory "" ""
config nvme ", \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"$nvme\", \"max_in_cpu\": 0}" ""
config nf4 "" ", \"quantize\": \"nf4\""
for name in ${VARIANTS:-memory nvme nf4}; do
  rm -rf "$work/run-$name" "$nvme" "$work/$name.rss"
  "$bin" launch --nproc-per-node "$nproc" -- train --config "$work/$name.json" --data "$work/data.tokens" \
    --steps "$steps" --out "$work/run-$name" > "$work/$name.log" 2>&1 &
  launcher=$!
  declare -A peak=() read=()
  start=$SECONDS steps_seen=0
  while kill -0 "$launcher" 2> /dev/null; do
    for pid in $(pgrep -P "$launcher" || true); do
      kib=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status" 2> /dev/null || true)
      if [ -n "$kib" ]; then peak[$pid]=$kib; fi
      bytes=$(awk '/^read_bytes:/ {print $2}' "/proc/$pid/io" 2> /dev/null || true)
      if [ -n "$bytes" ]; then read[$pid]=$bytes; fi
      awk -v t="$SECONDS" -v p="$pid" -v b="${bytes:-0}" '/^VmRSS:/ {print t, p, $2, b}' "/proc/$pid/status" 2> /dev/null >> "$work/$name.rss" || true
    done
    lines=0
    if [ -f "$work/run-$name/metrics.jsonl" ]; then lines=$(wc -l < "$work/run-$name/metrics.jsonl"); fi
    if [ "$lines" -gt "$steps_seen" ]; then
      steps_seen=$lines
      so_far=$(for pid in "${!read[@]}"; do awk -v b="${read[$pid]}" 'BEGIN {printf "%.2f GB ", b / 1e9}'; done)
      echo "$name: step $steps_seen written at $((SECONDS - start)) s; read from storage so far per process: ${so_far}"
    fi
    sleep 0.2
  done
  wait "$launcher" || { echo "$name: failed"; tail -20 "$work/$name.log"; exit 1; }
  peaks=$(for pid in "${!peak[@]}"; do awk -v k="${peak[$pid]}" 'BEGIN {printf "%.0f MiB ", k / 1024}'; done)
  frozen=$(awk '/^model states per rank/ {t = 1; next} t && $1 ~ /^[0-9]+$/ {printf "%.1f MiB ", $NF / 1048576} /^rank 0 communication/ {t = 0}' "$work/$name.log")
  timing=$(grep -o 'in [0-9.]* s, steps.*' "$work/$name.log" || true)
  echo "$name: peak RSS per process ${peaks}| rank 0's frozen bytes (engine) ${frozen}| ${timing}"
  unset peak read
done
