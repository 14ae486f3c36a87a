#!/usr/bin/env bash
# Crash-consistency sweep: SIGKILLs `zerotrain train --save-every 1` (after the first kill,
# its `--resume`) at random moments, KILLS times, then lets one last resume finish, and
# counts what went wrong. Every count must be 0:
#   unloadable  `latest` missing or failing `zerotrain inspect --verify` after a kill
#   resume      a resumed run that failed on its own before it was killed
#   lost        steps 1..latest missing from metrics.jsonl (a kill destroyed history)
#   leftovers   *.partial / *.deleting entries left after the final, clean run
#
#   bash bench/crash_sweep.sh [KILLS] [threads|mpi]     (default: 200 threads)
# Under `mpi` (build with --features mpi) the kill hits mpirun; its ranks must stop too.
set -u
cd "$(dirname "$0")/.."
kills=${1:-200}
backend=${2:-threads}
features=crash-points
[ "$backend" = mpi ] && features=mpi,crash-points
cargo build --quiet --features "$features" --bin zerotrain || exit 1
bin=target/debug/zerotrain
work=$(mktemp -d)
run=$work/run
# The tiny recipe, keeping 3 checkpoints: kills also land inside retention.
sed 's/"eval_every": 2 }/"eval_every": 2, "keep_last_n_checkpoints": 3 }/' configs/tiny.json >"$work/config.json"
grep -q keep_last_n "$work/config.json" || { echo "could not derive the sweep's config"; exit 1; }
unloadable=0 resume_failed=0 lost=0 leftovers=0

# Starts a run to step $1 in the background; its pid is in $pid.
launch() {
    local cmd=("$bin" train --config "$work/config.json" --steps "$1" --save-every 1 --out "$run")
    [ -e "$run/checkpoints/latest" ] && cmd+=(--resume)
    if [ "$backend" = mpi ]; then
        cmd=(mpirun --allow-run-as-root --oversubscribe -np 2 "${cmd[@]}")
    fi
    "${cmd[@]}" >/dev/null 2>"$work/stderr" &
    pid=$!
}

latest_step() {
    local tag
    tag=$(cat "$run/checkpoints/latest" 2>/dev/null) || { echo 0; return; }
    echo "${tag#global_step}"
}

for i in $(seq "$kills"); do
    launch 1000000
    sleep "0.$((RANDOM % 9 + 1))$((RANDOM % 10))"
    if ! kill -0 "$pid" 2>/dev/null; then
        resume_failed=$((resume_failed + 1))
        echo "kill $i: the run ended on its own: $(tail -c 300 "$work/stderr")"
    fi
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    # No rank may outlive the kill (under MPI they watch for mpirun's death).
    for _ in $(seq 100); do pgrep -f "$run" >/dev/null || break; sleep 0.05; done
    if [ -e "$run/checkpoints/latest" ]; then
        "$bin" inspect "$run/checkpoints" --verify >/dev/null 2>&1 || {
            unloadable=$((unloadable + 1))
            echo "kill $i: latest does not verify"
        }
    elif [ -d "$run/checkpoints" ] && ls "$run/checkpoints" | grep -q '^global_step[0-9]*$'; then
        unloadable=$((unloadable + 1))
        echo "kill $i: complete checkpoints but no latest"
    fi
    last=$(latest_step)
    have=$(python3 -c '
import json, sys
steps = set()
for line in open(sys.argv[1]):
    try: steps.add(json.loads(line)["step"])
    except Exception: pass
print(sum(1 for s in range(1, int(sys.argv[2]) + 1) if s not in steps))' "$run/metrics.jsonl" "$last" 2>/dev/null || echo "$last")
    if [ "$have" != 0 ]; then
        lost=$((lost + have))
        echo "kill $i: $have of steps 1..$last missing from metrics.jsonl"
    fi
done

final=$(( $(latest_step) + 2 ))
launch "$final"
wait "$pid" || { resume_failed=$((resume_failed + 1)); echo "final resume failed: $(tail -c 300 "$work/stderr")"; }
[ "$(latest_step)" = "$final" ] || { resume_failed=$((resume_failed + 1)); echo "final run ended at $(latest_step), not $final"; }
leftovers=$(find "$run" -maxdepth 2 \( -name '*.partial' -o -name '*.deleting' \) | wc -l)

printf '%-8s %6s %11s %7s %5s %10s %11s\n' backend kills unloadable resume lost leftovers final_step
printf '%-8s %6s %11s %7s %5s %10s %11s\n' "$backend" "$kills" "$unloadable" "$resume_failed" "$lost" "$leftovers" "$(latest_step)"
rm -rf "$work"
[ $((unloadable + resume_failed + lost + leftovers)) = 0 ]
