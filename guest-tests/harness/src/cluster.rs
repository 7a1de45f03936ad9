//! The cluster rig of `scripts/cluster.sh` driven from a test ([`Rig`]): nodes in namespaces
//! with corosync, pacemaker, libvirtd and a switchyard daemon each, the Pacemaker
//! configuration of `vmm-integration/pacemaker/`, and VMs from
//! `vmm-integration/libvirt/cluster-vm.xml`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{GuestEnv, wait_until};

/// The switchyard part of the cluster's configuration (crmsh).
const CLUSTER_CRM: &str = include_str!("../../../vmm-integration/pacemaker/cluster.crm");
/// One VM's resource (crmsh).
const VM_CRM: &str = include_str!("../../../vmm-integration/pacemaker/vm.crm");
/// A cluster VM's domain XML.
const VM_XML: &str = include_str!("../../../vmm-integration/libvirt/cluster-vm.xml");

/// The placeholders of the three templates above, each written `@NAME@` in them.
pub const TEMPLATE_PLACEHOLDERS: [(&str, &[&str]); 3] = [
    ("cluster.crm", &["NODES"]),
    ("vm.crm", &["CONFIG", "COUNT", "MIGRATE", "NAME", "POOL"]),
    (
        "cluster-vm.xml",
        &[
            "CMDLINE",
            "COUNT",
            "DEVICES",
            "EMULATOR",
            "INITRD",
            "IOMMU",
            "KERNEL",
            "MEMORY_MIB",
            "NAME",
            "POOL",
            "SERIAL_LOG",
        ],
    ),
];

/// The templates by name, for tests of their placeholders.
pub fn template(name: &str) -> &'static str {
    match name {
        "cluster.crm" => CLUSTER_CRM,
        "vm.crm" => VM_CRM,
        "cluster-vm.xml" => VM_XML,
        _ => panic!("no template {name}"),
    }
}

/// The words `@WORD@` of `text` (upper case, digits and `_`), sorted, once each.
pub fn placeholders_in(text: &str) -> Vec<String> {
    let mut found: Vec<String> = text
        .split('@')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_owned)
        .collect();
    found.sort();
    found.dedup();
    found
}

/// `text` with every `@KEY@` replaced; panics if a placeholder is left.
fn render(text: &str, values: &[(&str, String)]) -> String {
    let mut out = text.to_owned();
    for (key, value) in values {
        out = out.replace(&format!("@{key}@"), value);
    }
    let left = placeholders_in(&out);
    assert!(left.is_empty(), "placeholders left: {left:?}\n{out}");
    out
}

/// `s` escaped for XML text and attribute values.
pub fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('\'', "&apos;")
        .replace('"', "&quot;")
}

/// A VM of the cluster.
#[derive(Debug, Clone)]
pub struct Vm {
    /// Its domain's (and resource's) name.
    pub name: String,
    /// How many devices of pool `gpu` it needs.
    pub gpus: u32,
    /// The guest's kernel command line.
    pub cmdline: String,
    /// With the emulated VT-d (for an in-guest VFIO driver); without, the VM can live-migrate.
    pub iommu: bool,
    /// Its QEMU: `None` for the guest tests' QEMU 11.1, else the patched one (live migration).
    pub emulator: Option<PathBuf>,
}

/// The emulated VT-d of a VM with an in-guest VFIO driver.
const IOMMU: &str = "    <iommu model='intel'>\n      <driver caching_mode='on'/>\n    </iommu>";

impl Vm {
    /// Its serial console's file on the node that runs it (in the node's private /var/log).
    pub fn serial_in_node(&self) -> String {
        format!("/var/log/libvirt/qemu/{}.serial", self.name)
    }

    /// The domain XML: `vmm-integration/libvirt/cluster-vm.xml` rendered with the guest-test QEMU, kernel and `initrd`.
    pub fn domain_xml(&self, env: &GuestEnv, initrd: &Path) -> String {
        let path = |p: &Path| xml_escape(p.to_str().expect("UTF-8 path"));
        let devices: Vec<String> = (0..self.gpus)
            .map(|i| {
                let json = serde_json::json!({
                    "driver": "vfio-user-pci",
                    "id": format!("gpu{i}"),
                    "socket": {
                        "type": "unix",
                        "path": format!("/run/switchyard/endpoints/libvirt.{}.{i}.sock", self.name),
                    },
                });
                format!(
                    "    <qemu:arg value='-device'/>\n    <qemu:arg value='{}'/>",
                    xml_escape(&json.to_string())
                )
            })
            .collect();
        render(
            VM_XML,
            &[
                ("NAME", xml_escape(&self.name)),
                ("MEMORY_MIB", "512".into()),
                (
                    "EMULATOR",
                    path(self.emulator.as_deref().unwrap_or(&env.qemu)),
                ),
                ("IOMMU", if self.iommu { IOMMU } else { "" }.to_owned()),
                ("KERNEL", path(&env.vmlinux)),
                ("INITRD", path(initrd)),
                ("CMDLINE", xml_escape(&self.cmdline)),
                ("SERIAL_LOG", xml_escape(&self.serial_in_node())),
                ("POOL", "gpu".into()),
                ("COUNT", self.gpus.to_string()),
                ("DEVICES", devices.join("\n")),
            ],
        )
    }
}

/// A running rig (`scripts/cluster.sh up`); dropping it takes it down (`down`), also when the
/// test fails. Its directory (logs of every node) is under the test's log directory.
#[derive(Debug)]
pub struct Rig {
    script: PathBuf,
    /// The rig's directory (`SWITCHYARD_CLUSTER_DIR`).
    pub dir: PathBuf,
    switchyard: PathBuf,
    nodes: Vec<String>,
    /// How long `up` took, and until every node was an online member.
    pub up_time: Duration,
}

impl Rig {
    /// `scripts/cluster.sh up` with `boards[i]` softgpu boards on node i+1, then waits until
    /// every node is an online member.
    pub fn up(env: &GuestEnv, log_dir: &Path, boards: &[u32]) -> Rig {
        let started = Instant::now();
        let mut rig = Rig {
            script: env.repo.join("scripts/cluster.sh"),
            dir: log_dir.join("cluster"),
            switchyard: env.switchyard.clone(),
            nodes: (1..=boards.len()).map(|i| format!("node{i}")).collect(),
            up_time: Duration::ZERO,
        };
        let list: Vec<String> = boards.iter().map(u32::to_string).collect();
        rig.ok(&[
            "up",
            "--nodes",
            &boards.len().to_string(),
            "--boards",
            &list.join(","),
        ]);
        rig.ok(&["wait-online", "60"]);
        rig.up_time = started.elapsed();
        rig
    }

    /// The nodes' names.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The path of `path` (absolute, in a node's private `/var/log`) from outside the node.
    pub fn node_log(&self, node: &str, path: &str) -> PathBuf {
        let rel = path
            .strip_prefix("/var/log/")
            .unwrap_or_else(|| panic!("{path} is not under /var/log"));
        self.dir.join(node).join("var-log").join(rel)
    }

    /// Runs `scripts/cluster.sh ARGS`.
    pub fn run(&self, args: &[&str]) -> Output {
        Command::new("timeout")
            .args(["--kill-after=5", "180"])
            .arg(&self.script)
            .args(args)
            .env("SWITCHYARD_CLUSTER_DIR", &self.dir)
            .env("SWITCHYARD_BIN", &self.switchyard)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.script.display()))
    }

    /// [`Rig::run`], failing the test unless it succeeds; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "cluster.sh {}: {}\nstdout: {stdout}\nstderr: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// Runs a command in `node`.
    pub fn exec(&self, node: &str, cmd: &[&str]) -> Output {
        let mut args = vec!["exec", node];
        args.extend_from_slice(cmd);
        self.run(&args)
    }

    /// [`Rig::exec`], failing the test unless it succeeds; its stdout.
    pub fn exec_ok(&self, node: &str, cmd: &[&str]) -> String {
        let mut args = vec!["exec", node];
        args.extend_from_slice(cmd);
        self.ok(&args)
    }

    /// Loads crmsh configuration text into the cluster (through `node`).
    pub fn configure(&self, node: &str, text: &str, name: &str) {
        let file = self.dir.join(format!("{name}.crm"));
        std::fs::write(&file, text).expect("write the crm file");
        let f = file.to_str().expect("UTF-8");
        self.exec_ok(node, &["crm", "configure", "load", "update", f]);
    }

    /// Loads `vmm-integration/pacemaker/cluster.crm`: fencing, placement by utilization, the pool agent on every node.
    pub fn configure_switchyard(&self) {
        let text = render(CLUSTER_CRM, &[("NODES", self.nodes.join(" "))]);
        self.configure(&self.nodes[0], &text, "cluster");
    }

    /// Writes `vm`'s domain XML and loads its resource (`vmm-integration/pacemaker/vm.crm`) through `node`.
    pub fn add_vm(&self, env: &GuestEnv, initrd: &Path, node: &str, vm: &Vm) {
        let xml = self.dir.join(format!("{}.xml", vm.name));
        std::fs::write(&xml, vm.domain_xml(env, initrd)).expect("write the domain XML");
        let text = render(
            VM_CRM,
            &[
                ("NAME", vm.name.clone()),
                ("CONFIG", xml.to_str().expect("UTF-8").to_owned()),
                ("POOL", "gpu".into()),
                ("COUNT", vm.gpus.to_string()),
                // Migratable: no emulated IOMMU, the patched QEMU.
                ("MIGRATE", (!vm.iommu && vm.emulator.is_some()).to_string()),
            ],
        );
        self.configure(node, &text, &vm.name);
    }

    /// Where `resource` runs, as `crm_resource --locate` says through `node`; `None` when it
    /// runs nowhere.
    pub fn location(&self, node: &str, resource: &str) -> Option<String> {
        let out = self.exec(node, &["crm_resource", "--locate", "--resource", resource]);
        let text = String::from_utf8_lossy(&out.stdout);
        // "resource vm1 is running on: node2"
        text.lines()
            .find_map(|l| l.split_once("is running on: "))
            .map(|(_, n)| n.trim().to_owned())
    }

    /// Waits (through `node`) until `resource` runs somewhere; where.
    pub fn wait_running(&self, node: &str, resource: &str, timeout: Duration) -> String {
        wait_until(timeout, &format!("{resource} to run"), || {
            self.location(node, resource)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", self.status()))
    }

    /// `node`'s utilization attribute `name` (`None` when it has none).
    pub fn utilization(&self, via: &str, node: &str, name: &str) -> Option<String> {
        let out = self.exec(
            via,
            &[
                "crm_attribute",
                "--node",
                node,
                "--utilization",
                "--name",
                name,
                "--query",
                "--quiet",
            ],
        );
        let v = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success() && !v.is_empty()).then_some(v)
    }

    /// Waits until the cluster has nothing left to do (`crm_resource --wait`, through `node`).
    pub fn settle(&self, node: &str) {
        self.exec_ok(node, &["crm_resource", "--wait", "--timeout", "120s"]);
    }

    /// `cluster.sh status`, for failure messages.
    pub fn status(&self) -> String {
        let out = self.run(&["status"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `switchyard ctl endpoint ID --json` on `node`, parsed (`None` when there is none).
    pub fn endpoint(&self, node: &str, id: &str) -> Option<serde_json::Value> {
        let out = self.exec(node, &["switchyard", "ctl", "--json", "endpoint", id]);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).expect("endpoint JSON"))
    }

    /// The domain's switchyard metadata on `node` (`virsh metadata`; empty when none).
    pub fn metadata(&self, node: &str, domain: &str) -> String {
        let out = self.exec(
            node,
            &[
                "virsh",
                "metadata",
                domain,
                "--uri",
                "https://switchyard.dev/xmlns/libvirt/1",
            ],
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The endpoints of `node`'s daemon (`switchyard ctl endpoints --json`): their ids.
    pub fn endpoints(&self, node: &str) -> Vec<String> {
        let text = self.exec_ok(node, &["switchyard", "ctl", "--json", "endpoints"]);
        let v: serde_json::Value = serde_json::from_str(&text).expect("endpoints JSON");
        let mut ids: Vec<String> = v
            .as_array()
            .expect("an array")
            .iter()
            .filter_map(|e| e["endpoint"]["id"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let out = self.run(&["down"]);
        if !out.status.success() {
            eprintln!(
                "cluster.sh down: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
}
