//! Swapping the backing device under a connected client: the client keeps its socket, DMA
//! windows, eventfds and VRAM mapping, its queues keep completing, and nothing it can observe
//! changes except that register accesses wait during the swap.

mod common;

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
use switchyard_softgpu::{SoftGpu, SoftGpuConfig, SoftGpuError};

struct InProcess {
    slot: DeviceSlot<SoftGpu>,
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
        let (ctl, config, vram) = self
            .slot
            .with(|d| (d.engine_control(), d.config(), d.vram_file().clone()));
        let next =
            SoftGpu::with_vram(config, self.slot.context().clone(), vram).expect("successor");
        ctl.set_running(false);
        let report = self
            .slot
            .swap(|old: &mut SoftGpu, _ctx: DeviceContext| old.hand_over(next))
            .expect("swap");
        let held = report.held;
        drop(report.old);
        held
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
                let ctl = slot.with(|d| d.engine_control());
                ctl.set_running(false);
                let r = slot.swap(|old: &mut SoftGpu, ctx| old.successor(ctx));
                let r = r.expect("swap");
                worst = worst.max(r.held);
                drop(r.old);
                swaps += 1;
                thread::sleep(Duration::from_micros(200));
            }
            (swaps, worst)
        })
    };
    // A job of many small commands on both queues while the device is swapped underneath.
    // SAXPY (y = 1*x + y, x all ones) is not idempotent: y counts its executions, so a
    // command run by both the old and the new device shows.
    const N: usize = 4096;
    const X: u64 = 0x60_0000;
    const Y: u64 = 0x70_0000;
    let ones: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), N)
        .flatten()
        .collect();
    d.mem.write(X, &ones);
    d.mem.write(Y, &vec![0u8; N * 4]);
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
    let other = server
        .slot
        .swap(|_old: &mut SoftGpu, ctx| SoftGpu::new(CONFIG, ctx));
    assert!(
        matches!(other, Err(SwapError::Incompatible(_))),
        "{other:?}"
    );
    // Handing over to a device on other VRAM is refused too, and the old device runs on.
    let handed = server.slot.swap(|old: &mut SoftGpu, ctx| {
        let other = SoftGpu::new(CONFIG, ctx)?;
        old.hand_over(other)
    });
    assert!(matches!(handed, Err(SwapError::Build(_))), "{handed:?}");
    // A failing build.
    let failing = server.slot.swap(|_old: &mut SoftGpu, _ctx| {
        Err::<SoftGpu, _>(SoftGpuError::Thread(std::io::Error::other(
            "no threads left",
        )))
    });
    assert!(matches!(failing, Err(SwapError::Build(_))), "{failing:?}");
    // During a migration.
    c.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
    let migrating = server
        .slot
        .swap(|old: &mut SoftGpu, ctx| old.successor(ctx));
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
