//! A device kind added by one crate and one registry line (issue 22): the scratchpad
//! (`switchyard-scratchpad`) has no code of its own in the server, the daemon or the pool,
//! yet `switchyard serve` serves it, a pool of two scratchpad boards leases it to an
//! endpoint, a worker killed under its client is replaced without the client losing
//! anything, and `ctl move` takes it to the other board under the client.
//!
//! The client is our vfio-user client on the endpoint's socket; it sees only the device's
//! wire contract (the registers and RAM documented in the scratchpad crate).
#![forbid(unsafe_code)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::daemon::{Daemon, EXE, socket_of};
use serde_json::Value;
use switchyard_client::{Client, ClientConfig};

/// BAR0: the registers.
const REGS: u32 = 0;
/// BAR2: the RAM.
const RAM: u32 = 2;
/// PCI config space.
const CONFIG: u32 = 7;
const REG_ID: u64 = 0x00;
const REG_ACCUM: u64 = 0x08;
const REG_SIZE: u64 = 0x10;
const SIZE: u64 = 64 << 10;

/// A client whose requests wait long enough for a replacement worker.
fn client(socket: &Path) -> Client {
    Client::connect_with(
        socket,
        ClientConfig {
            timeout: Some(Duration::from_secs(20)),
            ..ClientConfig::default()
        },
    )
    .expect("connect")
}

fn r64(c: &mut Client, offset: u64) -> u64 {
    let mut b = [0u8; 8];
    c.region_read(REGS, offset, &mut b).expect("register read");
    u64::from_le_bytes(b)
}

fn add(c: &mut Client, v: u64) {
    c.region_write(REGS, REG_ACCUM, &v.to_le_bytes())
        .expect("ACCUM write");
}

fn ram(c: &mut Client) -> Vec<u8> {
    let mut b = vec![0u8; SIZE as usize];
    c.region_read(RAM, 0, &mut b).expect("RAM read");
    b
}

/// A pattern no two offsets share.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9).wrapping_add(seed) >> 3) as u8)
        .collect()
}

#[test]
fn serve_answers_region_reads_and_writes() {
    let server = common::ServerProcess::start("scratchpad,size=64K");
    let mut c = client(&server.socket);
    let info = c.device_info().expect("device info");
    assert!(info.num_regions >= 9, "{info:?}");
    assert_eq!(
        info.num_irqs, 5,
        "the VFIO PCI indexes, each without vectors"
    );
    assert_eq!(c.region_info(REGS).expect("BAR0").info.size, 4096);
    let bar2 = c.region_info(RAM).expect("BAR2");
    assert_eq!(bar2.info.size, SIZE);
    assert!(bar2.fd.is_none(), "the RAM is trapped, never mapped");
    let mut ids = [0u8; 4];
    c.region_read(CONFIG, 0, &mut ids).expect("config read");
    assert_eq!(u32::from_le_bytes(ids), 0x5350_1234, "vendor:device");

    assert_eq!(r64(&mut c, REG_ID).to_le_bytes(), *b"SYSCRPAD");
    assert_eq!(r64(&mut c, REG_SIZE), SIZE);
    add(&mut c, 5);
    add(&mut c, 37);
    assert_eq!(r64(&mut c, REG_ACCUM), 42);
    let data = pattern(1, 10_000);
    c.region_write(RAM, 3000, &data).expect("RAM write");
    let mut back = vec![0u8; data.len()];
    c.region_read(RAM, 3000, &mut back).expect("RAM read");
    assert!(back == data, "RAM reads what was written");

    // Accesses the device refuses are errors on the wire; the device serves on.
    let mut b = [0u8; 4];
    let e = c
        .region_read(RAM, SIZE - 2, &mut b)
        .expect_err("past the RAM");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL), "{e}");
    let e = c
        .region_write(REGS, REG_ACCUM + 2, &[1, 2])
        .expect_err("a width the registers do not take");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL), "{e}");
    assert_eq!(r64(&mut c, REG_ACCUM), 42);

    c.device_reset().expect("reset");
    assert_eq!(r64(&mut c, REG_ACCUM), 0);
    assert!(ram(&mut c).iter().all(|&b| b == 0), "reset zeroes the RAM");
}

#[test]
fn serve_refuses_options_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (device, field) in [
        ("scratchpad,size=3M", "size"),
        ("scratchpad,vram=1M", "vram"),
    ] {
        let out = Command::new(EXE)
            .arg("serve")
            .arg("--socket")
            .arg(dir.path().join("pad.sock"))
            .args(["--device", device])
            .output()
            .expect("run serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{device}: {stderr}");
        assert!(stderr.contains(&format!("`{field}`")), "{device}: {stderr}");
    }
}

const PADS: &str = "[[boards]]\nid = \"sp0\"\nmodel = \"scratchpad\"\nsize = \"64K\"\n\
     [[boards]]\nid = \"sp1\"\nmodel = \"scratchpad\"\nsize = \"64K\"\n\
     [[pools]]\nname = \"pads\"\nboards = [\"sp0\", \"sp1\"]\n";

fn worker_pid(d: &mut Daemon, id: &str) -> u64 {
    d.endpoint(id)
        .pointer("/worker/pid")
        .and_then(Value::as_u64)
        .expect("a worker pid")
}

fn lease_board(d: &mut Daemon, id: &str) -> String {
    d.endpoint(id)
        .pointer("/lease/board")
        .and_then(Value::as_str)
        .expect("lease")
        .to_owned()
}

fn kill9(pid: u64) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill -9");
}

/// Waits until the endpoint's worker has been replaced `restarts` times and serves.
fn wait_restarts(d: &mut Daemon, id: &str, restarts: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ep = d.endpoint(id);
        if ep.pointer("/worker/restarts").and_then(Value::as_u64) == Some(restarts)
            && ep.pointer("/worker/state").and_then(Value::as_str) == Some("running")
        {
            return ep;
        }
        assert!(Instant::now() < deadline, "no replacement worker: {ep}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_pool_board_survives_a_worker_kill_and_a_move_under_its_client() {
    let mut d = Daemon::start_with_config(PADS);
    let pools = d.ctl_ok(&["pools"]);
    assert!(pools.contains("sp0,sp1"), "{pools}");
    d.ctl_ok(&["create", "vm1", "--pool", "pads"]);
    let ep = d.endpoint("vm1");
    assert_eq!(lease_board(&mut d, "vm1"), "sp0");
    let mut c = client(&socket_of(&ep));
    assert_eq!(r64(&mut c, REG_SIZE), SIZE);
    add(&mut c, 1000);
    let mut want = pattern(7, SIZE as usize);
    c.region_write(RAM, 0, &want).expect("RAM write");

    // kill -9 of the worker: the client's next requests wait for the replacement, which
    // carries on with what the client wrote.
    let pid = worker_pid(&mut d, "vm1");
    kill9(pid);
    assert_eq!(r64(&mut c, REG_ACCUM), 1000, "ACCUM after the kill");
    assert!(ram(&mut c) == want, "RAM after the kill");
    add(&mut c, 1);
    let page = pattern(8, 4096);
    c.region_write(RAM, 5 * 4096, &page).expect("RAM write");
    want[5 * 4096..6 * 4096].copy_from_slice(&page);
    wait_restarts(&mut d, "vm1", 1);
    assert_ne!(worker_pid(&mut d, "vm1"), pid, "another worker serves");

    // A move to the other board, under the client.
    let out = d.ctl_ok(&["move", "vm1", "--to", "sp1"]);
    assert!(out.contains("moved from sp0 to sp1"), "{out}");
    // The first round copies the whole RAM; the client is idle during the move.
    assert!(out.contains("64K copied"), "{out}");
    assert_eq!(lease_board(&mut d, "vm1"), "sp1");
    assert_eq!(r64(&mut c, REG_ACCUM), 1001, "ACCUM after the move");
    assert!(ram(&mut c) == want, "RAM after the move");
    let ep = d.endpoint("vm1");
    assert_eq!(
        ep.pointer("/worker/restarts").and_then(Value::as_u64),
        Some(1),
        "a move is not a restart: {ep}"
    );

    // A kill after the move: the replacement runs on the RAM the device moved to.
    add(&mut c, 10);
    let page = pattern(9, 4096);
    c.region_write(RAM, SIZE - 4096, &page).expect("RAM write");
    want[SIZE as usize - 4096..].copy_from_slice(&page);
    kill9(worker_pid(&mut d, "vm1"));
    assert_eq!(r64(&mut c, REG_ACCUM), 1011, "ACCUM after the second kill");
    assert!(ram(&mut c) == want, "RAM after the second kill");
    wait_restarts(&mut d, "vm1", 2);
    assert_eq!(lease_board(&mut d, "vm1"), "sp1");
    assert_eq!(r64(&mut c, REG_ID).to_le_bytes(), *b"SYSCRPAD");
}
