# Shared by the hack/build-*.sh scripts: the cache outside the clone, one build of a thing at a
# time, progress lines, and the checks on Go and on the wrapper module's pinned version.
cache=${GEMINI_CACHE:-$HOME/.cache/gemini-operator}
build_start=$(date +%s)

step() { echo "[build $(( $(date +%s) - build_start ))s] $*" >&2; }

# exit_if_built WHAT GO_MIN IS_BUILT RESULT: print RESULT and exit 0 when the command IS_BUILT
# succeeds; otherwise take WHAT's build lock (after another build of it, check again), require
# Go >= GO_MIN and set the Go build environment.
exit_if_built() {
  local what=$1 go_min=$2 is_built=$3 result=$4
  if $is_built; then echo "$result"; exit 0; fi
  mkdir -p "$cache/bin"
  exec 9>"$cache/bin/.build-${what// /-}.lock"
  if ! flock -n 9; then
    echo "another build of $what is running; waiting for it" >&2
    flock 9
    if $is_built; then echo "$result"; exit 0; fi
  fi
  command -v go >/dev/null || {
    echo "error: Go is not installed (need Go >= $go_min to build $what; see README)" >&2
    exit 2
  }
  export GOFLAGS=-mod=mod CGO_ENABLED=0
}

# require_pinned DIR MODULE VERSION: the wrapper module in DIR pins MODULE at VERSION.
require_pinned() {
  local pinned
  pinned=$(cd "$1" && go list -m -f '{{.Version}}' "$2")
  if [[ $pinned != "$3" ]]; then
    echo "error: $1/go.mod pins $2 $pinned but its build script says $3; make them agree" >&2
    exit 2
  fi
}
