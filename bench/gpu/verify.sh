#!/usr/bin/env bash
# Every GPU check of zerotrain in one command, for a machine with an NVIDIA GPU, its driver
# and Python with torch (which brings NCCL), and neither Rust nor a network. It runs the
# binaries bench/gpu/bundle.sh built on a CPU machine (bench/gpu/bundle/) and writes one
# report (to $OUT/report.md when OUT is set, else bench/gpu/report.md):
#   1. the machine: GPU, driver, NCCL found;
#   2. the CUDA engine tests on the GPU (`world --include-ignored gpu::cuda`: stages 0-3, world size 1
#      through NCCL, 2 thread ranks sharing the GPU over host collectives, NCCL = host
#      backend bit for bit, device memory per stage against the formula);
#   3. several NCCL ranks as processes on the one GPU (`zerotrain launch --ranks-share-gpu`,
#      bench/gpu/nccl_ranks.sh): 2 ranks equal to thread ranks bit for bit in fp32 at stages
#      0-3, bf16 and 4 ranks against a bound, and a tensor-parallel LLaMA at tp 2 (2 and 4
#      ranks) and at sp 2, equal to thread ranks bit for bit (not yet run on a GPU);
#   4. the wgpu engine tests on the same GPU through Vulkan (`world gpu::wgpu`);
#   5. `zerotrain bench gpu` (GPT-2 small, 124M, bf16: plain Burn in fp32 and bf16, the engine
#      at stages 0 and 3 in units, recomputing no block, all 12, or the first 6
#      (`--recompute-units`): 190-236 s on an H200 before the last two rows, autotune
#      included; stages 1-2 would not fit the time), plain Burn bf16 with the attention
#      kernels off (`--blocked-attention`: what the kernels gain or lose), and last with the
#      loss of the whole logits (`--whole-logits`: the device memory the blocked loss saves;
#      both not yet run on a GPU), beside bench/pytorch/gpu_gpt.py, eager and torch.compile,
#      in the same run;
#   6. the Hugging Face families timed (`bench gpu --model gpt2|llama`, each with the
#      attention kernels off in a row of its own, and the LLaMA shape in PyTorch eager with
#      SDPA, bench/pytorch/gpu_llama.py: GPT-2 small at context 1024, TinyLlama-1.1B's shape
#      at 2048, random weights; not yet run on a GPU);
#   7. the engine's stage-0 step split into device time per phase (`bench gpu --breakdown`).
# Each part has its own time limit (on an H200 at ebbe482: the CUDA tests 219 s, the wgpu
# tests 103 s, the bench 190 s, PyTorch 12 + 38 s; the whole 470 s; on 2026-11-27 with the
# autotune cache: the CUDA tests 94 s, the wgpu tests 106 s, the bench with the recompute
# rows 73 s, the breakdown 36 s; a machine's start and the transfers added ~30 s a call).
# Burn's autotune runs at CUBECL_AUTOTUNE_LEVEL=minimal unless the caller sets it (at the
# default level, tuning bf16 GPT-2 small took over 200 s); its results are kept in
# target/environment, which the report's folder gets as tuned.tgz: put that file in
# bench/gpu/bundle/ (bundle.sh keeps it) and the next run starts from it (the bench took
# 56 s instead of 191 s on an H200).
# The exit status is 1 if any part failed or timed out (a part skipped for lack of a
# Vulkan loader is reported as skipped, not failed; a loader whose driver cannot load is a
# failure that names the missing library).
#
# Usage: bash bench/gpu/verify.sh [--quick] [--only PARTS]
#   --quick: 3 measured steps instead of 10;
#   --only cuda,ranks,wgpu,bench,pytorch,compile,families,breakdown: run only the parts named (for a lease too
#   short for the whole; the machine is always reported).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
bundle="$repo/bench/gpu/bundle"
report="${OUT:-$repo/bench/gpu}/report.md"
steps=10
parts="cuda,ranks,wgpu,bench,pytorch,compile,families,breakdown"
only="$parts"
while (($#)); do
    case "$1" in
        --quick) steps=3 ;;
        --only)
            only="${2:?--only needs a list of parts}"
            shift
            ;;
        *) echo "verify.sh: unknown argument $1 (--quick, --only PARTS)" >&2; exit 2 ;;
    esac
    shift
done
for p in ${only//,/ }; do
    [[ ",$parts," == *",$p,"* ]] || { echo "verify.sh: --only: no part named $p (the parts: $parts)" >&2; exit 2; }
done
wanted() { [[ ",$only," == *",$1,"* ]]; }
work="$(mktemp -d)"
start=$(date +%s)
failed=()
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"

say() { echo "$*" | tee -a "$report"; }
# part NAME LIMIT_S COMMAND...: runs one part, its output into the report in a code block.
part() {
    local name="$1" limit="$2"
    shift 2
    say ""
    say "## $name"
    say ""
    say '```'
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$report" | tail -n 400 >/dev/null
    local rc=${PIPESTATUS[0]}
    say '```'
    say "exit $rc after $(( $(date +%s) - t0 )) s$([[ $rc == 124 || $rc == 137 ]] && echo " (timed out at ${limit} s)")"
    [[ $rc == 0 ]] || failed+=("$name (exit $rc)")
    return 0
}

: >"$report"
say "# zerotrain GPU verification"
say ""
[[ -f "$bundle/commit" ]] || { say "no bundle in $bundle: run bench/gpu/bundle.sh on a CPU machine first"; exit 1; }
say "commit $(cat "$bundle/commit"), $(date -u +%Y-%m-%dT%H:%M:%SZ), parts: $only"

# The binaries, and the absolute paths the test binary was compiled against.
xz -dc "$bundle/bins.tar.xz" | tar -C "$work" -xf - || { say "the bundle does not unpack: rebuild it"; exit 1; }
# shellcheck disable=SC1091
source "$bundle/paths"
if [[ "$repo" != "$(pwd)" && ! -e "$repo" ]]; then
    mkdir -p "$(dirname "$repo")" && ln -s "$(pwd)" "$repo"
fi
mkdir -p "$(dirname "$zerotrain")" && cp "$work/zerotrain" "$zerotrain"
repo="$(pwd)"
if [[ -f "$bundle/tuned.tgz" ]]; then
    mkdir -p target && tar -C target -xzf "$bundle/tuned.tgz" && echo "autotune cache: from $bundle/tuned.tgz"
fi

# NCCL: torch's wheel ships libnccl.so.2, which cudarc loads only as libnccl.so.
nccl="$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "nccl", "lib", "libnccl.so*"))]
print(sorted(hits)[0] if hits else "")
PY
)"
if [[ -n "$nccl" ]]; then
    mkdir -p "$work/lib" && ln -sf "$nccl" "$work/lib/libnccl.so"
    export LD_LIBRARY_PATH="$work/lib:$(dirname "$nccl")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# Vulkan for wgpu: the device tool's carried loader (.gl/*.deb), where one was brought.
# NVIDIA's Vulkan driver (libGLX_nvidia) needs libglvnd's libGLdispatch beside the loader:
#   mkdir -p .gl && (cd .gl && apt-get download libvulkan1 libglvnd0)   # then carry .gl
if ! ldconfig -p | grep -q libvulkan && compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if [[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi

say ""
say "## Machine"
say ""
say '```'
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$report"
say "NCCL: ${nccl:-not found}"
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", torch.cuda.nccl.version())' 2>&1 | tee -a "$report"
"$work/zerotrain" config check configs/zero3.json 2>&1 | grep -E "^world size" | tee -a "$report"
say '```'

wanted cuda && part "CUDA engine tests (world --include-ignored gpu::cuda)" 230 \
    "$work/world" --include-ignored --test-threads 1 --nocapture gpu::cuda
wanted ranks && part "NCCL ranks as processes on one GPU (bench/gpu/nccl_ranks.sh)" 400 \
    bash bench/gpu/nccl_ranks.sh "$work/zerotrain"
# The libraries a Vulkan driver's library needs and this machine lacks (empty: it loads).
# A driver that cannot load leaves wgpu with no adapter: every test would fail alike.
driver_missing() {
    local icd lib path
    for icd in ${VK_DRIVER_FILES//:/ } /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json; do
        [[ -f "$icd" ]] || continue
        lib="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["ICD"]["library_path"])' "$icd" 2>/dev/null)"
        [[ -n "$lib" ]] || continue
        path="$lib"
        [[ "$lib" == /* ]] || path="$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')"
        [[ -n "$path" ]] || { echo "$lib, named by $icd, is not installed"; return; }
        ldd "$path" 2>&1 | awk -v l="$lib" '/not found/ { printf "%s%s needs %s", sep, l, $1; sep = "; " }'
        return
    done
}
if ! wanted wgpu; then
    :
elif ldconfig -p | grep -q 'libvulkan\.so\.1'; then
    missing="$(driver_missing)"
    if [[ -n "$missing" ]]; then
        say ""
        say "## wgpu engine tests on the GPU (world gpu::wgpu)"
        say ""
        say "not run: the Vulkan driver cannot load here ($missing): carry libglvnd0 with libvulkan1 in .gl/"
        failed+=("wgpu engine tests (the Vulkan driver does not load)")
    else
        part "wgpu engine tests on the GPU (world gpu::wgpu)" 120 \
            "$work/world" --test-threads 1 --nocapture gpu::wgpu
    fi
else
    say ""
    say "## wgpu engine tests on the GPU"
    say ""
    say "no Vulkan here (no libvulkan.so.1, none carried in .gl/): wgpu part skipped"
fi
gpt="--layers 12 --width 768 --heads 12 --context 1024 --batch 8 --steps $steps"
# shellcheck disable=SC2086
wanted bench && part "zerotrain bench gpu (124M GPT, bf16, stages 0 and 3 in units, recomputing none, all 12 or the first 6 blocks)" 270 \
    "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0,3 --mode units,checkpointed \
    --recompute-units 12,6 --blocked-attention --whole-logits $gpt
# shellcheck disable=SC2086
wanted pytorch && part "PyTorch eager (bench/pytorch/gpu_gpt.py)" 30 \
    python3 bench/pytorch/gpu_gpt.py --precision bf16 $gpt
# shellcheck disable=SC2086
wanted compile && part "PyTorch torch.compile (bench/pytorch/gpu_gpt.py --compile)" 50 \
    python3 bench/pytorch/gpu_gpt.py --precision bf16 --compile $gpt
wanted families && part "zerotrain bench gpu --model gpt2 (GPT-2 small, Hugging Face's layout, context 1024)" 150 \
    "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0 --mode units --model gpt2 \
    --context 1024 --batch 8 --steps "$steps" --blocked-attention
wanted families && part "zerotrain bench gpu --model llama (TinyLlama-1.1B's shape, GQA, context 2048)" 240 \
    "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0,3 --mode units --model llama \
    --context 2048 --batch 2 --steps "$steps" --blocked-attention
wanted families && part "PyTorch eager, the same LLaMA shape with SDPA (bench/pytorch/gpu_llama.py)" 60 \
    python3 bench/pytorch/gpu_llama.py --config configs/models/llama-1b.json --precision bf16 \
    --context 2048 --batch 2 --steps "$steps"
# Last, as the least needed: where the engine's step goes on the device (each phase waits
# for the device at its end, so the phases split the step; the step includes the waits).
# shellcheck disable=SC2086
wanted breakdown && part "zerotrain bench gpu --breakdown (stage 0, units: device time per phase)" 90 \
    "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0 --mode units --breakdown $gpt

say ""
say "total $(( $(date +%s) - start )) s, autotune level $CUBECL_AUTOTUNE_LEVEL"
[[ -d target/environment ]] && tar -C target -czf "$(dirname "$report")/tuned.tgz" environment
echo "report: $report"
if ((${#failed[@]})); then
    say "FAILED: ${failed[*]}"
    exit 1
fi
