#!/bin/sh
# passthrough.sh [VID:DID] [BARS] [CLIENT ARGS...]  (default 1234:11e8, QEMU's edu; BARS trap|mmap,
# default trap; CLIENT ARGS go to edu-client before the socket, e.g. --msix; a first CLIENT ARG
# --abandon-first runs `edu-client --abandon` first: a client that leaves its DMA window and
# MSI eventfd behind; a first CLIENT ARG --migrate serves a second such device too and runs
# `edu-client --migrate` from the first to the second; a first CLIENT ARG --conformance starts no
# server and runs `edu-client --conformance BDF`, the device conformance suite in that process)
# The guest side of the physical-device (nested VFIO) test: binds the device to vfio-pci, serves
# it with `switchyard serve --device vfio,host=BDF,bars=BARS` on a socket and drives it with
# `edu-client` over vfio-user. Needs the vIOMMU (intel-iommu with intremap/caching-mode, guest
# intel_iommu=on) and both static binaries in the image (--add).
# Markers: "PASSTHROUGH: bdf=B group=G", "PASSTHROUGH: serving", the client's "EDU: ..." lines
# and "EDU-SUMMARY {json}", "PASSTHROUGH: client rc=R", "PASSTHROUGH: server exit=E", then the
# server's log between "PASSTHROUGH: server log begin/end".
id=${1:-1234:11e8}
bars=${2:-trap}
if [ $# -ge 2 ]; then shift 2; else shift $#; fi
abandon=
if [ "$1" = --abandon-first ]; then abandon=1; shift; fi
vid=0x${id%:*}
did=0x${id#*:}

. /tests/pci-lib.sh

sh /tests/vfio-bind.sh "$id" || { echo "PASSTHROUGH: bind failed"; exit 1; }
bdf=$(find_dev) || { echo "PASSTHROUGH: no device $id"; exit 1; }
grp=$(basename "$(readlink "/sys/bus/pci/devices/$bdf/iommu_group")")
echo "PASSTHROUGH: bdf=$bdf group=$grp"

if [ "$1" = --conformance ]; then
  # No server: edu-client runs the device conformance suite on the passthrough kind in its own
  # process (`CONFORMANCE: <check> ok|FAIL`, `CONFORMANCE-SUMMARY {json}`).
  edu-client --conformance "$bdf"
  rc=$?
  echo "PASSTHROUGH: conformance rc=$rc"
  exit "$rc"
fi

sock=/tmp/edu.sock
RUST_LOG=${SY_RUST_LOG:-info,switchyard_vfio=debug} switchyard serve --socket "$sock" --device "vfio,host=$bdf,bars=$bars" \
  2> /tmp/server.log &
pid=$!
t=0
until [ -S "$sock" ]; do
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1; t=$((t + 1))
  [ $t -gt 300 ] && break
done
if [ ! -S "$sock" ]; then
  echo "PASSTHROUGH: server did not start"
  echo "PASSTHROUGH: server log begin"; cat /tmp/server.log; echo "PASSTHROUGH: server log end"
  exit 1
fi
echo "PASSTHROUGH: serving"
if [ -n "$abandon" ]; then
  edu-client --abandon "$sock"
  echo "PASSTHROUGH: abandoning client rc=$?"
fi
if [ "$1" = --migrate ]; then
  # A second server on the second such device: the migration's destination.
  bdf2=$(for d in /sys/bus/pci/devices/*; do
    [ "$(cat "$d/vendor")" = "$vid" ] && [ "$(cat "$d/device")" = "$did" ] && [ "${d##*/}" != "$bdf" ] && echo "${d##*/}"
  done | head -n 1)
  [ -n "$bdf2" ] || { echo "PASSTHROUGH: no second $id for --migrate"; exit 1; }
  echo "PASSTHROUGH: destination bdf=$bdf2"
  RUST_LOG=${SY_RUST_LOG:-info,switchyard_vfio=debug} switchyard serve --socket /tmp/edu2.sock \
    --device "vfio,host=$bdf2,bars=$bars" 2> /tmp/server2.log &
  pid2=$!
  t=0
  until [ -S /tmp/edu2.sock ] || [ $t -gt 300 ]; do sleep 0.1; t=$((t + 1)); done
  edu-client --migrate "$sock" /tmp/edu2.sock
  rc=$?
  kill -TERM "$pid2"
  wait "$pid2"
  echo "PASSTHROUGH: destination server log begin"
  sed 's/^/SERVER2: /' /tmp/server2.log
  echo "PASSTHROUGH: destination server log end"
else
  edu-client "$@" "$sock"
  rc=$?
fi
echo "PASSTHROUGH: client rc=$rc"
kill -TERM "$pid"
wait "$pid"
echo "PASSTHROUGH: server exit=$?"
echo "PASSTHROUGH: server log begin"
sed 's/^/SERVER: /' /tmp/server.log
echo "PASSTHROUGH: server log end"
exit "$rc"
