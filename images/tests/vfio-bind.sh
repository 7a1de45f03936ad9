# Guest test: vfio-bind [VID:DID]  (default 1234:5347, the softgpu)
# Binds every PCI device with that ID to vfio-pci (driver_override + drivers_probe) and checks that
# its VFIO group node /dev/vfio/<group> appears. Needs a vIOMMU (QEMU -device intel-iommu,caching-mode=on,
# guest intel_iommu=on): the Debian kernel has no VFIO no-IOMMU mode.
# Prints "GUEST: vfio-bind BDF driver=vfio-pci group=N dev=/dev/vfio/N ok" per device; rc 0 if all bound.
want=${1:-1234:5347}
vid=${want%%:*}
did=${want#*:}
[ -d /sys/bus/pci/drivers/vfio-pci ] || { echo "GUEST: vfio-bind vfio-pci driver not loaded"; exit 1; }
n=0
fail=0
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/vendor")" = "0x$vid" ] && [ "$(cat "$d/device")" = "0x$did" ] || continue
  n=$((n + 1))
  bdf=${d##*/}
  if [ ! -e "$d/iommu_group" ]; then
    echo "GUEST: vfio-bind $bdf has no iommu_group (vIOMMU missing or intel_iommu=on not given)"
    fail=1
    continue
  fi
  [ -e "$d/driver" ] && echo "$bdf" > "$d/driver/unbind"
  echo vfio-pci > "$d/driver_override"
  echo "$bdf" > /sys/bus/pci/drivers_probe
  drv=none; [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
  grp=$(basename "$(readlink "$d/iommu_group")")
  if [ "$drv" = vfio-pci ] && [ -c "/dev/vfio/$grp" ]; then
    echo "GUEST: vfio-bind $bdf driver=vfio-pci group=$grp dev=/dev/vfio/$grp ok"
  else
    echo "GUEST: vfio-bind $bdf FAILED driver=$drv group=$grp dev=$(ls /dev/vfio 2>/dev/null | tr '\n' ' ')"
    fail=1
  fi
done
[ $n -gt 0 ] || { echo "GUEST: vfio-bind no PCI device $want"; exit 1; }
ls -l /dev/vfio
exit $fail
