#!/bin/sh
# hotplug.sh VID:DID [ROUNDS] — the guest side of the PCIe hot-plug test.
# Each round: wait for the device to appear (the host hot-adds it through QMP), run the in-guest
# driver's quick workload on it, then wait for it to disappear (the host hot-removes it).
# Markers: "HOTPLUG: waiting round=N", "HOTPLUG: present round=N bdf=B", "HOTPLUG: run round=N rc=R",
# "HOTPLUG: gone round=N", "HOTPLUG: done".
id=$1
rounds=${2:-2}
vid=0x${id%:*}
did=0x${id#*:}

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

i=1
while [ "$i" -le "$rounds" ]; do
  echo "HOTPLUG: waiting round=$i"
  t=0
  until bdf=$(find_dev); do
    sleep 0.2; t=$((t + 1))
    [ $t -gt 1500 ] && { echo "HOTPLUG: timeout waiting for the device round=$i"; exit 1; }
  done
  echo "HOTPLUG: present round=$i bdf=$bdf"
  sygpu-driver --quick --bdf "$bdf"
  rc=$?
  echo "HOTPLUG: run round=$i rc=$rc"
  [ "$rc" = 0 ] || exit "$rc"
  t=0
  while find_dev >/dev/null; do
    sleep 0.2; t=$((t + 1))
    [ $t -gt 1500 ] && { echo "HOTPLUG: timeout waiting for removal round=$i"; exit 1; }
  done
  echo "HOTPLUG: gone round=$i"
  i=$((i + 1))
done
echo "HOTPLUG: done"
