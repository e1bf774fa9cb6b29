#!/usr/bin/env bash
# Builds kwok (fake nodes and pods for scale tests; hack/kwok pins it as a `go tool`) into a cache
# outside the clone, keyed by version, like hack/build-binaries.sh. Does nothing when the binary
# is already there.
# Usage: hack/build-kwok.sh            (prints the bin directory on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Keep in step with the `sigs.k8s.io/kwok` line of hack/kwok/go.mod.
KWOK_VERSION=v0.8.0
cache=${GEMINI_CACHE:-$HOME/.cache/gemini-operator}
bin="$cache/bin/kwok-$KWOK_VERSION"

if [[ -x "$bin/kwok" ]]; then echo "$bin"; exit 0; fi
mkdir -p "$cache/bin"
# One build at a time: a second caller waits for the first and then finds the binary.
exec 9>"$cache/bin/.build-kwok.lock"
if ! flock -n 9; then
  echo "another build of kwok is running; waiting for it" >&2
  flock 9
  if [[ -x "$bin/kwok" ]]; then echo "$bin"; exit 0; fi
fi
command -v go >/dev/null || { echo "error: Go is not installed (need Go >= 1.26 to build kwok $KWOK_VERSION; apt-get install golang or see README)" >&2; exit 2; }

export GOFLAGS=-mod=mod CGO_ENABLED=0
pinned=$(cd "$here/kwok" && go list -m -f '{{.Version}}' sigs.k8s.io/kwok)
if [[ $pinned != "$KWOK_VERSION" ]]; then
  echo "error: hack/kwok/go.mod pins kwok $pinned but hack/build-kwok.sh says $KWOK_VERSION; make them agree" >&2
  exit 2
fi
start=$(date +%s)
step() { echo "[build $(( $(date +%s) - start ))s] $*" >&2; }

step "kwok $KWOK_VERSION: downloading modules (a few hundred MB on a cold cache)"
(cd "$here/kwok" && go mod download 2>&1 >&2)
step "kwok $KWOK_VERSION: compiling (a few minutes on 2 cores, cold)"
rm -rf "$bin.tmp" && mkdir -p "$bin.tmp"
# The module's own consts.Version already says the right version (`kwok --version`).
(cd "$here/kwok" && go build -trimpath -ldflags "-s -w" -o "$bin.tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)
"$bin.tmp/kwok" --version >&2
rm -rf "$bin" && mv "$bin.tmp" "$bin"
step "done: $bin/kwok"
echo "$bin"
