#!/usr/bin/env bash
# scripts/check-gpu-check.sh — checks scripts/gpu-check.sh on a host without a GPU (CI), in
# seconds, with the binaries the test suite built (no release build of its own):
#   - its steps' budgets add up within the GPU host's limit (`gpu-check.sh --budget`);
#   - `--only` with an unknown step is a usage error (exit 2) naming the step;
#   - a run ends in under 60 s with exit 1: the fake-GPU tests pass and every step that needs a
#     GPU fails at once with its reason ("nvidia-smi not found", "no NVIDIA driver (libcuda.so)
#     on this host"), each a line of gpu-check-table.txt;
#   - `--only bench` runs that step alone.
# On a host with an NVIDIA driver only the first two are checked (run scripts/gpu-check.sh
# itself there). scripts/test.sh runs this after the tests.
#
#   scripts/check-gpu-check.sh [SWITCHYARD SWITCHYARD_BENCH CUDA_BACKEND_TEST_BINARY]
#
# Without arguments: the newest of the target directory's debug and release `switchyard` and
# `switchyard-bench`, and its newest cuda_backend test binary (target/debug/deps/cuda_backend-*).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "check-gpu-check: error: $*" >&2
  exit 1
}

scripts/gpu-check.sh --budget
rc=0
err=$(scripts/gpu-check.sh --only smi,nosuchstep 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "--only with an unknown step exited $rc, not 2"
grep -qF "unknown step \`nosuchstep\`" <<<"$err" || fail "--only with an unknown step said: $err"

if command -v nvidia-smi >/dev/null ||
  { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libcuda\.so'; then
  echo "check-gpu-check: this host has an NVIDIA driver: its no-GPU run is not checked here;" \
    "run scripts/gpu-check.sh itself"
  exit 0
fi

if [ $# -eq 3 ]; then
  sy=$1 bench=$2 cuda_backend=$3
elif [ $# -eq 0 ]; then
  t=$(cargo metadata --format-version 1 --no-deps --locked |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  # newest FILE...: the most recently built executable of FILE... (none: nothing).
  newest() {
    local f best=""
    for f in "$@"; do
      if [[ $f != *.d ]] && [ -f "$f" ] && [ -x "$f" ] && { [ -z "$best" ] || [ "$f" -nt "$best" ]; }; then
        best=$f
      fi
    done
    echo "$best"
  }
  sy=$(newest "$t/debug/switchyard" "$t/release/switchyard")
  bench=$(newest "$t/debug/switchyard-bench" "$t/release/switchyard-bench")
  cuda_backend=$(newest "$t"/debug/deps/cuda_backend-*)
else
  fail "usage: scripts/check-gpu-check.sh [SWITCHYARD SWITCHYARD_BENCH CUDA_BACKEND_TEST_BINARY]"
fi
for f in "$sy" "$bench" "$cuda_backend"; do
  if [ -z "$f" ] || [ ! -x "$f" ]; then
    fail "a binary is missing (switchyard: '$sy', switchyard-bench: '$bench', cuda_backend: '$cuda_backend'): build them (cargo build -p switchyard -p switchyard-bench; cargo test -p switchyard --test cuda_backend --no-run)"
  fi
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/bin"
ln -s "$(realpath "$sy")" "$work/bin/switchyard"
ln -s "$(realpath "$bench")" "$work/bin/switchyard-bench"
ln -s "$(realpath "$cuda_backend")" "$work/bin/cuda_backend"

t0=$SECONDS
rc=0
OUT=$work/out timeout 120 scripts/gpu-check.sh --bin "$work/bin" >"$work/run.txt" 2>&1 || rc=$?
took=$((SECONDS - t0))
table=$work/out/gpu-check-table.txt
show() {
  cat "$work/run.txt" >&2
  for f in "$work"/out/gpu-check-*.log; do
    [ -f "$f" ] && { echo "--- $f" >&2; tail -n 40 "$f" >&2; }
  done
  fail "$*"
}
[ "$rc" = 1 ] || show "gpu-check.sh without a GPU exited $rc, not 1 (its GPU steps failed, the rest passed)"
[ "$took" -lt 60 ] || show "gpu-check.sh without a GPU took $took s (60 s at most)"
[ -f "$table" ] || show "no $table"
expect() {
  grep -Eq "^$1: .*  $2\$" "$table" || show "gpu-check-table.txt has no line \`$1: ... $2\`"
}
expect smi 'FAILED: nvidia-smi not found'
for id in inventory tests pool bench; do
  expect "$id" 'FAILED: no NVIDIA driver \(libcuda\.so\) on this host'
done
expect fake passed
n=$(grep -Ec '^(smi|inventory|fake|tests|pool|bench): ' "$table")
[ "$n" = 6 ] || show "gpu-check-table.txt has $n step lines, not 6"

rc=0
OUT=$work/only timeout 60 scripts/gpu-check.sh --bin "$work/bin" --only bench >"$work/run.txt" 2>&1 || rc=$?
table=$work/only/gpu-check-table.txt
[ "$rc" = 1 ] || show "gpu-check.sh --only bench exited $rc, not 1"
n=$(grep -Ec '^(smi|inventory|fake|tests|pool|bench): ' "$table")
[ "$n" = 1 ] || show "gpu-check.sh --only bench: $n step lines, not bench's alone"
expect bench 'FAILED: no NVIDIA driver \(libcuda\.so\) on this host'

cat "$work/out/gpu-check-table.txt"
echo "check-gpu-check: without a GPU, gpu-check.sh ended in $took s, each GPU step failed with its reason, the fake-GPU tests passed"
