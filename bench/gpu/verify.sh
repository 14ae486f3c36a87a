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
# Usage: bash bench/gpu/verify.sh [--quick] [--only PARTS] | --lease
#   --quick: 3 measured steps instead of 10;
#   --only cuda,ranks,wgpu,bench,pytorch,compile,families,breakdown: run only the parts named (the
#   machine is always reported);
#   --lease: what one short lease of a GPU machine has time for (15 minutes of device time,
#   its start and idle seconds counted), in order of value and under 420 s of command time in
#   all, each part with its own limit and the whole with a deadline (a part gets what is left
#   when less is): ranks (nccl_ranks.sh --lease), speed (GPT-2 small, bf16, batch 8, context
#   1024: the engine at stage 0 with the attention kernels, plain Burn, the kernels off; then
#   PyTorch eager with SDPA), profile (one engine step's 20 costliest kernels, from cubecl's
#   own profiling: kernel_profile.py), families (TinyLlama-1.1B's shape at context 2048, and
#   PyTorch eager on it), rest (stage 3 on 4 NCCL ranks sharing the GPU: its step's phase
#   times, where the exposed communication shows). The report opens with the plan, before
#   anything is checked, and is written part by part, with the autotune cache as tuned.tgz
#   after each, so a lease cut short returns what it measured. Without a GPU (a CPU
#   machine) it is a dry run: the plan, the bundle checked (at most 62 MiB, both binaries,
#   their paths and commit), every part said skipped, in seconds (tests/cli/lease.rs).
#   BUNDLE=DIR reads the bundle from DIR instead of bench/gpu/bundle.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
bundle="${BUNDLE:-$repo/bench/gpu/bundle}"
report="${OUT:-$repo/bench/gpu}/report.md"
steps=10
parts="cuda,ranks,wgpu,bench,pytorch,compile,families,breakdown"
only="$parts"
lease=0
while (($#)); do
    case "$1" in
        --quick) steps=3 ;;
        --lease) lease=1 ;;
        --only)
            only="${2:?--only needs a list of parts}"
            shift
            ;;
        *) echo "verify.sh: unknown argument $1 (--quick, --only PARTS, --lease)" >&2; exit 2 ;;
    esac
    shift
done
# The lease's parts in order of value: name, limit (s), what it runs. Limits from the last
# measured times on an H200 (the bench's rows 73 s and the breakdown 36 s with the autotune
# cache; PyTorch 12 s), the NCCL ranks (never run) from the CUDA thread-rank tests' 94 s.
lease_plan=(
    "ranks 120 2 NCCL ranks = 2 thread ranks bit for bit at stages 0 and 3; 4 at stage 3 within the bound; a checkpoint of 2 NCCL ranks resumed on 1 and 4; tp 2, sp 2, 2 pipeline stages; no model-state byte host<->device"
    "speed 100 GPT-2 small bf16, batch 8, context 1024: engine stage 0 (attention kernels), plain Burn, kernels off"
    "pytorch 20 PyTorch eager with SDPA, the same model and batch"
    "profile 45 one engine step's 20 costliest kernels and their shares (cubecl's profiling)"
    "families 70 TinyLlama-1.1B's shape, bf16, context 2048, batch 2: engine stage 0"
    "families-pytorch 25 PyTorch eager with SDPA on the same LLaMA shape"
    "rest 40 stage 3 on 4 NCCL ranks sharing the GPU: step time and phases"
)
lease_budget=420
for p in ${only//,/ }; do
    [[ ",$parts," == *",$p,"* ]] || { echo "verify.sh: --only: no part named $p (the parts: $parts)" >&2; exit 2; }
done
wanted() { [[ ",$only," == *",$1,"* ]]; }
work="$(mktemp -d)"
start=$(date +%s)
failed=()
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"

say() { echo "$*" | tee -a "$report"; }
# The autotune cache so far, beside the report (the next lease's bundle starts from it).
keep_tuned() { [[ -d target/environment ]] && tar -C target -czf "$(dirname "$report")/tuned.tgz" environment; return 0; }
# part NAME LIMIT_S COMMAND...: runs one part, its output into the report in a code block.
# In a lease the part gets at most what is left of the lease's budget.
part() {
    local name="$1" limit="$2"
    shift 2
    say ""
    say "## $name"
    say ""
    if ((lease)); then
        local left=$((lease_budget - ($(date +%s) - start)))
        if ((left < 10)); then
            say "not run: ${left} s of the lease's ${lease_budget} s left"
            failed+=("$name (no time left)")
            return 0
        fi
        ((left < limit)) && limit=$left
    fi
    say '```'
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$report" | tail -n 400 >/dev/null
    local rc=${PIPESTATUS[0]}
    say '```'
    say "exit $rc after $(( $(date +%s) - t0 )) s$([[ $rc == 124 || $rc == 137 ]] && echo " (timed out at ${limit} s)")"
    [[ $rc == 0 ]] || failed+=("$name (exit $rc)")
    keep_tuned
    return 0
}

# check_bundle: what a run needs is in the bundle, within what one call may carry.
check_bundle() {
    [[ -f "$bundle/commit" && -f "$bundle/paths" && -f "$bundle/bins.tar.xz" ]] || {
        say "bundle: $bundle lacks$([[ -f "$bundle/commit" ]] || echo " commit")$([[ -f "$bundle/paths" ]] || echo " paths")$([[ -f "$bundle/bins.tar.xz" ]] || echo " bins.tar.xz"): run bench/gpu/bundle.sh on a CPU machine first"
        return 1
    }
    local total limit=$((62 * 1024 * 1024)) names
    total=$(du -cb "$bundle"/* | tail -1 | cut -f1)
    if ((total > limit)); then
        say "bundle: $total bytes, over the $limit a call may carry beside the repository"
        return 1
    fi
    names="$(xz -dc "$bundle/bins.tar.xz" | tar -tf - 2>/dev/null | sort | tr '\n' ' ')"
    for bin in zerotrain world; do
        [[ " $names" == *" $bin "* ]] || { say "bundle: bins.tar.xz holds no $bin (it holds: ${names:-nothing readable})"; return 1; }
    done
    say "bundle: $total bytes (limit $limit), commit $(cat "$bundle/commit"), binaries: $names"
}

: >"$report"
if ((lease)); then
    say "# zerotrain GPU lease run"
    say ""
    say "parts, in order, each with its limit:"
    planned=0
    for entry in "${lease_plan[@]}"; do
        read -r name limit what <<<"$entry"
        say "- $name: ${limit} s: $what"
        planned=$((planned + limit))
    done
    say "planned total: $planned s (deadline $lease_budget s)"
    say ""
    check_bundle || exit 1
    if ! nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
        say "no GPU here (nvidia-smi lists none): a dry run"
        for entry in "${lease_plan[@]}"; do
            read -r name _ <<<"$entry"
            say "- $name: skipped (no GPU)"
        done
        say "dry run done in $(( $(date +%s) - start )) s"
        exit 0
    fi
    only="ranks,speed,pytorch,profile,families,families-pytorch,rest"
    steps=5
fi
if ((!lease)); then
    say "# zerotrain GPU verification"
    say ""
    check_bundle || exit 1
fi
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

if ((lease)); then
    gpt="--layers 12 --width 768 --heads 12 --context 1024 --batch 8"
    part "ranks: NCCL ranks as processes on one GPU (nccl_ranks.sh --lease)" 120 \
        bash bench/gpu/nccl_ranks.sh --lease "$work/zerotrain"
    # shellcheck disable=SC2086
    part "speed: zerotrain bench gpu (124M GPT, bf16, stage 0 in units, the attention kernels off in a row)" 100 \
        "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0 --mode units --blocked-attention \
        $gpt --steps $steps
    # shellcheck disable=SC2086
    part "speed: PyTorch eager with SDPA (bench/pytorch/gpu_gpt.py)" 20 \
        python3 bench/pytorch/gpu_gpt.py --precision bf16 $gpt --steps $steps
    # cubecl reads cubecl.toml from the working directory: profiling for this part only.
    profile_log="$work/kernels.log"
    profile() {
        printf '[profiling.logger]\nlevel = "basic"\nfile = "%s"\n' "$profile_log" >cubecl.toml
        # shellcheck disable=SC2086
        "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0 --mode units $gpt --steps 1
        local rc=$?
        rm -f cubecl.toml
        ((rc == 0)) && python3 bench/gpu/kernel_profile.py "$profile_log" 20
    }
    part "profile: one engine step's costliest kernels (cubecl's profiling; every kernel timed alone)" 45 profile
    rm -f cubecl.toml
    part "families: zerotrain bench gpu --model llama (TinyLlama-1.1B's shape, GQA, context 2048)" 70 \
        "$work/zerotrain" bench gpu --device cuda --precision bf16 --stages 0 --mode units --model llama \
        --context 2048 --batch 2 --steps "$steps"
    part "families: PyTorch eager with SDPA on the same LLaMA shape (bench/pytorch/gpu_llama.py)" 25 \
        python3 bench/pytorch/gpu_llama.py --config configs/models/llama-1b.json --precision bf16 \
        --context 2048 --batch 2 --steps "$steps"
    rest() {
        python3 - "$work/s3-4.json" "$work/s3-4.txt" <<'PY'
import json, sys
json.dump({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "steps_per_print": 1,
           "wall_clock_breakdown": True, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
           "zerotrain": {"device": "cuda", "eval_every": 1000}}, open(sys.argv[1], "w"))
open(sys.argv[2], "w").write("".join(f"{i} + {i % 97} = {i + i % 97}\n" for i in range(200000)))
PY
        "$work/zerotrain" launch --nproc-per-node 4 --ranks-share-gpu --master-port 29710 --grace-s 10 -- \
            train --config "$work/s3-4.json" --data "$work/s3-4.txt" --steps 4 --out "$work/s3-4"
    }
    part "rest: stage 3 on 4 NCCL ranks sharing the GPU (time-sliced: not a multi-GPU speed)" 40 rest
    say ""
    say "total $(( $(date +%s) - start )) s of the lease's $lease_budget s, autotune level $CUBECL_AUTOTUNE_LEVEL"
    keep_tuned
    echo "report: $report"
    if ((${#failed[@]})); then
        say "FAILED: ${failed[*]}"
        exit 1
    fi
    exit 0
fi
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
