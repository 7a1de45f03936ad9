//! The `cuda` kind under the pool daemon, end to end, on the fake GPU (CI has no GPU): two
//! `cuda` partitions of one GPU and a softgpu board of the same shape, and a client (our
//! vfio-user client driving the softgpu's registers) whose jobs are verified through
//!
//! 1. its worker SIGKILLed with commands in flight,
//! 2. transparent moves cuda -> cuda (the other partition) and cuda -> softgpu -> cuda,
//! 3. a failover on a sticky GPU error injected from this process (a file in
//!    `SWITCHYARD_FAKE_GPU_FAULTS`, which the workers' fake GPU looks for: the jail lets it,
//!    since Landlock does not mediate a `stat` and the `cuda` policy may read every file),
//! 4. a live migration onto the other partition, the source's dirty log checked against the
//!    pages the GPU wrote.
//!
//! Where each job ran is checked too: the fake GPU sums a REDUCE in the real kernel's order,
//! the CPU path in another one, so a REDUCE's bits say which of them ran it
//! (`common::cuda::reduce_ran`).
//!
//! The daemon's binary must have the `fake-gpu` feature (`scripts/test.sh` builds
//! `SWITCHYARD_BIN` with it): without it the GPU board is out of service, and the test fails
//! saying so.
#![forbid(unsafe_code)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::GuestMemory;
use common::cuda::{REDUCE_OUT, Ran, reduce_ran};
use common::daemon::{Daemon, connect, socket_of};
use common::driver::{Driver, GUEST_IOVA, GUEST_SIZE, guest};
use common::ours::Ours;
use common::workload::fill_copy_round;
use serde_json::{Value, json};
use switchyard_client::migrate::{Migration, PreCopyPlan};
use switchyard_cuda::FAKE_FAULTS_ENV;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;

/// A `cuda` board on the fake GPU `fake-h0`, cut in two partitions, in pool `gpu`; a softgpu
/// board of the partitions' shape (`vram_mmap = false`, as a `cuda` board's) in none.
const CONFIG: &str = r#"
[[boards]]
id = "h0"
model = "cuda"
gpu = "fake-h0"
vram = "32M"
queues = 4
partitions = [ { id = "h0.p0", vram = "16M", queues = 2 }, { id = "h0.p1", vram = "16M", queues = 2 } ]

[[boards]]
id = "s0"
vram = "16M"
queues = 2
vram_mmap = false

[[pools]]
name = "gpu"
boards = ["h0"]
failover = "transparent"
"#;

/// The file whose existence makes `fake-h0` lose itself at its next batch.
const LOSE: &str = "fake-h0.lose";

/// VRAM written before everything (half through BAR2, half by a FILL on the GPU), checked
/// after every step.
const KEPT: u64 = 0x80_0000;
const KEPT_LEN: usize = 1 << 20;

fn wait(what: &str, f: impl FnMut() -> bool) {
    common::wait_until(what, Duration::from_secs(20), f);
}

/// One round of verified jobs: a FILL + COPY on each queue (checked bit for bit), then a
/// REDUCE on queue 0, whose result says what ran it.
fn round(d: &mut Driver<Ours>, n: u64) -> Ran {
    for q in 0..2 {
        fill_copy_round(d, n, q);
    }
    reduce_ran(d, n)
}

/// The guest pages round `n` has the device write: each queue's COPY into guest memory
/// (see [`fill_copy_round`]: 8 KiB at `0x40_0000 + ((2n + q) % 64) * 8 KiB`) and REDUCE's
/// result.
fn pages_written(n: u64) -> Vec<u64> {
    let mut pages = vec![REDUCE_OUT / 4096];
    for q in 0..2 {
        let off = 0x40_0000 + ((n * 2 + q) % 64) * 8192;
        pages.extend([off / 4096, off / 4096 + 1]);
    }
    pages
}

/// Runs `count` rounds from `*n` on, each of which must run where `want` says.
fn rounds(d: &mut Driver<Ours>, n: &mut u64, count: u64, want: Ran, what: &str) {
    for _ in 0..count {
        assert_eq!(round(d, *n), want, "{what}: round {n}");
        *n += 1;
    }
}

/// The kept VRAM's bytes: a pattern in its first half; in its second, each 4 KiB block
/// one word repeated.
fn kept() -> Vec<u8> {
    let half = KEPT_LEN / 2;
    let first = (0..half as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8);
    let second = (0..half / 4096)
        .flat_map(|b| std::iter::repeat_n(block_word(b).to_le_bytes(), 1024).flatten());
    first.chain(second).collect()
}

fn block_word(b: usize) -> u32 {
    0x5eed_0000 ^ (b as u32).wrapping_mul(0x0101_0101)
}

/// Writes the kept VRAM: its first half through BAR2, its second by FILLs (on whatever
/// runs the device).
fn write_kept(d: &mut Driver<Ours>) {
    let half = KEPT_LEN / 2;
    d.vram_write(KEPT, &kept()[..half]);
    let fills: Vec<Command> = (0..half / 4096)
        .map(|b| {
            let at = KEPT + (half + b * 4096) as u64;
            Command::fill(Operand::Vram(at), 4096, block_word(b))
        })
        .collect();
    d.run(1, &fills);
}

/// Checks the kept VRAM through BAR2.
fn check_kept(d: &mut Driver<Ours>, what: &str) {
    let mut got = vec![0u8; KEPT_LEN];
    d.vram_read(KEPT, &mut got);
    let kept = kept();
    let half = KEPT_LEN / 2;
    assert!(
        got[..half] == kept[..half],
        "{what}: VRAM written through BAR2 differs"
    );
    assert!(
        got[half..] == kept[half..],
        "{what}: VRAM the FILLs wrote differs"
    );
}

/// The daemon on [`CONFIG`], its workers' fake GPUs looking for faults in `faults`; fails,
/// saying why, when the GPU board is out of service (a binary without the `fake-gpu`
/// feature, whose workers cannot open `fake-h0`).
fn daemon(faults: &Path) -> Daemon {
    let mut d = Daemon::new().with_config(CONFIG).with_env(
        FAKE_FAULTS_ENV,
        faults.to_str().expect("a UTF-8 temporary directory"),
    );
    d.launch();
    let h0 = d.client().get("/v1/boards/h0").expect("board h0").body;
    if h0["state"] != "available" {
        let log = d.log();
        let about: Vec<&str> = log.lines().filter(|l| l.contains("h0")).collect();
        panic!(
            "the `cuda` board h0 (gpu = \"fake-h0\") is {}: this test needs a `switchyard` \
             built with the `fake-gpu` feature (`cargo build -p switchyard --features \
             fake-gpu`, then SWITCHYARD_BIN=target/debug/switchyard; scripts/test.sh does \
             both); the daemon ran {}. Its log about h0:\n{}",
            h0["state"],
            common::daemon::exe().display(),
            about[about.len().saturating_sub(5)..].join("\n")
        );
    }
    d
}

#[test]
fn a_client_on_cuda_partitions_of_a_fake_gpu_keeps_every_job_through_kills_moves_failover_and_migration()
 {
    let t0 = Instant::now();
    let faults = tempfile::tempdir().expect("tempdir");
    let mut d = daemon(faults.path());
    d.ctl_ok(&["create", "vm1", "--pool", "gpu"]);
    let e = d.endpoint("vm1");
    assert_eq!(e["lease"]["id"], "h0.p0", "{e}");
    let mut g = connect(&socket_of(&e));
    g.setup_queue(0);
    g.setup_queue(1);
    g.w32(SCRATCH, 0xc0da_0001);
    let mut n = 0u64;
    rounds(&mut g, &mut n, 2, Ran::Gpu, "on h0.p0");
    write_kept(&mut g);
    check_kept(&mut g, "written");

    let t = Instant::now();
    kill_under_the_client(&mut d, &mut g, &mut n);
    eprintln!("1. SIGKILL: {:?}", t.elapsed());
    let t = Instant::now();
    moves_under_the_client(&mut d, &mut g, &mut n);
    eprintln!("2. moves: {:?}", t.elapsed());
    let t = Instant::now();
    failover_on_a_lost_gpu(&mut d, &mut g, &mut n, faults.path());
    eprintln!("3. failover: {:?}", t.elapsed());
    let t = Instant::now();
    live_migration_with_the_dirty_log(&mut d, g, &mut n, faults.path());
    eprintln!("4. migration: {:?}", t.elapsed());
    eprintln!("{n} rounds in {:?}", t0.elapsed());
}

/// 1. The worker is SIGKILLed with commands in flight on both queues, three times: each
///    replacement resumes the connection and the device on the GPU (its engines run the
///    commands its predecessor was running again while it registers the guest's memory with
///    the GPU); every command completes with its result.
fn kill_under_the_client(d: &mut Daemon, g: &mut Driver<Ours>, n: &mut u64) {
    // 16 FILL + COPY pairs on each queue, into slots of their own, submitted at once.
    let slot = |q: u32, i: u64| {
        let k = u64::from(q) * 16 + i;
        (0x20_0000 + k * 8192, 0x50_0000 + k * 8192)
    };
    let value = |kill: u32, q: u32, i: u64| 0xdead_0000 ^ (kill << 12) ^ (q << 8) ^ i as u32;
    for kill in 0..3 {
        let pid = d.endpoint("vm1")["worker"]["pid"].as_u64().expect("pid") as u32;
        for q in 0..2 {
            let cmds: Vec<Command> = (0..16)
                .flat_map(|i| {
                    let (vram, mem) = slot(q, i);
                    [
                        Command::fill(Operand::Vram(vram), 8192, value(kill, q, i)),
                        Command::copy(Operand::Vram(vram), guest(mem), 8192),
                    ]
                })
                .collect();
            g.submit(q, &cmds);
        }
        let p = rustix::process::Pid::from_raw(pid as i32).expect("pid");
        rustix::process::kill_process(p, rustix::process::Signal::KILL)
            .expect("SIGKILL the worker");
        for q in 0..2 {
            assert_eq!(
                g.wait_queue(q),
                Q_STATUS_IDLE,
                "kill {kill}: queue {q} stopped with error {}",
                g.r32(queue_reg(q, Q_ERROR_CODE))
            );
            for i in 0..16 {
                let (_, mem) = slot(q, i);
                let mut got = vec![0u8; 8192];
                g.mem.read(mem, &mut got);
                let want = value(kill, q, i).to_le_bytes();
                assert!(
                    got.chunks(4).all(|w| w == want),
                    "kill {kill}: queue {q} slot {i}: the command's result differs"
                );
            }
        }
        // The daemon saw the worker die by the signal and a replacement continue the
        // connection.
        wait("the killed worker's exit event", || {
            d.worker_events("exited").iter().any(|w| {
                w["pid"] == pid && w["status"].as_str().is_some_and(|s| s.contains("SIGKILL"))
            })
        });
        wait("a replacement serves the connection", || {
            d.worker_events("ready").iter().any(|w| {
                w["endpoint"] == "vm1"
                    && w["pid"]
                        .as_u64()
                        .is_some_and(|p| p > 0 && p != u64::from(pid))
                    && w["resumed_connection"] == true
            })
        });
        let after = d.endpoint("vm1");
        assert_eq!(after["worker"]["restarts"], kill + 1, "{after}");
        assert_eq!(after["lease"]["id"], "h0.p0", "{after}");
        assert_eq!(g.r32(SCRATCH), 0xc0da_0001, "registers after kill {kill}");
        // The replacement runs the device on the GPU.
        rounds(g, n, 1, Ran::Gpu, &format!("after kill {kill}"));
    }
    check_kept(g, "after the kills");
}

/// 2. Moves under the running client, each while it works: to the other partition (cuda ->
///    cuda), to the softgpu board (its jobs run on the CPU there), and back (on the GPU again).
fn moves_under_the_client(d: &mut Daemon, g: &mut Driver<Ours>, n: &mut u64) {
    let plan = [("h0.p1", Ran::Gpu), ("s0", Ran::Cpu), ("h0.p0", Ran::Gpu)];
    let restarts = d.endpoint("vm1")["worker"]["restarts"].clone();
    // The client's progress, the mover's signals: rounds started so far, and each round
    // finished.
    let started = Arc::new(AtomicU64::new(*n));
    let (finished, finishes) = std::sync::mpsc::channel::<u64>();
    let mover = {
        let (client, started) = (d.client(), started.clone());
        std::thread::spawn(move || {
            let mut marks = Vec::new();
            let mut first = 0;
            let mut last_finished = 0;
            for (to, _) in plan {
                // The client works before each move: two rounds finished since the last one
                // (all of them after it).
                while last_finished < first + 1 {
                    last_finished = finishes
                        .recv_timeout(Duration::from_secs(20))
                        .expect("the client makes progress");
                }
                // Rounds finished before the move was asked for.
                while let Ok(r) = finishes.try_recv() {
                    last_finished = r;
                }
                let before = last_finished + 1;
                let reply = client
                    .post("/v1/endpoints/vm1/move", &json!({ "to": to }))
                    .unwrap_or_else(|e| panic!("move to {to}: {e}"));
                // Rounds from here on started after the move was committed.
                first = started.load(Ordering::SeqCst);
                marks.push((to, before, first, reply.body));
            }
            marks
        })
    };
    let mut ran = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    // Until the mover is done and the client ran two more rounds after its last move.
    let mut after_last: Option<u64> = None;
    while after_last.is_none_or(|first| *n < first + 2) {
        assert!(Instant::now() < deadline, "the moves take too long");
        let i = started.fetch_add(1, Ordering::SeqCst);
        assert_eq!(i, *n);
        ran.push((*n, round(g, *n)));
        // Gone once the mover is done.
        let _ = finished.send(*n);
        *n += 1;
        if after_last.is_none() && mover.is_finished() {
            after_last = Some(*n);
        }
    }
    let marks = mover.join().expect("the mover");
    // The rounds between a move's commit and the next one's request ran where it put the
    // device.
    for (k, (to, _, first, reply)) in marks.iter().enumerate() {
        let (_, want) = plan[k];
        let end = marks.get(k + 1).map_or(u64::MAX, |m| m.1);
        let between: Vec<&(u64, Ran)> = ran
            .iter()
            .filter(|(r, _)| (*first..end).contains(r))
            .collect();
        assert!(
            between.len() >= 2,
            "move {k} to {to}: rounds {first}..{end}: {ran:?}"
        );
        assert!(
            between.iter().all(|(_, r)| *r == want),
            "move {k} to {to}: jobs must run on the {want:?}: {between:?}; reply {reply}"
        );
    }
    let e = d.endpoint("vm1");
    assert_eq!(e["lease"]["id"], "h0.p0", "{e}");
    assert_eq!(
        e["worker"]["restarts"], restarts,
        "moves are not restarts: {e}"
    );
    let moved = d.pool_events("lease_moved");
    let targets: Vec<&str> = moved
        .iter()
        .filter_map(|m| m["kind"]["to"].as_str())
        .collect();
    assert_eq!(targets, ["h0.p1", "s0", "h0.p0"], "{moved:?}");
    assert_eq!(g.r32(SCRATCH), 0xc0da_0001, "registers after the moves");
    check_kept(g, "after the moves");
    eprintln!("   {} rounds under three moves", ran.len());
}

/// 3. The GPU is lost (a sticky error at its next batch): the board fails, the endpoint fails
///    over transparently to the only healthy device of its shape (the softgpu board: both
///    partitions are on the failed GPU), and the client's jobs go on, verified.
fn failover_on_a_lost_gpu(d: &mut Daemon, g: &mut Driver<Ours>, n: &mut u64, faults: &Path) {
    let pid = d.endpoint("vm1")["worker"]["pid"].clone();
    std::fs::write(faults.join(LOSE), b"").expect("inject: lose the GPU");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut during = 0;
    while d.pool_events("failed_over").is_empty() {
        assert!(
            Instant::now() < deadline,
            "no failover; events: {:?}",
            d.events()
        );
        round(g, *n);
        *n += 1;
        during += 1;
    }
    let failed = d.pool_events("board_failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    let f = &failed[0]["kind"];
    assert_eq!(f["board"], "h0", "{f}");
    assert_eq!(f["state_intact"], true, "{f}");
    assert!(
        f["reason"]
            .as_str()
            .is_some_and(|r| r.contains("CUDA_ERROR_ILLEGAL_ADDRESS (fake)")),
        "the GPU's error: {f}"
    );
    let over = d.pool_events("failed_over");
    let o = &over[0]["kind"];
    assert_eq!(
        (
            o["endpoint"].as_str(),
            o["from"].as_str(),
            o["to"].as_str(),
            o["mode"].as_str()
        ),
        (Some("vm1"), Some("h0.p0"), Some("s0"), Some("transparent")),
        "{o}"
    );
    let board = d.client().get("/v1/boards/h0").expect("board").body;
    assert_eq!(board["state"], "quarantined", "{board}");
    assert_eq!(board["failed"]["reason"], f["reason"], "{board}");
    assert_eq!(board["failed"]["state_intact"], true, "{board}");
    let e = d.endpoint("vm1");
    assert_eq!(e["lease"]["id"], "s0", "{e}");
    let last = &e["failover"]["last"];
    assert_eq!(
        (last["from"].as_str(), last["to"].as_str()),
        (Some("h0.p0"), Some("s0")),
        "{e}"
    );
    assert!(e["failover"].get("pending").is_none(), "{e}");
    // Transparent: the same worker process went on, re-executed in place.
    assert_eq!(e["worker"]["pid"], pid, "{e}");
    assert_eq!(g.r32(SCRATCH), 0xc0da_0001, "registers after the failover");
    check_kept(g, "after the failover");
    rounds(g, n, 2, Ran::Cpu, "on s0 after the failover");
    eprintln!(
        "   {during} rounds until the failover; stall {} ms",
        o["stall_ms"]
    );
}

/// 4. The GPU repaired, the endpoint moved back onto it, then live-migrated by our client
///    onto the other partition under the running guest: with the source's dirty log on, the
///    pages the GPU wrote into guest memory during pre-copy are exactly those reported dirty;
///    the destination runs every job on the GPU, VRAM and registers as they were.
fn live_migration_with_the_dirty_log(
    d: &mut Daemon,
    mut g: Driver<Ours>,
    n: &mut u64,
    faults: &Path,
) {
    std::fs::remove_file(faults.join(LOSE)).expect("repair the GPU");
    d.ctl_ok(&["unquarantine", "h0"]);
    d.ctl_ok(&["move", "vm1", "--to", "h0.p0"]);
    rounds(&mut g, n, 1, Ran::Gpu, "back on h0.p0");
    let out = d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    let e2 = d.endpoint("vm1-in");
    assert_eq!(e2["lease"]["id"], "h0.p1", "{out}\n{e2}");
    let dst = switchyard_client::Client::connect(socket_of(&e2)).expect("destination");
    assert_eq!(
        g.t.0
            .dma_logging_start(4096, &[])
            .expect("start dirty logging"),
        4096
    );
    let mut mig = Migration::new(g, dst);
    mig.prepare_destination().expect("destination RESUMING");
    mig.start_pre_copy().expect("PRE_COPY");
    mig.pre_copy_round().expect("first pre-copy round");
    // The guest works during pre-copy: the GPU writes guest memory, which the log must say.
    let mut written = BTreeSet::new();
    for _ in 0..3 {
        assert_eq!(round(mig.source(), *n), Ran::Gpu, "pre-copy: round {n}");
        written.extend(pages_written(*n));
        *n += 1;
    }
    let bitmap = mig
        .source()
        .t
        .0
        .dma_logging_report(GUEST_IOVA, GUEST_SIZE, 4096)
        .expect("dirty report");
    let dirty: BTreeSet<u64> = (0..bitmap.len() as u64 * 8)
        .filter(|&p| bitmap[(p / 8) as usize] & (1 << (p % 8)) != 0)
        .collect();
    assert_eq!(
        dirty, written,
        "the dirty log holds exactly the pages the GPU wrote (ring and REDUCE input pages are only read)"
    );
    mig.pre_copy(&PreCopyPlan::default()).expect("pre-copy");
    mig.switchover().expect("switchover");
    let (mut src, dst) = mig.into_parts();
    // The source's VMM stops its device and lets go, as QEMU does after a migration.
    src.t
        .0
        .set_mig_state(switchyard_proto::consts::VFIO_DEVICE_STATE_STOP)
        .expect("source STOP");
    let ram = GuestMemory {
        file: src.mem.file.try_clone().expect("the guest's RAM"),
        size: src.mem.size,
    };
    drop(src);
    // The destination's VMM maps the same guest RAM; the guest's driver goes on.
    let mut g = Driver::with_memory(Ours(dst), ram);
    g.setup_queue(0);
    g.setup_queue(1);
    assert_eq!(g.r32(SCRATCH), 0xc0da_0001, "registers on the destination");
    check_kept(&mut g, "on the destination");
    rounds(&mut g, n, 3, Ran::Gpu, "on the destination");
    wait("the migration committed", || {
        d.worker_events("migrated")
            .iter()
            .any(|m| m["endpoint"] == "vm1-in" && m["source"] == "vm1")
    });
    wait("the source endpoint deleted", || {
        d.client().get("/v1/endpoints/vm1").is_err()
    });
    let e2 = d.endpoint("vm1-in");
    assert_eq!(e2["lease"]["id"], "h0.p1", "{e2}");
    assert!(e2.get("incoming_for").is_none_or(Value::is_null), "{e2}");
}
