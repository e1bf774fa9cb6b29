#!/usr/bin/env bash
# Builds kwok (fake nodes and pods for scale tests; hack/kwok pins it as a `go tool`) into a cache
# outside the clone, keyed by version, like hack/build-binaries.sh. Does nothing when the binary
# is already there.
# Usage: hack/build-kwok.sh            (prints the bin directory on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Keep in step with the `sigs.k8s.io/kwok` line of hack/kwok/go.mod.
KWOK_VERSION=v0.8.0
source "$here/lib.sh"
bin="$cache/bin/kwok-$KWOK_VERSION"
built() { [[ -x "$bin/kwok" ]]; }

exit_if_built kwok 1.26 built "$bin"
require_pinned "$here/kwok" sigs.k8s.io/kwok "$KWOK_VERSION"

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
