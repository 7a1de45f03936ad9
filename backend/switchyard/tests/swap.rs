//! Swapping the backing device under a connected client: the client keeps its socket, DMA
//! windows, eventfds and VRAM mapping, its queues keep completing, and nothing it can observe
//! changes except that register accesses wait during the swap.
#![forbid(unsafe_code)]

mod common;

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use common::driver::{Driver, guest, wait_eventfd};
use common::ours::Ours;
use switchyard_client::Client;
use switchyard_device::DeviceContext;
use switchyard_proto::consts::*;
use switchyard_server::{DeviceSlot, Server, ServerConfig, StopHandle, SwapError};
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;
use switchyard_softgpu::{EngineControl, SoftGpu, SoftGpuConfig};

struct InProcess {
    slot: DeviceSlot,
    stop: StopHandle,
    thread: Option<thread::JoinHandle<()>>,
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl InProcess {
    fn start(config: SoftGpuConfig) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("gpu.sock");
        let mut server = Server::new(ServerConfig::new(&socket), |ctx| SoftGpu::new(config, ctx))
            .expect("server");
        let slot = server.device_slot();
        let stop = server.stop_handle();
        let thread = thread::spawn(move || server.run().expect("run"));
        Self {
            slot,
            stop,
            thread: Some(thread),
            socket,
            _dir: dir,
        }
    }

    /// The swap a pool daemon does: build the successor and drain the engines outside the
    /// lock, then only hand the state over inside it.
    fn swap(&self) -> Duration {
        let (ctl, next) = successor(&self.slot);
        let _parked = ctl.park();
        let report = self.slot.swap(Box::new(next)).expect("swap");
        let held = report.held;
        drop(report.old);
        held
    }
}

/// SAXPY counters: y = 1*x + y with x all ones is not idempotent, so y counts the executions
/// of every command on it, and a command run by both the old and the new device shows.
/// `N` floats of x (all ones) at `X` and of y (all zeros) at `Y` in guest memory.
const N: usize = 4096;
const X: u64 = 0x60_0000;
const Y: u64 = 0x70_0000;

fn reset_counters(mem: &common::GuestMemory) {
    let ones: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), N)
        .flatten()
        .collect();
    mem.write(X, &ones);
    mem.write(Y, &vec![0u8; N * 4]);
}

/// The softgpu in the slot: its engine control and configuration.
fn parts(slot: &DeviceSlot) -> (EngineControl, SoftGpuConfig) {
    slot.with_as(|d: &mut SoftGpu| (d.engine_control(), d.config()))
        .expect("the slot holds a softgpu")
}

/// The current device's engine control and a parked successor (built outside the slot, on
/// the slot's VRAM).
fn successor(slot: &DeviceSlot) -> (EngineControl, SoftGpu) {
    let (ctl, config) = parts(slot);
    let next = SoftGpu::successor(config, slot.context().clone()).expect("successor");
    (ctl, next)
}

/// The slot's context with memory objects of its own: a device built on it gets VRAM of its
/// own, as a device of another slot would.
fn other_memory(slot: &DeviceSlot) -> DeviceContext {
    DeviceContext {
        memory: Default::default(),
        ..slot.context().clone()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const CONFIG: SoftGpuConfig = SoftGpuConfig {
    vram_size: 16 << 20,
    queues: 2,
    irq: switchyard_softgpu::IrqMode::Msix,
    vram_mmap: true,
    keep_vram_on_reset: false,
    spin_us: switchyard_softgpu::SoftGpuConfig::DEFAULT_SPIN_US,
};

#[test]
fn queues_keep_completing_across_repeated_swaps() {
    let server = InProcess::start(CONFIG);
    let mut d = Driver::new(Ours(Client::connect(&server.socket).expect("connect")));
    d.setup_queue(0);
    d.setup_queue(1);
    d.w32(SCRATCH, 0x5151);
    let vram = d.t.0.region_info(2).expect("BAR2").fd.expect("VRAM fd");
    vram.write_all_at(b"kept across swaps", 0x1000)
        .expect("write VRAM");

    let done = Arc::new(AtomicBool::new(false));
    let swapper = {
        let slot = server.slot.clone();
        let done = done.clone();
        thread::spawn(move || {
            let mut swaps = 0;
            let mut worst = Duration::ZERO;
            while !done.load(Ordering::SeqCst) {
                let (ctl, next) = successor(&slot);
                let parked = ctl.park();
                let r = slot.swap(Box::new(next)).expect("swap");
                drop(parked);
                worst = worst.max(r.held);
                drop(r.old);
                swaps += 1;
                // Pacing: swaps back to back, a breath apart, for the client's jobs.
                thread::sleep(Duration::from_micros(200));
            }
            (swaps, worst)
        })
    };
    // A job of many small commands on both queues while the device is swapped underneath.
    reset_counters(&d.mem);
    let mut completed = 0u64;
    for round in 0..100u64 {
        for q in 0..2u32 {
            let off = (round * 2 + u64::from(q)) * 4096;
            d.submit(
                q,
                &[
                    Command::fill(
                        Operand::Vram(0x10_0000 + off),
                        4096,
                        round as u32 * 0x0101_0101,
                    ),
                    Command::copy(Operand::Vram(0x10_0000 + off), guest(0x40_0000 + off), 4096),
                    Command::saxpy(
                        N as u64 / 2,
                        1.0,
                        guest(X),
                        guest(Y + q as u64 * 2 * N as u64),
                    ),
                    Command::fence(
                        guest(0x20_0000 + 8 * u64::from(q)),
                        round + 1,
                        Some(q as u16),
                    ),
                ],
            );
        }
        for q in 0..2u32 {
            let st = d.wait_queue(q);
            assert_eq!(st, Q_STATUS_IDLE, "queue {q} round {round}");
            assert!(
                wait_eventfd(&d.completion[q as usize], Duration::from_secs(10)).is_some(),
                "fence interrupt of queue {q} round {round}"
            );
            assert_eq!(d.mem.read_u64(0x20_0000 + 8 * u64::from(q)), round + 1);
            let off = (round * 2 + u64::from(q)) * 4096;
            let mut b = vec![0u8; 4096];
            d.mem.read(0x40_0000 + off, &mut b);
            assert!(
                b.iter().all(|&x| x == (round as u8)),
                "copy result of queue {q} round {round}"
            );
        }
        let y = d.read_f32s(Y, N);
        assert!(
            y.iter().all(|&v| v == (round + 1) as f32),
            "round {round}: every SAXPY ran exactly once (y[0] = {})",
            y[0]
        );
        completed += 8;
    }
    done.store(true, Ordering::SeqCst);
    let (swaps, worst) = swapper.join().expect("swapper");
    assert!(swaps >= 10, "only {swaps} swaps happened during the job");
    assert!(
        worst < Duration::from_secs(2),
        "a swap held the device {worst:?}"
    );
    let per_queue: u64 = (0..2).map(|q| d.r64(queue_reg(q, Q_COMPLETED_LO))).sum();
    assert_eq!(per_queue, completed, "every command counted exactly once");
    assert_eq!(d.r32(SCRATCH), 0x5151);
    let mut b = [0u8; 17];
    vram.read_exact_at(&mut b, 0x1000).expect("read VRAM");
    assert_eq!(&b, b"kept across swaps");
}

#[test]
fn refused_swaps_leave_the_old_device_serving() {
    let server = InProcess::start(CONFIG);
    let mut c = Client::connect(&server.socket).expect("connect");
    c.region_write(0, SCRATCH, &9u32.to_le_bytes())
        .expect("write");

    // A device on another VRAM object would break the client's mapping.
    let other = SoftGpu::new(CONFIG, other_memory(&server.slot)).expect("device");
    let other = server.slot.swap(Box::new(other));
    assert!(
        matches!(other, Err(SwapError::Incompatible(_))),
        "{other:?}"
    );
    // A device of another configuration on the same VRAM (the client sees NUM_QUEUES).
    let (_, config) = parts(&server.slot);
    let one = SoftGpuConfig {
        queues: 1,
        ..config
    };
    let fewer = SoftGpu::successor(one, server.slot.context().clone()).expect("device");
    let fewer = server.slot.swap(Box::new(fewer));
    assert!(
        matches!(fewer, Err(SwapError::Incompatible(_))),
        "{fewer:?}"
    );
    // During a migration.
    c.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
    let migrating = server.slot.swap(Box::new(successor(&server.slot).1));
    assert!(
        matches!(migrating, Err(SwapError::Migrating(_))),
        "{migrating:?}"
    );
    c.set_mig_state(VFIO_DEVICE_STATE_RUNNING).expect("RUNNING");

    let mut b = [0u8; 4];
    c.region_read(0, SCRATCH, &mut b).expect("read");
    assert_eq!(u32::from_le_bytes(b), 9, "the old device still serves");
    let held = server.swap();
    assert!(held < Duration::from_secs(2));
    c.region_read(0, SCRATCH, &mut b).expect("read");
    assert_eq!(u32::from_le_bytes(b), 9, "the new device has the state");
}

#[test]
fn a_swap_after_the_client_left_keeps_the_device_parked() {
    let server = InProcess::start(CONFIG);
    let mut c = Client::connect(&server.socket).expect("connect");
    c.region_write(0, SCRATCH, &3u32.to_le_bytes())
        .expect("write");
    c.socket()
        .shutdown(std::net::Shutdown::Both)
        .expect("shutdown");
    drop(c);
    // The next client's handshake completes once the server has dropped the first one (and
    // parked the device's engines: they must not run without the client's DMA windows).
    let mut c = common::wait_for(Duration::from_secs(10), || {
        Client::connect(&server.socket).ok()
    })
    .expect("reconnect");
    let held = server.swap();
    assert!(held < Duration::from_secs(2));
    let mut b = [0u8; 4];
    c.region_read(0, DEV_STATUS, &mut b).expect("read");
    assert_ne!(
        u32::from_le_bytes(b) & DEV_STATUS_HALTED,
        0,
        "the successor is still parked for the departed client"
    );
    c.region_read(0, SCRATCH, &mut b).expect("read");
    assert_eq!(u32::from_le_bytes(b), 3);
}

/// Fills of 256 KiB of VRAM (no guest memory besides the ring): tens of microseconds each.
fn vram_fills(n: usize, pattern: u32) -> Vec<Command> {
    (0..n)
        .map(|i| Command::fill(Operand::Vram((i as u64 % 8) << 18), 1 << 18, pattern))
        .collect()
}

#[test]
fn refused_swaps_never_restart_a_device_that_migration_stopped() {
    let server = InProcess::start(CONFIG);
    let mut d = Driver::new(Ours(Client::connect(&server.socket).expect("connect")));
    d.setup_queue(0);
    let done = Arc::new(AtomicBool::new(false));
    // A checkpoint: the test hands the swapper a reply channel; the swapper runs one more
    // whole round (park, swap, unpark) that starts after it took the ask, then sends a
    // sender back and waits, holding nothing, until the test drops that sender.
    let (ask, asked) = mpsc::channel::<mpsc::Sender<mpsc::Sender<()>>>();
    let swapper = {
        let slot = server.slot.clone();
        let done = done.clone();
        thread::spawn(move || {
            let (mut swaps, mut refused) = (0u32, 0u32);
            while !done.load(Ordering::SeqCst) {
                let checkpoint = asked.try_recv().ok();
                let (ctl, next) = successor(&slot);
                let parked = ctl.park();
                // Pacing: a migration STOP lands between the park and the swap.
                thread::sleep(Duration::from_micros(300));
                match slot.swap(Box::new(next)) {
                    Ok(r) => {
                        swaps += 1;
                        drop(r.old);
                    }
                    Err(SwapError::Migrating(_)) => refused += 1,
                    Err(e) => panic!("swap: {e}"),
                }
                drop(parked);
                if let Some(reply) = checkpoint {
                    let (go, wait) = mpsc::channel::<()>();
                    if reply.send(go).is_ok() {
                        // Until the test lets go (drops `go`, or fails).
                        let _ = wait.recv();
                    }
                }
            }
            (swaps, refused)
        })
    };
    let mut submitted = 0u64;
    for i in 0..150u32 {
        let completed = d.r64(queue_reg(0, Q_COMPLETED_LO));
        if submitted - completed < 32 {
            d.submit(0, &vram_fills(64, i));
            submitted += 64;
        }
        d.t.0.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
        let before = d.r64(queue_reg(0, Q_COMPLETED_LO));
        // A whole round of the swapper meets the STOP (its swap refused); with the swapper
        // at its checkpoint, holding no park, the STOP alone holds the engines: a refused
        // swap or a released park that let them go shows as DEV_STATUS without STOPPED.
        let (reply, checkpoint) = mpsc::channel();
        ask.send(reply).expect("the swapper runs");
        let go = checkpoint
            .recv_timeout(Duration::from_secs(10))
            .expect("the swapper's round");
        assert_ne!(
            d.r32(DEV_STATUS) & DEV_STATUS_STOPPED,
            0,
            "iteration {i}: the engines of a device in STOP may run after a refused swap"
        );
        let after = d.r64(queue_reg(0, Q_COMPLETED_LO));
        assert_eq!(
            before, after,
            "iteration {i}: the engine ran commands while the device was in STOP"
        );
        drop(go);
        d.t.0
            .set_mig_state(VFIO_DEVICE_STATE_RUNNING)
            .expect("RUNNING");
        // Positive control: with work pending, the engine runs again in RUNNING.
        let progress = common::wait_for(Duration::from_secs(10), || {
            (d.r64(queue_reg(0, Q_COMPLETED_LO)) > after).then_some(())
        });
        assert!(progress.is_some(), "iteration {i}: no progress in RUNNING");
    }
    done.store(true, Ordering::SeqCst);
    let (swaps, refused) = swapper.join().expect("swapper");
    eprintln!("{swaps} swaps, {refused} refused during STOP");
    assert!(refused >= 10, "only {refused} swaps met a STOP");
    assert!(swaps >= 10, "only {swaps} swaps happened");
    assert_eq!(d.wait_queue(0), Q_STATUS_IDLE);
    assert_eq!(
        d.r64(queue_reg(0, Q_COMPLETED_LO)),
        submitted,
        "every command ran exactly once"
    );
}

#[test]
fn incompatible_successors_are_refused_before_anything_runs_on_them() {
    let server = InProcess::start(CONFIG);
    let mut d = Driver::new(Ours(Client::connect(&server.socket).expect("connect")));
    d.setup_queue(0);
    d.setup_queue(1);
    d.w32(SCRATCH, 0x77);
    let done = Arc::new(AtomicBool::new(false));
    let swapper = {
        let slot = server.slot.clone();
        let done = done.clone();
        thread::spawn(move || {
            let mut refused = 0u32;
            while !done.load(Ordering::SeqCst) {
                let (ctl, config) = parts(&slot);
                // Alternately: one queue fewer on the same VRAM, and VRAM of another size.
                let next = if refused.is_multiple_of(2) {
                    let other = SoftGpuConfig {
                        queues: 1,
                        ..config
                    };
                    SoftGpu::successor(other, slot.context().clone())
                } else {
                    let other = SoftGpuConfig {
                        vram_size: 32 << 20,
                        ..config
                    };
                    SoftGpu::new(other, other_memory(&slot))
                }
                .expect("successor");
                let parked = ctl.park();
                let r = slot.swap(Box::new(next));
                drop(parked);
                assert!(matches!(r, Err(SwapError::Incompatible(_))), "{r:?}");
                refused += 1;
                // Pacing: refusals back to back, a breath apart, for the client's jobs.
                thread::sleep(Duration::from_micros(500));
            }
            refused
        })
    };
    reset_counters(&d.mem);
    for round in 0..60u64 {
        for q in 0..2u32 {
            let y = guest(Y + u64::from(q) * 2 * N as u64);
            let mut cmds = vram_fills(4, round as u32);
            cmds.push(Command::saxpy(N as u64 / 2, 1.0, guest(X), y));
            cmds.push(Command::fence(
                guest(0x20_0000 + 8 * u64::from(q)),
                round + 1,
                Some(q as u16),
            ));
            d.submit(q, &cmds);
        }
        for q in 0..2u32 {
            assert_eq!(d.wait_queue(q), Q_STATUS_IDLE, "queue {q} round {round}");
            assert_eq!(d.mem.read_u64(0x20_0000 + 8 * u64::from(q)), round + 1);
        }
        let y = d.read_f32s(Y, N);
        assert!(
            y.iter().all(|&v| v == (round + 1) as f32),
            "round {round}: every SAXPY ran exactly once (y[0] = {})",
            y[0]
        );
    }
    done.store(true, Ordering::SeqCst);
    let refused = swapper.join().expect("swapper");
    assert!(refused >= 10, "only {refused} refused swaps during the job");
    let per_queue: u64 = (0..2).map(|q| d.r64(queue_reg(q, Q_COMPLETED_LO))).sum();
    assert_eq!(per_queue, 60 * 2 * 6, "every command counted exactly once");
    assert_eq!(d.r32(SCRATCH), 0x77, "the old device still serves");
    assert_eq!(d.r32(NUM_QUEUES), 2);
}
