//! Tenants of one pool daemon cannot hurt each other or the daemon (issue 21), against real
//! `switchyard daemon` and `switchyard worker` processes:
//!
//! - descriptors sent with messages the worker never handles (a header it cannot frame, a
//!   message cut short by closing the socket) leave custody with their connection, and stay
//!   gone across a `ctl restart` and a daemon restart (adoption);
//! - a client flooding its endpoint with descriptors is refused past its budget (EMFILE),
//!   while windows of a file already in custody cost nothing (a vIOMMU maps guest RAM page by
//!   page) and another endpoint's client runs verified jobs with no restart and no lost window;
//! - under a 1024 open-file limit the daemon admits endpoints by its descriptor plan (409
//!   with the numbers past it) and stays healthy with every endpoint at its budget;
//! - a replacement restores every window the server accepted (2,000 of one memfd under a
//!   1024 open-file limit); an adopted worker over a lowered budget is replaced and keeps its
//!   client whole; what a replacement cannot restore (memory the client shrank under it) is
//!   reported: event, endpoint state, metric;
//! - workers that cannot start make the daemon let go of the client, then of the device
//!   state, then give the endpoint up, after which its socket refuses connections.
#![forbid(unsafe_code)]

mod common;

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::GuestMemory;
use common::daemon::{Daemon, api_status, connect, fd_count, socket_of};
use common::raw::{Raw, message};
use serde_json::{Value, json};
use switchyard_client::{Client, ClientConfig};
use switchyard_proto::consts::*;
use switchyard_softgpu::cmd::{Command as GpuCommand, Operand};

const DMA_MAP: u16 = 2;

fn eventfds(n: usize) -> Vec<File> {
    (0..n)
        .map(|_| switchyard_device::irq::new_eventfd().expect("eventfd"))
        .collect()
}

fn borrowed(files: &[File]) -> Vec<BorrowedFd<'_>> {
    files.iter().map(|f| f.as_fd()).collect()
}

/// `(held, client_fds, connected, worker pid)` of an endpoint.
/// Read after a sync (answered after every earlier custody note of the worker), so that it
/// counts what the worker put into custody before; without a running worker, as it stands.
fn custody(d: &mut Daemon, id: &str) -> (u64, u64, bool, Option<u32>) {
    let synced = d
        .client()
        .post(&format!("/v1/endpoints/{id}/sync"), &())
        .ok()
        .filter(|r| r.status == 200);
    let w = match synced {
        Some(r) => r.body["worker"].clone(),
        None => d.endpoint(id)["worker"].clone(),
    };
    (
        w["held"].as_u64().expect("held"),
        w["client_fds"].as_u64().expect("client_fds"),
        w["connected"].as_bool().unwrap_or(false),
        w["pid"].as_u64().map(|p| p as u32),
    )
}

/// Waits until the endpoint's supervisor counts `want` client descriptors (a hold reaches it
/// a little after the message it came with was answered); returns the last count.
fn client_fds_reach(d: &mut Daemon, id: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = custody(d, id).1;
        if n == want || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The worker events of the daemon's stream.
fn worker_events(d: &Daemon) -> Vec<Value> {
    d.events()
        .iter()
        .filter_map(|e| e.get("worker").cloned())
        .collect()
}

/// Waits until the endpoint holds `held` descriptors with no client connected.
fn settles_at(d: &mut Daemon, id: &str, held: u64) -> (u64, u64, bool, Option<u32>) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = custody(d, id);
        if (now.0 == held && !now.2) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A connection that negotiated. The server takes one client at a time and refuses (closes)
/// a second one: right after a leak connection closed, the next may come before the server
/// has seen the close, so it tries again.
fn negotiated(socket: &Path) -> Raw {
    let mut version = Vec::new();
    switchyard_proto::encode_version_request(
        &mut version,
        0,
        0,
        &switchyard_proto::Capabilities::default(),
    )
    .expect("encode");
    for _ in 0..200 {
        let mut r = Raw::connect(socket);
        if switchyard_endpoint::send_all(&r.s, &version, &[]).is_ok()
            && r.recv().is_some_and(|(h, _)| !h.is_error())
        {
            return r;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the endpoint refuses every connection");
}

/// The leak connections of the attack run: half send a header that cannot be framed
/// (`msg_size` 0xFFFFFFFF) with 16 eventfds, half a DMA_MAP cut short (its header and part
/// of its body, with 16 eventfds) and close.
fn leak_connections(socket: &Path, n: usize) {
    for i in 0..n {
        let fds = eventfds(16);
        let mut r = negotiated(socket);
        let id = r.id();
        let mut m = message(id, DMA_MAP, 0, &[0u8; 32]);
        if i % 2 == 0 {
            m[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
            r.send(&m[..16], &borrowed(&fds));
            // An error reply may come, then the server closes.
            while r.recv().is_some() {}
        } else {
            r.send(&m[..24], &borrowed(&fds));
        }
    }
}

#[test]
fn descriptors_of_messages_never_handled_leave_with_their_connection() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let socket = socket_of(&d.endpoint("vm1"));
    // One ordinary client first, so that whatever a first client costs is in the baseline.
    drop(negotiated(&socket));
    let (base, _, _, pid) = settles_at(&mut d, "vm1", 3);
    assert_eq!(base, 3, "black box, VRAM, doorbell page");
    let worker = pid.expect("worker");
    let daemon = d.pid().expect("daemon");
    let (worker_fds, daemon_fds) = (fd_count(worker), fd_count(daemon));

    leak_connections(&socket, 20);
    let (held, client, connected, _) = settles_at(&mut d, "vm1", base);
    assert_eq!(
        (held, client, connected),
        (base, 0, false),
        "20 leak connections of 16 descriptors each"
    );
    // The processes' own descriptors are back where they were (give the last connection's
    // close a moment on a loaded machine).
    let back = |pid: u32, base: usize| {
        common::wait_for(Duration::from_secs(10), || {
            (fd_count(pid) <= base + 2).then_some(())
        })
        .is_some()
    };
    assert!(
        back(worker, worker_fds),
        "worker: {} > {worker_fds}",
        fd_count(worker)
    );
    assert!(
        back(daemon, daemon_fds),
        "daemon: {} > {daemon_fds}",
        fd_count(daemon)
    );

    // A replacement and a restarted daemon start from the same custody.
    d.ctl_ok(&["restart", "vm1"]);
    leak_connections(&socket, 6);
    assert_eq!(settles_at(&mut d, "vm1", base).0, base, "after ctl restart");
    let pid = custody(&mut d, "vm1").3;
    d.kill9();
    d.launch();
    let (held, client, _, adopted) = settles_at(&mut d, "vm1", base);
    assert_eq!((held, client), (base, 0), "after the daemon's restart");
    assert_eq!(adopted, pid, "the worker was adopted");
    // And the endpoint serves.
    let mut c = driver(&socket);
    c.setup_queue(0);
    common::workload::fill_copy_round(&mut c, 1, 0);
}

const TWO_BOARDS_SMALL_BUDGET: &str = "[daemon]\nfds_per_endpoint = 64\n\
     [[boards]]\nid = \"a\"\nvram = \"16M\"\n[[boards]]\nid = \"b\"\nvram = \"16M\"\n";

/// A 4 KiB window of `mem` at `iova`, from `offset` in it.
fn map_window(
    c: &mut Client,
    iova: u64,
    mem: &GuestMemory,
    offset: u64,
) -> Result<(), switchyard_client::ClientError> {
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    c.dma_map(iova, 4096, flags, Some((mem.file.as_fd(), offset)))
}

/// Windows of 4 KiB memfds of their own, every 64 KiB from `base`, until the server refuses
/// one (its errno must be EMFILE: the budget); returns their memory.
fn map_files_until_refused(c: &mut Client, base: u64) -> Vec<GuestMemory> {
    let mut mems = Vec::new();
    loop {
        let mem = GuestMemory::new(4096);
        let iova = base + mems.len() as u64 * 0x10000;
        match map_window(c, iova, &mem, 0) {
            Ok(()) => mems.push(mem),
            Err(e) => {
                assert_eq!(e.remote_errno(), Some(libc::EMFILE), "{e}");
                return mems;
            }
        }
        assert!(mems.len() <= 4096, "no budget refuses");
    }
}

/// One eventfd on MSI-X vector 0: its errno if refused.
fn set_one_eventfd(c: &mut Client) -> Option<i32> {
    let fds = eventfds(1);
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        1,
        &borrowed(&fds),
    )
    .err()
    .map(|e| e.remote_errno().expect("an error reply"))
}

/// Our client, connected (again while the server still finishes a previous client: see
/// [`negotiated`]).
fn client(socket: &Path) -> Client {
    let config = ClientConfig {
        timeout: Some(Duration::from_secs(5)),
        ..ClientConfig::default()
    };
    for _ in 0..200 {
        if let Ok(c) = Client::connect_with(socket, config.clone()) {
            return c;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the endpoint refuses every connection");
}

/// The test driver on [`client`].
fn driver(socket: &Path) -> common::driver::Driver<common::ours::Ours> {
    common::driver::Driver::new(common::ours::Ours(client(socket)))
}

#[test]
fn a_tenant_flooding_its_budget_is_refused_and_another_runs_undisturbed() {
    let mut d = Daemon::start_with_config(TWO_BOARDS_SMALL_BUDGET);
    d.ctl_ok(&["create", "victim", "--device", "a"]);
    d.ctl_ok(&["create", "attacker", "--device", "b"]);
    let (victim, attacker) = (d.endpoint("victim"), d.endpoint("attacker"));
    let mut v = connect(&socket_of(&victim));
    v.setup_queue(0);
    // The driver's guest memory (two windows of one memfd) and 16 MSI-X eventfds.
    assert_eq!(client_fds_reach(&mut d, "victim", 17), 17);

    // The victim runs verified FILL + COPY rounds through both of its windows meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::SeqCst) {
                common::workload::fill_copy_round(&mut v, rounds, 0);
                rounds += 1;
            }
            (rounds, v)
        })
    };

    let asocket = socket_of(&attacker);
    let mut a = client(&asocket);
    // Guest RAM first (one memfd: one descriptor), then memfds of their own, one descriptor
    // each, until the budget of 64 is spent: EMFILE.
    let ram = GuestMemory::new(512 * 4096);
    map_window(&mut a, 0x1_0000_0000, &ram, 0).expect("guest RAM");
    let files = map_files_until_refused(&mut a, 0x2_0000_0000);
    assert_eq!(files.len(), 63, "64 descriptors: guest RAM and 63 files");
    assert_eq!(
        set_one_eventfd(&mut a),
        Some(libc::EMFILE),
        "an eventfd is one more"
    );
    // Windows of a file in custody need no descriptor: the RAM mapped page by page, as a
    // vIOMMU does, is never refused.
    for page in 1..512u64 {
        map_window(&mut a, 0x1_0000_0000 + page * 0x1000, &ram, page * 4096)
            .expect("a window of guest RAM already in custody");
    }
    let (_, client_fds, _, _) = custody(&mut d, "attacker");
    assert!(
        client_fds <= 64,
        "{client_fds} client descriptors in custody"
    );
    // Leak connections on top, from a second attacker connection's point of view: refused
    // while the first is connected (one client at a time), so they queue; the first leaves.
    drop(a);
    leak_connections(&asocket, 10);

    stop.store(true, Ordering::SeqCst);
    // The victim stays connected (its descriptors held) until the checks below are done.
    let (rounds, _victim_client) = runner.join().expect("the victim's rounds all verified");
    assert!(rounds > 0);
    let victim_now = d.endpoint("victim");
    assert_eq!(victim_now["worker"]["restarts"], 0, "{victim_now}");
    assert_eq!(victim_now["worker"]["state"], "running");
    assert_eq!(
        custody(&mut d, "victim").1,
        17,
        "the victim's windows and eventfds are all held"
    );
    let attacker_now = d.endpoint("attacker");
    assert_eq!(attacker_now["worker"]["restarts"], 0, "{attacker_now}");
    assert_eq!(
        attacker_now["worker"]["refused_fds"].as_u64().unwrap_or(0),
        0
    );
    // The attacker's endpoint serves its next client.
    let mut again = driver(&asocket);
    again.setup_queue(0);
    common::workload::fill_copy_round(&mut again, 7, 0);
}

/// Ten boards: more endpoints than the plan below admits.
fn ten_boards() -> String {
    let mut toml = "[daemon]\nfds_per_endpoint = 64\nfd_reserve = 256\n".to_owned();
    for b in 0..10 {
        toml += &format!("[[boards]]\nid = \"b{b}\"\nvram = \"16M\"\n");
    }
    toml
}

/// Spends the budget of `socket`'s endpoint: windows of memfds of their own until EMFILE;
/// then an eventfd is refused too. Returns the client (connected: it keeps them).
fn fill_budget(socket: &Path) -> (Client, Vec<GuestMemory>) {
    let mut c = client(socket);
    let mems = map_files_until_refused(&mut c, 0x1_0000_0000);
    assert_eq!(set_one_eventfd(&mut c), Some(libc::EMFILE));
    (c, mems)
}

#[test]
fn under_a_1024_descriptor_limit_endpoints_are_admitted_by_the_plan() {
    let mut d = Daemon::new().with_config(&ten_boards()).with_nofile(1024);
    d.launch();
    // (1024 - 256) / (64 + 16) = 9 endpoints.
    for b in 0..9 {
        d.ctl_ok(&["create", &format!("vm{b}"), "--device", &format!("b{b}")]);
    }
    let refused = d
        .client()
        .post("/v1/endpoints", &json!({"id": "vm9", "device": "b9"}));
    let message = match &refused {
        Err(switchyard_control::ControlError::Api { message, .. }) => message.clone(),
        _ => String::new(),
    };
    assert_eq!(api_status(refused), (409, "no_room".to_owned()));
    for n in ["9 endpoints", "64", "256", "1024"] {
        assert!(message.contains(n), "{message:?} names {n}");
    }
    assert_eq!(d.endpoint("vm0")["worker"]["fd_budget"], 64);

    // Every client at its budget (64 memfds): the daemon still answers and stays within its
    // limit.
    let mut held = Vec::new();
    for b in 0..9 {
        let socket = socket_of(&d.endpoint(&format!("vm{b}")));
        held.push(fill_budget(&socket));
    }
    for b in 0..9 {
        assert_eq!(client_fds_reach(&mut d, &format!("vm{b}"), 64), 64, "vm{b}");
        let ep = d.endpoint(&format!("vm{b}"));
        assert_eq!(ep["worker"]["state"], "running", "{ep}");
    }
    let daemon_fds = fd_count(d.pid().expect("daemon"));
    assert!(
        daemon_fds <= 1024 - 256,
        "{daemon_fds} descriptors open in the daemon, its reserve not kept"
    );
    // A message past the budget is refused, and the endpoint serves on.
    let (c, _mems) = held.first_mut().expect("vm0");
    assert_eq!(set_one_eventfd(c), Some(libc::EMFILE));
    // A restart of a full endpoint restores all of it.
    d.ctl_ok(&["restart", "vm0"]);
    let ep = d.endpoint("vm0");
    assert_eq!(ep["worker"]["state"], "running", "{ep}");
    assert!(ep["worker"]["state_lost"].is_null(), "{ep}");
    assert_eq!(client_fds_reach(&mut d, "vm0", 64), 64);
    drop(held);
    // Deleting one makes room for another.
    d.ctl_ok(&["delete", "vm8"]);
    d.ctl_ok(&["create", "vm9", "--device", "b9"]);
}

#[test]
fn a_replacement_restores_every_window_the_server_accepted() {
    // A vIOMMU maps guest RAM page by page, each DMA_MAP with a descriptor of the same memfd.
    // Under a 1024 open-file limit, 2,000 such windows used to be 2,000 descriptors in the
    // daemon and in custody (a worker advertised what it could hold fresh, about 470, and a
    // replacement, holding every descriptor twice, kept one). Now they are one descriptor, and
    // a replacement restores every window.
    let config = "[daemon]\nfds_per_endpoint = 160\n[[boards]]\nid = \"a\"\nvram = \"16M\"\n";
    let mut d = Daemon::new().with_config(config).with_nofile(1024);
    d.launch();
    d.ctl_ok(&["create", "vm", "--device", "a"]);
    let socket = socket_of(&d.endpoint("vm"));
    let mut drv = driver(&socket);
    drv.setup_queue(0);
    const PAGES: u64 = 2000;
    let ram = GuestMemory::new(PAGES * 4096);
    for page in 0..PAGES {
        map_window(
            &mut drv.t.0,
            0x10_0000_0000 + page * 0x10000,
            &ram,
            page * 4096,
        )
        .expect("a window of one memfd");
    }
    // The driver's memory, its 16 eventfds and the RAM.
    assert_eq!(client_fds_reach(&mut d, "vm", 18), 18);
    d.ctl_ok(&["restart", "vm"]);
    let ep = d.endpoint("vm");
    assert!(ep["worker"]["state_lost"].is_null(), "{ep}");
    assert_eq!(ep["worker"]["restarts"], 1);
    assert_eq!(client_fds_reach(&mut d, "vm", 18), 18);
    // Every window is there: a FILL + COPY into the first, some in between and the last.
    for (k, page) in [0, 1, 999, 1000, PAGES - 2, PAGES - 1]
        .into_iter()
        .enumerate()
    {
        let fill = 0x5100_0000 | k as u32;
        drv.run(
            0,
            &[
                GpuCommand::fill(Operand::Vram(0x2000), 4096, fill),
                GpuCommand::copy(
                    Operand::Vram(0x2000),
                    Operand::Guest(0x10_0000_0000 + page * 0x10000),
                    4096,
                ),
            ],
        );
        let mut got = vec![0u8; 4096];
        ram.read(page * 4096, &mut got);
        assert!(
            got.chunks_exact(4).all(|c| c == fill.to_le_bytes()),
            "window {page} after the restart"
        );
    }
    common::workload::fill_copy_round(&mut drv, 3, 0);
    let log = d.log();
    assert!(
        log.contains(&format!("windows={}", PAGES + 2)),
        "the replacement's log names {} windows",
        PAGES + 2
    );
    assert!(!log.contains("could not restore"), "{log}");
}

#[test]
fn a_lowered_budget_replaces_an_adopted_worker_which_keeps_its_client_whole() {
    let budget = |n: u32| {
        format!("[daemon]\nfds_per_endpoint = {n}\n[[boards]]\nid = \"a\"\nvram = \"16M\"\n")
    };
    let mut d = Daemon::new().with_config(&budget(160));
    d.launch();
    d.ctl_ok(&["create", "vm", "--device", "a"]);
    let socket = socket_of(&d.endpoint("vm"));
    let mut drv = driver(&socket);
    drv.setup_queue(0);
    // 100 memfds of their own, the driver's memory (one memfd) and its 16 eventfds.
    let mems: Vec<GuestMemory> = (0..100u64)
        .map(|i| {
            let mem = GuestMemory::new(4096);
            map_window(&mut drv.t.0, 0x10_0000_0000 + i * 0x10000, &mem, 0).expect("a file");
            mem
        })
        .collect();
    assert_eq!(client_fds_reach(&mut d, "vm", 117), 117);
    // The operator lowers the budget and restarts the daemon: the adopted worker holds more
    // than the new budget, so it is replaced (what no table refers to would be released);
    // the client keeps everything it was granted, and gets EMFILE for anything new.
    d.kill9();
    d.set_config(&budget(64));
    d.launch();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let w = d.endpoint("vm")["worker"].clone();
        if w["restarts"] == 1 && w["state"] == "running" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the adopted worker was not replaced: {w}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ep = d.endpoint("vm");
    assert_eq!(ep["worker"]["state"], "running", "{ep}");
    assert!(ep["worker"]["state_lost"].is_null(), "{ep}");
    assert_eq!(client_fds_reach(&mut d, "vm", 117), 117);
    let worker_events = worker_events(&d);
    assert!(
        worker_events.iter().any(|w| w["event"] == "reset"
            && w["what"]
                .as_str()
                .is_some_and(|t| t.contains("over the budget"))),
        "{worker_events:?}"
    );
    common::workload::fill_copy_round(&mut drv, 9, 0);
    for (i, mem) in mems.iter().enumerate().step_by(33) {
        let iova = 0x10_0000_0000 + i as u64 * 0x10000;
        drv.run(
            0,
            &[
                GpuCommand::fill(Operand::Vram(0x2000), 4096, 0x77),
                GpuCommand::copy(Operand::Vram(0x2000), Operand::Guest(iova), 4096),
            ],
        );
        let mut got = vec![0u8; 4096];
        mem.read(0, &mut got);
        assert!(
            got.chunks_exact(4).all(|c| c == 0x77u32.to_le_bytes()),
            "file {i}"
        );
    }
    assert_eq!(set_one_eventfd(&mut drv.t.0), Some(libc::EMFILE));
}

#[test]
fn what_a_replacement_cannot_restore_is_reported_and_the_device_stays() {
    let mut d = Daemon::start_with_config("[[boards]]\nid = \"a\"\nvram = \"16M\"\n");
    d.ctl_ok(&["create", "vm", "--device", "a"]);
    let socket = socket_of(&d.endpoint("vm"));
    let mut drv = driver(&socket);
    drv.setup_queue(0);
    // A window of memory the client then shrinks under the server: a replacement can no
    // longer map it (it would lie past the file's end).
    let shrinking = GuestMemory::unsealed(8192);
    map_window(&mut drv.t.0, 0x10_0000_0000, &shrinking, 4096).expect("a window");
    shrinking.file.set_len(0).expect("shrink");
    d.ctl_ok(&["restart", "vm"]);
    let ep = d.endpoint("vm");
    let lost = ep["worker"]["state_lost"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(lost.len(), 1, "{ep}");
    assert!(
        lost[0].as_str().is_some_and(|l| l.contains("0x1000000000")),
        "{ep}"
    );
    assert_eq!(ep["worker"]["state"], "running", "{ep}");
    let worker_events = worker_events(&d);
    assert!(
        worker_events.iter().any(|w| w["event"] == "state_lost"),
        "{worker_events:?}"
    );
    let metrics = d.client().get_text("/metrics").expect("metrics");
    assert!(
        metrics.contains("switchyard_endpoint_state_lost_total{endpoint=\"vm\"} 1"),
        "{metrics}"
    );
    // The device and the rest of the client's state are there.
    common::workload::fill_copy_round(&mut drv, 9, 0);
    // A new client starts whole.
    drop(drv);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.endpoint("vm")["worker"]["state_lost"].is_null() {
        assert!(
            Instant::now() < deadline,
            "state_lost stays after the client left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The endpoint's socket refuses a connection (instead of letting it hang).
fn refuses(socket: &Path) -> bool {
    match UnixStream::connect(socket) {
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        Ok(s) => {
            // Accepted by no one: the first read times out, or the socket is closed at once.
            s.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            let mut b = [0u8; 1];
            matches!(std::io::Read::read(&mut &s, &mut b), Ok(0))
        }
    }
}

#[test]
fn workers_that_cannot_start_let_go_of_the_client_then_the_device_then_the_endpoint() {
    // Workers start from a copy of the binary, replaced by one that fails at once.
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("switchyard");
    std::fs::copy(common::daemon::EXE, &exe).expect("copy the binary");
    let mut d = Daemon::new()
        .with_config("[[boards]]\nid = \"a\"\nvram = \"16M\"\n")
        .with_worker_exe(exe.clone());
    d.launch();
    d.ctl_ok(&["create", "vm", "--device", "a"]);
    let socket = socket_of(&d.endpoint("vm"));
    let mut c = connect(&socket);
    c.setup_queue(0);
    let failing = dir.path().join("failing");
    std::fs::write(&failing, "#!/bin/sh\nexit 3\n").expect("script");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    std::fs::rename(&failing, &exe).expect("replace the worker binary");
    let _ = d.ctl(&["restart", "vm"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let ep = loop {
        let ep = d.endpoint("vm");
        if ep["worker"]["state"] == "failed" || Instant::now() > deadline {
            break ep;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(ep["worker"]["state"], "failed", "{ep}");
    assert_eq!(
        ep["worker"]["held"], 0,
        "nothing is held for a given-up endpoint: {ep}"
    );
    assert!(refuses(&socket), "a given-up endpoint refuses connections");
    // The event follows the state (the supervisor sets one, then reports the other).
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let events = d.events();
        let kinds: Vec<&Value> = events
            .iter()
            .filter_map(|e| e.get("worker"))
            .filter(|w| w["endpoint"] == "vm")
            .collect();
        let text = serde_json::to_string(&kinds).expect("json");
        if text.contains("gave_up") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let client = text.find("the client's connection").expect("client let go");
    let fresh = text.find("fresh device").expect("device state let go");
    let gave_up = text.find("gave_up").expect("gave up");
    assert!(client < fresh && fresh < gave_up, "{text}");
    // Letting go of the client is not losing its state: no client is there to lose it.
    assert!(!text.contains("state_lost"), "{text}");
    drop(c);
}
