#!/bin/bash
# scripts/boot-guest.sh — boot a Linux guest (QEMU 11.1, TCG) that sees the device of a running
# `switchyard serve` (or of a pool daemon's endpoint), with the serial console on this terminal.
#
# Usage: scripts/boot-guest.sh [--socket PATH] [--iommu] [--driver [--rounds N]] [--shell]
#                              [--device-id ID] [--bus ID] [--qmp PATH] [--timeout S]
#                              [-- extra QEMU args]
#   --socket PATH    the server's socket (default /tmp/switchyard.sock)
#   --iommu          add the emulated VT-d (intel-iommu,caching-mode=on + intel_iommu=on) and bind
#                    the device to vfio-pci in the guest (the vfio-bind guest test)
#   --driver         run the in-guest VFIO driver's workload on the device (COPY, FILL, SAXPY, GEMM,
#                    REDUCE; implies --iommu); builds the static sygpu-driver if needed (unless
#                    SYGPU_DRIVER names one)
#   --rounds N       with --driver: run the workload N times, once per plug of the device. Round 1
#                    runs on the device present at boot; after each round but the last the guest
#                    waits until the device is unplugged and plugged in again (a pool daemon's
#                    `ctl detach` + `ctl attach`, or a guest-visible `ctl move`: QMP device_del +
#                    device_add, which needs --bus and --qmp) and re-probes it for the next round.
#                    The guest powers off after round N. Console markers, one line each:
#                      ROUNDS: round=K present bdf=B   (the driver starts)
#                      ROUNDS: round=K rc=R            (R=0: every job verified bit-exact)
#                      ROUNDS: round=K gone            (the device was unplugged)
#                      ROUNDS: done
#   --device-id ID   the vfio-user-pci device's QEMU id (default gpu0): what QMP device_del names
#                    (`switchyard ctl vmm ... --device-id ID`)
#   --bus ID         put the device on a PCIe root port with this id (e.g. rp1), created here, so
#                    that it can be unplugged and plugged into the same slot again
#                    (`switchyard ctl vmm ... --bus ID`); default: the root complex, where the
#                    device cannot be unplugged
#   --qmp PATH       serve QMP on a UNIX socket at PATH (QEMU creates it), for hot-plug and for a
#                    pool daemon's VMM link (`switchyard ctl vmm ... --qmp PATH`)
#   --shell          an interactive shell on the console after boot (exit it to power off)
#   --timeout S      kill QEMU after S seconds (default 300; none with --shell)
#   --dry-run        print the QEMU command line (guest-run.sh --dry-run) and exit; the socket
#                    need not exist yet
#
# First, in another terminal (the server must be listening before QEMU starts):
#   cargo run --release -p switchyard -- serve --socket /tmp/switchyard.sock
#
# The guest lists its PCI devices (`GUEST: pci ... vendor=0x1234 device=0x5347 ...` is the
# softgpu), runs the chosen test, and powers off. Exit 0 when the guest saw the device (and the
# test passed). QEMU, the guest kernel and busybox come from scripts/setup.sh (run here once).
# The console goes to stdout, so the guest can run in the background with its console in a file:
#   scripts/boot-guest.sh --socket S --driver --rounds 3 --bus rp1 --qmp q.sock > guest.log 2>&1 &
set -euo pipefail

die() { echo "boot-guest.sh: error: $*" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SOCKET=/tmp/switchyard.sock
IOMMU=0
DRIVER=0
ROUNDS=""
SHELL_=0
TIMEOUT=300
DEVICE_ID=gpu0
BUS=""
QMP=""
DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    --socket|--timeout|--rounds|--device-id|--bus|--qmp) [ $# -ge 2 ] || die "$1 needs a value" ;;
  esac
  case $1 in
    --socket) SOCKET=$2; shift 2 ;;
    --iommu) IOMMU=1; shift ;;
    --driver) DRIVER=1; IOMMU=1; shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --device-id) DEVICE_ID=$2; shift 2 ;;
    --bus) BUS=$2; shift 2 ;;
    --qmp) QMP=$2; shift 2 ;;
    --shell) SHELL_=1; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (QEMU arguments go after --)" ;;
  esac
done
case $TIMEOUT in ''|*[!0-9]*) die "--timeout must be a number of seconds" ;; esac
if [ -n "$ROUNDS" ]; then
  case $ROUNDS in ''|*[!0-9]*|0) die "--rounds must be a number of rounds (1 or more)" ;; esac
  [ $DRIVER = 1 ] || die "--rounds needs --driver"
  [ $SHELL_ = 0 ] || die "--rounds and --shell do not go together"
fi
# QEMU ids: a letter, then letters, digits, '-', '.', '_'.
for id in "$DEVICE_ID" ${BUS:+"$BUS"}; do
  case $id in [A-Za-z]*) ;; *) die "'$id' is not a QEMU id (a letter first)" ;; esac
  case $id in *[!A-Za-z0-9._-]*) die "'$id' is not a QEMU id (letters, digits, - . _)" ;; esac
done

[ -S "$SOCKET" ] || [ $DRY = 1 ] || die "no server socket at $SOCKET; start the server first:
  cargo run --release -p switchyard -- serve --socket $SOCKET"
SOCKET=$(realpath -m "$SOCKET")
case $SOCKET in *'"'*|*\\*) die "the socket path must not contain \" or \\" ;; esac

"$REPO/scripts/setup.sh" >&2

# The console log and the in-guest round script are removed at exit.
LOG=""
ROUNDS_SH=""
trap 'rm -f "$LOG" "$LOG.clean" "$ROUNDS_SH"' EXIT

ARGS=(--timeout "$TIMEOUT")
[ $SHELL_ = 1 ] && ARGS=(--timeout 31536000 --append sy.shell)
QEMU_ARGS=()
if [ $IOMMU = 1 ]; then
  ARGS+=(--append intel_iommu=on)
  # shellcheck disable=SC2054  # commas are QEMU option syntax
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
  # The guest side of --rounds (run by the guest's /init as the test `driver-rounds`); the
  # device waits are those of the hot-plug guest tests (images/tests/pci-lib.sh).
  ROUNDS_SH=$(mktemp "${TMPDIR:-/tmp}/driver-rounds.XXXXXX")
  cat > "$ROUNDS_SH" <<'GUEST'
#!/bin/sh
# driver-rounds.sh N — written into the image by scripts/boot-guest.sh (--rounds N).
rounds=$1
vid=0x1234
did=0x5347
. /tests/pci-lib.sh
i=1
while :; do
  wait_dev "ROUNDS: round=$i"
  echo "ROUNDS: round=$i present bdf=$bdf"
  sygpu-driver --bdf "$bdf"
  rc=$?
  echo "ROUNDS: round=$i rc=$rc"
  [ "$rc" = 0 ] || exit "$rc"
  [ "$i" -lt "$rounds" ] || break
  wait_gone "ROUNDS: round=$i"
  echo "ROUNDS: round=$i gone"
  i=$((i + 1))
done
echo "ROUNDS: done"
GUEST
  INITRD=$REPO/target/boot-guest/initramfs-driver.cpio.gz
  mkdir -p "$(dirname "$INITRD")"
  "$REPO/images/build-initramfs.sh" "$INITRD" --add "$DRV" \
    --add "$ROUNDS_SH:/tests/driver-rounds.sh" >&2
  ARGS+=(--initrd "$INITRD")
  if [ -n "$ROUNDS" ]; then
    ARGS+=(--test driver-rounds --arg "$ROUNDS")
  else
    ARGS+=(--test sygpu-driver)
  fi
elif [ $IOMMU = 1 ]; then
  ARGS+=(--test vfio-bind --arg 1234:5347)
fi
# As the guest-test harness does (switchyard-qemu): a root port with room for a bigger BAR of a
# device plugged in later.
# shellcheck disable=SC2054  # commas are QEMU option syntax
[ -z "$BUS" ] || QEMU_ARGS+=(-device "pcie-root-port,id=$BUS,chassis=1,slot=1,pref64-reserve=256M")
DEV="{\"driver\":\"vfio-user-pci\",\"id\":\"$DEVICE_ID\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCKET\"}"
[ -z "$BUS" ] || DEV="$DEV,\"bus\":\"$BUS\""
QEMU_ARGS+=(-device "$DEV}")
# QEMU option syntax: a comma in the path is doubled.
[ -z "$QMP" ] || QEMU_ARGS+=(-qmp "unix:${QMP//,/,,},server=on,wait=off")

if [ $DRY = 1 ]; then
  "$REPO/scripts/guest-run.sh" --dry-run "${ARGS[@]}" -- "${QEMU_ARGS[@]}" "$@"
  exit 0
fi
if [ $SHELL_ = 1 ]; then
  exec "$REPO/scripts/guest-run.sh" "${ARGS[@]}" -- "${QEMU_ARGS[@]}" "$@"
fi

# The console goes to stdout and to a log, which is checked afterwards.
LOG=$(mktemp "${TMPDIR:-/tmp}/boot-guest.XXXXXX")
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
