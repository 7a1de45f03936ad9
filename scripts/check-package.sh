#!/usr/bin/env bash
# scripts/check-package.sh — checks a package built by scripts/package.sh, without installing
# it on this system: unpacked into a scratch root laid out like Debian 12 (merged /usr: the
# package's /lib/systemd/system lands in /usr/lib, as dpkg puts it there), every file the unit names must be where the unit expects it, and
# `systemd-analyze verify` must pass on the unit in that root.
#
#   scripts/check-package.sh target/package/switchyard_0.1.0-1_amd64.deb
#
# Checked: the control fields and the conffile; /usr/bin/switchyard (the unit's ExecStart=)
# is a static executable of the package's version; /etc/switchyard/pool.toml
# (ConfigurationDirectory=) is there and the daemon's embedded default (the daemon starts on it
# in the root, as the unit would, and reports ready); the group of Group= comes from the
# package's sysusers.d file (systemd-sysusers --root); the man pages of Documentation=, one per
# subcommand, and the shell completions are there; the maintainer scripts parse (and pass
# shellcheck when it is installed); lintian (when installed) finds no error or warning;
# systemd-analyze verify (with the man pages) passes, and
# systemd-analyze security rates the unit at most MAX_EXPOSURE (default 2.5; the score is
# printed). Exit 1 on the first failure. Needs dpkg-deb, systemd-analyze and systemd-sysusers
# (systemd 252 here; systemd need not run).
set -euo pipefail
cd "$(dirname "$0")/.."

deb=${1:?usage: scripts/check-package.sh PACKAGE.deb}
max_exposure=${MAX_EXPOSURE:-2.5}
fail() { echo "check-package.sh: error: $*" >&2; exit 1; }
ok() { echo "check-package.sh: ok: $*"; }
for tool in dpkg-deb systemd-analyze systemd-sysusers; do
  command -v "$tool" >/dev/null || fail "$tool is missing"
done

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# Debian 12's layout: /bin, /sbin and /lib are links into /usr.
mkdir -p "$root/usr/bin" "$root/usr/sbin" "$root/usr/lib" "$root/etc"
ln -s usr/bin "$root/bin"
ln -s usr/sbin "$root/sbin"
ln -s usr/lib "$root/lib"
# `dpkg -x`, but keeping the links as dpkg does when it installs (tar alone replaces them).
dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C "$root"
[ -f "$root/usr/lib/systemd/system/switchyard.service" ] || fail "the unit is not in /usr/lib/systemd/system"

# The control area.
[ "$(dpkg-deb -f "$deb" Package)" = switchyard ] || fail "Package is not switchyard"
[ "$(dpkg-deb -f "$deb" Architecture)" = amd64 ] || fail "Architecture is not amd64"
version=$(dpkg-deb -f "$deb" Version)
case "$(basename "$deb")" in
  "switchyard_${version}_amd64.deb") ;;
  *) fail "$(basename "$deb") is not named switchyard_${version}_amd64.deb" ;;
esac
control=$(mktemp -d)
trap 'rm -rf "$root" "$control"' EXIT
dpkg-deb -e "$deb" "$control"
[ "$(cat "$control/conffiles")" = "$(printf '%s\n' /etc/switchyard/pool.toml /etc/libvirt/hooks/qemu.d/switchyard)" ] ||
  fail "conffiles: $(cat "$control/conffiles")"
for script in postinst prerm postrm; do
  [ -x "$control/$script" ] || fail "no executable $script"
  sh -n "$control/$script" || fail "$script does not parse"
  if command -v shellcheck >/dev/null; then
    shellcheck -s sh "$control/$script" || fail "shellcheck $script"
  fi
done
(cd "$root" && md5sum --quiet -c "$control/md5sums") || fail "md5sums do not match"
ok "switchyard $version: control fields, conffiles, maintainer scripts, md5sums"

# The cluster's files: the OCF resource agent and libvirt's qemu hook, executable POSIX sh.
for f in usr/lib/ocf/resource.d/switchyard/pool etc/libvirt/hooks/qemu.d/switchyard; do
  [ -x "$root/$f" ] || fail "no executable /$f"
  sh -n "$root/$f" || fail "/$f does not parse"
  if command -v shellcheck >/dev/null; then
    shellcheck -s sh "$root/$f" || fail "shellcheck /$f"
  fi
done
grep -q 'exec /usr/bin/switchyard cluster hook "\$@"' "$root/etc/libvirt/hooks/qemu.d/switchyard" ||
  fail "the libvirt hook does not run switchyard cluster hook"
OCF_ROOT=/usr/lib/ocf "$root/usr/lib/ocf/resource.d/switchyard/pool" meta-data 2>/dev/null |
  grep -q '<resource-agent name="pool"' || fail "the resource agent's meta-data"
ok "/usr/lib/ocf/resource.d/switchyard/pool, /etc/libvirt/hooks/qemu.d/switchyard"

# What the unit names.
unit=$root/lib/systemd/system/switchyard.service
[ -f "$unit" ] || fail "no /lib/systemd/system/switchyard.service"
setting() { sed -n "s/^$1=//p" "$unit" | tail -n 1; }
exec_start=$(setting ExecStart)
exe=${exec_start%% *}
[ "$exe" = /usr/bin/switchyard ] || fail "ExecStart= runs $exe"
[ -x "$root$exe" ] || fail "no executable $exe (ExecStart=)"
if LC_ALL=C readelf -d "$root$exe" 2>/dev/null | grep -q NEEDED; then
  fail "$exe is not static"
fi
[ "$("$root$exe" --version)" = "switchyard ${version%-*}" ] || fail "$exe --version: $("$root$exe" --version)"
config_dir=$(setting ConfigurationDirectory)
[ -f "$root/etc/$config_dir/pool.toml" ] || fail "no /etc/$config_dir/pool.toml (ConfigurationDirectory=)"
for key in RuntimeDirectory StateDirectory; do
  [ "$(setting "$key")" = switchyard ] || fail "$key= is not switchyard"
done
group=$(setting Group)
[ -f "$root/usr/lib/sysusers.d/switchyard.conf" ] || fail "no /usr/lib/sysusers.d/switchyard.conf"
systemd-sysusers --root="$root" >/dev/null 2>&1 || fail "systemd-sysusers --root"
grep -q "^$group:" "$root/etc/group" || fail "the sysusers.d file does not create the group $group (Group=)"
ok "ExecStart= $exe, /etc/$config_dir/pool.toml, group $group from sysusers.d"

# The daemon starts on the packaged configuration, as the unit runs it (the directories as
# systemd names them, in the scratch root), and reports ready on its notification socket.
gid=$(grep "^$group:" "$root/etc/group" | cut -d: -f3)
run=$root/run/switchyard state=$root/var/lib/switchyard
mkdir -p "$run" "$state"
chmod 0750 "$run" && chmod 0700 "$state"
args=${exec_start#"$exe"}
# The unit's group exists in the scratch root only: the daemon looks in /etc/group, so it is
# started with the group's number.
# shellcheck disable=SC2086 # the unit's arguments, split as systemd splits them
set -- ${args/--socket-group $group/--socket-group $gid}
python3 - "$root$exe" "$run" "$state" "$root/etc/$config_dir" "$@" <<'PY' || fail "the daemon did not report ready on the packaged configuration"
import os, socket, subprocess, sys, time
exe, run, state, conf, *args = sys.argv[1:]
notify = os.path.join(run, "..", "notify")
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(notify)
s.settimeout(30)
env = {"PATH": "/usr/bin:/bin", "RUST_LOG": "info", "RUNTIME_DIRECTORY": run,
       "STATE_DIRECTORY": state, "CONFIGURATION_DIRECTORY": conf, "NOTIFY_SOCKET": notify}
daemon = subprocess.Popen([exe] + args, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
try:
    while True:
        msg = s.recv(4096).decode()
        if "READY=1" in msg.splitlines():
            print("check-package.sh: the daemon: " + msg.replace("\n", "; "))
            break
finally:
    daemon.terminate()
    _, err = daemon.communicate(timeout=10)
    if daemon.returncode != 0:
        sys.stderr.write(err.decode())
        sys.exit(1)
PY
ok "the daemon reported ready on the packaged configuration"

# Man pages and completions.
for page in switchyard switchyard-serve switchyard-daemon switchyard-ctl switchyard-ctl-create \
    switchyard-inventory switchyard-cluster switchyard-cluster-hook; do
  [ -f "$root/usr/share/man/man1/$page.1.gz" ] || fail "no man page $page.1"
done
for f in usr/share/bash-completion/completions/switchyard usr/share/zsh/vendor-completions/_switchyard \
    usr/share/fish/vendor_completions.d/switchyard.fish usr/share/doc/switchyard/copyright \
    usr/share/doc/switchyard/changelog.Debian.gz; do
  [ -s "$root/$f" ] || fail "no /$f"
done
ok "$(find "$root/usr/share/man/man1" -name '*.1.gz' | wc -l) man pages, bash/zsh/fish completions, copyright, changelog"

# systemd's own checks, in the root (with the host's units for the dependencies, like
# sysinit.target, which the package does not ship; the man pages of Documentation= from the
# root).
for u in /usr/lib/systemd/system/*; do
  [ -e "$root$u" ] || cp -a "$u" "$root$u"
done
MANPATH=$root/usr/share/man systemd-analyze verify --root="$root" switchyard.service ||
  fail "systemd-analyze verify"
ok "systemd-analyze verify"
exposure=$(systemd-analyze security --offline=yes --root="$root" switchyard.service 2>/dev/null |
  sed -n 's/.*Overall exposure level for switchyard.service: \([0-9.]*\).*/\1/p')
[ -n "$exposure" ] || fail "systemd-analyze security gave no score"
awk -v e="$exposure" -v m="$max_exposure" 'BEGIN { exit !(e <= m) }' ||
  fail "systemd-analyze security: exposure $exposure, over $max_exposure"
ok "systemd-analyze security --offline=yes: exposure $exposure (at most $max_exposure)"

if command -v lintian >/dev/null; then
  lintian --fail-on error,warning "$deb" || fail "lintian"
  ok "lintian"
fi
