#!/bin/bash
# scripts/guest-run.sh — boot a test guest under TCG with the serial console on stdout.
#
# Usage: scripts/guest-run.sh [options] [-- extra QEMU args]
#   --initrd FILE    initramfs (default: $SWITCHYARD_CACHE/initramfs-base.cpio.gz, built on demand
#                    with images/build-initramfs.sh)
#   --append "..."   extra kernel command line (e.g. "sy.test=vfio-bind sy.arg=1234:5347 intel_iommu=on")
#   --test NAME      shorthand for --append sy.test=NAME
#   --arg VALUE      shorthand for --append sy.arg=VALUE (repeatable; no spaces)
#   --timeout S      kill QEMU after S seconds (default 120); exit code 124 then
#   --smp N          vCPUs (default 1)
#   --mem MIB        guest RAM in MiB (default 512)
#   --kernel FILE    PVH vmlinux (default: $SWITCHYARD_CACHE/vmlinux)
#   --dry-run        print the QEMU command line and exit
# The exit code is QEMU's (0 after the guest's poweroff), or 124 on timeout. A guest kernel panic
# also ends in exit 0 (panic=-1 + -no-reboot), so callers must check the GUEST: markers.
#
# Guest RAM is a shared memfd backend (memory-backend-memfd,share=on) so that a vfio-user server
# receives the RAM as file descriptors it can mmap for DMA.
set -euo pipefail

die() { echo "guest-run.sh: error: $*" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${SWITCHYARD_CACHE:-$REPO/.cache/vmtools}
INITRD=""
APPEND=""
TIMEOUT=120
SMP=1
MEM=512
KERNEL=$CACHE/vmlinux
DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    --initrd|--append|--test|--arg|--timeout|--smp|--mem|--kernel)
      [ $# -ge 2 ] || die "$1 needs a value" ;;
  esac
  case $1 in
    --initrd) INITRD=$2; shift 2 ;;
    --append) APPEND="$APPEND $2"; shift 2 ;;
    --test) APPEND="$APPEND sy.test=$2"; shift 2 ;;
    --arg) case $2 in *[[:space:]]*) die "--arg '$2' contains whitespace" ;; esac
           APPEND="$APPEND sy.arg=$2"; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --smp) SMP=$2; shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --kernel) KERNEL=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (QEMU arguments go after --)" ;;
  esac
done
case $TIMEOUT in ''|*[!0-9]*) die "--timeout must be a number of seconds" ;; esac
case $MEM in ''|*[!0-9]*) die "--mem must be a number of MiB" ;; esac

if [ ! -x "$CACHE/qemu" ] || [ ! -s "$KERNEL" ]; then
  die "no QEMU/kernel in $CACHE: run scripts/setup.sh first"
fi
if [ -z "$INITRD" ]; then
  INITRD=$CACHE/initramfs-base.cpio.gz
  stale=0
  [ -s "$INITRD" ] || stale=1
  for f in "$REPO"/images/build-initramfs.sh "$REPO"/images/guest/* "$REPO"/images/tests/* "$CACHE/stamp"; do
    [ "$f" -nt "$INITRD" ] && stale=1
  done
  if [ $stale = 1 ]; then
    "$REPO/images/build-initramfs.sh" "$INITRD" >&2 || die "building $INITRD failed"
  fi
fi
[ -s "$INITRD" ] || die "initrd '$INITRD' not found"

# shellcheck disable=SC2054  # commas are QEMU option syntax
CMD=("$CACHE/qemu"
  -accel tcg                                   # /dev/kvm here is PVM: stock kernels cannot boot on it
  -machine q35,memory-backend=mem0
  -object "memory-backend-memfd,id=mem0,size=${MEM}M,share=on"
  -m "$MEM" -smp "$SMP"
  -nodefaults -display none -serial stdio -no-reboot
  -kernel "$KERNEL" -initrd "$INITRD"
  -append "console=ttyS0 panic=-1 quiet no_timer_check${APPEND}"   # switchyard_qemu::GUEST_BOOT_ARGS
  "$@")
if [ $DRY = 1 ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi

# --foreground: QEMU stays in our process group so -serial stdio may use a terminal; -k: SIGKILL
# 5 s after the SIGTERM if QEMU does not exit.
set +e
timeout --foreground -k 5 "$TIMEOUT" "${CMD[@]}"
rc=$?
set -e
[ $rc = 124 ] && echo "guest-run.sh: timeout after ${TIMEOUT} s, QEMU killed" >&2
exit $rc
