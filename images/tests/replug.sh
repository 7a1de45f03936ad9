#!/bin/sh
# replug.sh VID:DID SEED — the guest side of the guest-visible move test.
# Waits for the device (the host hot-adds it), writes a VRAM stamp through VFIO, waits while the
# pool daemon unplugs the device, moves it to another board and plugs it back, then checks
# that VRAM still holds the stamp (through the BAR2 mapping and an engine COPY).
# Markers: "REPLUG: waiting", "REPLUG: present bdf=B", "REPLUG: stamped rc=R", "REPLUG: gone",
# "REPLUG: back bdf=B", "REPLUG: checked rc=R".
id=$1
seed=${2:-1}
vid=0x${id%:*}
did=0x${id#*:}

. /tests/pci-lib.sh

echo "REPLUG: waiting"
wait_dev REPLUG
echo "REPLUG: present bdf=$bdf"
sygpu-driver --bdf "$bdf" --stamp "$seed"
rc=$?
echo "REPLUG: stamped rc=$rc"
[ "$rc" = 0 ] || exit "$rc"
wait_gone REPLUG
echo "REPLUG: gone"
wait_dev REPLUG
echo "REPLUG: back bdf=$bdf"
sygpu-driver --bdf "$bdf" --check-stamp "$seed"
rc=$?
echo "REPLUG: checked rc=$rc"
exit "$rc"
