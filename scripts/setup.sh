#!/bin/bash
# scripts/setup.sh — fetch the guest-test toolchain into a cache directory (idempotent).
#
# Puts into $SWITCHYARD_CACHE (default: <repo>/.cache/vmtools, git-ignored):
#   qemu               wrapper running QEMU >= 10.1 (with vfio-user-pci) from trixie-backports,
#                      extracted into prefix/ and started through the prefix's own ld-linux
#   prefix/            the extracted QEMU closure (docs, man pages, locales pruned)
#   vmlinux            Debian trixie 6.12 guest kernel as a PVH-bootable ELF (for -kernel under TCG)
#   modules/*.ko       decompressed VFIO modules (+ igb and its deps when the flavour has igb)
#   modules/load-order module names in dependency order (insmod order)
#   modules/nested-order the KVM modules (ccp, kvm, kvm_amd) an L1 guest loads to be a host,
#                      in insmod order (their .ko files are in modules/ too)
#   ch/                cloud-hypervisor and ch-remote (static v54), copied from SWITCHYARD_CH_DIR;
#                      optional (docs/cloud-hypervisor.md): when none is found and the cache has
#                      none from an earlier run (or with SWITCHYARD_CH_DIR=off: ch/ is removed), a
#                      WARNING line names the tests that will NOT RUN, and everything else works
#   busybox            busybox-static from trixie
#   stamp              recipe + exact package versions; a matching stamp makes a re-run a no-op
#
# Nothing is installed system-wide except the few host tools below (apt, only if missing).
# The Debian packages are resolved with a private apt configuration (own sources, lists, cache
# and an empty dpkg status) and unpacked with dpkg-deb -x: no dpkg install, no mounts, no chroot.
#
# Usage: scripts/setup.sh [--refresh]
#   --refresh   re-resolve package versions even if the stamp is up to date
# Environment:
#   SWITCHYARD_CACHE           cache directory (default <repo>/.cache/vmtools)
#   SWITCHYARD_KFLAVOR         kernel flavour: amd64 (default, has igb) or cloud-amd64 (smaller, no igb)
#   SWITCHYARD_QEMU_VERSION    exact qemu-system-x86 version to use (default: trixie-backports candidate)
#   SWITCHYARD_KERNEL_VERSION  exact linux-image-$KFLAVOR (meta package) version (default: trixie candidate)
#   SWITCHYARD_BUSYBOX_VERSION exact busybox-static version (default: trixie candidate)
#   DEBIAN_MIRROR              Debian mirror URI (default: the first Debian URI in /etc/apt sources)
#   SWITCHYARD_CH_DIR          directory with static cloud-hypervisor v54 + ch-remote (unset: the
#                              copy an earlier run installed in the cache; none: go without; no
#                              other place is searched); `off`: go without it. No registry ships
#                              them: docs/cloud-hypervisor.md
#   CI                         true or 1: a missing cloud-hypervisor is an error (CI runs every test)
set -euo pipefail

RECIPE=2                       # bump when the cache layout or contents change
QEMU_MIN=1:10.1                # first upstream release with vfio-user-pci
HOST_TOOLS="cpio:cpio zstd:zstd xz:xz-utils gzip:gzip dpkg-deb:dpkg apt-get:apt"

die() { echo "setup.sh: error: $*" >&2; exit 1; }
log() { echo "setup.sh: $*"; }

REFRESH=0
for a in "$@"; do
  case $a in
    --refresh) REFRESH=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$a' (see --help)" ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib/cloud-hypervisor.sh
. "$REPO/scripts/lib/cloud-hypervisor.sh"
# shellcheck source=scripts/lib/debian.sh
. "$REPO/scripts/lib/debian.sh"
CACHE=$(sy_cache "$REPO")
KFLAVOR=${SWITCHYARD_KFLAVOR:-amd64}
case $KFLAVOR in amd64|cloud-amd64) ;; *) die "SWITCHYARD_KFLAVOR must be amd64 or cloud-amd64, not '$KFLAVOR'" ;; esac
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)

# Serialise concurrent runs on the same cache.
exec 9>"$CACHE/.lock"
flock 9

# ---------------------------------------------------------------------------------------------
# 1. Host tools (apt, only what is missing).
# ---------------------------------------------------------------------------------------------
need_pkgs=()
all_pkgs=()
for t in $HOST_TOOLS; do
  all_pkgs+=("${t#*:}")
  command -v "${t%%:*}" >/dev/null 2>&1 || need_pkgs+=("${t#*:}")
done
# Keyring with the trixie archive keys (bookworm's debian-archive-keyring >= 2023.3 has them).
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
all_pkgs+=(debian-archive-keyring)
[ -s $KEYRING ] && [ -e /usr/share/keyrings/debian-archive-trixie-stable.gpg ] || need_pkgs+=(debian-archive-keyring)

# Mirror: the URI the machine's own apt sources name for Debian.
sy_debian_mirror
case $DEBIAN_MIRROR in https://*)
  all_pkgs+=(ca-certificates); [ -e /etc/ssl/certs/ca-certificates.crt ] || need_pkgs+=(ca-certificates) ;;
esac

if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "host packages needed: ${all_pkgs[*]}; installing missing: ${need_pkgs[*]}"
  sy_apt_install "${need_pkgs[@]}"
fi

# ---------------------------------------------------------------------------------------------
# 2. Fast path: a stamp that matches the recipe and flavour, and all outputs present.
# ---------------------------------------------------------------------------------------------
STAMP=$CACHE/stamp
stamp_get() { sed -n "s/^$1=//p" "$STAMP" 2>/dev/null | sed -n 1p; }
print_versions() {
  echo "  cache:          $CACHE ($(du -sh "$CACHE" 2>/dev/null | cut -f1))"
  echo "  qemu-system-x86 $(stamp_get qemu_version)  ($(stamp_get qemu_banner))"
  echo "  kernel          $(stamp_get kernel_pkg) $(stamp_get kernel_version)  (uname -r $(stamp_get kernel_release))"
  echo "  busybox-static  $(stamp_get busybox_version)"
  echo "  guest modules   $(tr '\n' ' ' < "$CACHE/modules/load-order" 2>/dev/null)"
  echo "  nested modules  $(tr '\n' ' ' < "$CACHE/modules/nested-order" 2>/dev/null)"
  if [ -n "$CH_BANNER" ]; then
    echo "  cloud-hypervisor $CH_BANNER (+ ch-remote) in $CACHE/ch"
  else
    echo "  cloud-hypervisor: not installed ($CH_ABSENT; NOT RUN: $(sy_ch_not_run); see docs/cloud-hypervisor.md)"
  fi
  echo "  mirror          $(stamp_get mirror) (trixie, trixie-backports)"
}
outputs_ok() {
  [ -x "$CACHE/qemu" ] && [ -s "$CACHE/vmlinux" ] && [ -x "$CACHE/busybox" ] &&
    [ -s "$CACHE/modules/load-order" ] && [ -s "$CACHE/modules/nested-order" ] &&
    [ -d "$CACHE/prefix/usr/bin" ]
}
# cloud-hypervisor (optional, docs/cloud-hypervisor.md): not in any package registry we reach, so
# it comes as static binaries from a tools directory; copied into the cache (checked on every run,
# cheap) so tests use one path. A cloud-hypervisor that is found but is not v54 is an error.
CH_VERSION_WANT="cloud-hypervisor v54."
CH_BANNER=""
CH_ABSENT=""
ch_absent() {  # ch_absent WHY: go without it (an error under CI); say loudly what will not run
  case ${CI:-} in
    true|1) die "cloud-hypervisor v54 + ch-remote: $1; with CI=${CI} every test runs, those that need them too: set SWITCHYARD_CH_DIR (docs/cloud-hypervisor.md)" ;;
  esac
  rm -rf "$CACHE/ch"   # a stale copy would make the tests expect it
  CH_ABSENT=$1
  echo "setup.sh: WARNING: cloud-hypervisor NOT installed ($1); these will NOT RUN: $(sy_ch_not_run); to run them set SWITCHYARD_CH_DIR to a directory with static cloud-hypervisor v54 + ch-remote (docs/cloud-hypervisor.md)" >&2
}
install_ch() {
  local src=${SWITCHYARD_CH_DIR:-}
  if [ "$src" = off ]; then
    ch_absent "disabled by SWITCHYARD_CH_DIR=off"
    return 0
  fi
  if [ -z "$src" ]; then
    # Only SWITCHYARD_CH_DIR names a source: no path outside the clone is searched. A copy an
    # earlier run installed from it is kept (set SWITCHYARD_CH_DIR=off to drop it), so that
    # variable is needed once, not on every run.
    if ! sy_ch_installed "$CACHE"; then
      ch_absent "not found: SWITCHYARD_CH_DIR is unset and $CACHE/ch has none from an earlier run"
      return 0
    fi
    src=$CACHE/ch
    log "cloud-hypervisor: SWITCHYARD_CH_DIR is unset; keeping the copy installed earlier in $CACHE/ch"
  fi
  if ! [ -x "$src/cloud-hypervisor" ] || ! [ -x "$src/ch-remote" ]; then
    die "$src has no executable cloud-hypervisor and ch-remote (set SWITCHYARD_CH_DIR to a directory with both, or to off to go without; docs/cloud-hypervisor.md)"
  fi
  mkdir -p "$CACHE/ch"
  for f in cloud-hypervisor ch-remote; do
    cmp -s "$src/$f" "$CACHE/ch/$f" 2>/dev/null || install -m 755 "$src/$f" "$CACHE/ch/$f"
  done
  if [ "$src" != "$CACHE/ch" ]; then
    for f in "$src"/*.txt; do [ -e "$f" ] && install -m 644 "$f" "$CACHE/ch/"; done
  fi
  local v
  # `sed -n 1p`, not `head -1`: head exits after one line and the writer, still printing, dies
  # of the closed pipe (cloud-hypervisor panics: exit 101), which pipefail makes fatal.
  v=$("$CACHE/ch/cloud-hypervisor" --version 2>&1 | sed -n 1p)
  case $v in "$CH_VERSION_WANT"*) ;; *) rm -rf "$CACHE/ch"; die "$src/cloud-hypervisor says '$v', want $CH_VERSION_WANT* (docs/cloud-hypervisor.md)" ;; esac
  CH_BANNER=$v
}
want_ok() {  # pins requested through the environment match the stamp
  [ -z "${SWITCHYARD_QEMU_VERSION:-}" ] || [ "$SWITCHYARD_QEMU_VERSION" = "$(stamp_get qemu_version)" ] || return 1
  [ -z "${SWITCHYARD_KERNEL_VERSION:-}" ] || [ "$SWITCHYARD_KERNEL_VERSION" = "$(stamp_get kernel_meta_version)" ] || return 1
  [ -z "${SWITCHYARD_BUSYBOX_VERSION:-}" ] || [ "$SWITCHYARD_BUSYBOX_VERSION" = "$(stamp_get busybox_version)" ] || return 1
}
if [ $REFRESH = 0 ] && [ -f "$STAMP" ] && [ "$(stamp_get recipe)" = $RECIPE ] &&
   [ "$(stamp_get kflavor)" = "$KFLAVOR" ] && outputs_ok && want_ok; then
  install_ch
  log "up to date"
  print_versions
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# 3. Private apt configuration for trixie + trixie-backports.
# ---------------------------------------------------------------------------------------------
T0=$(date +%s)
log "host packages used: ${all_pkgs[*]} (all present now)"
APTD=$CACHE/apt
mkdir -p "$APTD"/lists/partial "$APTD"/cache/archives/partial
cat > "$APTD/trixie.sources" <<EOF
Types: deb
URIs: $DEBIAN_MIRROR
Suites: trixie trixie-backports
Components: main
Signed-By: $KEYRING
EOF
: > "$APTD/status"
cat > "$APTD/apt.conf" <<EOF
Dir::Etc::SourceParts "/dev/null"; Dir::Etc::SourceList "$APTD/trixie.sources";
Dir::Etc::Preferences "/dev/null"; Dir::Etc::PreferencesParts "/dev/null";
Dir::State::Lists "$APTD/lists"; Dir::State::status "$APTD/status"; Dir::Cache "$APTD/cache";
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT::Architecture "amd64"; APT::Architectures { "amd64"; };
APT::Install-Recommends "false"; APT::Install-Suggests "false"; APT::Default-Release "trixie";
APT::Sandbox::User "root"; Acquire::Languages "none";
Acquire::IndexTargets::deb::DEP-11::DefaultEnabled "false";
Acquire::Retries "3";
EOF
export APT_CONFIG=$APTD/apt.conf
LOG=$CACHE/setup.log
: > "$LOG"
# Whatever happens, do not leave downloads, package lists or a half-built tree behind.
cleanup() {
  rm -rf "$APTD"/cache/archives/*.deb "$APTD"/single "$CACHE/.new" \
         "$APTD"/lists/*_Packages* "$APTD"/lists/*Release* "$APTD"/lists/partial/*
}
trap cleanup EXIT

log "resolving packages from $DEBIAN_MIRROR (trixie, trixie-backports)"
apt-get update >>"$LOG" 2>&1 || die "apt-get update of trixie/trixie-backports from $DEBIAN_MIRROR failed (see $LOG)"
# apt-get update exits 0 even when an index could not be fetched: check the lists are there.
ls "$APTD"/lists/*trixie-backports_main_binary-amd64_Packages* >/dev/null 2>&1 &&
  ls "$APTD"/lists/*trixie_main_binary-amd64_Packages* >/dev/null 2>&1 ||
  die "trixie/trixie-backports package lists could not be downloaded from $DEBIAN_MIRROR (see $LOG)"

# madison: " pkg | version | URI suite/main amd64 Packages"
version_in() {  # version_in PKG SUITE -> highest version of PKG in exactly SUITE
  apt-cache madison "$1" 2>/dev/null | awk -F'|' -v s=" $2/main " '
    index($3, s) && !done { gsub(/ /, "", $2); print $2; done = 1 }'
}

QEMU_VERSION=${SWITCHYARD_QEMU_VERSION:-$(version_in qemu-system-x86 trixie-backports)}
[ -n "$QEMU_VERSION" ] || die "qemu-system-x86 not found in trixie-backports (see $LOG)"
dpkg --compare-versions "$QEMU_VERSION" ge "$QEMU_MIN" ||
  die "qemu-system-x86 $QEMU_VERSION is older than $QEMU_MIN (no vfio-user-pci)"

KMETA_VERSION=${SWITCHYARD_KERNEL_VERSION:-$(version_in "linux-image-$KFLAVOR" trixie)}
[ -n "$KMETA_VERSION" ] || die "linux-image-$KFLAVOR not found in trixie (see $LOG)"
# The meta package depends on the versioned image package, e.g.
# "Depends: linux-image-6.12.57+deb13-amd64 (= 6.12.57-1)".
read -r KPKG KVERSION < <(apt-cache show "linux-image-$KFLAVOR=$KMETA_VERSION" 2>>"$LOG" |
  sed -n 's/^Depends: .*\(linux-image-[0-9][^ ,]*\) (= \([^)]*\)).*/\1 \2/p' | head -1) || true
[ -n "${KPKG:-}" ] && [ -n "${KVERSION:-}" ] || die "cannot resolve the image package of linux-image-$KFLAVOR=$KMETA_VERSION"
case $KPKG in linux-image-6.12.*) ;; *) die "linux-image-$KFLAVOR=$KMETA_VERSION is $KPKG, not a 6.12 kernel" ;; esac
KRELEASE=${KPKG#linux-image-}
KRELEASE=${KRELEASE%-unsigned}

BUSYBOX_VERSION=${SWITCHYARD_BUSYBOX_VERSION:-$(version_in busybox-static trixie)}
[ -n "$BUSYBOX_VERSION" ] || die "busybox-static not found in trixie (see $LOG)"

for pv in "qemu-system-x86=$QEMU_VERSION" "$KPKG=$KVERSION" "busybox-static=$BUSYBOX_VERSION"; do
  apt-cache show "$pv" 2>/dev/null | grep "^Package: " >/dev/null || die "$pv is not available from $DEBIAN_MIRROR (trixie, trixie-backports)"
done
log "pinned: qemu-system-x86=$QEMU_VERSION $KPKG=$KVERSION busybox-static=$BUSYBOX_VERSION"

# ---------------------------------------------------------------------------------------------
# 4. Download (QEMU with its closure; kernel and busybox as single debs, no dependencies).
# ---------------------------------------------------------------------------------------------
ARCH=$APTD/cache/archives
rm -f "$ARCH"/*.deb
apt-get install -y -d -t trixie-backports "qemu-system-x86=$QEMU_VERSION" >>"$LOG" 2>&1 ||
  die "download of qemu-system-x86=$QEMU_VERSION and its dependencies failed (see $LOG)"
mkdir -p "$APTD/single"
rm -f "$APTD"/single/*.deb
(cd "$APTD/single" && apt-get download "$KPKG=$KVERSION" "busybox-static=$BUSYBOX_VERSION") >>"$LOG" 2>&1 ||
  die "download of $KPKG=$KVERSION / busybox-static=$BUSYBOX_VERSION failed (see $LOG)"
NQ=$(ls "$ARCH"/*.deb | wc -l)
log "downloaded $NQ QEMU debs ($(du -ch "$ARCH"/*.deb | tail -1 | cut -f1)) + kernel and busybox ($(du -ch "$APTD"/single/*.deb | tail -1 | cut -f1)) in $(( $(date +%s) - T0 )) s"

# ---------------------------------------------------------------------------------------------
# 5. Unpack into a staging directory, then swap into place.
# ---------------------------------------------------------------------------------------------
NEW=$CACHE/.new
rm -rf "$NEW"
mkdir -p "$NEW/prefix" "$NEW/modules" "$NEW/kernel"
for f in "$ARCH"/*.deb; do
  dpkg-deb -x "$f" "$NEW/prefix" || die "cannot unpack $f"
done
# Prune what QEMU does not need at run time.
rm -rf "$NEW"/prefix/usr/share/{doc,man,info,locale,lintian,bug,bash-completion,zsh,fish,menu,applications,icons,pixmaps,polkit-1} \
       "$NEW"/prefix/usr/lib/x86_64-linux-gnu/gconv "$NEW"/prefix/etc "$NEW"/prefix/var "$NEW"/prefix/usr/sbin
# Only qemu-system-x86_64 is used (not i386, microvm, the helpers, nor passwd & co from the closure).
find "$NEW/prefix/usr/bin" -mindepth 1 ! -name qemu-system-x86_64 -exec rm -f {} +
# Firmware of other architectures.
(cd "$NEW/prefix/usr/share/qemu" && rm -f openbios-* skiboot.lid slof.bin u-boot* palcode-* hppa-firmware* \
  s390-* ./*.dtb QEMU,* npcm* vof.bin)
L=$NEW/prefix/usr/lib/x86_64-linux-gnu
[ -x "$L/ld-linux-x86-64.so.2" ] && [ -x "$NEW/prefix/usr/bin/qemu-system-x86_64" ] ||
  die "QEMU closure incomplete (no loader or qemu-system-x86_64 in the prefix)"

cat > "$NEW/qemu" <<'EOF'
#!/bin/sh
# QEMU from the extracted trixie-backports prefix, run with the prefix's own glibc loader.
D=$(dirname "$(readlink -f "$0")")
L=$D/prefix/usr/lib/x86_64-linux-gnu
export QEMU_MODULE_DIR="$L/qemu"
exec "$L/ld-linux-x86-64.so.2" --library-path "$L" --argv0 qemu-system-x86_64 \
  "$D/prefix/usr/bin/qemu-system-x86_64" -L "$D/prefix/usr/share/qemu" -L "$D/prefix/usr/share/seabios" "$@"
EOF
chmod 755 "$NEW/qemu"

# busybox-static
dpkg-deb -x "$APTD"/single/busybox-static_*.deb "$NEW/bb" || die "cannot unpack busybox-static"
install -m 755 "$NEW/bb/usr/bin/busybox" "$NEW/busybox"
rm -rf "$NEW/bb"

# Kernel: PVH vmlinux and the modules we need.
dpkg-deb -x "$APTD"/single/linux-image-*.deb "$NEW/kernel" || die "cannot unpack $KPKG"
VMLINUZ=$NEW/kernel/boot/vmlinuz-$KRELEASE
[ -f "$VMLINUZ" ] || die "no /boot/vmlinuz-$KRELEASE in $KPKG"
# The bzImage payload is a zstd frame holding the ELF vmlinux (the PVH entry point lives in it):
# try each zstd magic (28 b5 2f fd) until one decompresses to an ELF.
found=0
for off in $(LC_ALL=C grep -obUaF $'\x28\xb5\x2f\xfd' "$VMLINUZ" | cut -d: -f1); do
  tail -c +$((off + 1)) "$VMLINUZ" | zstd -dcq 2>/dev/null > "$NEW/vmlinux" || true
  if [ "$(head -c 4 "$NEW/vmlinux" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then found=1; break; fi
done
[ $found = 1 ] || die "no zstd-compressed ELF payload found in vmlinuz-$KRELEASE"

MODROOT=$NEW/kernel/usr/lib/modules/$KRELEASE
[ -d "$MODROOT" ] || MODROOT=$NEW/kernel/lib/modules/$KRELEASE
[ -d "$MODROOT" ] || die "no modules directory for $KRELEASE in $KPKG"
modfile() {  # modfile NAME -> path of NAME.ko[.xz|.zst|.gz] (dashes and underscores equivalent)
  local n1=$1 n2
  n2=$(echo "$1" | tr '_-' '-_')
  find "$MODROOT" -type f \( -name "$n1.ko*" -o -name "$n2.ko*" \) -print -quit
}
modcat() {
  case $1 in
    *.ko.xz) xz -dc "$1" ;; *.ko.zst) zstd -dcq "$1" ;; *.ko.gz) gzip -dc "$1" ;; *) cat "$1" ;;
  esac
}
# Wanted modules; the VFIO set is required, the igb set only where the flavour has igb.
REQUIRED="irqbypass vfio vfio_iommu_type1 vfio_pci_core vfio_pci"
OPTIONAL="igb"
ORDER=()
declare -A SEEN=()
add_mod() {  # depth-first: dependencies (from .modinfo "depends=") first
  local name=${1//-/_} f deps d
  [ -n "${SEEN[$name]:-}" ] && return 0
  SEEN[$name]=1
  f=$(modfile "$name")
  [ -n "$f" ] || return 1
  modcat "$f" > "$NEW/modules/$name.ko" || die "cannot decompress $f"
  deps=$(LC_ALL=C grep -aoE 'depends=[A-Za-z0-9_,-]*' "$NEW/modules/$name.ko" | sed -n 1p | cut -d= -f2 | tr ',' ' ')
  for d in $deps; do add_mod "$d" || die "module $name needs $d, which $KPKG does not have"; done
  ORDER+=("$name")
}
for m in $REQUIRED; do add_mod "$m" || die "$KPKG has no module $m"; done
for m in $OPTIONAL; do add_mod "$m" || log "note: $KPKG has no $m module (flavour $KFLAVOR)"; done
printf '%s\n' "${ORDER[@]}" > "$NEW/modules/load-order"
# KVM for an L1 guest that hosts L2 guests (nested SVM under TCG, `-cpu EPYC`): loaded only by
# the nested scenarios, after load-order (irqbypass is already there).
ORDER=()
add_mod kvm_amd || die "$KPKG has no module kvm_amd"
printf '%s\n' "${ORDER[@]}" > "$NEW/modules/nested-order"
rm -rf "$NEW/kernel"

QEMU_BANNER=$("$NEW/qemu" --version | sed -n 1p)
"$NEW/qemu" -device help 2>&1 | grep '"vfio-user-pci"' >/dev/null || die "QEMU $QEMU_VERSION has no vfio-user-pci device"

# Swap into place (stamp last).
rm -f "$STAMP"
rm -rf "$CACHE/prefix" "$CACHE/modules" "$CACHE/initramfs-base.cpio.gz"
mv "$NEW/prefix" "$NEW/modules" "$NEW/qemu" "$NEW/vmlinux" "$NEW/busybox" "$CACHE/"
rmdir "$NEW"
# (The EXIT trap drops the downloaded debs and package lists; a --refresh downloads the lists again.)
cat > "$STAMP" <<EOF
recipe=$RECIPE
kflavor=$KFLAVOR
mirror=$DEBIAN_MIRROR
qemu_version=$QEMU_VERSION
qemu_banner=$QEMU_BANNER
kernel_meta_version=$KMETA_VERSION
kernel_pkg=$KPKG
kernel_version=$KVERSION
kernel_release=$KRELEASE
busybox_version=$BUSYBOX_VERSION
EOF

install_ch
cleanup
log "verified: $("$CACHE/qemu" -device help 2>&1 | grep '"vfio-user-pci"')"
log "done in $(( $(date +%s) - T0 )) s; pinned versions:"
print_versions
