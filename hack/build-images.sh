#!/usr/bin/env bash
# Builds the Dockerfile's images here, without a Docker daemon: buildah (chroot isolation,
# overlay storage in a root of its own) over a Python base made with mmdebstrap from
# Debian's own packages (no registry is reachable here; Debian bookworm's python3.11, given to
# the Dockerfile as PYTHON_IMAGE in place of python:3.11.14-slim-bookworm).
#
# Usage: hack/build-images.sh [TARGET...]      (default: operator sidecar; also trainer, examples)
#        hack/build-images.sh --oci-dir DIR ... also writes each image as DIR/<target>.tar, an
#                                               OCI archive `ctr images import` takes
# Prints one line per image: "<target> <name> <bytes> <seconds>". Needs root (apt, buildah).
# The host's CA bundle and pip configuration are mounted into the build steps: where PyPI is
# reached through a TLS-intercepting proxy (as on these machines) pip inside needs them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
source "$here/lib.sh"

oci_dir=""
if [[ ${1:-} == --oci-dir ]]; then oci_dir=$2; shift 2; mkdir -p "$oci_dir"; fi
targets=("$@")
((${#targets[@]})) || targets=(operator sidecar)
version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$root/helm/gemini-operator/Chart.yaml")
base=localhost/gemini-python:3.11-bookworm
# overlay: each layer holds only its changes (vfs copies the whole tree per layer, 5 GB a step
# for the trainer images); a root of its own, apart from the host's default storage.
storage=(--storage-driver overlay --root /var/lib/containers/gemini --runroot /run/containers/gemini)
missing=()
for p in buildah mmdebstrap; do command -v "$p" >/dev/null || missing+=("$p"); done
if ((${#missing[@]})); then
  step "installing ${missing[*]} (Debian)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
# Builds before 2026-12-05 kept their images in the default (vfs) storage: drop those, once.
if [[ -d /var/lib/containers/storage/vfs ]]; then
  for old in $(buildah --storage-driver vfs images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep '^localhost/gemini-' || true); do
    buildah --storage-driver vfs rmi "$old" >/dev/null 2>&1 || true
  done
fi
# What an interrupted build left untagged takes disk the trainer images need (5 GB a step).
buildah "${storage[@]}" rmi --prune >/dev/null 2>&1 || true

if ! buildah "${storage[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  step "base image $base: Debian bookworm minbase + python3.11 (mmdebstrap, about 20 s)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # No documentation, manual pages or translations: nothing in the images reads them.
  mmdebstrap --variant=minbase --include=python3.11,python3.11-venv,python-is-python3,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    bookworm "$work/base.tar" >&2 2>"$work/mmdebstrap.log" || { cat "$work/mmdebstrap.log" >&2; exit 1; }
  ctr=$(buildah "${storage[@]}" from scratch)
  buildah "${storage[@]}" add "$ctr" "$work/base.tar" / >/dev/null
  buildah "${storage[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd python3 "$ctr"
  buildah "${storage[@]}" commit -q --rm "$ctr" "$base" >/dev/null
fi

mounts=()
for f in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
  [[ -f $f ]] && mounts+=(-v "$f:$f:ro")
done
bud() {
  buildah "${storage[@]}" bud --isolation chroot --network host --layers=false -q \
    "${mounts[@]}" --build-arg "PYTHON_IMAGE=$base" -f "$root/Dockerfile" "$@" "$root" >&2
}

# The trainer images start from their dependencies' image (torch, DeepSpeed: about 5 GB),
# built once per requirements.lock, the project's dependency lists and the Dockerfile: a code
# change adds a thin layer on top of the same layers (which the kubelet nodes' image seed then
# already has), and so does a change to pyproject.toml's tool settings.
project_deps() {
  python3 -c 'import json, sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(json.dumps([p["name"], p["dependencies"], p["optional-dependencies"]], sort_keys=True))' \
    "$root/pyproject.toml"
}
deps_args=()
if [[ " ${targets[*]} " =~ \ (trainer|examples)\  ]]; then
  key=$(cat "$root/requirements.lock" <(project_deps) <(grep -v '^ *#' "$root/Dockerfile") \
    | sha256sum | cut -c1-16)  # comments change no image
  deps=localhost/gemini-trainer-deps:$key
  if ! buildah "${storage[@]}" inspect --type image "$deps" >/dev/null 2>&1; then
    step "image $deps: torch, DeepSpeed and the rest of the lock (pip, about 4 minutes)"
    bud --target trainer-deps -t "$deps"
    for old in $(buildah "${storage[@]}" images --format '{{.Name}}:{{.Tag}}' | grep '/gemini-trainer-deps:' | grep -v ":$key\$"); do
      buildah "${storage[@]}" rmi "$old" >/dev/null
    done
  fi
  deps_args=(--build-arg "TRAINER_DEPS=$deps")
fi

for target in "${targets[@]}"; do
  name="gemini-$target:$version"
  step "image $name: buildah bud --target $target"
  started=$EPOCHREALTIME
  args=()
  [[ $target == trainer || $target == examples ]] && args=("${deps_args[@]}")
  bud "${args[@]}" --target "$target" -t "$name"
  seconds=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  # the unpacked size, as `docker images` shows it: the bytes of its root file system
  ctr=$(buildah "${storage[@]}" from -q "localhost/$name")
  size=$(du -sb "$(buildah "${storage[@]}" mount "$ctr")" | cut -f1)
  buildah "${storage[@]}" rm "$ctr" >/dev/null
  if [[ -n $oci_dir ]]; then
    buildah "${storage[@]}" push -q "localhost/$name" "oci-archive:$oci_dir/$target.tar:$name" >&2
  fi
  echo "$target $name $size $seconds"
done
# Each build leaves the previous image of its name and the build stages untagged: drop them
# (the base and the trainer's dependencies stay tagged).
buildah "${storage[@]}" rmi --prune >/dev/null 2>&1 || true
