#!/usr/bin/env bash
# Makes `cargo build --features cuda` work without a network.
#
# Burn's CUDA runtime compiles its kernels to PTX through LLVM (cubecl-llvm), and the build
# script of `tracel-llvm-bundler` downloads an LLVM bundle unless it finds one installed at
#   ${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-<version>/
# (bin/llvm-config, lib/ with LLVM's static libraries, include/, and an empty marker file
# `.tracel-llvm-installed`). This script lays out that folder from Debian's LLVM packages:
# symbolic links into /usr/lib/llvm-<major>, and a `bin/llvm-config` wrapper that prints
# libraries the way the bundler parses them (Debian's `--system-libs` names libz3 by its
# full path, which the bundler would turn into `-llibz3`).
#
# Idempotent: a second run checks the layout and changes nothing. Run as root, or as a user
# with sudo, where the packages are missing; as anyone once they are installed.
#
# Usage: scripts/setup-cuda-build.sh [--check]
#   --check  only say whether the bundle is in place (exit 1 if not); install nothing.
set -euo pipefail

llvm_major=22
# libpolly: `llvm-config --link-static --libs` names Polly, which llvm-dev does not carry.
packages="llvm-${llvm_major}-dev libpolly-${llvm_major}-dev libzstd-dev libz3-dev libxml2-dev"
repo="$(cd "$(dirname "$0")/.." && pwd)"

# The bundle version is the bundler's own, read from Cargo.lock, so that a Burn upgrade that
# moves to another bundle is noticed here instead of silently downloading at build time.
version="$(awk '/^name = "tracel-llvm-bundler"$/ { getline; gsub(/"/, "", $3); print $3 }' "$repo/Cargo.lock")"
if [[ -z "$version" ]]; then
    echo "setup-cuda-build: no tracel-llvm-bundler in $repo/Cargo.lock (did Burn stop using it?)" >&2
    exit 1
fi
data="${XDG_DATA_HOME:-${HOME:?HOME is not set}/.local/share}"
bundle="$data/tracel/tracel-llvm-$version"
llvm="/usr/lib/llvm-$llvm_major"

# The bundle answers llvm-config, and every static library it names is there.
in_place() {
    [[ -f "$bundle/.tracel-llvm-installed" && -x "$bundle/bin/llvm-config" && -d "$bundle/lib" && -d "$bundle/include" ]] \
        || return 1
    local libs
    libs="$("$bundle/bin/llvm-config" --link-static --libnames 2>/dev/null)" || return 1
    for lib in $libs; do
        [[ -f "$bundle/lib/$lib" ]] || { echo "setup-cuda-build: $bundle/lib/$lib is missing" >&2; return 1; }
    done
}

if [[ "${1:-}" == "--check" ]]; then
    if in_place; then echo "LLVM bundle in place: $bundle"; exit 0; fi
    echo "no LLVM bundle at $bundle: run scripts/setup-cuda-build.sh" >&2
    exit 1
fi

missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [[ -n "$missing" ]]; then
    sudo=""
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null || { echo "setup-cuda-build: needs root to install:$missing" >&2; exit 1; }
        sudo="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    $sudo apt-get install -y -qq $missing >/dev/null \
        || { $sudo apt-get update -qq && $sudo apt-get install -y -qq $missing >/dev/null; }
fi
[[ -x "$llvm/bin/llvm-config" ]] || { echo "setup-cuda-build: $llvm/bin/llvm-config missing after install" >&2; exit 1; }

mkdir -p "$bundle/bin"
for d in lib include share; do
    ln -sfn "$llvm/$d" "$bundle/$d"
done
# The wrapper: every argument passes through; library names given as paths become -l names.
cat >"$bundle/bin/llvm-config.new" <<EOF
#!/bin/sh
# Written by zerotrain's scripts/setup-cuda-build.sh: Debian's llvm-config, with libraries
# named by full path (libz3) printed as -l flags, which tracel-llvm-bundler expects.
"$llvm/bin/llvm-config" "\$@" | sed -E 's#(^| )/[^ ]*/lib([A-Za-z0-9_+-]+)\.(so|a)[^ ]*#\1-l\2#g'
EOF
chmod +x "$bundle/bin/llvm-config.new"
mv -f "$bundle/bin/llvm-config.new" "$bundle/bin/llvm-config"
: >"$bundle/.tracel-llvm-installed"

in_place || { echo "setup-cuda-build: the bundle at $bundle does not answer llvm-config" >&2; exit 1; }
if "$bundle/bin/llvm-config" --link-static --system-libs | grep -q '/'; then
    echo "setup-cuda-build: llvm-config still names a library by path:" >&2
    "$bundle/bin/llvm-config" --link-static --system-libs >&2
    exit 1
fi
echo "LLVM bundle in place: $bundle (LLVM $("$bundle/bin/llvm-config" --version) from $llvm)"
