#!/usr/bin/env bash
# Per-process memory at ZeRO stages 0-3 for a large MLP (one unit per layer, activation
# checkpointing) on N MPI processes, beside the ZeRO formula (fp32 Adam: 16Ψ, 8Ψ+8Ψ/N,
# 4Ψ+12Ψ/N, 16Ψ/N), stage 0 run as one unit (plain data parallelism) for reference, and
# stage 3 with the optimizer and the parameters offloaded to NVMe (swap files under
# $NVME, default /tmp/zerotrain-bench-swap; "3nvme" rows).
# The peak is the larger of the engine's construction and training; "vs stage 0" compares
# each rank's peak with the same rank's at stage 0 in the same mode, in this run.
# Usage: bench/mpi_memory.sh [MILLIONS_OF_PARAMETERS] [PROCESSES] (default 60 4); needs OpenMPI.
set -euo pipefail
cd "$(dirname "$0")/.."
millions="${1:-60}"
ranks="${2:-4}"
cargo build -q --features mpi
run() {
  local stage="$1" mode="$2"
  shift 2
  mpirun --allow-run-as-root --oversubscribe -np "$ranks" target/debug/zerotrain bench memory \
    --millions "$millions" --world-size "$ranks" --stage "$stage" --mode "$mode" "$@" | sed -n 's/^row //p'
}
nvme="${NVME:-/tmp/zerotrain-bench-swap}"
{
  run 0 one-unit
  for stage in 0 1 2 3; do run "$stage" checkpointed; done
  run 3 checkpointed --nvme "$nvme" | sed 's/^stage=3 /stage=3nvme /'
} | awk '
  function get(key,   i, kv) { for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] } }
  BEGIN { printf "%-5s %-12s %-4s %-10s %-10s %-11s %-13s %-11s %-11s %-8s %s\n", "stage", "mode", "rank", "states MiB", "formula", "gathered pk", "build peak", "train peak", "peak MiB", "RSS end", "vs stage 0" }
  {
    peak = get("build_peak_rss_MiB"); if (get("train_peak_rss_MiB") + 0 > peak + 0) peak = get("train_peak_rss_MiB")
    key = get("mode") "/" get("rank")
    if (get("stage") == 0) base[key] = peak
    ratio = (key in base && base[key] > 0) ? sprintf("%.2fx", peak / base[key]) : "-"
    printf "%-5s %-12s %-4s %-10s %-10s %-11s %-13s %-11s %-11s %-8s %s\n", get("stage"), get("mode"), get("rank"), get("model_states_MiB"), get("formula_MiB"), get("gathered_peak_MiB"), get("build_peak_rss_MiB"), get("train_peak_rss_MiB"), peak, get("rss_after_MiB"), ratio
  }'
