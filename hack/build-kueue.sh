#!/usr/bin/env bash
# Builds Kueue's controller manager (job queueing; hack/kueue pins it as a `go tool`) into a
# cache outside the clone, keyed by version, with the module's CRDs beside it. Does nothing
# when both are already there.
# Usage: hack/build-kueue.sh            (prints the bin directory on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Keep in step with the `sigs.k8s.io/kueue` line of hack/kueue/go.mod.
KUEUE_VERSION=v0.17.0
source "$here/lib.sh"
bin="$cache/bin/kueue-$KUEUE_VERSION"
built() { [[ -x "$bin/kueue" && -f "$bin/crds/kueue.x-k8s.io_workloads.yaml" ]]; }

exit_if_built kueue 1.26 built "$bin"
require_pinned "$here/kueue" sigs.k8s.io/kueue "$KUEUE_VERSION"

step "kueue $KUEUE_VERSION: downloading modules (a few hundred MB on a cold cache)"
(cd "$here/kueue" && go mod download 2>&1 >&2)
step "kueue $KUEUE_VERSION: compiling (about 5 minutes on 2 cores, cold)"
rm -rf "$bin.tmp" && mkdir -p "$bin.tmp/crds"
(cd "$here/kueue" && go build -trimpath -ldflags "-s -w" -o "$bin.tmp/kueue" sigs.k8s.io/kueue/cmd/kueue)
src=$(cd "$here/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
cp "$src"/config/components/crd/bases/*.yaml "$bin.tmp/crds/"
chmod u+w "$bin.tmp"/crds/*.yaml
rm -rf "$bin" && mv "$bin.tmp" "$bin"
step "done: $bin/kueue"
echo "$bin"
