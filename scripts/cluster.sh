#!/bin/bash
# scripts/cluster.sh — a Pacemaker + Corosync + libvirt + switchyard cluster of N "hosts" on this
# one machine, for the cluster tests and for trying the cluster out (docs/cluster.md).
#
# Each node is a process tree in its own network, mount, UTS and PID namespace: a bash as the
# namespace's PID 1 that mounts the node's private directories and starts, in this order, the
# node's `switchyard daemon`, libvirtd, corosync and pacemakerd. The nodes' links (one veth
# each, 10.231.9.N/24) meet on a bridge in a namespace of its own; no address of theirs exists in
# the root namespace, and nothing is ever sent to them from it. The node looks like a host with
# the switchyard Debian package installed: its /usr/bin/switchyard, the resource agent
# /usr/lib/ocf/resource.d/switchyard/pool, the libvirt hook /etc/libvirt/hooks/qemu.d/switchyard
# (overlays of the host's directories, seen by that node only), and a test fence agent
# /usr/sbin/fence_switchyard_rig.
#
# Fencing: fence_switchyard_rig asks the rig's fencer (a process in the root namespace, the
# only one that sees every node) to kill the node: SIGKILL to the node's PID 1 ends every
# process of it, QEMUs included, and its tmpfs /run and /dev/shm go with its mount namespace.
# That is "power off"; `start NODE` powers it on again (a fresh boot of the same disks: its
# /var/lib, /etc and /var/log directories persist).
#
# Usage: scripts/cluster.sh COMMAND [ARGS]
#   up [--nodes N] [--boards LIST]  make N nodes (default 3) and start them; LIST is the number
#                                   of softgpu boards per node, comma-separated (default 1 each)
#   down                            stop everything, by PID, and delete the namespaces
#   status                          the nodes and `crm_mon -1` from the first node that is up
#   exec NODE CMD [ARGS]            run a command in a node (all its namespaces)
#   kill NODE                       crash a node (SIGKILL to all its processes), no fencing
#   start NODE                      boot a node that is down (after `kill` or fencing)
#   boards NODE N                   give the node N boards of pool `gpu` (restarts its daemon;
#                                   the endpoints' workers keep running)
#   wait-online [SECONDS]           wait until every running node is an online, non-pending member
# Environment:
#   SWITCHYARD_CLUSTER_DIR  the rig's directory (default <repo>/.cache/cluster); `down` keeps
#                           its logs, `up` starts afresh
#   SWITCHYARD_BIN          the switchyard binary (default <repo>/target/debug/switchyard)
#   SWITCHYARD_CACHE        the guest toolchain (scripts/setup.sh; default <repo>/.cache/vmtools)
# Needs root, and the packages pacemaker corosync crmsh resource-agents libvirt-daemon
# libvirt-daemon-driver-qemu libvirt-clients (scripts/install-libvirt.sh --cluster installs them).
set -euo pipefail

die() { echo "cluster.sh: error: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RIG=${SWITCHYARD_CLUSTER_DIR:-$REPO/.cache/cluster}
BIN=${SWITCHYARD_BIN:-$REPO/target/debug/switchyard}
DEB=$REPO/backend/switchyard/debian
BRNS=swy-cl-br                 # the bridge's namespace
NET=10.231.9                   # node N is $NET.N
CLUSTER_NAME=switchyard-rig

node_ns() { echo "swy-cl-$1"; }
node_num() {
  [[ $1 =~ ^node([1-9][0-9]?)$ ]] || die "'$1' is not a node name (node1, node2, ...)"
  echo "${BASH_REMATCH[1]}"
}
nodes() { cat "$RIG/nodes" 2>/dev/null || true; }
# The root-namespace PID of the node's PID 1 (empty when the node is down).
node_init() {
  local pid
  pid=$(cat "$RIG/$1/init.pid" 2>/dev/null) || return 0
  # The holder is `unshare --fork --kill-child`: its one child is the node's PID 1.
  [ -d "/proc/$pid" ] && ps -o pid= --ppid "$pid" | tr -d ' ' | head -1
  return 0
}

in_node() {
  local node=$1 init
  shift
  init=$(node_init "$node")
  [ -n "$init" ] || die "$node is down"
  nsenter -t "$init" -m -n -u -p -- "$@"
}

# --- up ------------------------------------------------------------------------------------------

corosync_conf() {
  local n
  cat <<EOF
# corosync.conf of the switchyard cluster rig (scripts/cluster.sh)
totem {
    version: 2
    cluster_name: $CLUSTER_NAME
    transport: knet
    crypto_cipher: none
    crypto_hash: none
    # TCG guests share the cores: a short token declares busy nodes dead.
    token: 5000
}
nodelist {
EOF
  for n in $(nodes); do
    printf '    node {\n        name: %s\n        nodeid: %s\n        ring0_addr: %s\n    }\n' \
      "$n" "$(node_num "$n")" "$NET.$(node_num "$n")"
  done
  cat <<EOF
}
quorum {
    provider: corosync_votequorum
}
# Without systemd: no cgroup move, no realtime scheduling, no syslog.
system {
    move_to_root_cgroup: no
    sched_rr: no
}
logging {
    to_syslog: no
    to_stderr: no
    to_logfile: yes
    logfile: /var/log/corosync/corosync.log
    timestamp: hires
}
EOF
}

pool_toml() {
  local boards=$1 i
  echo "# pool of $2 (scripts/cluster.sh): $boards softgpu board(s) in pool gpu"
  for ((i = 0; i < boards; i++)); do
    printf '[[boards]]\nid = "%s-gpu%d"\nvram = "64M"\nqueues = 2\n\n' "$2" "$i"
  done
  printf '[[pools]]\nname = "gpu"\nboards = [%s]\n' \
    "$(for ((i = 0; i < boards; i++)); do printf '%s"%s-gpu%d"' "$([ $i = 0 ] || echo ', ')" "$2" "$i"; done)"
}

# libvirtd: root-only UNIX sockets without authentication (no polkit here); TCP without
# authentication on the node's link for live migration (qemu+tcp://NODE/system).
LIBVIRTD_CONF='unix_sock_group = "root"
unix_sock_ro_perms = "0700"
unix_sock_rw_perms = "0700"
unix_sock_admin_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
listen_tls = 0
listen_tcp = 1
auth_tcp = "none"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
'
# QEMU as root with no confinement and no cgroups (vmm-integration/libvirt/README.md says what
# a production host does instead).
QEMU_CONF='user = "root"
group = "root"
dynamic_ownership = 0
security_driver = "none"
cgroup_controllers = [ ]
stdio_handler = "file"
'

# The fence agent every node sees as /usr/sbin/fence_switchyard_rig (RHCS fence agent API:
# key=value lines on stdin, or -o ACTION -n NODE).
fence_agent() {
  cat <<'EOF'
#!/bin/bash
# fence_switchyard_rig: fences a node of the switchyard cluster rig (scripts/cluster.sh) by
# asking the rig's fencer to kill all its processes. Test rigs only.
action=reboot port=""
while [ $# -gt 0 ]; do
  case $1 in
    -o|--action) action=$2; shift ;;
    -n|--plug|--port) port=$2; shift ;;
  esac
  shift
done
if [ ! -t 0 ]; then
  while IFS='=' read -r k v; do
    case $k in
      action|option) action=$v ;;
      port|plug|nodename) port=$v ;;
    esac
  done
fi
case $action in
  metadata)
    cat <<'XML'
<?xml version="1.0" ?>
<resource-agent name="fence_switchyard_rig" shortdesc="Fences a node of the switchyard cluster rig">
<longdesc>Kills every process of a node of scripts/cluster.sh's rig (its PID namespace). Test rigs only.</longdesc>
<parameters>
  <parameter name="action" unique="0" required="0"><getopt mixed="-o, --action=[action]"/><content type="string" default="reboot"/><shortdesc lang="en">Fencing action</shortdesc></parameter>
  <parameter name="port" unique="0" required="0"><getopt mixed="-n, --plug=[node]"/><content type="string"/><shortdesc lang="en">The node to fence</shortdesc></parameter>
</parameters>
<actions>
  <action name="on"/><action name="off"/><action name="reboot"/><action name="status"/>
  <action name="list"/><action name="monitor"/><action name="metadata"/>
</actions>
</resource-agent>
XML
    exit 0 ;;
  monitor|list) [ -p "@FIFO@" ] || exit 1; exit 0 ;;
  status|on|off|reboot)
    [ -n "$port" ] || { echo "fence_switchyard_rig: no node (port=)" >&2; exit 1; }
    [ -p "@FIFO@" ] || { echo "fence_switchyard_rig: the rig's fencer is not running" >&2; exit 1; }
    reply=$(mktemp -u "@DIR@/reply.XXXXXX")
    mkfifo "$reply"
    # Read-write: opening never blocks, so a fencer that never answers costs 60 s, not forever;
    # the request's open blocks only without a fencer (then timeout ends it).
    exec 4<>"$reply"
    timeout 10 sh -c 'echo "$1" >"$2"' - "$action $port $reply" "@FIFO@" || answer="no fencer"
    [ -n "${answer:-}" ] || read -r -t 60 answer <&4
    exec 4<&-; rm -f "$reply"
    case $answer in
      ok) exit 0 ;;
      down) [ "$action" = status ] && exit 2; exit 0 ;;
      *) echo "fence_switchyard_rig: $action $port: ${answer:-no answer}" >&2; exit 1 ;;
    esac ;;
  *) echo "fence_switchyard_rig: unknown action $action" >&2; exit 1 ;;
esac
EOF
}

# The node's PID 1 (runs inside the node's new namespaces): private mounts, then the daemons;
# then it reaps orphans forever. Every daemon is its child, so the node's end ends them all.
node_boot() {
  local node=$1 dir=$RIG/$1 d
  # Fresh tmpfs for /run and /dev/shm on every boot (stale IPC files of a killed node are gone).
  mount -n -t tmpfs -o mode=0755 tmpfs /run
  mount -n -t tmpfs -o mode=1777 tmpfs /dev/shm
  for d in etc/corosync var/lib/corosync var/lib/pacemaker var/log etc/libvirt var/lib/libvirt \
           var/cache/libvirt; do
    mount -n --bind "$dir/${d//\//-}" "/$d"
  done
  mount -n --bind "$dir/hosts" /etc/hosts
  mount -n --bind "$dir/hostname" /etc/hostname
  mount -n -t overlay overlay -o "lowerdir=$RIG/usr-bin:/usr/bin" /usr/bin
  mount -n -t overlay overlay -o "lowerdir=$RIG/usr-sbin:/usr/sbin" /usr/sbin
  mount -n -t overlay overlay -o "lowerdir=$RIG/ocf:/usr/lib/ocf/resource.d" /usr/lib/ocf/resource.d
  hostname "$node"
  mkdir -p /run/libvirt /run/pacemaker /run/corosync /var/log/pacemaker /var/log/corosync \
    /var/log/libvirt/qemu /var/log/switchyard /var/log/crmsh
  chown hacluster:haclient /var/log/pacemaker /run/pacemaker 2>/dev/null || true
  ip link set lo up

  switchyard daemon --config "$dir/pool.toml" --state-dir "$dir/state" --run-dir /run/switchyard \
    >>/var/log/switchyard/daemon.log 2>&1 &
  libvirtd --listen >>/var/log/libvirt/libvirtd.stderr 2>&1 &
  corosync -f >>/var/log/corosync/corosync.stderr 2>&1 &
  PCMK_logfile=/var/log/pacemaker/pacemaker.log pacemakerd >>/var/log/pacemaker/pacemakerd.stderr 2>&1 &
  echo booted >"$dir/booted"
  # PID 1 reaps every orphan (bash reaps any child on SIGCHLD, adopted ones too).
  while :; do sleep 3600 & wait $! || true; done
}

start_node() {
  local node=$1 dir=$RIG/$1 n init
  n=$(node_num "$node")
  [ -z "$(node_init "$node")" ] || die "$node is already up"
  rm -f "$dir/booted"
  # The node's disks: what a fenced node left in its state stays (corosync/pacemaker state,
  # libvirt's, the daemon's store), as on a host that was powered off.
  setsid ip netns exec "$(node_ns "$node")" unshare --mount --uts --pid --fork --kill-child \
    --mount-proc --propagation private -- "$0" _boot "$node" \
    >>"$dir/boot.log" 2>&1 </dev/null &
  echo $! >"$dir/init.pid"
  for _ in $(seq 300); do
    [ -e "$dir/booted" ] && break
    sleep 0.1
  done
  [ -e "$dir/booted" ] || die "$node did not boot (see $dir/boot.log)"
  init=$(node_init "$node")
  log "$node up (pid $init, $NET.$n)"
}

make_node() {
  local node=$1 boards=$2 dir=$RIG/$1 n ns d m
  n=$(node_num "$node")
  ns=$(node_ns "$node")
  mkdir -p "$dir/state"
  # Private copies of the package-owned directories (owners and modes kept), emptied of state.
  for d in etc/corosync var/lib/corosync var/lib/pacemaker var/log etc/libvirt var/lib/libvirt \
           var/cache/libvirt; do
    mkdir -p "$dir/${d//\//-}"
    if [ -d "/$d" ] && [ "$d" != var/log ]; then
      cp -a "/$d/." "$dir/${d//\//-}/"
    fi
  done
  find "$dir/var-lib-pacemaker" -type f -delete
  mkdir -p "$dir/var-log/pacemaker" "$dir/var-log/corosync" "$dir/var-log/libvirt"
  chown hacluster:haclient "$dir/var-log/pacemaker"
  corosync_conf >"$dir/etc-corosync/corosync.conf"
  echo "$LIBVIRTD_CONF" >"$dir/etc-libvirt/libvirtd.conf"
  echo "$QEMU_CONF" >"$dir/etc-libvirt/qemu.conf"
  install -D -m 0755 "$DEB/libvirt-hook" "$dir/etc-libvirt/hooks/qemu.d/switchyard"
  pool_toml "$boards" "$node" >"$dir/pool.toml"
  { echo "127.0.0.1 localhost"
    for m in $(nodes); do echo "$NET.$(node_num "$m") $m"; done; } >"$dir/hosts"
  echo "$node" >"$dir/hostname"
  # A CIB written first, so that a fresh cluster does not wait 20 s for a DC.
  cibadmin --empty >"$dir/var-lib-pacemaker/cib/cib.xml"
  CIB_file=$dir/var-lib-pacemaker/cib/cib.xml crm_attribute --type crm_config \
    --name dc-deadtime --update 2s
  chown -R hacluster:haclient "$dir/var-lib-pacemaker/cib"
  chmod 0600 "$dir/var-lib-pacemaker/cib/cib.xml"
  # The link: one end in the node's namespace, the other on the bridge.
  ip netns add "$ns"
  ip -n "$BRNS" link add "vn$n" type veth peer name eth0 netns "$ns"
  ip -n "$BRNS" link set "vn$n" master br0 up
  ip -n "$ns" addr add "$NET.$n/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
}

# The root-namespace fencer: reads "ACTION NODE REPLY-FIFO" lines; kills or reports the node.
fencer() {
  local action node reply init
  exec 3<>"$RIG/fence/requests"     # held open for writing too: no EOF between requests
  while read -r action node reply <&3; do
    init=""
    if [[ $node =~ ^node[1-9][0-9]?$ ]] && grep -qx "$node" "$RIG/nodes"; then
      init=$(node_init "$node")
      echo "$(date +%s.%N) $action $node: ${init:+up (pid $init)}${init:-down}" >>"$RIG/fence/log"
      case $action in
        status) ;;
        off|reboot)
          if [ -n "$init" ]; then
            kill -9 "$(cat "$RIG/$node/init.pid")" "$init" 2>/dev/null || true
            while [ -d "/proc/$init" ]; do sleep 0.05; done
          fi
          init="" ;;
        on) ;;   # the rig's nodes are powered on by `cluster.sh start`
      esac
      # (timeout: an agent that gave up holds the FIFO open no more.)
      [ -p "$reply" ] && timeout 10 sh -c 'echo "$1" >"$2"' - \
        "$([ -n "$init" ] && echo ok || echo down)" "$reply" &
    else
      [ -p "$reply" ] && timeout 10 sh -c 'echo "$1" >"$2"' - "unknown node $node" "$reply" &
    fi
  done
}

up() {
  local count=3 boards="" i n
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) count=$2; shift ;;
      --boards) boards=$2; shift ;;
      *) die "up: unknown argument '$1'" ;;
    esac
    shift
  done
  [[ $count =~ ^[1-9]$ ]] || die "--nodes: 1 to 9"
  [ "$(id -u)" = 0 ] || die "the rig needs root"
  [ -x "$BIN" ] || die "no switchyard binary at $BIN (cargo build, or SWITCHYARD_BIN)"
  for t in corosync pacemakerd crm_mon libvirtd virsh nsenter unshare; do
    command -v "$t" >/dev/null || die "$t is missing: run scripts/install-libvirt.sh --cluster"
  done
  [ -e "$RIG/nodes" ] && down
  # A rig of another directory, or one whose script was killed: its namespaces' processes are
  # killed (by PID, from `ip netns pids`) and the namespaces deleted.
  local ns pid
  for ns in $(ip netns list | awk '$1 ~ /^swy-cl-/ {print $1}'); do
    log "removing the stale rig namespace $ns"
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  done
  rm -rf "$RIG"
  mkdir -p "$RIG/fence" "$RIG/usr-bin" "$RIG/usr-sbin" "$RIG/ocf/switchyard"
  cp "$BIN" "$RIG/usr-bin/switchyard"
  install -m 0755 "$DEB/ocf/pool" "$RIG/ocf/switchyard/pool"
  fence_agent | sed "s|@FIFO@|$RIG/fence/requests|; s|@DIR@|$RIG/fence|" >"$RIG/usr-sbin/fence_switchyard_rig"
  chmod 0755 "$RIG/usr-sbin/fence_switchyard_rig"
  for ((i = 1; i <= count; i++)); do echo "node$i"; done >"$RIG/nodes"
  ip netns add "$BRNS"
  ip -n "$BRNS" link add br0 type bridge
  ip -n "$BRNS" link set br0 up
  for ((i = 1; i <= count; i++)); do
    n=$(cut -d, -f"$i" <<<"$boards")
    make_node "node$i" "${n:-1}"
  done
  mkfifo "$RIG/fence/requests"
  setsid "$0" _fencer >>"$RIG/fence/fencer.log" 2>&1 </dev/null &
  echo $! >"$RIG/fence/fencer.pid"
  for n in $(nodes); do start_node "$n"; done
}

down() {
  local n pid
  for n in $(nodes); do
    pid=$(cat "$RIG/$n/init.pid" 2>/dev/null || true)
    # --kill-child: the holder's death is its PID 1's, and that ends the whole namespace.
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  done
  pid=$(cat "$RIG/fence/fencer.pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  for n in $(nodes); do
    pid=$(cat "$RIG/$n/init.pid" 2>/dev/null || true)
    while [ -n "$pid" ] && [ -d "/proc/$pid" ]; do sleep 0.05; done
    ip netns del "$(node_ns "$n")" 2>/dev/null || true
    rm -f "$RIG/$n/init.pid"
  done
  ip netns del "$BRNS" 2>/dev/null || true
  rm -f "$RIG/nodes"
  log "down (logs kept in $RIG)"
}

status() {
  local n init shown=0
  for n in $(nodes); do
    init=$(node_init "$n")
    if [ -n "$init" ]; then echo "$n: up (pid $init)"; else echo "$n: down"; fi
  done
  for n in $(nodes); do
    if [ -n "$(node_init "$n")" ]; then
      in_node "$n" crm_mon -1 -r || true
      shown=1
      break
    fi
  done
  [ $shown = 1 ] || echo "(no node up)"
}

wait_online() {
  local limit=${1:-60} want n end
  end=$((SECONDS + limit))
  want=$(for n in $(nodes); do [ -n "$(node_init "$n")" ] && echo "$n"; done | sort | tr '\n' ' ')
  n=$(head -1 <<<"$want" | cut -d' ' -f1)
  while :; do
    # Online and not pending: the node has joined the controller's membership.
    got=$(in_node "$n" crm_mon -1 --output-as=xml 2>/dev/null | python3 -c '
import sys, xml.etree.ElementTree as ET
try:
    nodes = ET.parse(sys.stdin).getroot().iter("node")
    print(" ".join(sorted(n.get("name") for n in nodes
                          if n.get("online") == "true" and n.get("pending") == "false")), end=" ")
except ET.ParseError:
    pass' || true)
    [ "$got" = "$want" ] && return 0
    [ $SECONDS -lt $end ] || die "after ${limit}s online: '$got', want '$want'"
    sleep 0.2
  done
}

boards() {
  local node=$1 count=$2 pid
  [[ $count =~ ^[1-9]$ ]] || die "boards: 1 to 9"
  pool_toml "$count" "$node" >"$RIG/$node/pool.toml"
  # SIGTERM: the daemon stops its API and leaves the workers running; the next one adopts them.
  pid=$(in_node "$node" pgrep -x -f "switchyard daemon .*" | head -1)
  [ -n "$pid" ] && in_node "$node" sh -c "kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.05; done"
  in_node "$node" sh -c "setsid switchyard daemon --config '$RIG/$node/pool.toml' \
    --state-dir '$RIG/$node/state' --run-dir /run/switchyard \
    >>/var/log/switchyard/daemon.log 2>&1 </dev/null &"
  for _ in $(seq 200); do
    in_node "$node" switchyard ctl --socket /run/switchyard/control.sock pools >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "$node's daemon did not come back (see $RIG/$node/var-log/switchyard/daemon.log)"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  up) up "$@" ;;
  down) down ;;
  status) status ;;
  exec) [ $# -ge 2 ] || die "exec NODE CMD [ARGS]"; node=$1; shift; in_node "$node" "$@" ;;
  kill) [ $# = 1 ] || die "kill NODE"; pid=$(cat "$RIG/$1/init.pid" 2>/dev/null || true)
        [ -n "$(node_init "$1")" ] || die "$1 is down"; kill -9 "$pid" ;;
  start) [ $# = 1 ] || die "start NODE"; start_node "$1" ;;
  boards) [ $# = 2 ] || die "boards NODE N"; boards "$1" "$2" ;;
  wait-online) wait_online "$@" ;;
  _boot) node_boot "$1" ;;
  _fencer) fencer ;;
  -h|--help|"") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; [ -n "$cmd" ] ;;
  *) die "unknown command '$cmd' (see --help)" ;;
esac
