#!/bin/bash
# images/build-initramfs.sh — build the guest initramfs from the setup cache (see images/README.md).
#
# Usage: images/build-initramfs.sh OUT.cpio.gz [--add FILE[:DEST]]... [--init-test NAME] [--nested] [--qemu] [--strip]
#   --add FILE[:DEST]  put FILE into the image at DEST (default /usr/bin/<basename of FILE>);
#                      a DEST ending in / is a directory. Repeatable. Use static binaries.
#   --init-test NAME   default test when the kernel command line has no sy.test=
#   --qemu             QEMU from the cache (binary, the libraries it loads, firmware) under /opt/qemu,
#                      run as /usr/bin/qemu: an L1 that starts L2 guests with QEMU -accel kvm
#   --strip            strip the symbols of every ELF program --add puts in /usr/bin or /usr/sbin
#   --nested           an L1 image that plays a host: the KVM modules (/lib/modules/nested/, loaded
#                      by /tests/nested.sh) and cloud-hypervisor + ch-remote (/usr/bin) from the cache
#                      when it has them (optional, docs/cloud-hypervisor.md: without them the image
#                      is built all the same, and its L2s run only under QEMU)
# Environment:
#   SWITCHYARD_CACHE   cache filled by scripts/setup.sh (default <repo>/.cache/vmtools)
#   SOURCE_DATE_EPOCH  mtime of every file in the archive (default 0)
#
# The output is reproducible: same inputs -> byte-identical OUT (sorted entries, fixed mtimes,
# owner 0:0, renumbered inodes, gzip without name/timestamp).
set -euo pipefail

die() { echo "build-initramfs.sh: error: $*" >&2; exit 1; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CACHE=${SWITCHYARD_CACHE:-$REPO/.cache/vmtools}
EPOCH=${SOURCE_DATE_EPOCH:-0}

OUT=""
ADDS=()
INIT_TEST=""
NESTED=0
STRIP=0
QEMU=0
while [ $# -gt 0 ]; do
  case $1 in
    --add) [ $# -ge 2 ] || die "--add needs FILE[:DEST]"; ADDS+=("$2"); shift 2 ;;
    --add=*) ADDS+=("${1#--add=}"); shift ;;
    --init-test) [ $# -ge 2 ] || die "--init-test needs NAME"; INIT_TEST=$2; shift 2 ;;
    --init-test=*) INIT_TEST=${1#--init-test=}; shift ;;
    --nested) NESTED=1; shift ;;
    --strip) STRIP=1; shift ;;
    --qemu) QEMU=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1'" ;;
    *) [ -z "$OUT" ] || die "more than one output file given ('$OUT', '$1')"; OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || die "usage: build-initramfs.sh OUT.cpio.gz [--add FILE[:DEST]]... [--init-test NAME] [--nested] [--qemu] [--strip]"
case $INIT_TEST in *[!A-Za-z0-9._-]*) die "--init-test '$INIT_TEST': use letters, digits, . _ -" ;; esac
for f in busybox modules/load-order; do
  [ -e "$CACHE/$f" ] || die "$CACHE/$f missing: run scripts/setup.sh first"
done
command -v cpio >/dev/null || die "cpio not installed: run scripts/setup.sh first"

umask 022
S=$(mktemp -d "${TMPDIR:-/tmp}/sy-initramfs.XXXXXX")
TMP_OUT=""
trap 'rm -rf "$S"; [ -z "$TMP_OUT" ] || rm -f "$TMP_OUT"' EXIT
R=$S/root
mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,lib/modules,tests,proc,sys,dev,tmp,run,etc,root}
chmod 1777 "$R/tmp"

# busybox + one symlink per applet: the build-time equivalent of `busybox --install -s`.
install -m 755 "$CACHE/busybox" "$R/bin/busybox"
"$CACHE/busybox" --list-full | while read -r p; do
  [ "$p" = bin/busybox ] || [ -L "$R/$p" ] || ln -s /bin/busybox "$R/$p"
done
[ -L "$R/bin/sh" ] || die "busybox has no sh applet"

# Kernel modules (already decompressed by setup.sh) and their load order.
while read -r m; do
  install -m 644 "$CACHE/modules/$m.ko" "$R/lib/modules/$m.ko"
done < "$CACHE/modules/load-order"
install -m 644 "$CACHE/modules/load-order" "$R/lib/modules/load-order"

# An L1 that hosts L2 guests: KVM modules (not loaded by /init) and cloud-hypervisor when the
# cache has it (the L2s under QEMU need none; sy-nested fails the cloud-hypervisor scenarios
# in an image without it).
if [ $NESTED = 1 ]; then
  [ -s "$CACHE/modules/nested-order" ] || die "$CACHE has no modules/nested-order: run scripts/setup.sh"
  mkdir -p "$R/lib/modules/nested"
  while read -r m; do
    install -m 644 "$CACHE/modules/$m.ko" "$R/lib/modules/nested/$m.ko"
  done < "$CACHE/modules/nested-order"
  install -m 644 "$CACHE/modules/nested-order" "$R/lib/modules/nested/nested-order"
  if [ -x "$CACHE/ch/cloud-hypervisor" ] && [ -x "$CACHE/ch/ch-remote" ]; then
    install -m 755 "$CACHE/ch/cloud-hypervisor" "$CACHE/ch/ch-remote" "$R/usr/bin/"
  else
    echo "build-initramfs.sh: note: $CACHE has no ch/cloud-hypervisor: the L1 image has none" \
      "(its cloud-hypervisor scenarios fail; docs/cloud-hypervisor.md)" >&2
  fi
fi

# QEMU inside the guest: the binary, the shared libraries its loader resolves (from the cache's
# prefix, with that prefix's own ld-linux), and the firmware; /usr/bin/qemu runs it.
if [ $QEMU = 1 ]; then
  P=$CACHE/prefix
  L=$P/usr/lib/x86_64-linux-gnu
  [ -x "$P/usr/bin/qemu-system-x86_64" ] || die "$P has no QEMU: run scripts/setup.sh"
  Q=$R/opt/qemu
  mkdir -p "$Q/bin" "$Q/lib" "$Q/share"
  install -m 755 "$P/usr/bin/qemu-system-x86_64" "$Q/bin/"
  libs=$("$L/ld-linux-x86-64.so.2" --library-path "$L" --list "$P/usr/bin/qemu-system-x86_64" |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 }') || die "cannot list QEMU's libraries"
  [ -n "$libs" ] || die "QEMU's loader listed no libraries"
  for l in $libs; do install -m 644 "$l" "$Q/lib/"; done
  install -m 755 "$L/ld-linux-x86-64.so.2" "$Q/lib/"   # after the libraries: it is listed too
  cp -r "$P/usr/share/qemu" "$Q/share/qemu"
  mkdir -p "$Q/share/seabios"
  install -m 644 "$P/usr/share/seabios/bios-256k.bin" "$Q/share/seabios/"
  cat > "$R/usr/bin/qemu" <<'EOF'
#!/bin/sh
# QEMU from /opt/qemu with its own loader and libraries (images/build-initramfs.sh --qemu).
Q=/opt/qemu
exec $Q/lib/ld-linux-x86-64.so.2 --library-path $Q/lib --argv0 qemu-system-x86_64 \
  $Q/bin/qemu-system-x86_64 -L $Q/share/qemu -L $Q/share/seabios "$@"
EOF
  chmod 755 "$R/usr/bin/qemu"
fi

# Guest helpers and built-in tests shipped with the image.
install -m 755 "$HERE/guest/sy-lspci" "$R/usr/bin/sy-lspci"
for t in "$HERE"/tests/*.sh; do
  [ -e "$t" ] && install -m 755 "$t" "$R/tests/$(basename "$t")"
done

# The /init (contract: images/README.md).
install -m 755 "$HERE/guest/init" "$R/init"
[ -z "$INIT_TEST" ] || echo "$INIT_TEST" > "$R/etc/sy-default-test"

# Extra files.
for a in "${ADDS[@]}"; do
  src=${a%%:*}
  if [ "$src" = "$a" ]; then dest=/usr/bin/; else dest=${a#*:}; fi
  [ -f "$src" ] || die "--add $a: no such file '$src'"
  case $dest in /*) ;; *) die "--add $a: DEST must be an absolute path" ;; esac
  case $dest in */) dest=$dest$(basename "$src") ;; esac
  mkdir -p "$R$(dirname "$dest")"
  if [ -x "$src" ]; then mode=755; else mode=644; fi
  install -m $mode "$src" "$R$dest"
  if [ $STRIP = 1 ] && case $dest in /usr/bin/*|/usr/sbin/*) true ;; *) false ;; esac &&
     [ "$(head -c 4 "$src" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
    command -v strip >/dev/null || die "--strip: no strip (binutils) on this machine"
    strip "$R$dest" || die "--strip: cannot strip $src"
  fi
done

# Reproducible archive.
find "$R" -type d -exec chmod 755 {} + ; chmod 1777 "$R/tmp"
find "$R" -exec touch -h -d "@$EPOCH" {} +
# Written to a unique temporary file next to OUT and renamed over it, so a reader (or a
# concurrent build of the same OUT) never sees a partial archive.
mkdir -p "$(dirname "$OUT")"
TMP_OUT=$(mktemp "$OUT.XXXXXX")
(cd "$R" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
  cpio -o -H newc -0 --reproducible -R 0:0 --quiet | gzip -n -6) > "$TMP_OUT"
chmod 644 "$TMP_OUT"
mv -f "$TMP_OUT" "$OUT"
TMP_OUT=""
echo "build-initramfs.sh: $OUT ($(du -h "$OUT" | cut -f1), $(tr '\n' ' ' < "$CACHE/modules/load-order" | wc -w) modules, sha256 $(sha256sum "$OUT" | cut -c1-16))"
