# shellcheck shell=bash
# scripts/lib/debian.sh — sourced, not run, by scripts/setup.sh and scripts/build-qemu.sh: the
# Debian mirror this machine's apt uses, and installing missing host packages. The caller
# defines die().

# sy_debian_mirror: sets DEBIAN_MIRROR (kept if set) to the first Debian URI of the machine's
# own apt sources, without a trailing slash; dies if there is none.
sy_debian_mirror() {
  if [ -z "${DEBIAN_MIRROR:-}" ]; then
    DEBIAN_MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
      sed -n -E 's/^URIs:[[:space:]]*//p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//p' |
      awk '{print $1}' | grep -E '^https?://[^ ]*/debian/?$' | head -1 || true)
  fi
  [ -n "$DEBIAN_MIRROR" ] || die "no Debian mirror found in /etc/apt sources; set DEBIAN_MIRROR"
  DEBIAN_MIRROR=${DEBIAN_MIRROR%/}
}

# sy_apt_install PKG...: installs the packages named (the missing ones, which the caller
# found) with apt, without recommends; dies naming them when this is not root or apt fails.
sy_apt_install() {
  [ $# -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || die "missing host packages ($*) and not root: apt-get install $*"
  apt-get -qq update >/dev/null 2>&1 || die "apt-get update (host) failed"
  DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends "$@" >/dev/null 2>&1 ||
    die "apt-get install $* (host) failed"
}
