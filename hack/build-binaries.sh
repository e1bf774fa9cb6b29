#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and kubelet from
# Go modules into a cache outside the clone, keyed by version. Does nothing when the binaries are
# already there; a cache from before kubelet was added keeps its binaries and only gains kubelet.
# Usage: hack/build-binaries.sh            (prints the bin directory on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=v1.35.4
ETCD_VERSION=v3.6.16
source "$here/lib.sh"
bin="$cache/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION"
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)

have_all() {
  for b in etcd "${k8s_cmds[@]}"; do [[ -x "$bin/$b" ]] || return 1; done
}

exit_if_built "the control plane" 1.25 have_all "$bin"
mkdir -p "$bin.tmp"
# Keep what an earlier (partial or older) build already produced.
for b in etcd "${k8s_cmds[@]}"; do
  [[ -x "$bin/$b" && ! -x "$bin.tmp/$b" ]] && cp "$bin/$b" "$bin.tmp/$b"
done

if [[ ! -x "$bin/etcd" && ! -x "$bin.tmp/etcd" ]]; then
  step "etcd $ETCD_VERSION: downloading modules"
  (cd "$here/etcd" && go mod download -x 2>&1 | grep -c '^# get' | xargs -I{} echo "  {} module downloads" >&2 || true)
  step "etcd $ETCD_VERSION: compiling"
  (cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$bin.tmp/etcd" go.etcd.io/etcd/server/v3)
fi

missing=()
for c in "${k8s_cmds[@]}"; do [[ -x "$bin.tmp/$c" ]] || missing+=("$c"); done
if ((${#missing[@]})); then
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  step "kubernetes $K8S_VERSION: downloading modules (about 0.5-1 GB on a cold cache)"
  (cd "$here/k8s" && go mod download 2>&1 >&2)
  for c in "${missing[@]}"; do
    step "kubernetes $K8S_VERSION: compiling $c (several minutes each on 2 cores, cold)"
    (cd "$here/k8s" && go build -trimpath -ldflags "$ldflags" -o "$bin.tmp/$c" "k8s.io/kubernetes/cmd/$c")
  done
fi
rm -rf "$bin.old" && { [[ ! -d "$bin" ]] || mv "$bin" "$bin.old"; } && mv "$bin.tmp" "$bin" && rm -rf "$bin.old"
step "done: $bin"
echo "$bin"
