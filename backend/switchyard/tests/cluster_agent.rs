//! The OCF resource agent `ocf:switchyard:pool` (`debian/ocf/pool`) against a real daemon
//! (issue 37), with stand-ins for what a cluster node has: the OCF shell functions (the codes,
//! `ocf_log` to a file), `crm_node`, `crm_attribute` (node attributes as files, every call
//! recorded) and `virsh` (the running domains from the environment). What it checks: start
//! releases the endpoints of domains not running and publishes every pool's attribute;
//! monitor updates only what changed and deletes the attributes of pools gone; stop deletes
//! them all; an unreachable daemon fails start and monitor, saying so; start and monitor
//! publish each running domain's migration descriptions in its metadata when they change
//! (issue 38), and a failure there is only a warning.
#![forbid(unsafe_code)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::daemon::{Daemon, exe};

const AGENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/debian/ocf/pool");

/// Pool `gpu` of two boards, pool `spare-1` of one.
const CONFIG: &str = "[[boards]]\nid = \"g0\"\nvram = \"8M\"\n\
     [[boards]]\nid = \"g1\"\nvram = \"8M\"\n\
     [[boards]]\nid = \"s0\"\nvram = \"8M\"\n\
     [[pools]]\nname = \"gpu\"\nboards = [\"g0\", \"g1\"]\n\
     [[pools]]\nname = \"spare-1\"\nboards = [\"s0\"]\n";

const SHELLFUNCS: &str = r#"
OCF_SUCCESS=0; OCF_ERR_GENERIC=1; OCF_ERR_ARGS=2; OCF_ERR_UNIMPLEMENTED=3; OCF_ERR_PERM=4
OCF_ERR_INSTALLED=5; OCF_ERR_CONFIGURED=6; OCF_NOT_RUNNING=7
__OCF_ACTION=$1
ocf_log() { echo "$*" >>"$STUB_DIR/log"; }
ocf_exit_reason() { echo "reason: $*" >>"$STUB_DIR/log"; }
have_binary() { command -v "$1" >/dev/null 2>&1; }
"#;

const CRM_NODE: &str = "#!/bin/sh\n[ \"$1\" = -n ] && echo node1\n";

const CRM_ATTRIBUTE: &str = r#"#!/bin/sh
echo "$*" >>"$STUB_DIR/calls"
while [ $# -gt 0 ]; do
	case "$1" in
	--node) [ "$2" = node1 ] || exit 2; shift ;;
	--name) name=$2; shift ;;
	--update) op=update; value=$2; shift ;;
	--query) op=query ;;
	--delete) op=delete ;;
	--utilization | --quiet) ;;
	*) exit 2 ;;
	esac
	shift
done
case "$op" in
query) [ -f "$STUB_DIR/attrs/$name" ] || exit 105; cat "$STUB_DIR/attrs/$name" ;;
update) echo "$value" >"$STUB_DIR/attrs/$name" ;;
delete) rm -f "$STUB_DIR/attrs/$name" ;;
esac
"#;

/// `list --name` (the domains of `$STUB_RUNNING`) and `metadata` of our namespace: a get
/// prints `meta/DOMAIN` (none: an error, as libvirt's), a `--key sy --set XML --live` writes
/// it (fails where `meta/DOMAIN.locked` exists). Every call recorded in `virsh-calls`.
const VIRSH: &str = r#"#!/bin/sh
echo "$*" >>"$STUB_DIR/virsh-calls"
[ "$1 $2" = "-c qemu:///system" ] || exit 1
shift 2
case "$1" in
list)
	[ "$*" = "list --name" ] || exit 1
	printf '%s\n' $STUB_RUNNING ''
	;;
metadata)
	domain=$2
	[ "$3 $4" = "--uri https://switchyard.dev/xmlns/libvirt/1" ] || exit 1
	if [ $# -eq 4 ]; then
		[ -f "$STUB_DIR/meta/$domain" ] || { echo "error: metadata not found" >&2; exit 1; }
		cat "$STUB_DIR/meta/$domain"
	else
		[ $# -eq 9 ] && [ "$5 $6 $7 $9" = "--key sy --set --live" ] || exit 1
		[ -f "$STUB_DIR/meta/$domain.locked" ] && { echo "error: operation failed" >&2; exit 1; }
		printf '%s\n' "$8" >"$STUB_DIR/meta/$domain"
	fi
	;;
*) exit 1 ;;
esac
"#;

/// The stand-ins, in a directory of their own.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).expect("bin");
        std::fs::create_dir_all(dir.path().join("attrs")).expect("attrs");
        std::fs::create_dir_all(dir.path().join("meta")).expect("meta");
        std::fs::write(dir.path().join("ocf-shellfuncs"), SHELLFUNCS).expect("shellfuncs");
        for (name, text) in [
            ("crm_node", CRM_NODE),
            ("crm_attribute", CRM_ATTRIBUTE),
            ("virsh", VIRSH),
        ] {
            let path = bin.join(name);
            std::fs::write(&path, text).expect("a stand-in");
            std::fs::set_permissions(&path, PermissionsExt::from_mode(0o755)).expect("chmod");
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The agent's `action` on the daemon at `socket`, `running` the domains virsh lists.
    fn agent(&self, action: &str, socket: &Path, running: &str) -> Output {
        let path = format!(
            "{}:{}",
            self.path("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Command::new("sh")
            .arg(AGENT)
            .arg(action)
            .env("PATH", path)
            .env("STUB_DIR", self.dir.path())
            .env("STUB_RUNNING", running)
            .env("OCF_ROOT", "/nonexistent")
            .env("OCF_FUNCTIONS_DIR", self.dir.path())
            .env("HA_RSCTMP", self.path("rsctmp"))
            .env("OCF_RESOURCE_INSTANCE", "swy")
            .env("OCF_RESKEY_binary", exe())
            .env("OCF_RESKEY_socket", socket)
            .stdin(Stdio::null())
            .output()
            .expect("run the agent")
    }

    fn rc(&self, action: &str, socket: &Path, running: &str) -> i32 {
        let out = self.agent(action, socket, running);
        out.status.code().expect("an exit code")
    }

    /// The node's utilization attributes, `NAME=VALUE` sorted.
    fn attributes(&self) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(self.path("attrs"))
            .expect("attrs")
            .map(|e| {
                let e = e.expect("an entry");
                let value = std::fs::read_to_string(e.path()).expect("a value");
                format!("{}={}", e.file_name().to_string_lossy(), value.trim())
            })
            .collect();
        out.sort();
        out
    }

    /// The `crm_attribute` calls since the last take.
    fn take_calls(&self) -> Vec<String> {
        let text = std::fs::read_to_string(self.path("calls")).unwrap_or_default();
        let _ = std::fs::remove_file(self.path("calls"));
        text.lines().map(str::to_owned).collect()
    }

    /// Domain `name`'s `<gpus>` metadata, as virsh prints it (`None`: it has none).
    fn meta(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(self.path("meta").join(name)).ok()
    }

    fn set_meta(&self, name: &str, text: &str) {
        std::fs::write(self.path("meta").join(name), text).expect("metadata");
    }

    /// The `virsh` calls since the last take.
    fn take_virsh_calls(&self) -> Vec<String> {
        let text = std::fs::read_to_string(self.path("virsh-calls")).unwrap_or_default();
        let _ = std::fs::remove_file(self.path("virsh-calls"));
        text.lines().map(str::to_owned).collect()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("log")).unwrap_or_default()
    }

    fn state_file(&self) -> PathBuf {
        self.path("rsctmp").join("switchyard-pool-swy.state")
    }
}

fn prepare(socket: &Path, domain: &str) {
    let out = Command::new(exe())
        .args(["cluster", "--socket"])
        .arg(socket)
        .args(["hook", domain, "prepare", "begin", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(
                b"<domain><metadata><sy:gpus xmlns:sy='https://switchyard.dev/xmlns/libvirt/1' \
                  pool='gpu' count='1'/></metadata></domain>",
            )?;
            c.wait_with_output()
        })
        .expect("run the hook");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_agent_publishes_capacity_without_churn_and_removes_it_at_stop() {
    let d = Daemon::start_with_config(CONFIG);
    let socket = d.socket();
    let node = Node::new();
    prepare(&socket, "alive");
    prepare(&socket, "gone");

    assert_eq!(node.rc("meta-data", &socket, ""), 0);
    assert_eq!(node.rc("validate-all", &socket, ""), 0);
    assert_eq!(node.rc("monitor", &socket, "alive"), 7, "{}", node.log());

    // start: the endpoints of domains not running go, every pool is published.
    assert_eq!(
        node.rc("start", &socket, "alive other"),
        0,
        "{}",
        node.log()
    );
    assert_eq!(d.endpoint_ids(), ["libvirt.alive.0"]);
    assert_eq!(node.attributes(), ["swy_gpu_gpus=2", "swy_spare_1_gpus=1"]);
    let calls = node.take_calls();
    assert!(
        calls.contains(&"--node node1 --utilization --name swy_gpu_gpus --update 2".to_owned()),
        "{calls:?}"
    );

    // monitor with nothing changed: queries only, no CIB update.
    assert_eq!(node.rc("monitor", &socket, ""), 0, "{}", node.log());
    let calls = node.take_calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls.iter().all(|c| c.ends_with("--query --quiet")),
        "{calls:?}"
    );

    // An endpoint outside the cluster takes spare-1's board: that attribute alone changes.
    d.ctl_ok(&["create", "hand", "--pool", "spare-1"]);
    assert_eq!(node.rc("monitor", &socket, ""), 0, "{}", node.log());
    assert_eq!(node.attributes(), ["swy_gpu_gpus=2", "swy_spare_1_gpus=0"]);
    let updates: Vec<String> = node
        .take_calls()
        .into_iter()
        .filter(|c| !c.ends_with("--query --quiet"))
        .collect();
    assert_eq!(
        updates,
        ["--node node1 --utilization --name swy_spare_1_gpus --update 0"]
    );

    // A pool published before and gone now (a configuration change): its attribute goes.
    let mut state = std::fs::read_to_string(node.state_file()).expect("the state file");
    assert_eq!(state, "swy_gpu_gpus\nswy_spare_1_gpus\n");
    state.push_str("swy_old_gpus\n");
    std::fs::write(node.state_file(), state).expect("state");
    std::fs::write(node.path("attrs").join("swy_old_gpus"), "3\n").expect("attr");
    assert_eq!(node.rc("monitor", &socket, ""), 0, "{}", node.log());
    assert_eq!(node.attributes(), ["swy_gpu_gpus=2", "swy_spare_1_gpus=0"]);
    node.take_calls();

    // An unreachable daemon fails monitor and start, naming the socket.
    let gone = node.path("no.sock");
    assert_eq!(node.rc("monitor", &gone, ""), 1);
    assert_eq!(node.rc("start", &gone, ""), 1);
    let log = node.log();
    assert!(
        log.contains(&format!(
            "reason: switchyard cluster capacity failed (socket {}",
            gone.display()
        )),
        "{log}"
    );

    // stop: every attribute published goes, twice is fine, and it is not running then.
    assert_eq!(node.rc("stop", &socket, ""), 0);
    assert_eq!(node.attributes(), Vec::<String>::new());
    assert!(!node.state_file().exists());
    assert_eq!(node.rc("stop", &socket, ""), 0);
    assert_eq!(node.rc("monitor", &socket, ""), 7);
    assert_eq!(d.endpoint_ids(), ["hand", "libvirt.alive.0"]);
}

/// Endpoint `id`'s migration token.
fn token(d: &Daemon, id: &str) -> String {
    d.client()
        .get(&format!("/v1/endpoints/{id}"))
        .expect("endpoint")
        .body["endpoint"]["migration_token"]
        .as_str()
        .expect("a token")
        .to_owned()
}

#[test]
fn the_monitor_publishes_the_running_domains_descriptions_when_they_change() {
    let d = Daemon::start_with_config(CONFIG);
    let socket = d.socket();
    let node = Node::new();
    prepare(&socket, "vm");
    let bare = "<gpus pool=\"gpu\" count=\"1\"/>\n";
    node.set_meta("vm", bare);
    // `plain` has no <gpus>; `elsewhere` has, without endpoints here.
    node.set_meta("elsewhere", bare);
    let running = "vm plain elsewhere";
    let published =
        "info domain vm: its switchyard migration descriptions published in its metadata";

    assert_eq!(node.rc("start", &socket, running), 0, "{}", node.log());
    let meta = node.meta("vm").expect("published");
    assert!(
        meta.starts_with("<gpus pool=\"gpu\" count=\"1\"><source index=\"0\">"),
        "{meta}"
    );
    let first = token(&d, "libvirt.vm.0");
    assert!(meta.contains(&first), "{meta}");
    assert_eq!(node.meta("elsewhere").as_deref(), Some(bare));
    assert_eq!(node.meta("plain"), None);
    assert_eq!(node.log().matches(published).count(), 1, "{}", node.log());
    let sets = |calls: &[String]| calls.iter().filter(|c| c.contains(" --set ")).count();
    let calls = node.take_virsh_calls();
    assert_eq!(sets(&calls), 1, "{calls:?}");

    // Nothing changed: one list and one get per running domain, no set, no log line.
    assert_eq!(node.rc("monitor", &socket, running), 0, "{}", node.log());
    let calls = node.take_virsh_calls();
    assert_eq!(
        calls,
        [
            "-c qemu:///system list --name",
            "-c qemu:///system metadata vm --uri https://switchyard.dev/xmlns/libvirt/1",
            "-c qemu:///system metadata plain --uri https://switchyard.dev/xmlns/libvirt/1",
            "-c qemu:///system metadata elsewhere --uri https://switchyard.dev/xmlns/libvirt/1",
        ]
    );
    assert_eq!(node.meta("vm").as_deref(), Some(meta.as_str()));
    assert_eq!(node.log().matches(published).count(), 1);

    // The endpoint made again (a new token): the next monitor publishes it.
    prepare(&socket, "vm");
    let second = token(&d, "libvirt.vm.0");
    assert_ne!(first, second);
    assert_eq!(node.rc("monitor", &socket, running), 0, "{}", node.log());
    let meta = node.meta("vm").expect("published");
    assert!(meta.contains(&second) && !meta.contains(&first), "{meta}");
    assert_eq!(node.log().matches(published).count(), 2);

    // A set that fails, or metadata switchyard cannot read: warnings, the monitor passes.
    prepare(&socket, "vm");
    std::fs::write(node.path("meta").join("vm.locked"), "").expect("lock");
    node.set_meta("elsewhere", "<gpus pool=\"gpu\" count=\"0\"/>");
    assert_eq!(node.rc("monitor", &socket, running), 0, "{}", node.log());
    let log = node.log();
    assert!(
        log.contains("warn domain vm: cannot set its switchyard metadata: error: operation failed"),
        "{log}"
    );
    assert!(
        log.contains("warn switchyard cluster metadata elsewhere failed: error: domain elsewhere:"),
        "{log}"
    );
    assert_eq!(node.meta("vm").as_deref(), Some(meta.as_str()));
}
