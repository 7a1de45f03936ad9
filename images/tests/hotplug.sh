#!/bin/sh
# hotplug.sh VID:DID [ROUNDS [DRIVER_ARG...]] — the guest side of the PCIe hot-plug tests (QEMU
# QMP and cloud-hypervisor REST). DRIVER_ARGs go to the driver after --quick --bdf (e.g.
# --noiommu under cloud-hypervisor, which gives a vfio-user device no vIOMMU).
# Each round: wait for the device to appear (the host hot-adds it through QMP), run the in-guest
# driver's quick workload on it, then wait for it to disappear (the host hot-removes it).
# Markers: "HOTPLUG: waiting round=N", "HOTPLUG: present round=N bdf=B", "HOTPLUG: run round=N rc=R",
# "HOTPLUG: gone round=N", "HOTPLUG: done".
id=$1
rounds=${2:-2}
[ $# -ge 2 ] && shift 2 || shift $#
vid=0x${id%:*}
did=0x${id#*:}

. /tests/pci-lib.sh

i=1
while [ "$i" -le "$rounds" ]; do
  echo "HOTPLUG: waiting round=$i"
  wait_dev "HOTPLUG: round=$i"
  echo "HOTPLUG: present round=$i bdf=$bdf"
  sygpu-driver --quick --bdf "$bdf" "$@"
  rc=$?
  echo "HOTPLUG: run round=$i rc=$rc"
  [ "$rc" = 0 ] || exit "$rc"
  wait_gone "HOTPLUG: round=$i"
  echo "HOTPLUG: gone round=$i"
  i=$((i + 1))
done
echo "HOTPLUG: done"
