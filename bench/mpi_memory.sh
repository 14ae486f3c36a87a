#!/usr/bin/env bash
# Per-process memory at ZeRO stages 0-3 for a large MLP on 4 MPI processes, beside the
# ZeRO formula (fp32 Adam: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N).
# Usage: bench/mpi_memory.sh [MILLIONS_OF_PARAMETERS] (default 60); needs OpenMPI.
set -euo pipefail
cd "$(dirname "$0")/.."
millions="${1:-60}"
cargo build -q --features mpi
printf '%-6s %-5s %-14s %-12s %-12s %-18s %-18s\n' stage rank params "states MiB" "formula MiB" "peak RSS MiB" "RSS after MiB"
for stage in 0 1 2 3; do
  mpirun --allow-run-as-root --oversubscribe -np 4 target/debug/zerotrain bench memory --millions "$millions" --stage "$stage" \
    | sed -n 's/^row //p' | sort -t= -k3 -n | while read -r line; do
        get() { echo "$line" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
        printf '%-6s %-5s %-14s %-12s %-12s %-18s %-18s\n' "$(get stage)" "$(get rank)" "$(get params)" \
          "$(get model_states_MiB)" "$(get formula_MiB)" "$(get process_peak_rss_MiB)" "$(get process_rss_after_MiB)"
      done
done
