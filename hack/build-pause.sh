#!/usr/bin/env bash
# Builds hack/pause (a static binary that prints its arguments and waits for SIGTERM: the sandbox
# and test image of real kubelet nodes) into a cache outside the clone, keyed by its source's
# hash. Does nothing when it is already there.
# Usage: hack/build-pause.sh            (prints the binary's path on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
key=$(cat "$here/pause/go.mod" "$here/pause/main.go" | sha256sum | cut -c1-12)
bin="$cache/bin/pause-$key"
built() { [[ -x "$bin/pause" ]]; }

exit_if_built pause 1.25 built "$bin/pause"
step "pause: compiling"
rm -rf "$bin.tmp" && mkdir -p "$bin.tmp"
(cd "$here/pause" && go build -trimpath -ldflags "-s -w" -o "$bin.tmp/pause" .)
rm -rf "$bin" && mv "$bin.tmp" "$bin"
step "done: $bin/pause"
echo "$bin/pause"
