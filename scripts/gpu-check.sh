#!/usr/bin/env bash
# scripts/gpu-check.sh — everything that needs an NVIDIA GPU, in one run of at most 300 s
# (issues 26, 36): the `cuda` board's GPU tests, a host-level client workload on a `cuda` board
# checked against the CPU backend, a pool with two `cuda` partitions and a failover between two
# `cuda` boards, and the bench rows (GEMM 4096, COPY 64 MiB, a 4 KiB COPY's submit → FENCE, each
# against the same operation called natively on the same GPU in the same run).
#
# The GPU machine has no Rust toolchain, no network: build here, carry the binaries.
#
#   scripts/gpu-check.sh --build            # here: release binaries (switchyard, switchyard-bench,
#                                           # the cuda_backend test binary), stripped, and
#                                           # BUILD-INFO (the commit) in target/gpu-check/
#   scripts/gpu-check.sh                    # there: runs every step (binaries from
#                                           # target/gpu-check/; --bin DIR for another place)
#   scripts/gpu-check.sh --only tests,bench # only these steps (a second run repeats what failed)
#   scripts/gpu-check.sh --budget           # each step's budget and their sum; exit 1 if over 300 s
#   scripts/gpu-check.sh --help             # the steps, their ids and budgets
#
# SY_GPU=UUID|ordinal picks the GPU (0). With the `device` tool:
#   run(command="bash scripts/gpu-check.sh", carry=["target/gpu-check"], timeout_s=360)
#
# The budget: the GPU host lends 15 minutes of device time per session in all (each call's start,
# about a minute, included; 600 s at most per call), enough for two runs of this script: one, a
# fix, one more. So the steps' budgets add up to at most 300 s (`--budget` checks it, and
# scripts/test.sh runs that), each step is stopped at its budget (`timeout`), and an overall
# deadline of 300 s from the start stops the step running then and leaves the rest NOT RUN: the
# script ends within 300 s + 5 s (timeout's --kill-after) even if a step hangs. The budgets are
# estimates (no run on a GPU has been timed yet): revise them from the table's times.
#
# Output in $OUT (a new temporary directory without it), written as it goes, so a device call
# stopped early still brings back what was measured:
#   gpu-check-table.txt  the host, the binaries' commit, then one line per step appended as the
#                        step finishes (id: what, budget, time, result), the bench's table after
#                        the bench step, and a last line with the counts
#   cuda-bench.md, cuda-bench.json   the bench's table and figures
#   gpu-check-ID.log     each step's output; gpu-check.log: all of them
#
# Without a GPU (nvidia-smi absent and no libcuda.so where the loader looks) every step that needs
# one fails at once with the reason ("nvidia-smi not found", "no NVIDIA driver (libcuda.so) on
# this host"); the fake-GPU tests still run: the whole run takes seconds (scripts/test.sh checks
# that with scripts/check-gpu-check.sh). Where nvidia-smi is present but libcuda.so was not found
# by this script's search, the GPU steps run anyway and say themselves what they cannot load.
#
# Exit status: 0 only if every step run passed; 1 if any failed, timed out or was left NOT RUN by
# the deadline; 2 for a usage error or a missing binary.
set -uo pipefail
cd "$(dirname "$0")/.."

# The whole run's limit, seconds: the steps' budgets must add up to at most this.
TOTAL=300
# Seconds a step gets after its TERM before it is killed.
KILL_AFTER=5

# Steps, in the order they run: id, budget (seconds), what it needs (smi: nvidia-smi; driver:
# the NVIDIA driver; none), what it checks. Each budget is what the step needs on an H100/H200
# host (16 cores), with room for a slow start of the CUDA context, NVRTC and cuBLAS:
STEPS=(smi inventory fake tests pool bench)
declare -A BUDGET NEEDS NAME
# nvidia-smi -L: instant; 10 s is for a driver slow to answer.
BUDGET[smi]=10 NEEDS[smi]=smi NAME[smi]="the GPU (nvidia-smi -L)"
# One NVML query (and the driver's, if NVML cannot list the GPUs): a second or two.
BUDGET[inventory]=15 NEEDS[inventory]=driver NAME[inventory]="switchyard inventory gpus (NVML)"
# The cuda_backend tests on the fake GPU: 2 s in a debug build here; no GPU used.
BUDGET[fake]=30 NEEDS[fake]=none NAME[fake]="fake-GPU tests on the same binary"
# Three tests, each opening the GPU (context, NVRTC compile, cuBLAS: a few seconds): the
# workload against the CPU backend, a GEMM 4096 checked against the CPU's arithmetic on three
# rows, window registration.
BUDGET[tests]=60 NEEDS[tests]=driver NAME[tests]="GPU tests: results vs the CPU backend, GEMM 4096, windows"
# A daemon with five `cuda` boards (a worker process each opening the GPU), 2 x 200 rounds of
# jobs, a failover, three moves GPU <-> CPU board with 128 MiB of VRAM each.
BUDGET[pool]=90 NEEDS[pool]=driver NAME[pool]="GPU pool: two partitions, a failover, moves GPU <-> CPU"
# switchyard-bench --only cuda: the GPU opened, 320 MiB of guest memory written; six rows of
# 2 warm-up + 20 runs of ours and of native CUDA, each run a few to tens of milliseconds
# (every row on the GPU: the bench's VRAM is sized so its staging budget holds every row's
# guest operands, and a row run on the CPU path fails the bench at once); then one GEMM 4096
# on the CPU backend (one engine thread: 10-25 s).
BUDGET[bench]=90 NEEDS[bench]=driver NAME[bench]="switchyard-bench --only cuda (same GPU, same run)"

usage() {
  cat <<EOF
usage: scripts/gpu-check.sh [--bin DIR] [--only STEP,...]   run the steps (all by default)
       scripts/gpu-check.sh --build                     build the binaries into target/gpu-check
       scripts/gpu-check.sh --budget [--only STEP,...]  each step's budget and the sum (<= $TOTAL s)
       scripts/gpu-check.sh --help

steps (ids for --only), in the order they run, with their budgets:
EOF
  local id
  for id in "${STEPS[@]}"; do
    printf '  %-10s %4s s  %s%s\n' "$id" "${BUDGET[$id]}" "${NAME[$id]}" \
      "$([ "${NEEDS[$id]}" = none ] && echo " (no GPU needed)")"
  done
  echo
  echo "Results in \$OUT: gpu-check-table.txt (a line per step as it finishes), cuda-bench.md/json, logs."
}

fail_usage() {
  echo "gpu-check: $*" >&2
  echo "gpu-check: see scripts/gpu-check.sh --help" >&2
  exit 2
}

mode=run
bin=target/gpu-check
only=""
only_given=0
while [ $# -gt 0 ]; do
  case $1 in
    --build) mode=build ;;
    --budget) mode=budget ;;
    -h | --help) mode=help ;;
    --bin)
      [ $# -ge 2 ] || fail_usage "--bin needs a directory"
      bin=$2
      shift
      ;;
    --bin=*) bin=${1#--bin=} ;;
    --only)
      [ $# -ge 2 ] || fail_usage "--only needs a list of steps (${STEPS[*]})"
      only=$2 only_given=1
      shift
      ;;
    --only=*) only=${1#--only=} only_given=1 ;;
    *) fail_usage "unknown argument \`$1\`" ;;
  esac
  shift
done

# The steps to run: all, or those --only names (in the order they run).
selected=("${STEPS[@]}")
if [ "$only_given" = 1 ]; then
  IFS=, read -r -a wanted <<<"$only"
  [ ${#wanted[@]} -gt 0 ] || fail_usage "--only: no step named; the steps are ${STEPS[*]}"
  for w in "${wanted[@]}"; do
    if [ -z "$w" ]; then
      fail_usage "--only: an empty step name in \`$only\`; the steps are ${STEPS[*]}"
    elif [ -z "${BUDGET[$w]+set}" ]; then
      fail_usage "--only: unknown step \`$w\`; the steps are ${STEPS[*]}"
    fi
  done
  selected=()
  for id in "${STEPS[@]}"; do
    for w in "${wanted[@]}"; do
      if [ "$w" = "$id" ]; then
        selected+=("$id")
        break
      fi
    done
  done
fi

case $mode in
  help)
    usage
    exit 0
    ;;
  budget)
    sum=0
    printf '%-10s %6s  %s\n' step budget what
    for id in "${selected[@]}"; do
      printf '%-10s %5ss  %s\n' "$id" "${BUDGET[$id]}" "${NAME[$id]}"
      sum=$((sum + BUDGET[$id]))
    done
    printf '%-10s %5ss  (the limit: %s s; the overall deadline stops a run at %s s + %s s)\n' \
      sum "$sum" "$TOTAL" "$TOTAL" "$KILL_AFTER"
    if [ "$sum" -gt "$TOTAL" ]; then
      echo "gpu-check: error: the steps' budgets add up to $sum s, over the limit of $TOTAL s" >&2
      exit 1
    fi
    exit 0
    ;;
  build)
    set -e
    cargo build --release --locked -p switchyard -p switchyard-bench
    test_exe=$(cargo test --release --locked -p switchyard --test cuda_backend --no-run \
      --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_backend":
        print(m["executable"])')
    [ -n "$test_exe" ] || { echo "gpu-check: the cuda_backend test binary was not built" >&2; exit 1; }
    # The target directory may be elsewhere (CARGO_TARGET_DIR); the binaries go into the clone.
    target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
    rm -rf "$bin" && mkdir -p "$bin"
    cp "$target_dir/release/switchyard" "$target_dir/release/switchyard-bench" "$bin/"
    cp "$test_exe" "$bin/cuda_backend"
    strip "$bin"/* 2>/dev/null || true
    echo "commit $(git describe --always --dirty 2>/dev/null || echo unknown), built $(date -u +%FT%TZ), $(rustc -V)" \
      >"$bin/BUILD-INFO"
    du -sh "$bin"
    echo "gpu-check: built $bin ($(cat "$bin/BUILD-INFO")); on the GPU machine: bash scripts/gpu-check.sh (carry $bin)"
    exit 0
    ;;
esac

# The binaries the selected steps run.
need_bins=()
for id in "${selected[@]}"; do
  case $id in
    inventory) need_bins+=(switchyard) ;;
    fake | tests) need_bins+=(cuda_backend) ;;
    pool) need_bins+=(cuda_backend switchyard) ;;
    bench) need_bins+=(switchyard-bench switchyard) ;;
  esac
done
for f in "${need_bins[@]}"; do
  [ -x "$bin/$f" ] ||
    { echo "gpu-check: $bin/$f missing: run scripts/gpu-check.sh --build first (where cargo is)" >&2; exit 2; }
done
[ -d "$bin" ] && bin=$(cd "$bin" && pwd)

start=$SECONDS
deadline=$((start + TOTAL))
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu-check.log"
table="$out/gpu-check-table.txt"
: >"$log"
rm -f "$out/cuda-bench.md" "$out/cuda-bench.json"
export SY_GPU=${SY_GPU:-0}
export SWITCHYARD_BIN="$bin/switchyard"
# NVRTC and cuBLAS live with the toolkit; the driver (libcuda, libnvidia-ml) in the loader path.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export RUST_LOG=${RUST_LOG:-warn}
export RUST_BACKTRACE=1

# find_lib NAME: a file NAME* the dynamic loader would find (its cache, LD_LIBRARY_PATH, the
# usual directories), or nothing.
find_lib() {
  local name=$1 d p
  p=$({ ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } |
    awk -v n="$name" 'index($1, n) == 1 {print $NF; exit}')
  if [ -n "$p" ]; then
    echo "$p"
    return
  fi
  local IFS=:
  for d in ${LD_LIBRARY_PATH:-} /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 \
    /usr/lib /lib/x86_64-linux-gnu /lib64 /usr/lib/wsl/lib; do
    for p in "$d/$name"*; do
      if [ -e "$p" ]; then
        echo "$p"
        return
      fi
    done
  done
}

# What this host has, checked once up front: a GPU step whose need is missing fails at once.
smi=$(command -v nvidia-smi || true)
libcuda=$(find_lib libcuda.so)
gpu="nvidia-smi not found"
if [ -n "$smi" ]; then
  gpu="GPU $(timeout 5 nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader 2>&1 |
    head -1)"
fi
if [ -z "$libcuda" ] && [ -n "$smi" ]; then
  echo "gpu-check: libcuda.so not found by this script, but nvidia-smi is here: the GPU steps run and say what they cannot load"
fi
{
  echo "gpu-check on $(uname -n), $(date -u +%FT%TZ): $gpu"
  echo "binaries: $bin ($(cat "$bin/BUILD-INFO" 2>/dev/null || echo "no BUILD-INFO"))"
  echo "libcuda: ${libcuda:-not found}; NVRTC: $(find_lib libnvrtc.so | grep . || echo not found);" \
    "cuBLAS: $(find_lib libcublas.so | grep . || echo not found)"
  echo "steps: ${selected[*]}; the run's limit: $TOTAL s"
  echo
  printf '%-68s %6s %6s  %s\n' "step" "budget" "time" "result"
} >"$table"
cat "$table"

# missing ID: why step ID cannot run on this host, or nothing.
missing() {
  case ${NEEDS[$1]} in
    smi) [ -n "$smi" ] || echo "nvidia-smi not found" ;;
    driver) [ -n "$libcuda" ] || [ -n "$smi" ] || echo "no NVIDIA driver (libcuda.so) on this host" ;;
  esac
}

# command_of ID: sets `cmd` to step ID's command.
command_of() {
  case $1 in
    smi) cmd=(nvidia-smi -L) ;;
    inventory) cmd=("$bin/switchyard" inventory gpus) ;;
    # The fake-GPU tests (the gpu_* ones are #[ignore]d: not run without --ignored), but for the
    # one that expects a host without a GPU.
    fake) cmd=("$bin/cuda_backend" --test-threads 2 --skip without_a_gpu) ;;
    tests) cmd=("$bin/cuda_backend" --ignored --test-threads 1 gpu_commands gpu_gemm gpu_windows) ;;
    pool) cmd=("$bin/cuda_backend" --ignored --test-threads 1 gpu_pool) ;;
    bench) cmd=("$bin/switchyard-bench" --only cuda --switchyard-bin "$bin/switchyard"
      --markdown "$out/cuda-bench.md" --json "$out/cuda-bench.json") ;;
  esac
}

# why LOG: the first error a failed step's output names (a test's panic message, an `error:`
# line), on one line.
why() {
  awk '/panicked at/ {getline; print; exit} /^(error|Error)[: ]/ {print; exit}' "$1" |
    cut -c1-110
}

passed=0
failed=0
# record ID TIME RESULT: the step's line, appended to the table as it finishes.
record() {
  printf '%-68s %5ss %5ss  %s\n' "$1: ${NAME[$1]}" "${BUDGET[$1]}" "$2" "$3" | tee -a "$table"
}

# step ID: runs step ID within its budget and the overall deadline.
step() {
  local id=$1 budget=${BUDGET[$1]} reason left limit rc t0 result steplog
  steplog="$out/gpu-check-$id.log"
  reason=$(missing "$id")
  if [ -n "$reason" ]; then
    echo "=== $id: FAILED: $reason" >>"$log"
    record "$id" 0 "FAILED: $reason"
    failed=$((failed + 1))
    return
  fi
  left=$((deadline - SECONDS))
  if [ "$left" -lt "$KILL_AFTER" ]; then
    record "$id" 0 "NOT RUN: the run's $TOTAL s were spent"
    failed=$((failed + 1))
    return
  fi
  limit=$((budget < left ? budget : left))
  command_of "$id"
  echo "=== $id: ${cmd[*]} (within ${limit} s)" | tee -a "$log"
  t0=$SECONDS
  # Into a file, not a pipe: a process the step leaves behind holding its output cannot keep
  # this script waiting. timeout stops the step's whole process group.
  timeout --kill-after="$KILL_AFTER" "$limit" "${cmd[@]}" </dev/null >"$steplog" 2>&1
  rc=$?
  cat "$steplog" >>"$log"
  case $rc in
    0) result=passed ;;
    124 | 137)
      if [ "$limit" -lt "$budget" ]; then
        result="TIMED OUT at the run's limit of $TOTAL s (${limit} s left of its budget)"
      else
        result="TIMED OUT (its budget, ${budget} s)"
      fi
      ;;
    *) result="FAILED (exit $rc)$(why "$steplog" | sed 's/^/: /')" ;;
  esac
  if [ "$rc" = 0 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "--- $id: the last lines of $steplog:"
    tail -n 25 "$steplog"
  fi
  record "$id" "$((SECONDS - t0))" "$result"
  if [ "$id" = bench ] && [ -f "$out/cuda-bench.md" ]; then
    { echo; cat "$out/cuda-bench.md"; echo; } >>"$table"
  fi
}

for id in "${selected[@]}"; do
  step "$id"
done

{
  echo
  echo "gpu-check: $passed passed, $failed failed or not run, of ${#selected[@]} steps; $((SECONDS - start)) s; results in $out"
} >>"$table"
echo
echo "==================== gpu-check-table.txt ===================="
cat "$table"
[ "$failed" = 0 ]
