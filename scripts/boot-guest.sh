#!/bin/bash
# scripts/boot-guest.sh — boot a Linux guest (QEMU 11.1, TCG) that sees the device of a running
# `switchyard serve`, with the serial console on this terminal.
#
# Usage: scripts/boot-guest.sh [--socket PATH] [--iommu] [--driver] [--shell] [--timeout S]
#                              [-- extra QEMU args]
#   --socket PATH  the server's socket (default /tmp/switchyard.sock)
#   --iommu        add the emulated VT-d (intel-iommu,caching-mode=on + intel_iommu=on) and bind
#                  the device to vfio-pci in the guest (the vfio-bind guest test)
#   --driver       run the in-guest VFIO driver's workload on the device (COPY, FILL, SAXPY, GEMM,
#                  REDUCE; implies --iommu); builds the static sygpu-driver if needed
#   --shell        an interactive shell on the console after boot (exit it to power off)
#   --timeout S    kill QEMU after S seconds (default 300; none with --shell)
#
# First, in another terminal (the server must be listening before QEMU starts):
#   cargo run --release -p switchyard -- serve --socket /tmp/switchyard.sock
#
# The guest lists its PCI devices (`GUEST: pci ... vendor=0x1234 device=0x5347 ...` is the
# softgpu), runs the chosen test, and powers off. Exit 0 when the guest saw the device (and the
# test passed). QEMU, the guest kernel and busybox come from scripts/setup.sh (run here once).
set -euo pipefail

die() { echo "boot-guest.sh: error: $*" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SOCKET=/tmp/switchyard.sock
IOMMU=0
DRIVER=0
SHELL_=0
TIMEOUT=300
while [ $# -gt 0 ]; do
  case $1 in
    --socket|--timeout) [ $# -ge 2 ] || die "$1 needs a value" ;;
  esac
  case $1 in
    --socket) SOCKET=$2; shift 2 ;;
    --iommu) IOMMU=1; shift ;;
    --driver) DRIVER=1; IOMMU=1; shift ;;
    --shell) SHELL_=1; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (QEMU arguments go after --)" ;;
  esac
done
case $TIMEOUT in ''|*[!0-9]*) die "--timeout must be a number of seconds" ;; esac

[ -S "$SOCKET" ] || die "no server socket at $SOCKET; start the server first:
  cargo run --release -p switchyard -- serve --socket $SOCKET"
SOCKET=$(realpath "$SOCKET")
case $SOCKET in *'"'*|*'\'*) die "the socket path must not contain \" or \\" ;; esac

"$REPO/scripts/setup.sh" >&2

ARGS=(--timeout "$TIMEOUT")
[ $SHELL_ = 1 ] && ARGS=(--timeout 31536000 --append sy.shell)
QEMU_ARGS=()
if [ $IOMMU = 1 ]; then
  ARGS+=(--append intel_iommu=on)
  QEMU_ARGS+=(-machine kernel-irqchip=split -device intel-iommu,caching-mode=on)
fi
if [ $DRIVER = 1 ]; then
  DRV=${SYGPU_DRIVER:-$REPO/target/x86_64-unknown-linux-gnu/release/sygpu-driver}
  if [ -z "${SYGPU_DRIVER:-}" ]; then
    echo "==> building the static in-guest driver" >&2
    (cd "$REPO" && RUSTFLAGS="-C target-feature=+crt-static" \
      cargo build --release --locked -p sygpu-driver --target x86_64-unknown-linux-gnu) >&2
  fi
  [ -x "$DRV" ] || die "no in-guest driver at $DRV"
  INITRD=$REPO/target/boot-guest/initramfs-driver.cpio.gz
  mkdir -p "$(dirname "$INITRD")"
  "$REPO/images/build-initramfs.sh" "$INITRD" --add "$DRV" >&2
  ARGS+=(--initrd "$INITRD" --test sygpu-driver)
elif [ $IOMMU = 1 ]; then
  ARGS+=(--test vfio-bind --arg 1234:5347)
fi
QEMU_ARGS+=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCKET\"}}")

if [ $SHELL_ = 1 ]; then
  exec "$REPO/scripts/guest-run.sh" "${ARGS[@]}" -- "${QEMU_ARGS[@]}" "$@"
fi

# The console goes to this terminal and to a log, which is checked afterwards.
LOG=$(mktemp "${TMPDIR:-/tmp}/boot-guest.XXXXXX")
trap 'rm -f "$LOG"' EXIT
set +e
"$REPO/scripts/guest-run.sh" "${ARGS[@]}" -- "${QEMU_ARGS[@]}" "$@" < /dev/null | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
tr -d '\r' < "$LOG" > "$LOG.clean" && mv "$LOG.clean" "$LOG"
if ! grep -Eq '^GUEST: pci [0-9a-f:.]+ vendor=0x1234 device=0x5347 ' "$LOG"; then
  echo "boot-guest.sh: FAIL: the guest did not see the softgpu (1234:5347); QEMU exit code $rc" >&2
  exit 1
fi
echo "boot-guest.sh: the guest saw the softgpu (1234:5347)" >&2
if grep -Eq '^GUEST: test [^ ]+ rc=' "$LOG" && ! grep -Eq '^GUEST: test [^ ]+ rc=0$' "$LOG"; then
  echo "boot-guest.sh: FAIL: the guest test failed: $(grep -E '^GUEST: test [^ ]+ rc=' "$LOG")" >&2
  exit 1
fi
[ "$rc" = 0 ] || { echo "boot-guest.sh: FAIL: QEMU exit code $rc" >&2; exit 1; }
