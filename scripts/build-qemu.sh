#!/bin/bash
# scripts/build-qemu.sh — build the patched QEMU whose vfio-user-pci can live-migrate a device
# (vmm-integration/qemu/patches/, issue 24), x86_64-softmmu only, cached outside the clone.
#
# Fetches Debian's own source package of QEMU with a private apt configuration (deb-src of the
# same mirror scripts/setup.sh uses: trixie, trixie-backports), unpacks it with dpkg-source -x
# (which applies Debian's debian/patches series), applies vmm-integration/qemu/patches/*.patch
# in order, configures a minimal build and compiles it. The result is keyed by the source
# version, the sha256 of every patch and this recipe: a rebuild happens only when one changes;
# otherwise the script only prints where the binary is.
#
# The unpatched QEMU of scripts/setup.sh stays the default for every test; nothing here
# replaces it. Firmware (SeaBIOS, the PVH/linuxboot option ROMs) comes from setup.sh's cache,
# which the wrapper passes with -L, as setup.sh's own wrapper does. The build is shared by
# every clone (outside them); each clone's setup cache gets its own wrapper.
#
# Output ($CACHE is ${SWITCHYARD_QEMU_BUILD_CACHE:-$HOME/.cache/switchyard/qemu}):
#   $CACHE/qemu-patched/bin/qemu-system-x86_64   the patched binary (host libraries)
#   $CACHE/qemu-patched/stamp                    version, patch hashes, key, build time
#   <setup cache>/qemu-migration                 wrapper: the binary with -L <this clone's
#                                                firmware> (what the migration tests run)
# The last line printed is the wrapper's path.
#
# Usage: scripts/build-qemu.sh [--rebuild] [--jobs N] [--print-path] [--configure-only]
#   --rebuild          build again even if the cached build matches
#   --jobs N           parallel compile jobs (default: nproc)
#   --print-path       print the wrapper's path if the cached build is current, else exit 1
#   --configure-only   fetch, unpack, patch and configure, then stop (leaves the build tree in
#                      $CACHE/build-KEY; no compile)
# Environment:
#   SWITCHYARD_QEMU_BUILD_CACHE   cache directory (default $HOME/.cache/switchyard/qemu)
#   SWITCHYARD_QEMU_SRC_VERSION   Debian source version to build (default: the qemu-system-x86
#                                 version scripts/setup.sh pinned, else 1:11.1.3+ds-1~bpo13+1);
#                                 when the mirror does not serve that source, the script falls
#                                 back to $FALLBACK_VERSION below (checksums pinned here) and
#                                 says so in a WARNING line and in the stamp
#   DEBIAN_MIRROR                 Debian mirror URI (default: the first Debian URI in /etc/apt)
#   SWITCHYARD_CACHE              setup.sh's cache (firmware for the wrapper)
#
# Host packages (apt, installed only if missing): gcc make ninja-build pkgconf libglib2.0-dev
# zlib1g-dev python3-venv dpkg-dev xz-utils patch debian-archive-keyring. Meson (>= 1.5; Debian
# bookworm has 1.0) and the configure-time Python packages come from PyPI into a venv in the
# cache ($CACHE/tools-venv), because Debian's +ds source drops QEMU's bundled python/wheels.
set -euo pipefail

RECIPE=1                       # bump when the configure flags or the layout change
DEFAULT_VERSION=1:11.1.3+ds-1~bpo13+1
# The newest QEMU 11.1 source package the mirror served when this was written (the
# trixie-backports 11.1.3 one was listed in the Sources index but its files were missing).
FALLBACK_VERSION=1:11.1.1+ds-1
FALLBACK_FILES="
qemu_11.1.1+ds-1.dsc dfd4fbdd38517e2467002091bbcd938bbff8b2c851cc3f56b019236c7d1f21da
qemu_11.1.1+ds.orig.tar.xz 0b1376e75dbe3e2fea4e408f8669f88a723f419f36a5b7d74cc6a4cfe07e4f5e
qemu_11.1.1+ds-1.debian.tar.xz 870a1193f28ce522ac91f68100d75dce5527e08d8958344b389c9fa24b44968f
"
PY_PKGS="meson==1.11.1 pycotap==1.3.1 qemu.qmp==0.0.6 setuptools wheel"
HOST_PKGS="gcc make ninja-build pkgconf libglib2.0-dev zlib1g-dev python3-venv dpkg-dev xz-utils patch debian-archive-keyring"
CONFIGURE_FLAGS=(
  --target-list=x86_64-softmmu
  --without-default-features     # every optional library off (gtk, sdl, vnc, slirp, curl, ...)
  --enable-tcg --enable-kvm
  --disable-docs --disable-werror --disable-debug-info
  --disable-tools --disable-guest-agent --disable-user --disable-install-blobs
  --disable-fdt --disable-plugins
)

die() { echo "build-qemu.sh: error: $*" >&2; exit 1; }
log() { echo "build-qemu.sh: $*"; }

REBUILD=0
PRINT=0
CONFIGURE_ONLY=0
JOBS=$(nproc)
while [ $# -gt 0 ]; do
  case $1 in
    --rebuild) REBUILD=1 ;;
    --print-path) PRINT=1 ;;
    --configure-only) CONFIGURE_ONLY=1; REBUILD=1 ;;
    --jobs) JOBS=${2:?--jobs needs a number}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib/cloud-hypervisor.sh
. "$REPO/scripts/lib/cloud-hypervisor.sh"
# shellcheck source=scripts/lib/debian.sh
. "$REPO/scripts/lib/debian.sh"
SETUP_CACHE=$(sy_cache "$REPO")
PATCHES=$REPO/vmm-integration/qemu/patches
CACHE=${SWITCHYARD_QEMU_BUILD_CACHE:-$HOME/.cache/switchyard/qemu}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
case $CACHE/ in "$REPO"/*) die "the build cache ($CACHE) must be outside the clone" ;; esac
OUT=$CACHE/qemu-patched

exec 9>"$CACHE/.lock"
flock 9

# ---------------------------------------------------------------------------------------------
# The key: source version wanted, recipe, configure flags, every patch (name and sha256).
# ---------------------------------------------------------------------------------------------
WANT=${SWITCHYARD_QEMU_SRC_VERSION:-$(sed -n 's/^qemu_version=//p' "$SETUP_CACHE/stamp" 2>/dev/null | sed -n 1p)}
WANT=${WANT:-$DEFAULT_VERSION}
mapfile -t PATCH_FILES < <(find "$PATCHES" -maxdepth 1 -name '[0-9][0-9][0-9][0-9]-*.patch' | sort)
[ ${#PATCH_FILES[@]} -gt 0 ] || die "no patches in $PATCHES"
patch_sums() { (cd "$PATCHES" && sha256sum -- "${PATCH_FILES[@]##*/}"); }
KEY=$( { echo "recipe=$RECIPE want=$WANT"; printf '%s\n' "${CONFIGURE_FLAGS[@]}"; patch_sums; } |
  sha256sum | cut -c1-16)
stamp_get() { sed -n "s/^$1=//p" "$OUT/stamp" 2>/dev/null | sed -n 1p; }
current() { [ -x "$OUT/bin/qemu-system-x86_64" ] && [ "$(stamp_get key)" = "$KEY" ]; }
WRAPPER=$SETUP_CACHE/qemu-migration
# The clone's wrapper: the shared binary with this clone's firmware (setup.sh's prefix).
write_wrapper() {
  local fw="" d
  for d in "$SETUP_CACHE/prefix/usr/share/qemu" "$SETUP_CACHE/prefix/usr/share/seabios"; do
    [ -d "$d" ] && fw+=" -L \"$d\""
  done
  [ -n "$fw" ] || die "no firmware in $SETUP_CACHE: run scripts/setup.sh first"
  printf '%s\n' '#!/bin/sh' \
    "# The patched QEMU $(stamp_get version) (vmm-integration/qemu/patches, key $KEY; scripts/build-qemu.sh)." \
    "exec \"$OUT/bin/qemu-system-x86_64\"$fw \"\$@\"" > "$WRAPPER.new"
  chmod 755 "$WRAPPER.new"
  mv "$WRAPPER.new" "$WRAPPER"
}

if [ $PRINT = 1 ]; then
  current && [ -x "$WRAPPER" ] || exit 1
  echo "$WRAPPER"
  exit 0
fi
if [ $REBUILD = 0 ] && current; then
  log "up to date: QEMU $(stamp_get version) + ${#PATCH_FILES[@]} patches (key $KEY; built in $(stamp_get build_seconds) s on $(stamp_get built))"
  write_wrapper
  echo "$WRAPPER"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# 1. Host packages (apt, only what is missing).
# ---------------------------------------------------------------------------------------------
need=()
for p in $HOST_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "host packages needed: $HOST_PKGS; installing missing: ${need[*]}"
  sy_apt_install "${need[@]}"
fi

# ---------------------------------------------------------------------------------------------
# 2. Source: Debian's source package through a private apt configuration (deb-src).
# ---------------------------------------------------------------------------------------------
sy_debian_mirror
APTD=$CACHE/apt
mkdir -p "$APTD"/lists/partial "$APTD"/cache/archives/partial
cat > "$APTD/trixie-src.sources" <<EOF
Types: deb-src
URIs: $DEBIAN_MIRROR
Suites: trixie trixie-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
: > "$APTD/status"
cat > "$APTD/apt.conf" <<EOF
Dir::Etc::SourceParts "/dev/null"; Dir::Etc::SourceList "$APTD/trixie-src.sources";
Dir::Etc::Preferences "/dev/null"; Dir::Etc::PreferencesParts "/dev/null";
Dir::State::Lists "$APTD/lists"; Dir::State::status "$APTD/status"; Dir::Cache "$APTD/cache";
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT::Sandbox::User "root"; Acquire::Languages "none";
Acquire::IndexTargets::deb::DEP-11::DefaultEnabled "false";
Acquire::Retries "3";
EOF
LOG=$CACHE/build.log
: > "$LOG"

upstream_of() { local v=${1#*:}; echo "${v%-*}"; }   # 1:11.1.3+ds-1~bpo13+1 -> 11.1.3+ds
dsc_of() { local v=${1#*:}; echo "qemu_$v.dsc"; }     # -> qemu_11.1.3+ds-1~bpo13+1.dsc

fetch_source() {  # fetch_source VERSION DIR: apt-get source --download-only; 0 when the .dsc is there
  local ver=$1 dir=$2
  mkdir -p "$dir"
  [ -s "$dir/$(dsc_of "$ver")" ] && return 0
  APT_CONFIG=$APTD/apt.conf apt-get update >>"$LOG" 2>&1 || return 1
  (cd "$dir" && APT_CONFIG=$APTD/apt.conf apt-get source --download-only "qemu=$ver") >>"$LOG" 2>&1 || return 1
  [ -s "$dir/$(dsc_of "$ver")" ]
}
fetch_fallback() {  # the pinned fallback, file by file from the pool, each checked against its sha256
  local dir=$1 f sum
  mkdir -p "$dir"
  while read -r f sum; do
    [ -n "$f" ] || continue
    if ! { [ -s "$dir/$f" ] && echo "$sum  $dir/$f" | sha256sum -c --quiet >/dev/null 2>&1; }; then
      /usr/lib/apt/apt-helper download-file "$DEBIAN_MIRROR/pool/main/q/qemu/$f" "$dir/$f" "SHA256:$sum" >>"$LOG" 2>&1 ||
        return 1
    fi
  done <<< "$FALLBACK_FILES"
}

T0=$(date +%s)
VERSION=$WANT
SRCDIR=$CACHE/src/$(upstream_of "$VERSION")-${VERSION##*-}
if ! fetch_source "$VERSION" "$SRCDIR"; then
  [ -z "${SWITCHYARD_QEMU_SRC_VERSION:-}" ] ||
    die "source package qemu=$VERSION not available from $DEBIAN_MIRROR (see $LOG)"
  echo "build-qemu.sh: WARNING: the mirror does not serve Debian's source of qemu=$WANT (the harness's QEMU); building the pinned fallback qemu=$FALLBACK_VERSION instead (see $LOG)" >&2
  rmdir "$SRCDIR" 2>/dev/null || true
  VERSION=$FALLBACK_VERSION
  SRCDIR=$CACHE/src/$(upstream_of "$VERSION")-${VERSION##*-}
  fetch_fallback "$SRCDIR" || die "cannot fetch the fallback source qemu=$VERSION from $DEBIAN_MIRROR (see $LOG)"
fi
log "source: qemu=$VERSION ($(du -sh "$SRCDIR" | cut -f1)) in $(( $(date +%s) - T0 )) s"

# ---------------------------------------------------------------------------------------------
# 3. Unpack (Debian's patches applied by dpkg-source), then ours.
# ---------------------------------------------------------------------------------------------
WORK=$CACHE/build-$KEY
TREE=$WORK/qemu
rm -rf "$CACHE"/build-*
mkdir -p "$WORK"
# The .dsc signature is the uploader's (debian-keyring, not installed); the files' checksums
# come from the archive-signed Sources index (apt) or from the sha256s pinned above.
dpkg-source --no-check -x "$SRCDIR/$(dsc_of "$VERSION")" "$TREE" >>"$LOG" 2>&1 ||
  die "dpkg-source -x of qemu=$VERSION failed (see $LOG)"
log "unpacked with Debian's patches: $(grep -vc '^\s*#' "$TREE/debian/patches/series" 2>/dev/null || echo 0) in debian/patches/series"
for p in "${PATCH_FILES[@]}"; do
  patch -d "$TREE" -p1 --batch --forward --no-backup-if-mismatch < "$p" >>"$LOG" 2>&1 ||
    die "patch ${p##*/} does not apply to qemu=$VERSION (see $LOG)"
done
log "applied ${#PATCH_FILES[@]} patches: $(printf '%s ' "${PATCH_FILES[@]##*/}")"

# ---------------------------------------------------------------------------------------------
# 4. Configure-time Python (meson >= 1.5 and QEMU's tooling group) in a venv of the cache.
# ---------------------------------------------------------------------------------------------
VENV=$CACHE/tools-venv
PY=${PYTHON:-$(command -v python3 || echo /usr/bin/python3)}
if ! "$VENV/bin/python3" -c 'import mesonbuild, pycotap, qemu.qmp' >/dev/null 2>&1; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" >>"$LOG" 2>&1 || die "python venv creation failed (see $LOG)"
  # shellcheck disable=SC2086
  "$VENV/bin/python3" -m pip install -q $PY_PKGS >>"$LOG" 2>&1 ||
    die "pip install $PY_PKGS failed (see $LOG)"
fi
log "configure-time python: $("$VENV/bin/python3" -c 'import mesonbuild.coredata as c; print("meson", c.version)')"

# ---------------------------------------------------------------------------------------------
# 5. Configure, build, install the binary.
# ---------------------------------------------------------------------------------------------
B=$TREE/build
mkdir -p "$B"
T1=$(date +%s)
(cd "$B" && ../configure --python="$VENV/bin/python3" "${CONFIGURE_FLAGS[@]}") >>"$LOG" 2>&1 ||
  die "configure failed (see $LOG)"
log "configured in $(( $(date +%s) - T1 )) s"
if [ $CONFIGURE_ONLY = 1 ]; then
  log "configure only: the tree is $TREE"
  exit 0
fi
log "compiling with $JOBS jobs"
T2=$(date +%s)
ninja -C "$B" -j "$JOBS" qemu-system-x86_64 >>"$LOG" 2>&1 || die "build failed (see $LOG)"
BUILD_S=$(( $(date +%s) - T2 ))
"$B/qemu-system-x86_64" -device help 2>&1 | grep -q '"vfio-user-pci"' || die "the built QEMU has no vfio-user-pci"

rm -rf "$OUT.new"
mkdir -p "$OUT.new/bin"
install -m 755 "$B/qemu-system-x86_64" "$OUT.new/bin/"
cat > "$OUT.new/stamp" <<EOF
key=$KEY
recipe=$RECIPE
wanted=$WANT
version=$VERSION
banner=$("$B/qemu-system-x86_64" --version | sed -n 1p)
patches=$(patch_sums | awk '{printf "%s:%s ", $2, substr($1, 1, 12)}')
configure=${CONFIGURE_FLAGS[*]}
build_seconds=$BUILD_S
jobs=$JOBS
built=$(date -u +%Y-%m-%dT%H:%M:%SZ)
EOF
rm -rf "$OUT"
mv "$OUT.new" "$OUT"
# Keep the source download (a rebuild after a patch change reuses it), drop the build tree.
rm -rf "$WORK"
write_wrapper
log "built QEMU $VERSION + ${#PATCH_FILES[@]} patches: compile $BUILD_S s with $JOBS jobs, $(( $(date +%s) - T0 )) s in all"
echo "$WRAPPER"
