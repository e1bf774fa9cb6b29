#!/usr/bin/env bash
# Issue 13's GPU checks as one run (a few minutes on one GPU): `pytest -m cuda` (bit-exact CUDA
# restores) and bench/gpu_snapshot.py (stall per iteration, copy rate against pinned D2H).
#
# Made for the lent device machine, whose python3 holds torch, numpy and pytest but not this
# project's one compiled dependency (isal) and can fetch nothing. Here, first:
#     bash hack/gpu-check.sh --wheels      # downloads isal's cp312 wheel into .whl/ (ignored)
# then run `bash hack/gpu-check.sh` there with `.whl` carried; logs go to $OUT (or $1).
# Without a GPU it runs too: the cuda tests skip with their reason and the bench says
# "skipped" (PYTHON=.venv/bin/python bash hack/gpu-check.sh /tmp/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ ${1:-} == --wheels ]]; then
  isal=$(grep -E '^isal==' requirements.lock) || { echo "no isal pin in requirements.lock" >&2; exit 2; }
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$isal"
fi

out=${OUT:-${1:-/tmp/gemini-gpu-check}}
py=${PYTHON:-python3}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
site=
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    .whl/*.whl || exit 1
fi
# The source folders (gemini, gemini_trainer), not an installed package: nothing is
# installed there.
export PYTHONPATH="$PWD:$PWD/trainer_sidecar${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

# Room for the biggest shard's two versions in shared memory: a bigger tmpfs if /dev/shm is
# small, else only the sizes that fit (said, not hidden).
sizes="1 4 16"  # GiB, ascending
shm=/dev/shm
need_gib() { echo $(( $1 * 2 + 2 )); }  # two versions and headroom
free_gib() { df -BG --output=avail "$1" 2>/dev/null | tail -1 | tr -dc 0-9; }
largest=$(need_gib "${sizes##* }")
if (( $(free_gib $shm) < largest )); then
  mkdir -p /tmp/gemini-gpu-shm
  if mount -t tmpfs -o size=$(( largest + 4 ))g tmpfs /tmp/gemini-gpu-shm 2>/dev/null; then
    shm=/tmp/gemini-gpu-shm
    trap 'umount /tmp/gemini-gpu-shm' EXIT
  else
    sizes=$(for s in $sizes; do (( $(need_gib $s) <= $(free_gib $shm) )) && echo $s; done)
    echo "only ${sizes:-no} GiB shard sizes fit in $shm ($(free_gib $shm) GiB free)"
  fi
fi
sizes=$(echo $sizes | tr ' ' ,)

status=0
echo "== pytest -m cuda"
"$py" -m pytest --noconftest -p no:cacheprovider -q -rs -m cuda \
  tests/unit/trainer/test_checkpointer.py || status=1
echo "== bench/gpu_snapshot.py --sizes-gib $sizes --shm-dir $shm"
if [[ -n $sizes ]]; then
  "$py" bench/gpu_snapshot.py --sizes-gib "$sizes" --shm-dir "$shm" || status=1
else
  echo "no shard size fits in shared memory: the bench did not run"; status=1
fi
exit $status
