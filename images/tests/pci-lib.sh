#!/bin/sh
# pci-lib.sh — sourced by the hot-plug guest scripts (not a test of its own).
# find_dev: prints the address of the first PCI device with $vid/$did (0x-prefixed, as in
# sysfs); fails when there is none.
find_dev() {
  for d in /sys/bus/pci/devices/*; do
    [ -r "$d/vendor" ] || continue
    if [ "$(cat "$d/vendor")" = "$vid" ] && [ "$(cat "$d/device")" = "$did" ]; then
      echo "${d##*/}"
      return 0
    fi
  done
  return 1
}

# wait_dev PREFIX: waits (up to 5 min) until find_dev succeeds; sets $bdf.
wait_dev() {
  t=0
  until bdf=$(find_dev); do
    sleep 0.2; t=$((t + 1))
    [ $t -gt 1500 ] && { echo "$1: timeout waiting for the device"; exit 1; }
  done
}

# wait_gone PREFIX: waits (up to 5 min) until the device at $bdf (found by wait_dev) is
# removed. It holds its config file open: once the device is removed, reads through that
# descriptor fail even if a new device already sits at the same address (an unplug and
# re-plug can be shorter than one poll), so a quick re-plug is not missed.
wait_gone() {
  # Gone already (the host can remove it as soon as the workload ends): nothing to wait for.
  # `command` keeps a failed redirection (removed between the test and the open) from
  # ending the shell, as a special built-in's error would.
  [ -e "/sys/bus/pci/devices/$bdf/config" ] || return 0
  command exec 3< "/sys/bus/pci/devices/$bdf/config" 2>/dev/null || return 0
  t=0
  while dd bs=1 count=1 skip=0 <&3 >/dev/null 2>&1; do
    sleep 0.2; t=$((t + 1))
    [ $t -gt 1500 ] && { echo "$1: timeout waiting for the removal"; exit 1; }
  done
  exec 3<&-
}
