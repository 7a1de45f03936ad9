//! A Pacemaker cluster of switchyard hosts (`scripts/cluster.sh`, docs/cluster.md): three nodes
//! in namespaces, each with corosync, pacemaker, libvirtd and a switchyard daemon; VMs are
//! `ocf:heartbeat:VirtualDomain` resources placed by their GPU needs (utilization
//! `swy_gpu_gpus`, published by `ocf:switchyard:pool`), their devices leased by the libvirt
//! hook where they start. The guest tests are `#[ignore]`d like every guest test
//! (`scripts/test.sh` runs them); they need root and the cluster packages
//! (`scripts/install-libvirt.sh --cluster`). One TCG guest boots at a time where the test
//! allows it.
#![forbid(unsafe_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use switchyard_guest_tests::cluster::{Rig, TEMPLATE_PLACEHOLDERS, Vm, placeholders_in, template};
use switchyard_guest_tests::{
    GuestEnv, assert_full_workload, complete_lines, find_line, list_tests, wait_until,
    with_logs_within,
};
use switchyard_qemu::GUEST_BOOT_ARGS;

/// The utilization attribute of pool `gpu`.
const GPUS: &str = "swy_gpu_gpus";

/// A VM that boots, lists its PCI devices and keeps running (no workload: cheap under TCG).
fn idle_vm(name: &str, gpus: u32) -> Vm {
    Vm {
        name: name.into(),
        gpus,
        cmdline: format!("console=ttyS0 panic=-1 quiet {GUEST_BOOT_ARGS} sy.stay"),
        iommu: false,
        emulator: None,
    }
}

/// A VM whose guest runs the in-guest driver's full workload on its device, then keeps running.
fn workload_vm(name: &str) -> Vm {
    Vm {
        name: name.into(),
        gpus: 1,
        cmdline: format!(
            "console=ttyS0 panic=-1 quiet {GUEST_BOOT_ARGS} intel_iommu=on sy.test=sygpu-driver \
             sy.stay"
        ),
        iommu: true,
        emulator: None,
    }
}

/// How long the migrating VMs' driver soaks its device: long enough for the test's moves.
const SOAK_SECONDS: u32 = 60;

/// A VM that can live-migrate (the patched QEMU, no emulated IOMMU) whose driver soaks its
/// device (`--noiommu`: hugepages for DMA), then keeps running.
fn soaking_vm(env: &GuestEnv, name: &str) -> Vm {
    Vm {
        name: name.into(),
        gpus: 1,
        cmdline: format!(
            "console=ttyS0 panic=-1 quiet {GUEST_BOOT_ARGS} hugepages=16 sy.test=sygpu-driver \
             sy.arg=--noiommu sy.arg=--soak sy.arg={SOAK_SECONDS} sy.stay"
        ),
        iommu: false,
        emulator: Some(
            env.migration_qemu()
                .expect("the patched QEMU (scripts/build-qemu.sh)"),
        ),
    }
}

/// Checks a soak's summary in `console`: the driver passed, every job verified, no stale page.
fn assert_soak(console: &str) -> serde_json::Value {
    assert_eq!(
        find_line(console, "GUEST: test sygpu-driver rc="),
        Some("GUEST: test sygpu-driver rc=0"),
        "{console}"
    );
    let s: serde_json::Value = find_line(console, "SYGPU-SUMMARY")
        .and_then(|l| serde_json::from_str(l["SYGPU-SUMMARY".len()..].trim()).ok())
        .unwrap_or_else(|| panic!("no summary:\n{console}"));
    assert_eq!(s["result"], "pass", "{s}");
    let soak = &s["soak"];
    assert_eq!(soak["ok"], true, "{s}");
    let jobs = soak["jobs"].as_u64().expect("soak jobs");
    assert!(jobs > 0, "{s}");
    assert_eq!(soak["jobs_verified"].as_u64(), Some(jobs), "{s}");
    assert_eq!(soak["region_stale_pages"], 0, "{s}");
    s
}

/// A 3-node rig with one board per node, configured (fencing, placement by utilization, the
/// pool agent on every node), each node's capacity published.
fn configured_rig(env: &GuestEnv, dir: &Path) -> Rig {
    let rig = Rig::up(env, dir, &[1, 1, 1]);
    rig.configure_switchyard();
    for node in rig.nodes() {
        wait_capacity(&rig, node, "1");
    }
    rig
}

/// A node of the rig other than `node`.
fn another(rig: &Rig, node: &str) -> String {
    rig.nodes()
        .iter()
        .find(|n| *n != node)
        .expect("another node")
        .clone()
}

/// [`configured_rig`] with the soaking VM `vm1` running and its soak started: the rig, the
/// VM and its node.
fn start_soaking(env: &GuestEnv, dir: &Path) -> (Rig, Vm, String) {
    let initrd = env.initramfs().expect("initramfs");
    let rig = configured_rig(env, dir);
    let n1 = rig.nodes()[0].clone();
    let vm = soaking_vm(env, "vm1");
    rig.add_vm(env, &initrd, &n1, &vm);
    let first = rig.wait_running(&n1, "vm1", Duration::from_secs(120));
    wait_console(
        &rig,
        &first,
        &vm,
        "SYGPU: soak start",
        Duration::from_secs(240),
    );
    (rig, vm, first)
}

/// Waits until `node`'s pool agent published the migration description of `vm`'s endpoint
/// there into the domain's metadata (its migration token is in it).
fn wait_published(rig: &Rig, node: &str, vm: &Vm) {
    let id = format!("libvirt.{}.0", vm.name);
    wait_until(
        Duration::from_secs(60),
        &format!("{id}'s description in the metadata"),
        || {
            let e = rig.endpoint(node, &id)?;
            let token = e["endpoint"]["migration_token"].as_str()?.to_owned();
            (!token.is_empty() && rig.metadata(node, &vm.name).contains(&token)).then_some(())
        },
    )
    .unwrap_or_else(|e| panic!("{e}: {}\n{}", rig.metadata(node, &vm.name), rig.status()));
}

/// Live-migrates `vm` from `from` to `to` with `crm resource move`, waits until it runs
/// there, the destination's daemon committed the migration and the source's endpoint is gone,
/// then clears the move's constraint (stickiness keeps it there). How long it took, and the
/// migration's downtime as libvirt reports it on the destination (`domjobinfo --completed`).
fn live_migrate(rig: &Rig, vm: &Vm, from: &str, to: &str) -> (Duration, String) {
    wait_published(rig, from, vm);
    let id = format!("libvirt.{}.0", vm.name);
    let t = Instant::now();
    rig.exec_ok(from, &["crm", "resource", "move", &vm.name, to]);
    wait_until(
        Duration::from_secs(120),
        &format!("{} to run on {to}", vm.name),
        || (rig.location(to, &vm.name).as_deref() == Some(to)).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", rig.status()));
    wait_until(Duration::from_secs(60), "the destination to commit", || {
        let e = rig.endpoint(to, &id)?;
        e.get("incoming_for").is_none().then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}", rig.endpoint(to, &id)));
    wait_no_endpoints(rig, from);
    let took = t.elapsed();
    rig.exec_ok(to, &["crm", "resource", "clear", &vm.name]);
    let info = rig.exec(to, &["virsh", "domjobinfo", &vm.name, "--completed"]);
    let info = String::from_utf8_lossy(&info.stdout);
    let downtime = info
        .lines()
        .find(|l| l.starts_with("Total downtime:"))
        .map(|l| {
            l["Total downtime:".len()..]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| format!("unknown ({})", info.trim()));
    (took, downtime)
}

/// Waits until `node`'s daemon has no endpoint left (a source after its VM went, a fenced
/// node's stale lease).
fn wait_no_endpoints(rig: &Rig, node: &str) {
    wait_until(
        Duration::from_secs(60),
        &format!("{node}'s endpoints to go"),
        || rig.endpoints(node).is_empty().then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", rig.endpoints(node), rig.status()));
}

/// The complete lines of `vm`'s serial console on `node` (empty before it exists).
fn console(rig: &Rig, node: &str, vm: &Vm) -> String {
    let text =
        std::fs::read_to_string(rig.node_log(node, &vm.serial_in_node())).unwrap_or_default();
    complete_lines(&text).to_owned()
}

/// Waits until `vm`'s guest on `node` printed a line starting with `prefix`; the console.
fn wait_console(rig: &Rig, node: &str, vm: &Vm, prefix: &str, timeout: Duration) -> String {
    wait_until(
        timeout,
        &format!("`{prefix}` from {} on {node}", vm.name),
        || {
            let text = console(rig, node, vm);
            find_line(&text, prefix).is_some().then_some(text)
        },
    )
    .unwrap_or_else(|e| panic!("{e}:\n{}\n{}", console(rig, node, vm), rig.status()))
}

/// How many switchyard softgpu devices the guest enumerated.
fn softgpus(console: &str) -> usize {
    console
        .lines()
        .filter(|l| l.starts_with("GUEST: pci ") && l.contains("vendor=0x1234 device=0x5347"))
        .count()
}

/// Waits until `node`'s utilization attribute for pool `gpu` is `want` (the pool agent's
/// monitor publishes it).
fn wait_capacity(rig: &Rig, node: &str, want: &str) {
    let via = &rig.nodes()[0];
    wait_until(
        Duration::from_secs(60),
        &format!("{node}'s {GPUS} = {want}"),
        || (rig.utilization(via, node, GPUS).as_deref() == Some(want)).then_some(()),
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e}: it is {:?}\n{}",
            rig.utilization(via, node, GPUS),
            rig.status()
        )
    });
}

#[test]
fn the_templates_name_exactly_the_placeholders_the_rig_fills() {
    for (name, want) in TEMPLATE_PLACEHOLDERS {
        let want: Vec<String> = want.iter().map(|w| (*w).to_owned()).collect();
        assert_eq!(placeholders_in(template(name)), want, "{name}");
    }
}

#[test]
fn a_vms_domain_declares_its_gpus_and_names_the_hooks_sockets() {
    let env = GuestEnv::for_test();
    let xml = idle_vm("vm3", 2).domain_xml(&env, Path::new("/tmp/it's <odd>/initrd"));
    assert!(
        xml.contains(
            "<sy:gpus xmlns:sy='https://switchyard.dev/xmlns/libvirt/1' pool='gpu' count='2'/>"
        ),
        "{xml}"
    );
    for i in 0..2 {
        assert!(
            xml.contains(&format!(
                "&quot;path&quot;:&quot;/run/switchyard/endpoints/libvirt.vm3.{i}.sock&quot;"
            )),
            "{xml}"
        );
    }
    assert!(
        xml.contains("<initrd>/tmp/it&apos;s &lt;odd&gt;/initrd</initrd>"),
        "{xml}"
    );
}

/// The tests that boot guests are ignored, so that a plain `cargo test` reports them as
/// ignored instead of passing them without booting anything; the template tests run everywhere.
#[test]
fn only_the_guest_tests_are_ignored() {
    assert_eq!(
        list_tests(true),
        [
            "cluster_live_migrates_a_soaking_vm_there_and_back",
            "cluster_places_vms_by_their_gpu_needs",
            "cluster_restarts_the_vm_of_a_failed_node_on_a_survivor",
            "cluster_standby_live_migrates_the_nodes_vm_away",
        ]
    );
    assert_eq!(list_tests(false).len(), 7);
}

/// Issue 37's placement test: two 1-GPU VMs on a 3-node cluster with one GPU per node land on
/// different nodes; a 2-GPU VM stays stopped (the scheduler says why) until the free node is
/// given a second board, then starts there and its guest sees both devices. Before the pool
/// agent is configured, `ocf-tester` checks the packaged agent on node1.
#[test]
#[ignore = "boots a Pacemaker cluster and QEMU guests: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn cluster_places_vms_by_their_gpu_needs() {
    with_logs_within("cluster-placement", Duration::from_secs(600), |env, dir| {
        let initrd = env.initramfs().expect("initramfs");
        let rig = Rig::up(env, dir, &[1, 1, 1]);
        let n1 = rig.nodes()[0].clone();

        // The packaged resource agent against node1's daemon.
        let t = Instant::now();
        let tester = rig.exec(
            &n1,
            &[
                "ocf-tester",
                "-n",
                "swy-ocf-test",
                "/usr/lib/ocf/resource.d/switchyard/pool",
            ],
        );
        let text = String::from_utf8_lossy(&tester.stdout).into_owned();
        assert!(
            tester.status.success() && text.contains("passed all tests"),
            "ocf-tester: {}\n{text}\n{}",
            tester.status,
            String::from_utf8_lossy(&tester.stderr)
        );
        let ocf_time = t.elapsed();

        rig.configure_switchyard();
        for node in rig.nodes() {
            wait_capacity(&rig, node, "1");
        }

        let t = Instant::now();
        let vm1 = idle_vm("vm1", 1);
        let vm2 = idle_vm("vm2", 1);
        rig.add_vm(env, &initrd, &n1, &vm1);
        let at1 = rig.wait_running(&n1, "vm1", Duration::from_secs(120));
        rig.add_vm(env, &initrd, &n1, &vm2);
        let at2 = rig.wait_running(&n1, "vm2", Duration::from_secs(120));
        assert_ne!(
            at1,
            at2,
            "two 1-GPU VMs on one 1-GPU node\n{}",
            rig.status()
        );
        let cold_start = t.elapsed();
        for (vm, node) in [(&vm1, &at1), (&vm2, &at2)] {
            let text = wait_console(&rig, node, vm, "GUEST: stay", Duration::from_secs(240));
            assert_eq!(softgpus(&text), 1, "{}:\n{text}", vm.name);
            assert_eq!(
                rig.endpoints(node),
                [format!("libvirt.{}.0", vm.name)],
                "{node}'s endpoints"
            );
        }
        let booted = t.elapsed();

        // Two GPUs: no node has them.
        let vm3 = idle_vm("vm3", 2);
        rig.add_vm(env, &initrd, &n1, &vm3);
        rig.settle(&n1);
        assert_eq!(rig.location(&n1, "vm3"), None, "{}", rig.status());
        let why = rig.exec(
            &n1,
            &[
                "env",
                "PCMK_debug=yes",
                "crm_simulate",
                "--live-check",
                "--show-utilization",
                "--verbose",
            ],
        );
        let why = String::from_utf8_lossy(&why.stderr).into_owned()
            + &String::from_utf8_lossy(&why.stdout);
        assert!(why.contains("Resource vm3 cannot run anywhere"), "{why}");
        for node in rig.nodes() {
            assert!(
                why.contains(&format!("{node} does not have enough capacity for vm3")),
                "{why}"
            );
        }

        // The free node gets a second board: its agent publishes 2, and vm3 starts there.
        let free = rig
            .nodes()
            .iter()
            .find(|n| **n != at1 && **n != at2)
            .expect("a third node")
            .clone();
        let t = Instant::now();
        rig.ok(&["boards", &free, "2"]);
        wait_capacity(&rig, &free, "2");
        let at3 = rig.wait_running(&n1, "vm3", Duration::from_secs(120));
        assert_eq!(at3, free, "{}", rig.status());
        let text = wait_console(&rig, &free, &vm3, "GUEST: stay", Duration::from_secs(240));
        assert_eq!(softgpus(&text), 2, "vm3:\n{text}");
        assert_eq!(rig.endpoints(&free), ["libvirt.vm3.0", "libvirt.vm3.1"]);
        let third = t.elapsed();
        // The others stayed where they were.
        assert_eq!(rig.location(&n1, "vm1").as_deref(), Some(at1.as_str()));
        assert_eq!(rig.location(&n1, "vm2").as_deref(), Some(at2.as_str()));

        eprintln!(
            "cluster placement: rig up {:.1} s, ocf-tester {:.1} s, vm1+vm2 placed and \
             started {:.1} s ({at1}, {at2}), their guests booted {:.1} s, vm3 placed after its \
             node's second board and its guest booted {:.1} s",
            rig.up_time.as_secs_f64(),
            ocf_time.as_secs_f64(),
            cold_start.as_secs_f64(),
            booted.as_secs_f64(),
            third.as_secs_f64()
        );
    });
}

/// Issue 37's node-failure test: the node of a VM running the driver's workload is killed;
/// it is fenced, and within 120 s of the kill the VM runs on a survivor with fresh endpoints
/// and the driver's full workload passes there (a reboot of the guest). When the killed node
/// rejoins, its pool agent releases the lease of the VM that now runs elsewhere.
#[test]
#[ignore = "boots a Pacemaker cluster and QEMU guests: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn cluster_restarts_the_vm_of_a_failed_node_on_a_survivor() {
    with_logs_within("cluster-failure", Duration::from_secs(600), |env, dir| {
        let initrd = env.initramfs().expect("initramfs");
        let rig = configured_rig(env, dir);
        let n1 = rig.nodes()[0].clone();
        let vm = workload_vm("vm1");
        let t = Instant::now();
        rig.add_vm(env, &initrd, &n1, &vm);
        let first = rig.wait_running(&n1, "vm1", Duration::from_secs(120));
        wait_console(
            &rig,
            &first,
            &vm,
            "GUEST: test sygpu-driver start",
            Duration::from_secs(240),
        );
        let cold_start = t.elapsed();
        assert_eq!(rig.endpoints(&first), ["libvirt.vm1.0"]);

        // Crash the VM's node mid-workload.
        let via = another(&rig, &first);
        let killed = Instant::now();
        rig.ok(&["kill", &first]);
        let second = wait_until(Duration::from_secs(120), "vm1 to run on a survivor", || {
            rig.location(&via, "vm1").filter(|n| *n != first)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", rig.status()));
        let restarted = killed.elapsed();
        let text = wait_console(
            &rig,
            &second,
            &vm,
            "GUEST: test sygpu-driver rc=",
            Duration::from_secs(120).saturating_sub(killed.elapsed()),
        );
        let passed = killed.elapsed();
        assert!(
            passed <= Duration::from_secs(120),
            "the workload passed {:.1} s after the kill",
            passed.as_secs_f64()
        );
        assert_eq!(
            find_line(&text, "GUEST: test sygpu-driver rc="),
            Some("GUEST: test sygpu-driver rc=0"),
            "{text}"
        );
        let s: serde_json::Value = find_line(&text, "SYGPU-SUMMARY")
            .and_then(|l| serde_json::from_str(l["SYGPU-SUMMARY".len()..].trim()).ok())
            .unwrap_or_else(|| panic!("no summary:\n{text}"));
        assert_full_workload(&s);
        assert_eq!(rig.endpoints(&second), ["libvirt.vm1.0"]);
        // Fenced: the fencer got the request for the killed node.
        let fence_log =
            std::fs::read_to_string(rig.dir.join("fence/log")).expect("the fencer's log");
        assert!(
            fence_log
                .lines()
                .any(|l| l.contains(&format!(" off {first}:"))),
            "{fence_log}"
        );

        // The killed node comes back: its daemon still holds vm1's lease from before the
        // crash, and the pool agent's start releases it (vm1 is not running in its libvirt).
        let t = Instant::now();
        rig.ok(&["start", &first]);
        rig.ok(&["wait-online", "60"]);
        wait_no_endpoints(&rig, &first);
        wait_capacity(&rig, &first, "1");
        let rejoin = t.elapsed();
        // Released by the agent, not lost: the pool's events (kept in its store across the
        // crash) show the lease made before the kill and its deletion after the rejoin.
        let events = rig.exec_ok(&first, &["switchyard", "ctl", "events"]);
        let created = events
            .lines()
            .position(|l| l.contains("endpoint_created") && l.contains("endpoint=libvirt.vm1.0 "));
        let deleted = events
            .lines()
            .position(|l| l.contains("endpoint_deleted") && l.contains("endpoint=libvirt.vm1.0"));
        assert!(
            matches!((created, deleted), (Some(c), Some(d)) if c < d),
            "{events}"
        );
        assert_eq!(rig.location(&via, "vm1").as_deref(), Some(second.as_str()));

        eprintln!(
            "cluster node failure: rig up {:.1} s, vm1 cold start to its workload {:.1} s; \
             {first} killed: vm1 running on {second} after {:.1} s, its workload passed after \
             {:.1} s; {first} rejoined and released the stale lease in {:.1} s",
            rig.up_time.as_secs_f64(),
            cold_start.as_secs_f64(),
            restarted.as_secs_f64(),
            passed.as_secs_f64(),
            rejoin.as_secs_f64()
        );
    });
}

/// Issue 38: a VM whose driver soaks its device is live-migrated with its device's state by
/// `crm resource move` from its node to another and back; the soak is bit-exact, each
/// destination's daemon committed and each source's released its lease, and no endpoint is
/// left anywhere but where the VM runs.
#[test]
#[ignore = "boots a Pacemaker cluster and QEMU guests: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn cluster_live_migrates_a_soaking_vm_there_and_back() {
    with_logs_within("cluster-migrate", Duration::from_secs(600), |env, dir| {
        let (rig, vm, first) = start_soaking(env, dir);
        let other = another(&rig, &first);

        let (there, there_down) = live_migrate(&rig, &vm, &first, &other);
        let (back, back_down) = live_migrate(&rig, &vm, &other, &first);
        assert!(
            find_line(&console(&rig, &first, &vm), "SYGPU-SUMMARY").is_none(),
            "the soak ended before the second migration: make SOAK_SECONDS longer"
        );
        let text = wait_console(
            &rig,
            &first,
            &vm,
            "GUEST: test sygpu-driver rc=",
            Duration::from_secs(240),
        );
        let s = assert_soak(&text);

        // Leases: the VM's node has its one endpoint; no other node has any.
        for node in rig.nodes() {
            let want: Vec<String> = if *node == first {
                vec!["libvirt.vm1.0".into()]
            } else {
                Vec::new()
            };
            assert_eq!(rig.endpoints(node), want, "{node}'s endpoints");
        }
        eprintln!(
            "cluster live migration: {first} -> {other} {:.1} s (downtime {there_down}), \
             back {:.1} s (downtime {back_down}); soak {}",
            there.as_secs_f64(),
            back.as_secs_f64(),
            s["soak"]
        );
    });
}

/// Issue 38: the node of a soaking VM goes standby; the VM live-migrates off it and the soak
/// is bit-exact; the node's lease is released.
#[test]
#[ignore = "boots a Pacemaker cluster and QEMU guests: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn cluster_standby_live_migrates_the_nodes_vm_away() {
    with_logs_within("cluster-standby", Duration::from_secs(600), |env, dir| {
        let (rig, vm, first) = start_soaking(env, dir);
        wait_published(&rig, &first, &vm);
        let via = another(&rig, &first);

        let t = Instant::now();
        rig.exec_ok(&via, &["crm", "node", "standby", &first]);
        let second = wait_until(
            Duration::from_secs(120),
            "vm1 to leave the standby node",
            || rig.location(&via, "vm1").filter(|n| *n != first),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", rig.status()));
        wait_no_endpoints(&rig, &first);
        let took = t.elapsed();
        // Migrated, not restarted: the guest never booted again there.
        let text = wait_console(
            &rig,
            &second,
            &vm,
            "GUEST: test sygpu-driver rc=",
            Duration::from_secs(240),
        );
        assert!(
            find_line(&text, "GUEST: boot").is_none(),
            "the guest booted again:\n{text}"
        );
        let s = assert_soak(&text);
        assert_eq!(rig.endpoints(&second), ["libvirt.vm1.0"]);
        rig.exec_ok(&via, &["crm", "node", "online", &first]);
        eprintln!(
            "cluster standby: {first} standby -> vm1 live on {second} in {:.1} s; soak {}",
            took.as_secs_f64(),
            s["soak"]
        );
    });
}
