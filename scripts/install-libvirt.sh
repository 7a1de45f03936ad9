#!/bin/bash
# scripts/install-libvirt.sh — install the libvirt binaries the libvirt guest test needs
# (idempotent; a no-op when they are there).
#
# Installs, with apt and without recommends (about 4 MB of downloads on Debian 12, libvirt 9.0):
#   libvirt-daemon             libvirtd (the monolithic daemon; the test starts its own)
#   libvirt-daemon-driver-qemu the QEMU driver module libvirtd loads
#   libvirt-clients            virsh
# and does the two things of libvirt-daemon-system the test needs, as its postinst does them:
#   - the user libvirt-qemu (group kvm, also in group libvirt-qemu; uid/gid 64055 when free):
#     libvirt's QEMU driver looks up its default user at start, before it reads qemu.conf,
#     and refuses to start without it (even with user = "root" in qemu.conf);
#   - the empty directories /etc/libvirt, /run/libvirt, /var/lib/libvirt, /var/log/libvirt,
#     /var/cache/libvirt: a root libvirtd has these paths compiled in, so the test bind-mounts
#     private directories over them in a mount namespace of its own, and a mount needs a
#     mount point.
# Not libvirt-daemon-system itself: it pulls in systemd and systemd-sysv (a new init) and
# iptables, and sets up units and a default network. Not QEMU either: libvirt runs the QEMU 11.1
# of scripts/setup.sh (`<emulator>` in the domain XML).
#
# Installing starts no service: policy-rc.d denies every start for the duration of the install
# (one already in place is kept and restored), and the daemons are not started by their
# postinst scripts on a machine without systemd anyway.
#
# With --cluster, also what the cluster rig (scripts/cluster.sh) and its tests need (about
# 16 MB of downloads, 40 MB installed): pacemaker, corosync, crmsh and resource-agents
# (VirtualDomain, ocf-tester). Their daemons are not started either: the rig starts its own.
#
# Usage: scripts/install-libvirt.sh [--cluster] [--check]
#   --cluster also the cluster packages
#   --check   exit 0 if everything is installed, 1 (naming what is missing) otherwise
set -euo pipefail

die() { echo "install-libvirt.sh: error: $*" >&2; exit 1; }
log() { echo "install-libvirt.sh: $*"; }

PKGS=(libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients)
# Executables and the QEMU driver module that must be there afterwards.
WANT=(/usr/sbin/libvirtd /usr/bin/virsh
      /usr/lib/x86_64-linux-gnu/libvirt/connection-driver/libvirt_driver_qemu.so)
DIRS=(/etc/libvirt /run/libvirt /var/lib/libvirt /var/log/libvirt /var/cache/libvirt)
QEMU_ID=64055

CHECK=0
for a in "$@"; do
  case $a in
    --check) CHECK=1 ;;
    --cluster)
      PKGS+=(pacemaker corosync crmsh resource-agents)
      WANT+=(/usr/sbin/corosync /usr/sbin/pacemakerd /usr/sbin/crm /usr/sbin/ocf-tester
             /usr/lib/ocf/resource.d/heartbeat/VirtualDomain) ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$a' (see --help)" ;;
  esac
done

missing() {
  local f
  for f in "${WANT[@]}" "${DIRS[@]}"; do [ -e "$f" ] || echo "$f"; done
  getent passwd libvirt-qemu >/dev/null || echo "user libvirt-qemu"
}

# What libvirt-daemon-system's postinst does for the QEMU user, with groupadd/useradd (package
# passwd, always there) instead of adduser.
add_qemu_user() {
  local gid_opt=() uid_opt=()
  getent group kvm >/dev/null || groupadd --system kvm || die "groupadd kvm failed"
  if ! getent group libvirt-qemu >/dev/null; then
    getent group $QEMU_ID >/dev/null || gid_opt=(--gid "$QEMU_ID")
    groupadd --system "${gid_opt[@]}" libvirt-qemu || die "groupadd libvirt-qemu failed"
  fi
  if ! getent passwd libvirt-qemu >/dev/null; then
    getent passwd $QEMU_ID >/dev/null || uid_opt=(--uid "$QEMU_ID")
    # (useradd warns that 64055 is above SYS_UID_MAX: Debian allocates it on purpose.)
    useradd --system "${uid_opt[@]}" --gid kvm --groups libvirt-qemu --home-dir /var/lib/libvirt \
      --no-create-home --shell /usr/sbin/nologin --comment "Libvirt Qemu" libvirt-qemu 2>/dev/null ||
      die "useradd libvirt-qemu failed"
  fi
}

if [ -z "$(missing)" ]; then
  log "up to date: $(libvirtd --version 2>/dev/null | sed -n 1p)"
  exit 0
fi
if [ $CHECK = 1 ]; then
  echo "install-libvirt.sh: missing: $(missing | tr '\n' ' ')" >&2
  exit 1
fi
[ "$(id -u)" = 0 ] || die "not root: run as root, or apt-get install --no-install-recommends ${PKGS[*]}"
command -v apt-get >/dev/null || die "no apt-get: install ${PKGS[*]} (libvirt >= 9.0) by other means"

T0=$(date +%s)
if [ -z "$(for f in "${WANT[@]}"; do [ -e "$f" ] || echo "$f"; done)" ]; then
  add_qemu_user
  mkdir -p "${DIRS[@]}"
  [ -z "$(missing)" ] || die "still missing: $(missing | tr '\n' ' ')"
  log "added what was missing of the libvirt-qemu user and the mount points"
  exit 0
fi
# No service may start while packages are configured. policy-rc.d is what invoke-rc.d and
# deb-systemd-invoke ask; keep an existing one and put it back afterwards.
POLICY=/usr/sbin/policy-rc.d
SAVED=""
if [ -e $POLICY ]; then
  SAVED=$(mktemp "${TMPDIR:-/tmp}/policy-rc.d.XXXXXX")
  cp -a $POLICY "$SAVED"
fi
restore() {
  if [ -n "$SAVED" ]; then mv -f "$SAVED" $POLICY; else rm -f $POLICY; fi
}
trap restore EXIT
printf '#!/bin/sh\n# scripts/install-libvirt.sh: no service starts during the install\nexit 101\n' > $POLICY
chmod 755 $POLICY

export DEBIAN_FRONTEND=noninteractive
log "installing ${PKGS[*]} (no recommends)"
if ! apt-get -qq install -y --no-install-recommends "${PKGS[@]}" >/dev/null 2>&1; then
  apt-get -qq update >/dev/null 2>&1 || die "apt-get update failed"
  apt-get -qq install -y --no-install-recommends "${PKGS[@]}" >/dev/null ||
    die "apt-get install ${PKGS[*]} failed"
fi
restore
trap - EXIT
add_qemu_user
mkdir -p "${DIRS[@]}"

[ -z "$(missing)" ] || die "installed ${PKGS[*]}, but still missing: $(missing | tr '\n' ' ')"
log "installed $(libvirtd --version | sed -n 1p) in $(( $(date +%s) - T0 )) s"
