#!/bin/bash
# scripts/smoke-guest.sh — end-to-end smoke test: switchyard server <-> QEMU vfio-user-pci <-> Linux guest.
#
# Usage: scripts/smoke-guest.sh [--no-build] [--no-iommu] [--keep]
#   --no-build  do not run `cargo build -p switchyard` (use the existing binary)
#   --no-iommu  skip the second boot (intel-iommu + bind to vfio-pci in the guest)
#   --keep      keep the work directory (logs) even on success
# Environment: SWITCHYARD_BIN (server binary, default target/debug/switchyard), SWITCHYARD_CACHE.
#
# Boot 1: the guest lists PCI devices from sysfs; asserts the softgpu (1234:5347, class 030200).
# Boot 2: -device intel-iommu,caching-mode=on + intel_iommu=on; the guest binds the softgpu to
#         vfio-pci and asserts /dev/vfio/<group>.
# Each boot gets a fresh server on a fresh socket; only the servers started here are stopped.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=1
IOMMU=1
KEEP=0
for a in "$@"; do
  case $a in
    --no-build) BUILD=0 ;;
    --no-iommu) IOMMU=0 ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "smoke-guest.sh: unknown argument '$a'" >&2; exit 2 ;;
  esac
done
BIN=${SWITCHYARD_BIN:-$REPO/target/debug/switchyard}
VID=1234 DID=5347 CLASS=030200

fail() { echo "smoke-guest.sh: FAIL: $*" >&2; echo "smoke-guest.sh: logs in $W" >&2; exit 1; }
qemu_errors() { grep -E '^qemu-system[^:]*: ' "$1" | grep -v 'vfio_container_dma_unmap' | head -5 >&2; }

"$REPO/scripts/setup.sh" >/dev/null || { echo "smoke-guest.sh: FAIL: scripts/setup.sh failed" >&2; exit 1; }
if [ $BUILD = 1 ] && [ -z "${SWITCHYARD_BIN:-}" ]; then
  (cd "$REPO" && cargo build -q -p switchyard) || { echo "smoke-guest.sh: FAIL: cargo build -p switchyard" >&2; exit 1; }
fi
[ -x "$BIN" ] || { echo "smoke-guest.sh: FAIL: no server binary $BIN" >&2; exit 1; }

W=$(mktemp -d "${TMPDIR:-/tmp}/sy-smoke.XXXXXX")
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
trap 'stop_server' EXIT
trap 'exit 130' INT TERM

start_server() {  # start_server NAME -> sets SPID, SOCK
  SOCK=$W/$1.sock
  "$BIN" serve --socket "$SOCK" > "$W/$1.server.log" 2>&1 &
  SPID=$!
  for _ in $(seq 100); do
    [ -S "$SOCK" ] && return 0
    kill -0 "$SPID" 2>/dev/null || fail "server exited before listening (see $W/$1.server.log)"
    sleep 0.1
  done
  fail "server socket $SOCK did not appear within 10 s"
}
dev_arg() { printf '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"%s"}}' "$SOCK"; }

# Boot 1: enumeration.
start_server plain
t0=$(date +%s.%N)
"$REPO/scripts/guest-run.sh" --timeout 120 -- -device "$(dev_arg)" < /dev/null > "$W/plain.guest.log" 2>&1
rc=$?
t1=$(date +%s.%N)
stop_server
grep '^GUEST: ' "$W/plain.guest.log" | tr -d '\r'
[ $rc = 0 ] || { qemu_errors "$W/plain.guest.log"; fail "boot 1: QEMU exit code $rc"; }
grep -q '^GUEST: poweroff' "$W/plain.guest.log" || fail "boot 1: guest did not reach poweroff"
grep -Eq "^GUEST: pci [0-9a-f:.]+ vendor=0x$VID device=0x$DID class=0x$CLASS " "$W/plain.guest.log" ||
  fail "boot 1: guest did not see $VID:$DID class $CLASS"
printf 'smoke-guest.sh: boot 1 (enumeration) ok in %.1f s\n' "$(awk "BEGIN{print $t1-$t0}")"

# Boot 2: vIOMMU + vfio-pci in the guest.
if [ $IOMMU = 1 ]; then
  start_server iommu
  t0=$(date +%s.%N)
  "$REPO/scripts/guest-run.sh" --timeout 180 --test vfio-bind --arg "$VID:$DID" --append intel_iommu=on -- \
    -machine kernel-irqchip=split -device intel-iommu,intremap=on,caching-mode=on -device "$(dev_arg)" \
    < /dev/null > "$W/iommu.guest.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  stop_server
  grep '^GUEST: ' "$W/iommu.guest.log" | tr -d '\r'
  [ $rc = 0 ] || { qemu_errors "$W/iommu.guest.log"; fail "boot 2: QEMU exit code $rc"; }
  grep -q '^GUEST: test vfio-bind rc=0' "$W/iommu.guest.log" || fail "boot 2: vfio-bind test failed"
  grep -Eq '^GUEST: vfio-bind [0-9a-f:.]+ driver=vfio-pci group=[0-9]+ dev=/dev/vfio/[0-9]+ ok' "$W/iommu.guest.log" ||
    fail "boot 2: no /dev/vfio/<group> for the device"
  printf 'smoke-guest.sh: boot 2 (intel-iommu, vfio-pci bind) ok in %.1f s\n' "$(awk "BEGIN{print $t1-$t0}")"
fi

echo "smoke-guest.sh: PASS"
if [ $KEEP = 1 ]; then echo "smoke-guest.sh: logs in $W"; else rm -rf "$W"; fi
