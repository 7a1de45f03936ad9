#!/bin/sh
# nested.sh SY-NESTED-ARG... — L1 side of the nested tests: this guest plays the host.
# Loads KVM (nested SVM: L0 must give this guest `-cpu EPYC`), checks /dev/kvm, then runs
# sy-nested (guest-tests/nested), which starts switchyard and cloud-hypervisor and boots L2s.
# Needs an image built with build-initramfs.sh --nested (KVM modules; cloud-hypervisor, which the
# ch-* and mmio-bench scenarios need, when the setup cache had it: docs/cloud-hypervisor.md).
order=/lib/modules/nested/nested-order
[ -r $order ] || { echo "NESTED: no $order (image not built with --nested)"; exit 1; }
while read -r m; do
  err=$(insmod "/lib/modules/nested/$m.ko" 2>&1) || { echo "NESTED: insmod $m failed: $err"; exit 1; }
done < $order
grep -qw svm /proc/cpuinfo || { echo "NESTED: no svm flag in /proc/cpuinfo (L0 needs -cpu EPYC)"; exit 1; }
[ -c /dev/kvm ] || { echo "NESTED: no /dev/kvm after loading $(tr '\n' ' ' < $order)"; exit 1; }
echo "NESTED: kvm ready: $(dmesg | grep -c 'Nested Paging enabled') npt, $(grep -c ^processor /proc/cpuinfo) cpus, $(free -m | awk '/Mem:/ {print $2}') MiB"
mkdir -p /tmp/nested
sy-nested "$@"
