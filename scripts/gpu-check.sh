#!/usr/bin/env bash
# scripts/gpu-check.sh — everything that needs an NVIDIA GPU, in one run (issue 26): the `cuda`
# board's GPU tests, a host-level client workload on a `cuda` board checked against the CPU
# backend, a pool with two `cuda` partitions and a failover between two `cuda` boards, and the
# bench rows (GEMM 4096, COPY 64 MiB, a 4 KiB COPY's submit → FENCE, each against the same
# operation called natively on the same GPU in the same run). Prints one table.
#
# The GPU machine has no Rust toolchain, no network: build here, carry the binaries.
#
#   scripts/gpu-check.sh --build   # here: release binaries (switchyard, switchyard-bench, the
#                                  # cuda_backend test binary), stripped, in target/gpu-check/
#   scripts/gpu-check.sh           # there: runs them (from target/gpu-check/; --bin DIR for
#                                  # another place). SY_GPU=UUID|ordinal picks the GPU (0).
#
# With the `device` tool: run(command="bash scripts/gpu-check.sh", carry=["target/gpu-check"]).
# Exit 0 only if every step passed. Under 8 minutes on an H100/H200 (16 cores).
set -uo pipefail
cd "$(dirname "$0")/.."

bin=target/gpu-check
if [ "${1:-}" = "--build" ]; then
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
  rm -rf "$bin" && mkdir -p "$bin"
  cp target/release/switchyard target/release/switchyard-bench "$bin/"
  cp "$test_exe" "$bin/cuda_backend"
  strip "$bin"/* 2>/dev/null || true
  du -sh "$bin"
  echo "gpu-check: built $bin; on the GPU machine: bash scripts/gpu-check.sh (carry $bin)"
  exit 0
fi
if [ "${1:-}" = "--bin" ]; then bin=$2; fi
for f in switchyard switchyard-bench cuda_backend; do
  [ -x "$bin/$f" ] || { echo "gpu-check: $bin/$f missing: run scripts/gpu-check.sh --build first (where cargo is)" >&2; exit 2; }
done
bin=$(cd "$bin" && pwd)

out=${OUT:-$(mktemp -d)}
log="$out/gpu-check.log"
export SY_GPU=${SY_GPU:-0}
export SWITCHYARD_BIN="$bin/switchyard"
# NVRTC and cuBLAS live with the toolkit; the driver (libcuda, libnvidia-ml) in the loader path.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export RUST_LOG=${RUST_LOG:-warn}
export RUST_BACKTRACE=1

results=()
failed=0
# step NAME TIMEOUT_S COMMAND...: runs it, its output in the log, a line in the table.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  echo "=== $name: $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local verdict=passed
  if [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; failed=1; fi
  results+=("$(printf '%-66s %-16s %5ss' "$name" "$verdict" "$((SECONDS - t0))")")
}

step "the GPU (nvidia-smi -L)" 30 nvidia-smi -L
step "switchyard inventory gpus (NVML)" 30 "$bin/switchyard" inventory gpus
step "GPU tests: results vs the CPU backend, GEMM 4096, registration" 240 \
  "$bin/cuda_backend" --ignored --test-threads 1 gpu_commands gpu_gemm gpu_windows
step "GPU pool: two partitions, a failover, moves GPU <-> CPU board" 240 \
  "$bin/cuda_backend" --ignored --test-threads 1 gpu_pool
step "fake-GPU tests on the same binary" 60 "$bin/cuda_backend" --test-threads 2 \
  --skip gpu_ --skip without_a_gpu
step "bench: cuda rows (same GPU, same run)" 300 "$bin/switchyard-bench" --only cuda \
  --switchyard-bin "$bin/switchyard" --markdown "$out/cuda-bench.md" --json "$out/cuda-bench.json"

{
  echo
  echo "==================== gpu-check on $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader 2>/dev/null | head -1) ===================="
  printf '%-66s %-16s %6s\n' "step" "result" "time"
  for r in "${results[@]}"; do echo "$r"; done
  if [ -f "$out/cuda-bench.md" ]; then
    echo
    cat "$out/cuda-bench.md"
  fi
} | tee -a "$log" | tee "$out/gpu-check-table.txt"
exit $failed
