#!/usr/bin/env bash
# Builds the monitoring stack of `gemini local up --with-monitoring` (hack/monitoring pins it as
# `go tool`s): Prometheus and promtool, the Prometheus Operator, and the operator's
# monitoring.coreos.com CRDs beside them, into a cache outside the clone keyed by both versions.
# Does nothing when they are already there. Two wrapper modules (hack/monitoring: Prometheus;
# hack/monitoring/operator: the operator): each release builds with the dependencies it was
# released with (in one module the operator v0.93.0 fails against Prometheus v0.316.0's newer
# automemlimit).
# Usage: hack/build-monitoring.sh       (prints the bin directory on its last line)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Keep in step with hack/monitoring/go.mod and hack/monitoring/operator/go.mod. Prometheus' Go module version v0.316.0 is
# Prometheus 3.16.0. The operator stays at v0.93.0: the proxy does not serve v0.94.0's
# pkg/client module, which v0.94.0 needs.
PROMETHEUS_VERSION=v0.316.0 PROMETHEUS_RELEASE=3.16.0
OPERATOR_VERSION=v0.93.0
source "$here/lib.sh"
bin="$cache/bin/monitoring-prometheus-$PROMETHEUS_RELEASE-operator-$OPERATOR_VERSION"
built() {
  [[ -x "$bin/prometheus" && -x "$bin/promtool" && -x "$bin/prometheus-operator" \
     && -f "$bin/crds/monitoring.coreos.com_servicemonitors.yaml" ]]
}

exit_if_built monitoring 1.26.7 built "$bin"
require_pinned "$here/monitoring" github.com/prometheus/prometheus "$PROMETHEUS_VERSION"
require_pinned "$here/monitoring/operator" github.com/prometheus-operator/prometheus-operator \
  "$OPERATOR_VERSION"

step "monitoring: downloading modules (several hundred MB on a cold cache)"
(cd "$here/monitoring" && go mod download 2>&1 >&2)
(cd "$here/monitoring/operator" && go mod download 2>&1 >&2)
rm -rf "$bin.tmp" && mkdir -p "$bin.tmp/crds"
# Only Kubernetes service discovery is compiled in (the others pull in every cloud's SDK); the
# web UI's assets are left out too (no `builtinassets` tag): the HTTP API is what is used.
tags=remove_all_sd,enable_kubernetes_sd
ver=github.com/prometheus/common/version
build() {  # build MODULE_DIR NAME PACKAGE VERSION: one binary at a time (2 cores)
  step "monitoring: compiling $2 (minutes on 2 cores, cold)"
  (cd "$1" && go build -trimpath -tags "$tags" \
    -ldflags "-s -w -X $ver.Version=$4 -X $ver.Branch=HEAD -X $ver.Revision=$4" \
    -o "$bin.tmp/$2" "$3")
}
prom=github.com/prometheus/prometheus operator=github.com/prometheus-operator/prometheus-operator
build "$here/monitoring" prometheus "$prom/cmd/prometheus" "$PROMETHEUS_RELEASE"
build "$here/monitoring" promtool "$prom/cmd/promtool" "$PROMETHEUS_RELEASE"
build "$here/monitoring/operator" prometheus-operator "$operator/cmd/operator" "${OPERATOR_VERSION#v}"
src=$(cd "$here/monitoring/operator" && go list -m -f '{{.Dir}}' "$operator")
cp "$src"/example/prometheus-operator-crd/*.yaml "$bin.tmp/crds/"
chmod u+w "$bin.tmp"/crds/*.yaml
for b in prometheus prometheus-operator; do "$bin.tmp/$b" --version 2>&1 | head -1 >&2; done
rm -rf "$bin" && mv "$bin.tmp" "$bin"
step "done: $bin"
echo "$bin"
