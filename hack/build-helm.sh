#!/usr/bin/env bash
# Builds helm from Go modules (hack/helm pins it as a `go tool`) into a cache outside the clone,
# keyed by version, like hack/build-binaries.sh. Does nothing when the binary is already there.
# Usage: hack/build-helm.sh            (prints the helm binary's path on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Keep in step with the `helm.sh/helm/v3` line of hack/helm/go.mod.
HELM_VERSION=v3.21.4
source "$here/lib.sh"
bin="$cache/bin/helm-$HELM_VERSION"
built() { [[ -x "$bin/helm" ]]; }

exit_if_built helm 1.26 built "$bin/helm"
require_pinned "$here/helm" helm.sh/helm/v3 "$HELM_VERSION"

# The same version stamps as helm's own Makefile: its version, and the Kubernetes version its
# client libraries speak (used for .Capabilities.KubeVersion and by `helm lint`).
k8s=$(cd "$here/helm" && go list -m -f '{{.Version}}' k8s.io/client-go)  # v0.<minor>.<patch>
k8s_minor=${k8s#v0.}; k8s_minor=${k8s_minor%%.*}
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done

step "helm $HELM_VERSION: downloading modules (about 300 MB on a cold cache)"
(cd "$here/helm" && go mod download 2>&1 >&2)
step "helm $HELM_VERSION: compiling (a few minutes on 2 cores, cold)"
rm -rf "$bin.tmp" && mkdir -p "$bin.tmp"
(cd "$here/helm" && go build -trimpath -ldflags "$ldflags" -o "$bin.tmp/helm" helm.sh/helm/v3/cmd/helm)
"$bin.tmp/helm" version --short >&2
rm -rf "$bin" && mv "$bin.tmp" "$bin"
step "done: $bin/helm"
echo "$bin/helm"
