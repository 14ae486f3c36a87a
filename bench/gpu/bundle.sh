#!/usr/bin/env bash
# Builds what bench/gpu/verify.sh runs on a GPU machine that has no Rust and no network:
# the `zerotrain` command and the `world` test binary, built with `--features
# wgpu,cuda,crash-points` (the feature set CI builds, so a warm CI target is reused),
# stripped and compressed together with xz into bench/gpu/bundle/bins.tar.xz (ignored by
# git), with the absolute paths the test binary was compiled against. At most 62 MiB in all: the device
# tool takes 64 MiB per call, the repository's own files included.
#
# Usage: bench/gpu/bundle.sh        (then, on the GPU machine: bash bench/gpu/verify.sh)
#   BUNDLE_BASE=FILE bench/gpu/bundle.sh: also packs FILE, a `zerotrain` built at another
#   commit, as `zerotrain-base`, so that one call times a change against its base on the
#   same machine (9 MB more compressed: 57 MB in all at 2fe9303).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
out="$repo/bench/gpu/bundle"
features="wgpu,cuda,crash-points"
limit=$((62 * 1024 * 1024))

scripts/setup-cuda-build.sh --check >/dev/null 2>&1 || scripts/setup-cuda-build.sh
cargo build --locked --features "$features" --bin zerotrain
# The test binary's path, from cargo's own report of what it built.
world="$(cargo test --locked --features "$features" --test world --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "world" and m.get("executable"):
        print(m["executable"])')"
[[ -x "$world" ]] || { echo "bundle: no world test binary built" >&2; exit 1; }

# An autotune cache a GPU run left (verify.sh's tuned.tgz) stays.
tuned="$(mktemp)"
[[ -f "$out/tuned.tgz" ]] && cp "$out/tuned.tgz" "$tuned"
rm -rf "$out"
mkdir -p "$out/bin"
[[ -s "$tuned" ]] && mv "$tuned" "$out/tuned.tgz"
rm -f "$tuned"
strip -o "$out/bin/zerotrain" "$repo/target/debug/zerotrain"
strip -o "$out/bin/world" "$world"
base=()
if [[ -n "${BUNDLE_BASE:-}" ]]; then
    strip -o "$out/bin/zerotrain-base" "$BUNDLE_BASE"
    base=(zerotrain-base)
fi
# One stream with a dictionary larger than either binary: the two share most of their code
# (Burn, cubecl, the engine), which xz then stores once (46 MB against 73 MB compressed
# apart, with fusion and autotune built in). Compressing takes ~5 minutes and ~4 GB.
tar -C "$out/bin" -cf - zerotrain world "${base[@]}" | xz -T1 -9 --lzma2=preset=9,dict=400MiB >"$out/bins.tar.xz"
rm -rf "$out/bin"
# verify.sh recreates these paths: the test binary runs the command and reads configs/
# through paths fixed at compile time.
cat >"$out/paths" <<PATHS
repo=$repo
zerotrain=$repo/target/debug/zerotrain
PATHS
git rev-parse HEAD >"$out/commit"
total=$(du -cb "$out"/* | tail -1 | cut -f1)
ls -l "$out"
if ((total > limit)); then
    echo "bundle: $total bytes is over the $limit-byte limit" >&2
    exit 1
fi
echo "bundle: $total bytes in $out (commit $(cat "$out/commit"))"
