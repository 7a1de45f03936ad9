//! `switchyard cluster` against a real daemon (issue 37): libvirt's hook creates and deletes a
//! domain's endpoints (all or none), `capacity` counts what the cluster may place, and
//! `release-stale` deletes the endpoints of domains no longer running; a live migration
//! between two nodes (two daemons): `metadata` publishes the source's descriptions, the
//! destination's `migrate` hook makes incoming endpoints from them (issue 38).
#![forbid(unsafe_code)]

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::daemon::{Daemon, exe};
use serde_json::Value;

/// Pool `gpu` of three boards, pool `spare-1` of two.
const CONFIG: &str = "[[boards]]\nid = \"g0\"\nvram = \"8M\"\n\
     [[boards]]\nid = \"g1\"\nvram = \"8M\"\n\
     [[boards]]\nid = \"g2\"\nvram = \"8M\"\n\
     [[boards]]\nid = \"s0\"\nvram = \"8M\"\n\
     [[boards]]\nid = \"s1\"\nvram = \"8M\"\n\
     [[pools]]\nname = \"gpu\"\nboards = [\"g0\", \"g1\", \"g2\"]\n\
     [[pools]]\nname = \"spare-1\"\nboards = [\"s0\", \"s1\"]\n";

fn domain_xml(name: &str, pool: &str, count: &str) -> String {
    format!(
        "<domain type='kvm'><name>{name}</name><metadata>\
         <sy:gpus xmlns:sy=\"https://switchyard.dev/xmlns/libvirt/1\" pool=\"{pool}\" \
         count=\"{count}\"/></metadata></domain>"
    )
}

/// `switchyard cluster --socket SOCKET ARGS`, `stdin` on its standard input.
fn cluster(socket: &Path, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(exe())
        .arg("cluster")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("SWITCHYARD_CONTROL_SOCKET")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run switchyard cluster");
    // A hook that does not read its input (every operation but prepare) may have exited.
    let _ = child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes());
    child
        .wait_with_output()
        .expect("wait for switchyard cluster")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `cluster ARGS` that must succeed; its standard output.
fn cluster_ok(socket: &Path, args: &[&str], stdin: &str) -> String {
    let out = cluster(socket, args, stdin);
    assert!(
        out.status.success(),
        "cluster {args:?}: {}\n{}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The hook for `domain`'s `operation`, as libvirt runs it.
fn hook(socket: &Path, domain: &str, operation: &str, xml: &str) -> Output {
    cluster(socket, &["hook", domain, operation, "begin", "-"], xml)
}

fn capacity_json(d: &Daemon) -> Value {
    let out = cluster_ok(&d.socket(), &["capacity", "--json"], "");
    serde_json::from_str(&out).expect("capacity --json is JSON")
}

#[test]
fn the_hook_places_a_domains_gpus_and_capacity_counts_what_the_cluster_may_place() {
    let d = Daemon::start_with_config(CONFIG);
    let socket = d.socket();
    assert_eq!(cluster_ok(&socket, &["capacity"], ""), "gpu 3\nspare-1 2\n");

    // prepare: two endpoints of pool gpu, with their sockets where the domain's XML names them.
    let out = hook(&socket, "vm1", "prepare", &domain_xml("vm1", "gpu", "2"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "", "a hook prints nothing on stdout");
    assert_eq!(d.endpoint_ids(), ["libvirt.vm1.0", "libvirt.vm1.1"]);
    for i in 0..2 {
        let e = d
            .client()
            .get(&format!("/v1/endpoints/libvirt.vm1.{i}"))
            .expect("endpoint")
            .body;
        assert_eq!(e["endpoint"]["pool"], "gpu");
        assert_eq!(
            e["endpoint"]["socket"],
            d.run_dir()
                .join(format!("endpoints/libvirt.vm1.{i}.sock"))
                .to_str()
                .expect("utf-8")
        );
    }
    // The cluster's own leases are Pacemaker's to count: the capacity stays.
    assert_eq!(
        capacity_json(&d),
        serde_json::json!({ "gpu": 3, "spare-1": 2 })
    );

    // A second domain asking for two gets one: none of its endpoints stays, and the error
    // names the domain, the pool, the endpoint and the daemon's reason.
    let out = hook(&socket, "vm2", "prepare", &domain_xml("vm2", "gpu", "2"));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    for part in ["vm2", "pool gpu", "libvirt.vm2.1", "HTTP"] {
        assert!(err.contains(part), "{part:?} not in {err}");
    }
    assert_eq!(d.endpoint_ids(), ["libvirt.vm1.0", "libvirt.vm1.1"]);

    // An endpoint made by hand takes capacity.
    d.ctl_ok(&["create", "x", "--pool", "gpu"]);
    assert_eq!(
        capacity_json(&d),
        serde_json::json!({ "gpu": 2, "spare-1": 2 })
    );
    assert_eq!(
        cluster_ok(&socket, &["capacity", "--attributes"], ""),
        "swy_gpu_gpus 2\nswy_spare_1_gpus 2\n"
    );
    // A quarantined board takes no leases: one device less.
    d.ctl_ok(&["quarantine", "s0"]);
    assert_eq!(
        capacity_json(&d),
        serde_json::json!({ "gpu": 2, "spare-1": 1 })
    );

    // release deletes the domain's endpoints; a second release finds none, and is fine.
    for _ in 0..2 {
        let out = hook(&socket, "vm1", "release", &domain_xml("vm1", "gpu", "2"));
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout), "");
        assert_eq!(d.endpoint_ids(), ["x"]);
    }
    // A domain's stale endpoints are replaced at prepare.
    d.ctl_ok(&["create", "libvirt.vm3.5", "--pool", "gpu"]);
    let out = hook(&socket, "vm3", "prepare", &domain_xml("vm3", "gpu", "1"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(d.endpoint_ids(), ["libvirt.vm3.0", "x"]);
}

#[test]
fn release_stale_deletes_the_endpoints_of_domains_not_running() {
    let d = Daemon::start_with_config(CONFIG);
    let socket = d.socket();
    for (domain, pool) in [("up", "gpu"), ("down", "gpu"), ("down.b", "spare-1")] {
        let out = hook(&socket, domain, "prepare", &domain_xml(domain, pool, "1"));
        assert!(out.status.success(), "{domain}: {}", text(&out.stderr));
    }
    d.ctl_ok(&["create", "libvirt.odd", "--pool", "gpu"]);
    d.ctl_ok(&["create", "mine", "--pool", "spare-1"]);
    let out = cluster_ok(&socket, &["release-stale", "--running", "up"], "");
    let mut deleted: Vec<&str> = out.lines().collect();
    deleted.sort_unstable();
    assert_eq!(
        deleted,
        [
            "endpoint libvirt.down.0 deleted",
            "endpoint libvirt.down.b.0 deleted"
        ]
    );
    assert_eq!(d.endpoint_ids(), ["libvirt.odd", "libvirt.up.0", "mine"]);
    // Nothing left to delete: nothing printed.
    assert_eq!(
        cluster_ok(&socket, &["release-stale", "--running", "up"], ""),
        ""
    );
    // No domain running: the cluster's endpoints go, the others stay.
    assert_eq!(
        cluster_ok(&socket, &["release-stale"], ""),
        "endpoint libvirt.up.0 deleted\n"
    );
    assert_eq!(d.endpoint_ids(), ["libvirt.odd", "mine"]);
}

#[test]
fn the_hook_without_a_daemon_or_with_bad_metadata() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gone = dir.path().join("control.sock");
    // No metadata: nothing to do, the daemon is not asked (there is none).
    let plain = "<domain type='kvm'><name>web</name><metadata/></domain>";
    let out = hook(&gone, "web", "prepare", plain);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        (text(&out.stdout), text(&out.stderr)),
        (String::new(), String::new())
    );
    // Every other operation: nothing, and nothing on stdout (libvirt takes migrate's and
    // restore's as a new XML).
    for op in [
        "start",
        "started",
        "stopped",
        "restore",
        "reconnect",
        "attach",
    ] {
        let out = hook(&gone, "vm1", op, &domain_xml("vm1", "gpu", "2"));
        assert!(out.status.success(), "{op}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), "", "{op}");
    }
    // migrate without <gpus>: nothing to make, the XML stays (nothing printed).
    let out = hook(&gone, "web", "migrate", plain);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    // migrate with <gpus> but no sources' descriptions (none published yet): the migration
    // fails before the daemon is asked, saying what to do.
    let out = hook(&gone, "vm1", "migrate", &domain_xml("vm1", "gpu", "2"));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "error: domain vm1: no switchyard migration description for device 0 in its \
         metadata: the source node's pool agent publishes it (monitor interval); try again\n"
    );
    assert_eq!(text(&out.stdout), "");
    // prepare needs the daemon: the start fails, saying so.
    let out = hook(&gone, "vm1", "prepare", &domain_xml("vm1", "gpu", "2"));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("vm1") && err.contains("unreachable") && err.lines().count() == 1,
        "{err}"
    );
    // release only warns: libvirt ignores it, the resource agent reconciles.
    let out = hook(&gone, "vm1", "release", "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("warning: domain vm1:") && err.contains("unreachable"),
        "{err}"
    );
    assert_eq!(text(&out.stdout), "");

    // Malformed metadata or XML, or a name that makes no id: exit 1, one line naming the
    // domain (before the daemon is asked: there is none).
    for (domain, xml, what) in [
        ("vm1", domain_xml("vm1", "gpu", "0"), "count"),
        ("vm1", domain_xml("vm1", "gpu", "17"), "count"),
        ("vm1", "<domain><metadata><sy:gpus xmlns:sy=\"https://switchyard.dev/xmlns/libvirt/1\" count=\"1\"/></metadata></domain>".to_owned(), "pool"),
        ("vm1", "<domain><metadata>".to_owned(), "does not parse"),
        ("my vm", domain_xml("my vm", "gpu", "1"), "libvirt.my vm.0"),
    ] {
        let out = hook(&gone, domain, "prepare", &xml);
        assert_eq!(out.status.code(), Some(1), "{xml}");
        let err = text(&out.stderr);
        assert!(
            err.starts_with(&format!("error: domain {domain}:"))
                && err.contains(what)
                && err.lines().count() == 1,
            "{xml}: {err}"
        );
        assert_eq!(text(&out.stdout), "");
    }
}

/// `published` (a `<gpus>` element as `cluster metadata` prints it) as libvirt keeps it in
/// the domain (`virsh metadata --key sy --set`: in the namespace, prefix `sy`).
fn namespaced(published: &str) -> String {
    published
        .trim_end()
        .replace(
            "<gpus ",
            "<sy:gpus xmlns:sy=\"https://switchyard.dev/xmlns/libvirt/1\" ",
        )
        .replace("</gpus>", "</sy:gpus>")
        .replace("<source ", "<sy:source ")
        .replace("</source>", "</sy:source>")
}

/// Domain `name`'s XML as libvirt sends it to a migration's destination: `gpus` in its
/// metadata, one vfio-user-pci device per socket of `sockets` (written as libvirt writes
/// an argument: `&quot;` in single quotes).
fn migrating_xml(name: &str, gpus: &str, sockets: &[String]) -> String {
    let mut args = String::new();
    for (i, path) in sockets.iter().enumerate() {
        let json = serde_json::json!({
            "driver": "vfio-user-pci", "id": format!("gpu{i}"),
            "socket": {"type": "unix", "path": path},
        });
        args.push_str(&format!(
            "    <qemu:arg value='-device'/>\n    <qemu:arg value='{}'/>\n",
            json.to_string().replace('"', "&quot;")
        ));
    }
    format!(
        "<domain type='kvm' id='7' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>\n  \
         <name>{name}</name>\n  <metadata>\n    {gpus}\n  </metadata>\n  <devices>\n    \
         <controller type='usb' model='none'/>\n  </devices>\n  <qemu:commandline>\n{args}  \
         </qemu:commandline>\n</domain>\n"
    )
}

/// The sockets of `d`'s endpoints libvirt.NAME.0 to libvirt.NAME.(count - 1).
fn sockets(d: &Daemon, name: &str, count: u32) -> Vec<String> {
    (0..count)
        .map(|i| {
            d.run_dir()
                .join(format!("endpoints/libvirt.{name}.{i}.sock"))
                .to_str()
                .expect("utf-8")
                .to_owned()
        })
        .collect()
}

/// Endpoint `id` on `d`.
fn status(d: &Daemon, id: &str) -> Value {
    d.client()
        .get(&format!("/v1/endpoints/{id}"))
        .expect("endpoint")
        .body
}

#[test]
fn a_migrations_destination_makes_incoming_endpoints_from_the_published_descriptions() {
    // Two nodes: each its own daemon, configuration, state and run directory.
    let a = Daemon::start_with_config(CONFIG);
    let b = Daemon::start_with_config(CONFIG);
    let (sa, sb) = (a.socket(), b.socket());
    let out = hook(&sa, "vm1", "prepare", &domain_xml("vm1", "gpu", "2"));
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Node A publishes: from the element as the domain defines it (virsh prints it without
    // its namespace) to one with a description per endpoint, its token included.
    let bare = "<gpus pool=\"gpu\" count=\"2\"/>\n";
    let published = cluster_ok(&sa, &["metadata", "vm1"], bare);
    assert!(
        published.starts_with("<gpus pool=\"gpu\" count=\"2\"><source index=\"0\">{"),
        "{published}"
    );
    assert_eq!(published.lines().count(), 1, "{published}");
    for i in 0..2 {
        let token = status(&a, &format!("libvirt.vm1.{i}"))["endpoint"]["migration_token"]
            .as_str()
            .expect("root sees the token")
            .to_owned();
        assert_eq!(token.len(), 32);
        assert!(published.contains(&token), "{published}");
    }
    // Published already (in either form libvirt prints it): nothing to set.
    assert_eq!(cluster_ok(&sa, &["metadata", "vm1"], &published), "");
    assert_eq!(
        cluster_ok(&sa, &["metadata", "vm1"], &namespaced(&published)),
        ""
    );
    // No <gpus>, or a domain whose endpoints are not (all) here: nothing.
    assert_eq!(cluster_ok(&sa, &["metadata", "vm1"], ""), "");
    assert_eq!(cluster_ok(&sa, &["metadata", "vm9"], bare), "");
    assert_eq!(
        cluster_ok(
            &sa,
            &["metadata", "vm1"],
            "<gpus pool=\"gpu\" count=\"3\"/>"
        ),
        ""
    );

    // Node B: a stale endpoint of the domain (made by hand) goes first.
    b.ctl_ok(&["create", "libvirt.vm1.0", "--pool", "gpu"]);
    let xml = migrating_xml("vm1", &namespaced(&published), &sockets(&a, "vm1", 2));
    let out = hook(&sb, "vm1", "migrate", &xml);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // B's endpoint directory is not A's: the XML comes back with B's sockets, the rest of
    // it byte for byte (A's socket paths in the descriptions included).
    let want = migrating_xml("vm1", &namespaced(&published), &sockets(&b, "vm1", 2));
    assert_ne!(want, xml);
    assert_eq!(text(&out.stdout), want);
    assert_eq!(b.endpoint_ids(), ["libvirt.vm1.0", "libvirt.vm1.1"]);
    let tokens: Vec<Value> = (0..2)
        .map(|i| {
            let e = status(&b, &format!("libvirt.vm1.{i}"));
            assert_eq!(e["incoming_for"], format!("libvirt.vm1.{i}"), "{e}");
            // Leased from pool gpu (boards g*; the daemon records no pool for an
            // incoming endpoint).
            let board = e["lease"]["board"].as_str().expect("a lease");
            assert!(board.starts_with('g'), "{e}");
            e["endpoint"]["migration_token"].clone()
        })
        .collect();
    // B's prepare (libvirt runs it after migrate) keeps them as they are.
    let out = hook(&sb, "vm1", "prepare", &want);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    for (i, token) in tokens.iter().enumerate() {
        let e = status(&b, &format!("libvirt.vm1.{i}"));
        assert_eq!(&e["endpoint"]["migration_token"], token);
        assert_eq!(e["incoming_for"], format!("libvirt.vm1.{i}"));
    }
    // While they are incoming, B publishes nothing (A's descriptions stay).
    assert_eq!(
        cluster_ok(&sb, &["metadata", "vm1"], &namespaced(&published)),
        ""
    );
    // The migration failed: release deletes them; tried again with the XML of B's
    // sockets, they are made again and nothing is printed.
    let out = hook(&sb, "vm1", "release", &want);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(b.endpoint_ids(), Vec::<String>::new());
    let out = hook(&sb, "vm1", "migrate", &want);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    assert_eq!(b.endpoint_ids(), ["libvirt.vm1.0", "libvirt.vm1.1"]);

    // All or none: vm2 runs on A with both of pool spare-1's boards; on B one of them is
    // quarantined: the second incoming endpoint cannot be made, the first is deleted, and
    // the error is the daemon's.
    let out = hook(&sa, "vm2", "prepare", &domain_xml("vm2", "spare-1", "2"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let vm2 = cluster_ok(
        &sa,
        &["metadata", "vm2"],
        "<gpus pool=\"spare-1\" count=\"2\"/>",
    );
    b.ctl_ok(&["quarantine", "s1"]);
    let two = migrating_xml("vm2", &namespaced(&vm2), &sockets(&a, "vm2", 2));
    let out = hook(&sb, "vm2", "migrate", &two);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    for part in [
        "domain vm2",
        "incoming endpoint libvirt.vm2.1",
        "source libvirt.vm2.1",
        "pool spare-1",
        "No free device",
    ] {
        assert!(err.contains(part), "{part:?} not in {err}");
    }
    assert_eq!(text(&out.stdout), "");
    assert_eq!(b.endpoint_ids(), ["libvirt.vm1.0", "libvirt.vm1.1"]);

    // A description missing (one of two published): nothing made, saying which.
    let (first, _) = published
        .split_once("<source index=\"1\">")
        .expect("two sources");
    let partial = namespaced(&format!("{first}</gpus>"));
    let out = hook(&sb, "vm3", "migrate", &migrating_xml("vm3", &partial, &[]));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with(
            "error: domain vm3: no switchyard migration description for device 1 in its metadata"
        ),
        "{err}"
    );
    assert_eq!(b.endpoint_ids(), ["libvirt.vm1.0", "libvirt.vm1.1"]);

    // On A, the VM started again (new endpoints, new tokens): published again.
    let out = hook(&sa, "vm1", "prepare", &domain_xml("vm1", "gpu", "2"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let again = cluster_ok(&sa, &["metadata", "vm1"], &published);
    assert!(
        again.starts_with("<gpus pool=\"gpu\" count=\"2\">"),
        "{again}"
    );
    assert_ne!(again, published);
    assert_eq!(cluster_ok(&sa, &["metadata", "vm1"], &again), "");
}
