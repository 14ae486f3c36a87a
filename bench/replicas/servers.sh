#!/usr/bin/env bash
# Replica groups as separate jobs on this machine: `zerotrain serve` and 4 `zerotrain train`
# processes of one rank each (configs/local_sgd.json's groups, the same samples as the
# in-job run), then each group's final validation loss and its longest step (a pause).
#
#   bench/replicas/servers.sh sync                # the recipe through a server
#   bench/replicas/servers.sh async 1             # async, max_staleness 1
#   bench/replicas/servers.sh sync 0 720          # group 3 SIGKILLed at step 720 (30%)
#
# Arguments: mode (sync|async), max_staleness (async), the step to kill group 3 at (none:
# no kill). Environment: STEPS (2400), TIMEOUT (local_sgd.group_timeout_s, 10), OUTER (a
# JSON outer_optimizer replacing the recipe's), ZEROTRAIN (target/release/zerotrain).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-sync}; staleness=${2:-1}; kill_at=${3:-}
steps=${STEPS:-2400}; timeout=${TIMEOUT:-10}
bin=${ZEROTRAIN:-target/release/zerotrain}
work=$(mktemp -d /tmp/zerotrain-servers.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

section() { # $1: servers, $2: group
  python3 - "$1" "$2" "$mode" "$staleness" "$timeout" "${OUTER:-}" <<'PY'
import json, sys
servers, group, mode, staleness, timeout, outer = sys.argv[1:]
c = json.load(open("configs/local_sgd.json"))
if outer:
    c["local_sgd"]["outer_optimizer"] = json.loads(outer)
c["local_sgd"].update({"servers": [servers], "group": int(group), "mode": mode, "group_timeout_s": float(timeout)})
if mode == "async":
    c["local_sgd"]["max_staleness"] = int(staleness)
c["zerotrain"]["world_size"] = 1
c["zerotrain"]["comm_timeout_s"] = 120
print(json.dumps(c))
PY
}

section 127.0.0.1:1 0 > "$work/server.json"
"$bin" serve --config "$work/server.json" --listen 127.0.0.1:0 > "$work/server.out" 2> "$work/server.err" &
for _ in $(seq 100); do grep -q listening "$work/server.out" 2>/dev/null && break; sleep 0.1; done
addr=$(awk '/listening/ {print $NF}' "$work/server.out")
echo "server on $addr; $mode${kill_at:+, group 3 killed at step $kill_at}; $steps steps"
pids=()
for g in 0 1 2 3; do
  section "$addr" "$g" > "$work/group$g.json"
  "$bin" train --config "$work/group$g.json" --steps "$steps" --out "$work/run$g" > /dev/null 2> "$work/group$g.err" &
  pids+=($!)
done
if [[ -n "$kill_at" ]]; then
  until [[ -f "$work/run3/metrics.jsonl" ]] && (( $(wc -l < "$work/run3/metrics.jsonl") >= kill_at )); do sleep 0.05; done
  kill -9 "${pids[3]}"
  echo "killed group 3 at step $(wc -l < "$work/run3/metrics.jsonl")"
fi
status=0
for g in 0 1 2 3; do wait "${pids[$g]}" || { [[ -n "$kill_at" && $g == 3 ]] || { status=1; tail -3 "$work/group$g.err"; }; }; done
python3 - "$work" "$steps" <<'PY'
import json, sys
work, steps = sys.argv[1], int(sys.argv[2])
tokens = 16 * 32  # micro-batch x block size of one rank's step
for g in range(4):
    try:
        lines = [json.loads(l) for l in open(f"{work}/run{g}/metrics.jsonl")]
    except FileNotFoundError:
        continue
    last = lines[-1]
    longest = max(tokens / m["tokens_per_s"] for m in lines)
    print(f"group {g}: step {last['step']}, val_loss {last.get('val_loss')}, rounds {last.get('rounds')}, "
          f"live {last.get('live_groups')}, staleness max {max(m.get('staleness') or 0 for m in lines)}, "
          f"longest step {longest:.2f} s")
PY
echo "groups dropped from the quorum: $(grep -c dropped "$work/server.err" || true)"
grep -h "dropped" "$work/server.err" | head -3 || true
exit $status
