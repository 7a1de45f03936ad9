//! Two "hosts" on one machine: two network namespaces joined by a veth pair
//! ([`TwoHosts`]), for live migrations over TCP between QEMUs that see only their own.

use std::process::Command;

/// Two network namespaces, `a` and `b`, made by the test and joined by a veth pair whose
/// ends live only in them (created there: the root namespace never holds either end, and
/// has no address on them), with [`TwoHosts::ADDR_A`] and [`TwoHosts::ADDR_B`] and their
/// loopback up. Root only. Dropping it deletes both namespaces (and the pair with them),
/// also when the test fails.
#[derive(Debug)]
pub struct TwoHosts {
    /// Host A's namespace.
    pub a: String,
    /// Host B's namespace.
    pub b: String,
}

impl TwoHosts {
    /// Host A's address on the link.
    pub const ADDR_A: &str = "10.231.7.1";
    /// Host B's address on the link.
    pub const ADDR_B: &str = "10.231.7.2";

    /// Makes the namespaces, named after `tag` and this process (so that parallel runs do
    /// not meet), and the link between them. Panics, saying why, if that fails (not root,
    /// no `ip`): a test that needs them cannot run without.
    pub fn new(tag: &str) -> Self {
        assert!(
            rustix::process::geteuid().is_root(),
            "two hosts in network namespaces need root (CI runs as root)"
        );
        let pid = std::process::id();
        let hosts = TwoHosts {
            a: format!("sy-{tag}-a-{pid}"),
            b: format!("sy-{tag}-b-{pid}"),
        };
        // From here on the guard deletes what was made, whatever fails next.
        ip(&["netns", "add", &hosts.a]);
        ip(&["netns", "add", &hosts.b]);
        ip(&[
            "link", "add", "sy-va", "netns", &hosts.a, "type", "veth", "peer", "name", "sy-vb",
            "netns", &hosts.b,
        ]);
        for (ns, dev, addr) in [
            (&hosts.a, "sy-va", Self::ADDR_A),
            (&hosts.b, "sy-vb", Self::ADDR_B),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }
}

/// Runs `ip ARGS`, panicking with its error output if it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run ip {}: {e}", args.join(" ")));
    assert!(
        out.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            // Deleting a namespace deletes the veth end in it, and with it the pair.
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}
