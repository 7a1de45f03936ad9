//! Board failures: an engine that dies, VRAM that fails; reported once through the failure
//! hook (or the ERR interrupt), injected through [`FaultInjection`].

use std::sync::Mutex;
use std::sync::mpsc;

use switchyard_device::kind::{BoardFailure, Build, DeviceKind, FailedHook};
use switchyard_device::{FaultInjection, MemoryObjects, MigArc};

use super::*;
use crate::SoftGpuKind;
use crate::cmd::Operand;

const G: fn(u64) -> Operand = Operand::Guest;
const V: fn(u64) -> Operand = Operand::Vram;

/// What a failure hook was told.
#[derive(Default)]
struct Reports(Mutex<Vec<BoardFailure>>);

impl Reports {
    /// A hook that records every report and answers `handled`.
    fn hook(self: &Arc<Self>, handled: bool) -> FailedHook {
        let me = self.clone();
        Arc::new(move |f| {
            me.0.lock().expect("reports").push(f);
            // A supervisor's channel may take a while.
            std::thread::sleep(Duration::from_millis(5));
            handled
        })
    }

    fn all(&self) -> Vec<BoardFailure> {
        self.0.lock().expect("reports").clone()
    }

    /// Waits for the first report and returns it.
    fn first(&self) -> BoardFailure {
        wait_until("a failure report", || !self.all().is_empty());
        self.all().remove(0)
    }
}

/// Wires an eventfd to the ERR interrupt; returns it.
fn wire_err(h: &Harness) -> File {
    let err = new_eventfd().expect("eventfd");
    h.irqs
        .set_triggers(
            IrqIndex::Err as u32,
            0,
            vec![Some(err.try_clone().expect("clone"))],
        )
        .expect("ERR eventfd");
    err
}

fn wait_engine_gone(h: &Harness, q: usize) {
    wait_until("the engine thread to end", || {
        h.gpu.engines.get(q).is_some_and(|e| e.is_finished())
    });
}

/// Runs `f` on another thread and fails the test if it does not return in time (a hang).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// Drops the device, which joins its engines (a dead one included), without hanging.
fn drop_bounded(h: Harness) {
    bounded("dropping the device", move || drop(h));
}

/// How soon a queue with work stops once its device is lost (the in-guest driver's timeout,
/// which it must not need).
const QUICKLY: Duration = Duration::from_secs(5);

/// The IOVA of the ring slot of command `index` of queue `q`.
fn slot_of(q: u32, index: u32) -> u64 {
    Harness::ring(q) + u64::from(index % RING_ENTRIES) * COMMAND_SIZE as u64
}

/// Queue `q`'s error as a replacement process would find it in the black box: (code, index,
/// the in-flight marker).
fn mirrored_error(h: &Harness, q: usize) -> (u32, u32, Option<u32>) {
    let bb = h.bb.as_ref().expect("a black box");
    let (_, saved) = crate::mirror::Mirror::recover(bb, &h.config).expect("the black box");
    let qs = saved.state.queues[q];
    (qs.error_code, qs.error_index, saved.inflight[q])
}

fn fill(dst: Operand, len: u64, pattern: u32) -> Command {
    Command::fill(dst, len, pattern)
}

/// A healthy queue still runs commands.
fn assert_runs(h: &mut Harness, q: u32) {
    h.run(q, &[fill(G(DATA), 256, 0xabcd_0123)]);
    assert_eq!(
        h.guest_read(DATA, 8),
        [0x23, 0x01, 0xcd, 0xab, 0x23, 0x01, 0xcd, 0xab]
    );
}

#[test]
fn fault_kinds_are_engine_and_vram_and_others_are_unsupported() {
    let h = Harness::new();
    let faults = h.gpu.faults().expect("the softgpu offers fault injection");
    assert_eq!(faults.fault_kinds(), ["engine", "vram"]);
    assert!(matches!(
        faults.inject_fault("power"),
        Err(DeviceError::Unsupported)
    ));
    drop_bounded(h);
}

#[test]
fn an_engine_fault_on_an_idle_device_is_failed_over_without_err() {
    let mut h = Harness::new();
    h.init();
    let err = wire_err(&h);
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    assert_runs(&mut h, 0);

    h.gpu.inject_fault("engine").expect("inject");
    let failure = reports.first();
    assert_eq!(
        failure,
        BoardFailure {
            reason: "the engine of queue 0 died: injected fault: engine of queue 0".into(),
            state_intact: true,
        }
    );
    wait_engine_gone(&h, 0);
    assert_eq!(take_eventfd(&err), None, "the pool took it: no ERR");

    // The dead queue is still answered; it completes nothing.
    let first = h.submit(0, &[fill(G(DATA), 64, 7)]);
    assert_eq!(h.qr(0, Q_HEAD), first);
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 1);
    assert_eq!(h.rd32(MAGIC), MAGIC_VALUE);
    // The other queue runs, and resets do not wait for the dead engine.
    assert_runs(&mut h, 1);
    let mut h = bounded("a reset", move || {
        h.gpu.reset().expect("reset");
        h
    });
    h.init();
    assert_runs(&mut h, 1);

    // A second fault kills the other engine, but reports nothing new.
    h.gpu.inject_fault("engine").expect("inject again");
    wait_engine_gone(&h, 1);
    assert_eq!(reports.all().len(), 1, "reported once");
    assert_eq!(take_eventfd(&err), None);
    drop_bounded(h);
}

#[test]
fn an_engine_fault_during_a_long_command_signals_err_when_the_hook_declines() {
    let mut h = Harness::with_config(gemm_room());
    h.init();
    let err = wire_err(&h);
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(false)));
    // A GEMM of the largest size: seconds of work, with checkpoints every few rows.
    let (m, n, k) = (1024, 1024, 1024);
    let first = h.submit(1, &[Command::gemm(m, n, k, V(0), V(4 << 20), V(8 << 20))]);
    wait_until("queue 1 to run its command", || {
        h.gpu.shared.lock().inflight.get(1).copied().flatten() == Some(first)
    });

    h.gpu.inject_fault("engine").expect("inject");
    let failure = reports.first();
    assert_eq!(
        failure,
        BoardFailure {
            reason: "the engine of queue 1 died: injected fault: engine of queue 1".into(),
            state_intact: true,
        },
        "the queue running a command is the one that dies"
    );
    wait_until("the ERR interrupt", || take_eventfd(&err) == Some(1));
    wait_engine_gone(&h, 1);
    assert_eq!(h.qr(1, Q_HEAD), first, "the GEMM did not complete");
    assert_eq!(h.rd64(queue_reg(1, Q_COMPLETED_LO)), 0);
    assert_eq!(reports.all().len(), 1);
    assert_eq!(take_eventfd(&err), None, "ERR signalled once");

    assert_runs(&mut h, 0);
    // Parking (a swap, a migration STOP) does not wait for the dead engine either.
    let parked = bounded("parking the engines", {
        let control = h.gpu.engine_control();
        move || control.park()
    });
    drop(parked);
    assert_runs(&mut h, 0);
    drop_bounded(h);
}

#[test]
fn an_engine_fault_without_a_hook_signals_err() {
    let mut h = Harness::new();
    h.init();
    let err = wire_err(&h);
    h.gpu.inject_fault("engine").expect("inject");
    wait_until("the ERR interrupt", || take_eventfd(&err) == Some(1));
    wait_engine_gone(&h, 0);
    assert_runs(&mut h, 1);
    h.gpu.inject_fault("engine").expect("inject again");
    wait_engine_gone(&h, 1);
    assert_eq!(take_eventfd(&err), None, "a device fails once");
    drop_bounded(h);
}

#[test]
fn an_engine_that_panics_mid_command_is_reported_with_its_message() {
    let mut h = Harness::new();
    h.init();
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    h.gpu.shared.hook.die_at(0, 2);
    let first = h.submit(0, &[fill(V(0), 4 << 20, 0x1111_1111)]);
    assert_eq!(
        reports.first(),
        BoardFailure {
            reason: "the engine of queue 0 died: test: an engine bug in queue 0".into(),
            state_intact: true,
        }
    );
    wait_engine_gone(&h, 0);
    // Its command stays in flight (a replacement replays it), and nothing waits for it.
    assert_eq!(
        h.gpu.shared.lock().inflight.first().copied().flatten(),
        Some(first)
    );
    let snapshot = bounded("a snapshot", {
        let control = h.gpu.engine_control();
        move || control.0.snapshot()
    });
    assert_eq!(snapshot.queues[0].head, first);
    assert_runs(&mut h, 1);
    drop_bounded(h);
}

#[test]
fn a_swap_hands_the_hook_over_and_treats_a_dead_engines_command_as_a_recovery_would() {
    const N: u64 = 1 << 17;
    const X: u64 = DATA;
    const Y: u64 = DATA + N * 4;
    let mut h = Harness::new();
    h.init();
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    h.guest_write(X, &f32_bytes(&floats(1, N as usize)));
    h.guest_write(Y, &f32_bytes(&floats(2, N as usize)));
    // Queue 0 dies in the middle of an in-place SAXPY (cannot run again), queue 1 in the
    // middle of a FILL (can).
    h.gpu.shared.hook.die_at(0, 2);
    h.gpu.shared.hook.die_at(1, 2);
    let saxpy = h.submit(0, &[Command::saxpy(N, 2.0, G(X), G(Y))]);
    let filled = h.submit(1, &[fill(V(0), 4 << 20, 0x5a5a_5a5a)]);
    wait_engine_gone(&h, 0);
    wait_engine_gone(&h, 1);
    assert_eq!(reports.all().len(), 1, "one report for the device");

    let mut next = SoftGpu::successor(h.config, h.slot_ctx()).expect("successor");
    h.gpu.hand_over_to(&mut next).expect("hand over");
    let old = std::mem::replace(&mut h.gpu, next);
    assert_eq!(
        h.wait_error(0),
        (
            ERR_INTERRUPTED,
            saxpy,
            Harness::ring(0) + u64::from(saxpy % RING_ENTRIES) * COMMAND_SIZE as u64,
            u32::from(crate::cmd::OP_SAXPY)
        )
    );
    h.wait_idle(1);
    assert_eq!(h.qr(1, Q_HEAD), filled + 1);
    assert!(h.vram_file_read(0, 4 << 20).iter().all(|&b| b == 0x5a));

    // The hook went with the state: the successor, a device of its own, reports.
    h.gpu
        .inject_fault("engine")
        .expect("inject into the successor");
    wait_until("the successor's report", || reports.all().len() == 2);
    assert!(reports.all()[1].state_intact);
    bounded("dropping the retired device", move || drop(old));
    drop_bounded(h);
}

#[test]
fn a_retired_device_reports_nothing() {
    let mut h = Harness::new();
    h.init();
    let err = wire_err(&h);
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    let mut next = SoftGpu::successor(h.config, h.slot_ctx()).expect("successor");
    h.gpu.hand_over_to(&mut next).expect("hand over");
    let old = std::mem::replace(&mut h.gpu, next);
    old.inject_fault("engine")
        .expect("inject into the retired device");
    wait_until("the retired engine to end", || {
        old.engines.first().is_some_and(|e| e.is_finished())
    });
    assert!(reports.all().is_empty());
    assert_eq!(take_eventfd(&err), None);
    assert_runs(&mut h, 0);
    h.gpu
        .inject_fault("engine")
        .expect("inject into the successor");
    assert_eq!(
        reports.first().reason,
        "the engine of queue 0 died: injected fault: engine of queue 0"
    );
    bounded("dropping the retired device", move || drop(old));
    drop_bounded(h);
}

#[test]
fn a_vram_fault_is_reported_once_and_nothing_reaches_vram_any_more() {
    let mut h = Harness::new();
    h.init();
    let err = wire_err(&h);
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    h.run(0, &[fill(V(0), 4096, 0x0101_0101)]);
    assert_eq!(h.vram_region_read(0, 4), [1, 1, 1, 1]);

    h.gpu.inject_fault("vram").expect("inject");
    let failure = reports.first();
    assert!(!failure.state_intact, "{failure:?}");
    assert!(failure.reason.contains("VRAM"), "{failure:?}");

    let mut b = [0u8; 4];
    let eio = |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::Io(e)) if e.raw_os_error() == Some(libc::EIO));
    assert!(eio(h.gpu.region_read(BAR_VRAM, 0, &mut b)));
    assert!(eio(h.gpu.region_write(BAR_VRAM, 0, &[9; 4])));
    // A FILL submitted now on the idle queue stops it with ERR_DEVICE_LOST at once, and
    // writes nothing.
    h.drain_irqs();
    let submitted = Instant::now();
    let first = h.submit(0, &[fill(V(0), 4096, 0x0202_0202)]);
    assert_eq!(
        h.wait_error(0),
        (ERR_DEVICE_LOST, first, slot_of(0, first), 0)
    );
    assert!(
        submitted.elapsed() < QUICKLY,
        "the error took {:?}",
        submitted.elapsed()
    );
    h.wait_irq(8);
    assert_eq!(h.qr(0, Q_HEAD), first);
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 1);
    assert_eq!(h.vram_file_read(0, 4), [1, 1, 1, 1]);
    // RECOVER | ENABLE skips it; the next command fails the same way, and nothing runs.
    h.recover(0);
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_IDLE);
    let next = h.submit(0, &[fill(V(0), 4096, 0x0303_0303), fill(G(DATA), 64, 3)]);
    assert_eq!(
        h.wait_error(0),
        (ERR_DEVICE_LOST, next, slot_of(0, next), 0)
    );
    h.wait_irq(8);
    assert_eq!(h.qr(0, Q_HEAD), next);
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 1);
    assert_eq!(h.vram_file_read(0, 4), [1, 1, 1, 1]);
    assert_eq!(h.guest_read(DATA, 4), [0; 4]);
    // No migration or relocation reads it either.
    let migration = h.gpu.migration().expect("migratable");
    migration
        .step(MigArc::StartPreCopy)
        .expect("start pre-copy");
    let mut chunk = [0u8; 4096];
    assert!(migration.read(&mut chunk).is_err());
    migration.step(MigArc::AbortPreCopy).expect("abort");
    let target = SoftGpu::create_vram(&h.config).expect("VRAM");
    assert!(matches!(
        h.gpu.begin_detached_relocation(target),
        Err(crate::SoftGpuError::VramFailed(_))
    ));

    // Other faults after it report nothing new.
    h.gpu.inject_fault("vram").expect("again");
    h.gpu.inject_fault("engine").expect("and an engine");
    wait_engine_gone(&h, 0);
    assert_eq!(reports.all().len(), 1);
    assert_eq!(take_eventfd(&err), None, "the pool took it: no ERR");
    drop_bounded(h);
}

#[test]
fn a_vram_fault_without_a_hook_signals_err_once() {
    let mut h = Harness::new();
    h.init();
    let err = wire_err(&h);
    h.gpu.inject_fault("vram").expect("inject");
    wait_until("the ERR interrupt", || take_eventfd(&err) == Some(1));
    let mut b = [0u8; 4];
    assert!(h.gpu.region_read(BAR_VRAM, 0, &mut b).is_err());
    assert_eq!(take_eventfd(&err), None, "ERR signalled once");
    drop_bounded(h);
}

#[test]
fn the_kind_gives_the_devices_it_builds_their_failure_hook() {
    let config = Harness::new().config;
    let irqs = Arc::new(Interrupts::new(&config.irq_counts()));
    let ctx = DeviceContext {
        dma: Arc::new(DmaSpace::new(16)),
        irqs,
        waits: Default::default(),
        memory: Arc::new(MemoryObjects::default()),
    };
    let reports = Arc::new(Reports::default());
    let build = Build {
        failed: Some(reports.hook(true)),
        ..Build::new(ctx)
    };
    // Through the kind, as a worker builds it.
    let options = crate::SoftGpuKind::options(&config);
    let kind_config = SoftGpuKind.configure(&options).expect("configures");
    let dev = kind_config.build(build).expect("build");
    dev.faults()
        .expect("fault injection")
        .inject_fault("engine")
        .expect("inject");
    assert!(reports.first().state_intact);
    bounded("dropping the device", move || drop(dev));
}

#[test]
fn a_successor_on_failed_vram_reports_it_once_it_runs() {
    let mut h = Harness::new();
    h.init();
    let err = wire_err(&h);
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    h.gpu.inject_fault("vram").expect("inject");
    assert!(!reports.first().state_intact);
    // Parked, without a hook yet: it reports nothing (no ERR either).
    let mut next = SoftGpu::successor(h.config, h.slot_ctx()).expect("successor");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(reports.all().len(), 1);
    assert_eq!(take_eventfd(&err), None);
    h.gpu.hand_over_to(&mut next).expect("hand over");
    let old = std::mem::replace(&mut h.gpu, next);
    // Running on the same (failed) memory, the successor finds it so, through the hook.
    wait_until("the successor's report", || reports.all().len() == 2);
    assert!(!reports.all()[1].state_intact);
    assert_eq!(take_eventfd(&err), None);
    bounded("dropping the retired device", move || drop(old));
    drop_bounded(h);
}

#[test]
fn a_vram_fault_stops_a_running_command_and_the_work_behind_it_with_device_lost() {
    let mut h = Harness::with_config(gemm_room());
    h.init();
    let err = wire_err(&h);
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    h.drain_irqs();
    // Queue 1 runs a GEMM of the largest size (seconds of work), a FILL of guest memory
    // waiting behind it.
    let (m, n, k) = (1024, 1024, 1024);
    let gemm = Command::gemm(m, n, k, V(0), V(4 << 20), V(8 << 20));
    let first = h.submit(1, &[gemm, fill(G(DATA), 256, 0x0404_0404)]);
    wait_until("queue 1 to run its command", || {
        h.gpu.shared.lock().inflight.get(1).copied().flatten() == Some(first)
    });

    let failed = Instant::now();
    h.gpu.inject_fault("vram").expect("inject");
    let want = (
        ERR_DEVICE_LOST,
        first,
        slot_of(1, first),
        u32::from(crate::cmd::OP_GEMM),
    );
    assert_eq!(h.wait_error(1), want);
    assert!(
        failed.elapsed() < QUICKLY,
        "the error took {:?}",
        failed.elapsed()
    );
    assert_eq!(h.wait_irq(9), 1, "queue 1's error vector, once");
    assert_ne!(h.rd32(INT_STATUS) & int_error(1), 0);
    assert_ne!(h.rd32(DEV_STATUS) & DEV_STATUS_ERROR, 0);
    assert_eq!(h.qr(1, Q_HEAD), first, "the GEMM did not complete");
    assert_eq!(h.rd64(queue_reg(1, Q_COMPLETED_LO)), 0);
    assert_eq!(
        h.guest_read(DATA, 4),
        [0; 4],
        "the FILL behind it did not run"
    );
    assert_eq!(
        h.gpu.shared.lock().inflight.get(1).copied().flatten(),
        None,
        "nothing is left to replay"
    );
    assert_eq!(mirrored_error(&h, 1), (ERR_DEVICE_LOST, first, None));
    // The idle queue stays idle, and the pool took the failure: no ERR.
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_IDLE);
    assert_eq!(h.rd32(INT_STATUS) & int_error(0), 0);
    assert_eq!(reports.all().len(), 1);
    assert_eq!(take_eventfd(&err), None);
    drop_bounded(h);
}

#[test]
fn queues_with_pending_work_stop_with_device_lost_once_the_host_lets_them_run() {
    let mut h = Harness::new();
    h.init();
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    h.drain_irqs();
    // The host stops the engines (a migration STOP): the work waits, PAUSED.
    h.gpu.set_running(false);
    let first0 = h.submit(0, &[fill(G(DATA), 64, 1), fill(G(DATA + 64), 64, 2)]);
    let first1 = h.submit(1, &[fill(G(DATA + 128), 64, 3)]);
    for q in 0..2 {
        h.wait_engine_saw(q, "the pending work", |s| s.stopped);
        assert_eq!(h.qr(q, Q_STATUS), Q_STATUS_PAUSED);
    }

    h.gpu.inject_fault("vram").expect("inject");
    assert!(!reports.first().state_intact);
    // A stopped device changes nothing: the queues wait on.
    for q in 0..2 {
        assert_eq!(h.qr(q, Q_STATUS), Q_STATUS_PAUSED);
    }
    assert_eq!(h.irq_total(), 0);

    h.gpu.set_running(true);
    assert_eq!(
        h.wait_error(0),
        (ERR_DEVICE_LOST, first0, slot_of(0, first0), 0)
    );
    assert_eq!(
        h.wait_error(1),
        (ERR_DEVICE_LOST, first1, slot_of(1, first1), 0)
    );
    h.wait_irq(8);
    h.wait_irq(9);
    assert_eq!(
        h.rd32(INT_STATUS) & (int_error(0) | int_error(1)),
        int_error(0) | int_error(1)
    );
    for q in 0..2 {
        assert_eq!(h.rd64(queue_reg(q, Q_COMPLETED_LO)), 0);
    }
    assert_eq!(h.guest_read(DATA, 192), [0; 192], "nothing ran");
    assert_eq!(mirrored_error(&h, 0), (ERR_DEVICE_LOST, first0, None));
    assert_eq!(reports.all().len(), 1);
    drop_bounded(h);
}

#[test]
fn a_mapped_queue_on_failed_vram_asks_for_kicks_and_its_work_stops_with_device_lost() {
    use super::doorbells::{GuestPage, map_queue, submit_mapped};
    // No polling: the engine sleeps at once, asking for a kick.
    let mut h = Harness::with_config(SoftGpuConfig {
        vram_size: 4 << 20,
        queues: 2,
        spin_us: 0,
        ..SoftGpuConfig::default()
    });
    h.init();
    let reports = Arc::new(Reports::default());
    h.gpu.set_failure_hook(Some(reports.hook(true)));
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    h.gpu.inject_fault("vram").expect("inject");
    reports.first();
    h.drain_irqs();
    wait_until("the engine asks for a kick", || page.need_kick(0));
    let first = h.tails[0];
    assert!(
        submit_mapped(&mut h, &page, 0, &[fill(G(DATA), 64, 5)]),
        "kicked"
    );
    assert_eq!(
        h.wait_error(0),
        (ERR_DEVICE_LOST, first, slot_of(0, first), 0)
    );
    h.wait_irq(8);
    assert_eq!(h.guest_read(DATA, 4), [0; 4]);
    drop_bounded(h);
}

/// Two queues and VRAM for a GEMM of the largest size (seconds of work).
fn gemm_room() -> SoftGpuConfig {
    SoftGpuConfig {
        vram_size: 16 << 20,
        queues: 2,
        irq: IrqMode::Msix,
        vram_mmap: true,
        keep_vram_on_reset: false,
        spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
    }
}
