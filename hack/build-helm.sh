#!/usr/bin/env bash
# Builds helm from Go modules (hack/helm pins it as a `go tool`) into a cache outside the clone,
# keyed by version, like hack/build-binaries.sh. Does nothing when the binary is already there.
# Usage: hack/build-helm.sh            (prints the helm binary's path on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Keep in step with the `helm.sh/helm/v3` line of hack/helm/go.mod.
HELM_VERSION=v3.21.4
cache=${GEMINI_CACHE:-$HOME/.cache/gemini-operator}
bin="$cache/bin/helm-$HELM_VERSION"

if [[ -x "$bin/helm" ]]; then echo "$bin/helm"; exit 0; fi
mkdir -p "$cache/bin"
# One build at a time: a second caller waits for the first and then finds the binary.
exec 9>"$cache/bin/.build-helm.lock"
if ! flock -n 9; then
  echo "another build of helm is running; waiting for it" >&2
  flock 9
  if [[ -x "$bin/helm" ]]; then echo "$bin/helm"; exit 0; fi
fi
command -v go >/dev/null || { echo "error: Go is not installed (need Go >= 1.26 to build helm $HELM_VERSION; apt-get install golang or see README)" >&2; exit 2; }
pinned=$(cd "$here/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v3)
if [[ $pinned != "$HELM_VERSION" ]]; then
  echo "error: hack/helm/go.mod pins helm $pinned but hack/build-helm.sh says $HELM_VERSION; make them agree" >&2
  exit 2
fi

export GOFLAGS=-mod=mod CGO_ENABLED=0
start=$(date +%s)
step() { echo "[build $(( $(date +%s) - start ))s] $*" >&2; }

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
