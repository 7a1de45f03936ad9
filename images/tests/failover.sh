#!/bin/sh
# failover.sh VID:DID — the guest side of the guest-visible failover test.
# Waits for the device (the host hot-adds it) and runs the driver's soak on it until the
# board fails under it (its VRAM is lost: the device stops its queues with DEVICE_LOST and the
# driver gives up at once; --timeout bounds a wait otherwise), then waits while the pool
# daemon unplugs the dead device and plugs a fresh one of a healthy board into the same slot,
# and runs the full workload on that one.
# Markers: "FAILOVER: waiting", "FAILOVER: present bdf=B", "FAILOVER: first run rc=R",
# "FAILOVER: gone", "FAILOVER: back bdf=B", "FAILOVER: rerun rc=R".
id=$1
vid=0x${id%:*}
did=0x${id#*:}

. /tests/pci-lib.sh

echo "FAILOVER: waiting"
wait_dev FAILOVER
echo "FAILOVER: present bdf=$bdf"
# Held across the first run: the device may be gone by the time the driver lets go of it (the
# unplug waits for that), and reads through this descriptor fail once it is.
exec 3< "/sys/bus/pci/devices/$bdf/config"
sygpu-driver --bdf "$bdf" --timeout 5 --soak 600
echo "FAILOVER: first run rc=$?"
t=0
while dd bs=1 count=1 <&3 >/dev/null 2>&1; do
  sleep 0.2; t=$((t + 1))
  [ $t -gt 1500 ] && { echo "FAILOVER: timeout waiting for the removal"; exit 1; }
done
exec 3<&-
echo "FAILOVER: gone"
wait_dev FAILOVER
echo "FAILOVER: back bdf=$bdf"
sygpu-driver --bdf "$bdf"
rc=$?
echo "FAILOVER: rerun rc=$rc"
exit "$rc"
