#!/bin/sh
# mmio-bench.sh [--count N] LABEL=VID:DID:NTH:BAR:OFFSET... — the L2 side of the nested MMIO benchmark:
# times 32-bit reads of one register of each target with sy-mmio (user space, sysfs resourceN
# mmap, no driver). Prints one "SY-MMIO {json}" line per target; rc 0 if every target ran.
# Devices claimed by a driver need iomem=relaxed on the kernel command line.
count=2000
[ "$1" = --count ] && { count=$2; shift 2; }
rc=0
for t in "$@"; do
  label=${t%%=*}
  IFS=: read -r vid did nth bar off <<EOT
${t#*=}
EOT
  sy-mmio --label "$label" --id "$vid:$did" --nth "$nth" --bar "$bar" --offset "$off" \
    --count "$count" || rc=1
done
exit $rc
