#!/usr/bin/env bash
# Several NCCL ranks as processes on one GPU (`zerotrain launch --ranks-share-gpu`: each
# process its own NCCL_HOSTID, P2P and SHM off, sockets on loopback), against the same
# ranks as threads sharing the GPU over host collectives. Run by verify.sh (part `ranks`).
#   - 2 ranks in fp32: every loss equal bit for bit (a sum of two operands is exact in either
#     order, so a difference is a defect): stages 0-3, accumulation 1 and 3;
#   - 2 ranks in bf16 and 4 ranks in fp32: the largest relative difference of a loss,
#     reported beside a provisional bound of 1e-5 (4-operand sums in NCCL's ring order
#     against rank order; no bound derived yet: the first run's figures set it);
#   - tensor and sequence parallelism: LLaMA (4 heads over 2 kv heads, fresh from a
#     config.json) at tensor_parallel.autotp_size 2 on 2 ranks (tp 2) and 4 (tp 2 x dp 2),
#     at zerotrain.mesh.sp 2 on 2 ranks, in two pipeline stages (2 ranks) and in two of tp 2
#     (4 ranks); the
#     built-in GPT at tp 2; in fp32: every loss equal bit for bit to the same mesh of thread
#     ranks (every sum has two operands; the exchanges move values);
#   - every launched run used NCCL (no "host backend" notice in its log).
#   - every launched rank copied no model-state byte between host memory and its device
#     (each rank's own line of `train`'s end: NCCL reads and writes device memory).
# Time-sliced ranks on one GPU: no figure here is a multi-GPU speed.
# --lease runs the part a short lease has time for, most needed first: 2 ranks at stages 0
# and 3 bit for bit, 4 ranks at stage 3 within the bound, a checkpoint saved by 2 NCCL
# ranks resumed on 1 and on 4 (their losses against the uninterrupted thread ranks' within
# the bound: another world size sums in another order), tp 2, sp 2 and 2 pipeline stages
# bit for bit (their activations on device memory over NCCL).
#
# Usage: bash bench/gpu/nccl_ranks.sh [--lease] ZEROTRAIN_BINARY   (from the repository's root)
set -uo pipefail
lease=0
[[ "${1:-}" == --lease ]] && { lease=1; shift; }
zt="${1:?usage: nccl_ranks.sh [--lease] ZEROTRAIN_BINARY}"
work="$(mktemp -d)"
steps=6
port=29650
failures=0

# config NAME STAGE PRECISION ACCUMULATION: configs/tiny.json on CUDA at that stage.
config() {
    python3 - "$work/$1.json" "$2" "$3" "$4" <<'PY'
import json, sys
out, stage, precision, accumulation = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
c = json.load(open("configs/tiny.json"))
c["zero_optimization"] = {"stage": stage}
c["gradient_accumulation_steps"] = accumulation
if precision == "bf16":
    c["bf16"] = {"enabled": True}
c["zerotrain"]["device"] = "cuda"
json.dump(c, open(out, "w"))
PY
}

# compare A B MODE: the two runs' losses; MODE equal (bit for bit) or bound (relative 1e-5).
compare() {
    python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" "$3" <<'PY'
import json, sys
read = lambda p: [json.loads(l)["loss"] for l in open(p) if l.strip()]
a, b, mode = read(sys.argv[1]), read(sys.argv[2]), sys.argv[3]
if len(a) != len(b) or not a:
    sys.exit(f"steps differ: {len(a)} against {len(b)}")
worst = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))
equal = all(repr(float(x)) == repr(float(y)) for x, y in zip(a, b))
print(f"  losses {a[0]} .. {a[-1]}; {'equal bit for bit' if equal else f'largest relative difference {worst:.3g}'}")
if mode == "equal" and not equal:
    sys.exit(f"  NOT EQUAL: {a} against {b}")
if mode == "bound" and worst > 1e-5:
    sys.exit(f"  past the provisional bound 1e-5: {a} against {b}")
PY
}

# launched RANKS LOG TRAIN_ARGS...: `train` as RANKS NCCL processes sharing the GPU, on a
# port of their own, its output into LOG.
launched() {
    local ranks="$1" log="$2"
    shift 2
    port=$((port + 1))
    timeout 300 "$zt" launch --nproc-per-node "$ranks" --ranks-share-gpu --master-port $port --grace-s 10 -- \
        train "$@" >"$log" 2>&1
}

# run NAME RANKS MODE [TRAIN ARGS...]: the config's job as thread ranks and as launched
# NCCL processes.
run() {
    local name="$1" ranks="$2" mode="$3" out="$work/$1-$2"
    shift 3
    echo "$name, $ranks ranks:"
    if ! "$zt" train --config "$work/$name.json" --world-size "$ranks" --steps $steps --out "$out-threads" "$@" \
        >"$out-threads.log" 2>&1; then
        echo "  threads run failed:"; tail -5 "$out-threads.log"; failures=$((failures + 1)); return
    fi
    if ! launched "$ranks" "$out-nccl.log" --config "$work/$name.json" --steps $steps --out "$out-nccl" "$@"; then
        echo "  launched run failed:"; tail -8 "$out-nccl.log"; failures=$((failures + 1)); return
    fi
    if grep -q "host backend" "$out-nccl.log"; then
        echo "  the launched ranks did not use NCCL:"; grep "host backend" "$out-nccl.log" | head -2
        failures=$((failures + 1)); return
    fi
    compare "$out-threads" "$out-nccl" "$mode" || failures=$((failures + 1))
    crossed_none "$out-nccl.log" "$ranks" || failures=$((failures + 1))
}

# crossed_none LOG RANKS: every one of the RANKS launched ranks said it copied no model-state
# byte between host memory and its device.
crossed_none() {
    local said none
    said=$(grep -cE "rank [0-9]+: model states crossed host<->device" "$1")
    none=$(grep -cE "rank [0-9]+: model states crossed host<->device over [0-9]+ steps: 0 B to the device, 0 B to the host" "$1")
    echo "  host<->device model-state bytes: $none of $2 ranks crossed none ($said said)"
    if ((said != $2 || none != $2)); then
        grep -E "model states crossed" "$1" | head -4
        return 1
    fi
}

# resumed NAME: the 2-rank NCCL run NAME stopped at step 3 and resumed to step 6 on 1 rank
# and as 4 launched ranks, against the uninterrupted 2 thread ranks' losses (bound).
resumed() {
    local name="$1" out="$work/$1-resume"
    shift
    echo "$name: saved by 2 NCCL ranks at step 3, resumed on 1 and on 4:"
    if ! launched 2 "$out-2.log" --config "$work/$name.json" --steps 3 --out "$out-2" "$@"; then
        echo "  the saving run failed:"; tail -8 "$out-2.log"; failures=$((failures + 1)); return
    fi
    cp -r "$out-2" "$out-1" && cp -r "$out-2" "$out-4"
    if ! "$zt" train --config "$work/$name.json" --world-size 1 --steps $steps --resume --out "$out-1" "$@" \
        >"$out-1.log" 2>&1; then
        echo "  resuming on 1 rank failed:"; tail -5 "$out-1.log"; failures=$((failures + 1))
    else
        compare "$work/$name-2-threads" "$out-1" bound || failures=$((failures + 1))
    fi
    if ! launched 4 "$out-4.log" --config "$work/$name.json" --steps $steps --resume --out "$out-4" "$@"; then
        echo "  resuming on 4 NCCL ranks failed:"; tail -8 "$out-4.log"; failures=$((failures + 1))
    else
        compare "$work/$name-2-threads" "$out-4" bound || failures=$((failures + 1))
    fi
}

if ((lease)); then
    config s0-fp32-a1 0 fp32 1 && run s0-fp32-a1 2 equal
    config s3-fp32-a1 3 fp32 1 && run s3-fp32-a1 2 equal
    run s3-fp32-a1 4 bound
    # A global batch of 8 in micro-batches of 2: accumulation 4, 2 and 1 at 1, 2 and 4 ranks,
    # so every world size trains on the same samples.
    config ckpt 3 fp32 1
    python3 - "$work/ckpt.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
del c["gradient_accumulation_steps"]
c["train_batch_size"], c["train_micro_batch_size_per_gpu"] = 8, 2
json.dump(c, open(sys.argv[1], "w"))
PY
    run ckpt 2 equal
    resumed ckpt
fi

if ((!lease)); then
    for stage in 0 1 2 3; do
        config "s$stage-fp32-a1" "$stage" fp32 1
        run "s$stage-fp32-a1" 2 equal
    done
    config s2-fp32-a3 2 fp32 3 && run s2-fp32-a3 2 equal
    config s3-fp32-a3 3 fp32 3 && run s3-fp32-a3 2 equal
    config s3-bf16-a1 3 bf16 1 && run s3-bf16-a1 2 report
    run s1-fp32-a1 4 bound
    run s3-fp32-a1 4 bound
fi

# Tensor parallelism: a tokenizer and token file made here, LLaMA fresh from a config.json.
python3 -c "
w = ['the', 'rank', 'holds', 'a', 'slice', 'of', 'each', 'layer', 'and', 'sums', 'its', 'part', '.']
print(' '.join(w[(i * 7 + i * i // 11) % len(w)] for i in range(4000)))" >"$work/text.txt"
"$zt" tokenize "$work/text.txt" --tokenizer "$work/tokenizer.json" --train-vocab 280 --out "$work/data.tokens" \
    >"$work/tokenize.log" 2>&1 || { echo "tokenize failed:"; tail -5 "$work/tokenize.log"; failures=$((failures + 1)); }
cat >"$work/model.json" <<'JSON'
{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": false}
JSON
cat >"$work/tp.json" <<JSON
{"train_batch_size": 8, "zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zerotrain": {"device": "cuda", "eval_every": 100},
 "model": {"hf_config": "$work/model.json", "tokenizer": "$work/tokenizer.json", "block_size": 16}}
JSON
run tp 2 equal --data "$work/data.tokens"
((lease)) || run tp 4 equal --data "$work/data.tokens"
sed -e 's/"tensor_parallel": {"autotp_size": 2},//' -e 's/"device": "cuda"/"device": "cuda", "mesh": {"sp": 2}/' \
    "$work/tp.json" >"$work/sp.json"
run sp 2 equal --data "$work/data.tokens"
# Two pipeline stages on 2 ranks: activations and gradients as device tensors over NCCL's
# sends and receives (a communicator per direction), never run before.
python3 - "$work/tp.json" "$work/pp.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
del c["tensor_parallel"]
c["pipeline"] = {"stages": 2}
c["gradient_accumulation_steps"] = 2
json.dump(c, open(sys.argv[2], "w"))
PY
run pp 2 equal --data "$work/data.tokens"
if ((lease)); then
    echo "$failures failure(s); logs in $work"
    exit $((failures > 0))
fi
# LLaMA in two pipeline stages of tp 2 (4 ranks: activations between stages over NCCL's
# point-to-point), and the built-in GPT at tp 2 (its parts cut from the whole model).
python3 - "$work/tp.json" "$work/pp-tp.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["pipeline"] = {"stages": 2}
c["gradient_accumulation_steps"] = 2
json.dump(c, open(sys.argv[2], "w"))
PY
run pp-tp 4 equal --data "$work/data.tokens"
config gpt-tp 2 fp32 1
python3 - "$work/gpt-tp.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["tensor_parallel"] = {"autotp_size": 2}
json.dump(c, open(sys.argv[1], "w"))
PY
run gpt-tp 2 equal
echo "$failures failure(s); logs in $work"
((failures == 0))
