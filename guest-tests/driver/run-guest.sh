#!/bin/bash
# guest-tests/driver/run-guest.sh — run sygpu-driver inside a TCG guest against a fresh
# `switchyard serve` (host side of the end-to-end test).
#
# Usage: guest-tests/driver/run-guest.sh [--quick|--probe] [--no-iommu] [--no-build] [--keep]
#                                        [--server-args "..."] [--timeout S] [-- DRIVER ARGS...]
#   (default)       full VFIO workload (GEMM 256^3); guest has intel-iommu + intel_iommu=on
#   --quick         smaller sizes (sygpu-driver --quick)
#   --probe         sysfs probe only (sygpu-driver --probe); implies --no-iommu
#   --no-iommu      boot without the vIOMMU (the VFIO workload then fails: no IOMMU group)
#   --no-build      use the existing binaries
#   --keep          keep the work directory (logs) on success too
#   --server-args   extra `switchyard serve` arguments, e.g. "--device softgpu,queues=8,vram=16M"
#   --timeout S     QEMU time limit (default 300)
# Environment: RUST_LOG for the server (default info), SWITCHYARD_CACHE (see scripts/setup.sh).
#
# Prints the guest's SYGPU lines; exit 0 only if the final SYGPU-SUMMARY / SYGPU-PROBE line says
# "result":"pass" and the driver exited 0. Only the server started here is stopped (by PID).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODE=full
IOMMU=1
BUILD=1
KEEP=0
SERVER_ARGS=""
TIMEOUT=300
EXTRA=()
while [ $# -gt 0 ]; do
  case $1 in
    --quick) MODE=quick; shift ;;
    --probe) MODE=probe; IOMMU=0; shift ;;
    --no-iommu) IOMMU=0; shift ;;
    --no-build) BUILD=0; shift ;;
    --keep) KEEP=1; shift ;;
    --server-args) SERVER_ARGS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run-guest.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

DRIVER=$REPO/target/x86_64-unknown-linux-gnu/release/sygpu-driver
SERVER=$REPO/target/debug/switchyard
if [ $BUILD = 1 ]; then
  (cd "$REPO" && RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build -q --release -p sygpu-driver --target x86_64-unknown-linux-gnu) || exit 1
  (cd "$REPO" && cargo build -q -p switchyard) || exit 1
fi
if [ ! -x "$DRIVER" ] || [ ! -x "$SERVER" ]; then
  echo "run-guest.sh: build $DRIVER and $SERVER first" >&2
  exit 1
fi

W=$(mktemp -d "${TMPDIR:-/tmp}/sy-driver.XXXXXX")
SOCK=$W/softgpu.sock
SPID=""
stop_server() {
  if [ -n "$SPID" ]; then
    kill -TERM "$SPID" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SPID" 2>/dev/null
    wait "$SPID" 2>/dev/null
    SPID=""
  fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM
fail() { echo "run-guest.sh: FAIL: $* (logs in $W)" >&2; exit 1; }

"$REPO/images/build-initramfs.sh" "$W/initrd.gz" --add "$DRIVER" >/dev/null || fail "initramfs build"

# shellcheck disable=SC2086 # SERVER_ARGS is a word list on purpose
RUST_LOG=${RUST_LOG:-info} "$SERVER" serve --socket "$SOCK" $SERVER_ARGS > "$W/server.log" 2>&1 &
SPID=$!
for _ in $(seq 100); do
  [ -S "$SOCK" ] && break
  kill -0 "$SPID" 2>/dev/null || fail "server exited before listening"
  sleep 0.1
done
[ -S "$SOCK" ] || fail "server socket did not appear"

ARGS=()
case $MODE in quick) ARGS+=(--arg --quick) ;; probe) ARGS+=(--arg --probe) ;; esac
for a in "${EXTRA[@]}"; do ARGS+=(--arg "$a"); done
QEMU=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCK\"}}")
APPEND=()
if [ $IOMMU = 1 ]; then
  # shellcheck disable=SC2054 # commas are QEMU option syntax
  QEMU=(-machine kernel-irqchip=split -device intel-iommu,caching-mode=on "${QEMU[@]}")
  APPEND=(--append intel_iommu=on)
fi
t0=$(date +%s.%N)
"$REPO/scripts/guest-run.sh" --initrd "$W/initrd.gz" --timeout "$TIMEOUT" --test sygpu-driver \
  "${ARGS[@]}" "${APPEND[@]}" -- "${QEMU[@]}" < /dev/null > "$W/guest.log" 2>&1
rc=$?
t1=$(date +%s.%N)
stop_server
tr -d '\r' < "$W/guest.log" | grep -E '^(SYGPU|GUEST: test)'
[ $rc = 0 ] || fail "QEMU exit code $rc"
TAG=SYGPU-SUMMARY; [ $MODE = probe ] && TAG=SYGPU-PROBE
last=$(tr -d '\r' < "$W/guest.log" | grep "^$TAG " | tail -1)
[ -n "$last" ] || fail "no $TAG line"
case $last in *'"result":"pass"'*) ;; *) fail "$TAG says fail" ;; esac
tr -d '\r' < "$W/guest.log" | grep -q '^GUEST: test sygpu-driver rc=0' || fail "driver exit code"
printf 'run-guest.sh: PASS (%s, %.1f s QEMU wall time)\n' "$MODE" "$(awk "BEGIN{print $t1-$t0}")"
if [ $KEEP = 1 ]; then echo "run-guest.sh: logs in $W"; else rm -rf "$W"; fi
