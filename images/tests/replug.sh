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

wait_present() {
  t=0
  until bdf=$(find_dev); do
    sleep 0.2; t=$((t + 1))
    [ $t -gt 1500 ] && { echo "REPLUG: timeout waiting for the device"; exit 1; }
  done
}

echo "REPLUG: waiting"
wait_present
echo "REPLUG: present bdf=$bdf"
sygpu-driver --bdf "$bdf" --stamp "$seed"
rc=$?
echo "REPLUG: stamped rc=$rc"
[ "$rc" = 0 ] || exit "$rc"
t=0
while find_dev >/dev/null; do
  sleep 0.2; t=$((t + 1))
  [ $t -gt 1500 ] && { echo "REPLUG: timeout waiting for the removal"; exit 1; }
done
echo "REPLUG: gone"
wait_present
echo "REPLUG: back bdf=$bdf"
sygpu-driver --bdf "$bdf" --check-stamp "$seed"
rc=$?
echo "REPLUG: checked rc=$rc"
exit "$rc"
