//! Mirroring into a black box and recovering in a new device (a new process, in the real
//! kill test) after the one that served the device died.

use std::io::BufRead;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use switchyard_device::blackbox::{BlackBox, BlackBoxError};
use switchyard_device::irq::take_eventfd;

use super::*;
use crate::cmd::{self, Operand};
use crate::{QueueRecovery, Recovery, SoftGpuError, StateError};

fn g(a: u64) -> Operand {
    Operand::Guest(a)
}

fn v(a: u64) -> Operand {
    Operand::Vram(a)
}

/// Everything a driver can read: every BAR0 register, the config space, the MSI-X table and
/// PBA (MSI-X mode).
fn visible(h: &mut Harness) -> Vec<(u32, u64, u32)> {
    let mut out = vec![];
    for off in (0..0x100).step_by(4) {
        out.push((BAR_REGS, off, h.rd32(off)));
    }
    for q in 0..h.config.queues {
        for r in (0..QUEUE_STRIDE).step_by(4) {
            let off = queue_reg(q, r);
            out.push((BAR_REGS, off, h.rd32(off)));
        }
    }
    for off in (0..4096).step_by(4) {
        out.push((crate::CONFIG_REGION_INDEX, off, h.cfg_read(off, 4)));
    }
    if h.config.irq == IrqMode::Msix {
        for off in (0..0x100).chain(0x800..0x808).step_by(4) {
            let mut b = [0u8; 4];
            h.gpu.region_read(BAR_MSIX, off, &mut b).expect("BAR4 read");
            out.push((BAR_MSIX, off, u32::from_le_bytes(b)));
        }
    }
    out
}

/// A DMA window: IOVA, size, protection, the guest's memfd.
type GuestWindow = (u64, u64, DmaProt, File);

fn dup(f: &File) -> File {
    f.try_clone().expect("dup")
}

/// The guest's windows of `h`, for a new device on the same guest memory.
fn windows_of(h: &Harness) -> Vec<GuestWindow> {
    h.windows
        .iter()
        .map(|w| {
            let prot = if w.iova == RO {
                DmaProt::READ_ONLY
            } else {
                DmaProt::READ_WRITE
            };
            (w.iova, w.size, prot, dup(&w.file))
        })
        .collect()
}

/// A new device recovered from `bb` (opened again, as a new process would) and `vram`, on the
/// guest memory `windows`, with new eventfds.
fn recover(
    config: SoftGpuConfig,
    bb: &Arc<BlackBox>,
    vram: File,
    windows: Vec<GuestWindow>,
) -> (Harness, Recovery) {
    recover_with(config, bb, vram, None, windows)
}

/// [`recover`] with the dead device's doorbell page.
fn recover_with(
    config: SoftGpuConfig,
    bb: &Arc<BlackBox>,
    vram: File,
    doorbells: Option<File>,
    windows: Vec<GuestWindow>,
) -> (Harness, Recovery) {
    let bb = BlackBox::open(dup(bb.file())).expect("reopen the black box");
    let mut recovery = None;
    let mut h = Harness::build(config, windows, |ctx| {
        let (gpu, r) = SoftGpu::recover(config, ctx, &bb, vram, doorbells).expect("recover");
        recovery = Some(r);
        gpu
    });
    h.bb = Some(bb);
    (h, recovery.expect("recovered"))
}

/// The old device "dies": its threads stay where they are, it never publishes again.
fn die(h: Harness) -> (Arc<BlackBox>, File, Vec<GuestWindow>) {
    let bb = h.bb.clone().expect("a mirrored device");
    let vram = h.gpu.vram_memfd().expect("VRAM memfd");
    let windows = windows_of(&h);
    std::mem::forget(h.gpu);
    (bb, vram, windows)
}

fn vram_all(f: &File, size: u64) -> Vec<u8> {
    let mut b = vec![0u8; size as usize];
    f.read_exact_at(&mut b, 0).expect("read VRAM");
    b
}

fn saxpy_ref(a: f32, x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(x, y)| a * x + y).collect()
}

/// A workload on both queues: fills, copies through VRAM, SAXPY, fences with interrupts.
fn workload(h: &mut Harness, round: u64) {
    let n = 1024u64;
    let x = floats(round, n as usize);
    let y = floats(round + 100, n as usize);
    h.guest_write(DATA, &f32_bytes(&x));
    h.guest_write(DATA + 0x1_0000, &f32_bytes(&y));
    let fence0 = DATA + 0x8_0000;
    h.run(
        0,
        &[
            Command::copy(g(DATA), v(0x1000), n * 4),
            Command::copy(g(DATA + 0x1_0000), v(0x2000), n * 4),
            Command::saxpy(n, 1.5, v(0x1000), v(0x2000)).with_irq(),
            Command::copy(v(0x2000), g(DATA + 0x2_0000), n * 4),
            Command::fence(g(fence0), 100 + round, Some(4)).with_irq(),
        ],
    );
    h.wait_source(4);
    assert_eq!(
        bytes_f32(&h.guest_read(DATA + 0x2_0000, n as usize * 4)),
        saxpy_ref(1.5, &x, &y)
    );
    h.run(
        1,
        &[
            Command::fill(g(DATA + 0x3_0000), 4096, 0x5a5a_0000 | round as u32),
            Command::fill(v(0x10_0000), 8192, 0xdead_beef),
            Command::fence(g(fence0 + 8), 200 + round, Some(2)).with_irq(),
        ],
    );
    h.wait_source(2);
}

/// After a workload the device dies; a new one recovered from the black box and the VRAM
/// memfd reads exactly the same everywhere, and its rings carry on.
#[test]
fn a_recovered_device_is_the_device_that_died() {
    for irq in [IrqMode::Msix, IrqMode::Msi] {
        let mut h = Harness::with_irq(irq);
        let config = h.config;
        h.init();
        h.wr32(SCRATCH, 0x1234_5678);
        h.wr32(INT_MASK, 0x8000_0000);
        if irq == IrqMode::Msix {
            // The client drives the MSI-X table: vector 6 masked, the rest unmasked, so a
            // FENCE to vector 6 leaves it pending in the PBA (cold state).
            for vec in 0..16 {
                h.msix_entry_write(vec, 0, 0xfee0_0000);
                h.msix_entry_write(vec, 2, 0x40 + vec);
                h.msix_entry_write(vec, 3, u32::from(vec == 6));
            }
        }
        workload(&mut h, 1);
        workload(&mut h, 2);
        h.run(
            1,
            &[Command::fence(g(DATA + 0x8_0010), 7, Some(6)).with_irq()],
        );
        let fences = h.rd64(FENCE_COUNT_LO);
        assert_eq!(fences, 5);
        let before = visible(&mut h);
        let vram_before = vram_all(h.gpu.vram_file(), config.vram_size);
        h.drain_irqs();

        let (bb, vram, windows) = die(h);
        let (mut r, recovery) = recover(config, &bb, vram, windows);
        assert_eq!(
            recovery.queues,
            vec![QueueRecovery::Idle; 2],
            "{irq}: nothing was in flight"
        );
        assert_eq!(visible(&mut r), before, "{irq}: registers and config space");
        assert_eq!(
            vram_all(r.gpu.vram_file(), config.vram_size),
            vram_before,
            "{irq}: VRAM"
        );
        if irq == IrqMode::Msix {
            assert!(r.gpu.shared.lock().st.msix.pending(6), "the PBA survived");
        }
        // Only interrupts the dead device may not have sent are sent again, once each.
        assert_eq!(
            u64::from(recovery.resent.count_ones()),
            r.irq_total(),
            "{irq}"
        );

        // The rings carry on: results, counters and interrupts continue from where they were.
        workload(&mut r, 3);
        assert_eq!(r.rd64(FENCE_COUNT_LO), fences + 2, "{irq}");
        assert_eq!(r.rd32(INT_STATUS) & int_completion(0), int_completion(0));
        assert_eq!(r.rd32(SCRATCH), 0x1234_5678);
        assert_eq!(r.qr(0, Q_COMPLETED_LO), 15);
        if irq == IrqMode::Msix {
            // Unmasking vector 6 on the recovered device delivers what went pending before.
            r.drain_irqs();
            r.msix_entry_write(6, 3, 0);
            assert_eq!(r.irq_count(6), 1, "the pending vector is delivered");
        }
        // And the recovered device mirrors too: it can be recovered in turn.
        let before = visible(&mut r);
        let (bb, vram, windows) = die(r);
        let (mut again, _) = recover(config, &bb, vram, windows);
        assert_eq!(visible(&mut again), before, "{irq}: a second restart");
    }
}

/// Mirroring follows a swap: the successor publishes into the old device's black box.
#[test]
fn a_swap_hands_the_black_box_over() {
    let mut h = Harness::new();
    h.init();
    workload(&mut h, 1);
    let config = h.config;
    let mut next = SoftGpu::successor(config, h.slot_ctx()).expect("successor");
    h.gpu.hand_over_to(&mut next).expect("hand over");
    let old = std::mem::replace(&mut h.gpu, next);
    drop(old);
    workload(&mut h, 2);
    let before = visible(&mut h);
    let (bb, vram, windows) = die(h);
    let (mut r, _) = recover(config, &bb, vram, windows);
    assert_eq!(visible(&mut r), before);
    assert_eq!(r.rd64(FENCE_COUNT_LO), 4);
}

#[test]
fn black_boxes_and_vram_of_other_devices_are_refused() {
    let mut h = Harness::new();
    let config = h.config;
    h.init();
    workload(&mut h, 1);
    let bb = h.bb.clone().expect("mirrored");
    let vram = || h.gpu.vram_memfd().expect("VRAM");
    let refused = |config: SoftGpuConfig, bb: &Arc<BlackBox>, vram: File| -> SoftGpuError {
        match SoftGpu::recover(config, h.ctx(), bb, vram, None) {
            Err(e) => e,
            Ok(_) => panic!("recovered with {config:?}"),
        }
    };
    // Another configuration.
    let one_queue = SoftGpuConfig {
        queues: 1,
        ..config
    };
    let e = refused(one_queue, &bb, vram());
    assert!(
        matches!(
            e,
            SoftGpuError::State(StateError::ConfigMismatch {
                saved_queues: 2,
                queues: 1,
                ..
            })
        ),
        "{e:?}"
    );
    let msi = SoftGpuConfig {
        irq: IrqMode::Msi,
        ..config
    };
    let e = refused(msi, &bb, vram());
    assert!(
        matches!(e, SoftGpuError::State(StateError::IrqModeMismatch { .. })),
        "{e:?}"
    );
    let bigger = SoftGpuConfig {
        vram_size: 8 << 20,
        ..config
    };
    let e = refused(bigger, &bb, SoftGpu::create_vram(&bigger).expect("vram"));
    assert!(
        matches!(e, SoftGpuError::State(StateError::ConfigMismatch { .. })),
        "{e:?}"
    );
    // VRAM that is not the device's, or not sealed.
    let other = SoftGpu::create_vram(&config).expect("vram");
    let e = refused(config, &bb, other);
    assert!(matches!(e, SoftGpuError::VramMismatch { .. }), "{e:?}");
    let e = refused(config, &bb, memfd(config.vram_size));
    assert!(matches!(e, SoftGpuError::VramNotSealed(_)), "{e:?}");
    // A black box nothing was published into, and one too small for this device.
    let empty = BlackBox::create(&SoftGpu::black_box_records(&config)).expect("bb");
    let e = refused(config, &empty, vram());
    assert!(matches!(e, SoftGpuError::NothingToRecover), "{e:?}");
    let small = BlackBox::create(&SoftGpu::black_box_records(&one_queue)).expect("bb");
    let e = refused(config, &small, vram());
    assert!(
        matches!(e, SoftGpuError::BlackBox(BlackBoxError::Layout(_))),
        "{e:?}"
    );
    // A new device does not take over a black box that holds a state.
    let e = SoftGpu::with_black_box(config, h.ctx(), &bb, None).expect_err("in use");
    assert!(matches!(e, SoftGpuError::BlackBoxInUse), "{e:?}");
    // The positive control: the right black box and VRAM recover.
    SoftGpu::recover(config, h.ctx(), &bb, vram(), None).expect("recovers");
}

/// The process dies after it published a completion but before it sent the interrupt: the
/// recovered device sends it.
#[test]
fn an_interrupt_the_dead_process_did_not_send_is_sent() {
    let mut h = Harness::new();
    let config = h.config;
    h.init();
    h.gpu
        .shared
        .hook
        .mute
        .store(true, std::sync::atomic::Ordering::SeqCst);
    h.run(0, &[Command::fence(g(DATA), 9, Some(7)).with_irq()]);
    assert_eq!(h.rd32(INT_STATUS), int_completion(0));
    assert_eq!(h.irq_total(), 0, "the dead process sent nothing");
    let (bb, vram, windows) = die(h);
    let (r, recovery) = recover(config, &bb, vram, windows);
    assert_eq!(recovery.resent, 1 << 7);
    assert_eq!(r.irq_count(7), 1, "sent by the recovered device");
    assert_eq!(r.irq_total(), 0, "and nothing else");
}

/// The process dies between publishing the cold record and the hot one: the cold record,
/// a whole state, wins over the older hot one.
#[test]
fn a_cold_record_newer_than_the_hot_one_is_a_whole_state() {
    let mut h = Harness::new();
    let config = h.config;
    h.init();
    workload(&mut h, 1);
    h.wr32(SCRATCH, 1);
    let mut state = h.gpu.snapshot();
    // `die` leaves the engine threads running (a test cannot kill its own process): parked
    // here, none of them publishes a hot record after the cold one below, as none would
    // after a real death. (Unparked, an engine's late flush of the workload named the new
    // cold generation under load and won.)
    let parked = h.gpu.engine_control().park();
    let (bb, vram, windows) = die(h);
    std::mem::forget(parked);
    // What a flush publishing both would have written first.
    state.scratch = 2;
    let cold = crate::mirror::Cold {
        inflight: vec![None; state.queues.len()],
        state,
        owed: 0,
    };
    bb.record(crate::COLD_RECORD)
        .expect("record")
        .publish(&serde_json::to_vec(&cold).expect("encode"))
        .expect("publish");
    let (mut r, _) = recover(config, &bb, vram, windows);
    assert_eq!(r.rd32(SCRATCH), 2);
    assert_eq!(r.rd64(FENCE_COUNT_LO), 2);
}

/// What recovery plans for a queue's command in flight, by where and what it is.
#[test]
fn commands_in_flight_are_replayed_or_interrupted() {
    let h = Harness::new();
    let remote = 0x1000_0000;
    h.dma
        .map(remote, 0x1000, DmaProt::READ_WRITE, None)
        .expect("a window without fd");
    let mut st = h.gpu.snapshot();
    st.queues[0].ring_size = RING_ENTRIES;
    st.queues[0].ring_base = Harness::ring(0);
    st.queues[0].head = 5;
    st.queues[0].tail = 6;
    let plan = |st: &crate::SoftGpuState, c: Option<Command>| {
        if let Some(c) = c {
            h.guest_write(Harness::ring(0) + 5 * COMMAND_SIZE as u64, &c.encode());
        }
        crate::recover::plan_replays(st, &[Some(5), None], &h.dma).map_err(|e| e.to_string())
    };
    let copy = Command::copy(g(DATA), g(DATA + 0x1000), 0x1000);
    let saxpy = Command::saxpy(16, 2.0, g(DATA), g(DATA + 0x1000));
    assert_eq!(
        plan(&st, Some(copy)),
        Ok(vec![
            QueueRecovery::Replayed { index: 5 },
            QueueRecovery::Idle
        ])
    );
    assert_eq!(
        plan(&st, Some(saxpy)),
        Ok(vec![
            QueueRecovery::Interrupted {
                index: 5,
                opcode: Some(cmd::OP_SAXPY)
            },
            QueueRecovery::Idle
        ])
    );
    // A ring that cannot be read: the engine faults on it again, as usual.
    let mut unmapped = st.clone();
    unmapped.queues[0].ring_base = HOLE;
    assert_eq!(
        plan(&unmapped, None),
        Ok(vec![
            QueueRecovery::Replayed { index: 5 },
            QueueRecovery::Idle
        ])
    );
    // A ring that only the client can read is not read.
    let mut far = st.clone();
    far.queues[0].ring_base = remote;
    assert_eq!(
        plan(&far, None),
        Ok(vec![
            QueueRecovery::Interrupted {
                index: 5,
                opcode: None
            },
            QueueRecovery::Idle
        ])
    );
    // A marker that is not at the head contradicts the state.
    let mut moved = st.clone();
    moved.queues[0].head = 6;
    assert!(plan(&moved, None).is_err());
}

#[test]
fn replayability_follows_operand_overlap() {
    use crate::recover::replayable;
    let r = |c: Command| replayable(&c);
    assert!(r(Command::nop()));
    assert!(r(Command::fill(g(0x1000), 4096, 1)));
    assert!(r(Command::fence(g(0x1000), 1, Some(1))));
    assert!(r(Command::copy(g(0x1000), g(0x2000), 0x1000)));
    assert!(!r(Command::copy(g(0x1000), g(0x1800), 0x1000)));
    assert!(
        r(Command::copy(g(0x1000), v(0x1000), 0x1000)),
        "another space"
    );
    assert!(!r(Command::copy(v(0x1000), v(0x1fff), 0x1000)));
    assert!(!r(Command::saxpy(16, 2.0, g(0x1000), g(0x2000))));
    assert!(
        r(Command::saxpy(0, 2.0, g(0x1000), g(0x1000))),
        "nothing to do"
    );
    assert!(r(Command::gemm(4, 4, 4, v(0), v(64), v(128))));
    assert!(
        !r(Command::gemm(4, 4, 4, v(0), v(64), v(120))),
        "C overlaps B"
    );
    assert!(r(Command::reduce(16, g(0x1000), g(0x1040))));
    assert!(!r(Command::reduce(16, g(0x1000), g(0x103c))));
    let mut bad = Command::saxpy(16, 2.0, g(0x1000), g(0x2000));
    bad.reserved = 1;
    assert!(r(bad), "a command refused before it writes anything");
}

// ---- a real kill of the process serving the device, mid-command ----

const SAXPY_N: u64 = 2 * 65536;
const X: u64 = RAM0 + 0x1_0000;
const Y: u64 = RAM0 + 0x9_0000;
const COPY_LEN: u64 = 0x14_0000;
const SRC: u64 = RAM0 + 0x11_0000;
const DST: u64 = RAM1 + 0x6_0000;
const FENCES: u64 = RAM1 + 0x1f_0000;

fn kill_config() -> SoftGpuConfig {
    SoftGpuConfig {
        vram_size: 4 << 20,
        queues: 2,
        irq: IrqMode::Msix,
        vram_mmap: true,
        keep_vram_on_reset: false,
        spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
    }
}

fn kill_windows(files: [File; 3]) -> Vec<GuestWindow> {
    let [ram0, ram1, ro] = files;
    vec![
        (RAM0, RAM_SIZE, DmaProt::READ_WRITE, ram0),
        (RAM1, RAM_SIZE, DmaProt::READ_WRITE, ram1),
        (RO, RO_SIZE, DmaProt::READ_ONLY, ro),
    ]
}

/// The child side of `a_device_killed_mid_command_resumes_in_a_new_process`: serves the
/// device on the parent's black box, VRAM and guest memory, runs a first workload, then
/// parks both engines in the middle of a command and waits to be killed.
#[test]
#[ignore = "child process of a_device_killed_mid_command_resumes_in_a_new_process"]
fn killed_device_child() {
    let Ok(paths) = std::env::var("SOFTGPU_KILL_PATHS") else {
        return;
    };
    let open = |p: &str| {
        File::options()
            .read(true)
            .write(true)
            .open(p)
            .expect("open the parent's memfd")
    };
    let paths: Vec<&str> = paths.split(',').collect();
    let [bb, vram, ram0, ram1, ro] = paths[..] else {
        panic!("five paths");
    };
    let bb = BlackBox::open(open(bb)).expect("black box");
    let config = kill_config();
    let vram = open(vram);
    let windows = kill_windows([open(ram0), open(ram1), open(ro)]);
    let mut h = Harness::build(config, windows, |ctx| {
        SoftGpu::with_black_box(config, ctx, &bb, Some(vram)).expect("device")
    });
    h.init();
    // A first workload that completes.
    h.run(
        1,
        &[
            Command::fill(v(0), 4096, 0x0101_0101),
            Command::fence(g(FENCES), 1, Some(3)).with_irq(),
        ],
    );
    // Each engine parks at its second checkpoint: after the first chunk of its command.
    h.gpu.shared.hook.park_at(0, 2);
    h.gpu.shared.hook.park_at(1, 2);
    h.submit(
        0,
        &[
            Command::saxpy(SAXPY_N, 2.0, g(X), g(Y)).with_irq(),
            Command::fence(g(FENCES + 8), 2, Some(5)).with_irq(),
        ],
    );
    h.submit(
        1,
        &[
            Command::copy(g(SRC), g(DST), COPY_LEN).with_irq(),
            Command::fence(g(FENCES + 16), 3, Some(3)).with_irq(),
        ],
    );
    h.gpu.shared.hook.wait_parked(0b11);
    println!("parked");
    loop {
        std::thread::park();
    }
}

/// The process serving the device is SIGKILLed while queue 0 runs an in-place SAXPY and
/// queue 1 a COPY, both half done. A device recovered in this process from the black box and
/// the VRAM memfd re-runs the COPY (correct result, its FENCE counted once, its interrupts
/// sent) and stops queue 0 with ERR_INTERRUPTED on the SAXPY; the driver recovers the queue
/// and the commands after it run.
#[test]
fn a_device_killed_mid_command_resumes_in_a_new_process() {
    let config = kill_config();
    let bb = BlackBox::create(&SoftGpu::black_box_records(&config)).expect("black box");
    let vram = SoftGpu::create_vram(&config).expect("VRAM");
    let ram = [memfd(RAM_SIZE), memfd(RAM_SIZE), memfd(RO_SIZE)];
    let x = floats(1, SAXPY_N as usize);
    let y = floats(2, SAXPY_N as usize);
    let src: Vec<u8> = (0..COPY_LEN).map(|i| (i * 7 % 251) as u8).collect();
    ram[0].write_all_at(&f32_bytes(&x), X - RAM0).expect("x");
    ram[0].write_all_at(&f32_bytes(&y), Y - RAM0).expect("y");
    // SRC spans both RAM windows.
    let split = (RAM1 - SRC) as usize;
    ram[0].write_all_at(&src[..split], SRC - RAM0).expect("src");
    ram[1].write_all_at(&src[split..], 0).expect("src");

    let me = std::process::id();
    let path = |f: &File| format!("/proc/{me}/fd/{}", f.as_raw_fd());
    let paths = [bb.file(), &vram, &ram[0], &ram[1], &ram[2]]
        .map(path)
        .join(",");
    let exe = std::env::current_exe().expect("test binary");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "tests::recovery::killed_device_child",
            "--include-ignored",
            "--nocapture",
        ])
        .env("SOFTGPU_KILL_PATHS", paths)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn the child");
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    while !line.contains("parked") {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("read") > 0,
            "the child exited early"
        );
    }
    // Both commands are half done: the positive control for what recovery must repair.
    let read = |f: &File, off: u64, len: u64| {
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off).expect("pread");
        b
    };
    let mib = 1 << 20;
    assert_eq!(read(&ram[1], DST - RAM1, mib), src[..mib as usize]);
    assert!(
        read(&ram[1], DST - RAM1 + mib, COPY_LEN - mib)
            .iter()
            .all(|&b| b == 0)
    );
    let y_now = bytes_f32(&read(&ram[0], Y - RAM0, SAXPY_N * 4));
    let half = (SAXPY_N / 2) as usize;
    assert_eq!(y_now[..half], saxpy_ref(2.0, &x[..half], &y[..half]));
    assert_eq!(y_now[half..], y[half..]);

    child.kill().expect("SIGKILL");
    child.wait().expect("reap");

    let (mut h, recovery) = recover(config, &bb, vram, kill_windows(ram));
    assert_eq!(
        recovery.queues,
        vec![
            QueueRecovery::Interrupted {
                index: 0,
                opcode: Some(cmd::OP_SAXPY)
            },
            QueueRecovery::Replayed { index: 2 },
        ]
    );
    h.tails = vec![2, 4];
    // Queue 1: the COPY ran again, then its FENCE; each counted once.
    h.wait_idle(1);
    assert_eq!(h.guest_read(DST, COPY_LEN as usize), src);
    assert_eq!(h.guest_read(FENCES + 16, 8), 3u64.to_le_bytes());
    assert_eq!(h.qr(1, Q_COMPLETED_LO), 4);
    assert!(h.wait_irq(1) >= 1, "the COPY's completion interrupt");
    assert!(h.wait_irq(3) >= 1, "the FENCE's interrupt");
    // Queue 0: stopped on the SAXPY, with the error interrupt; nothing after it ran.
    let slot = Harness::ring(0);
    assert_eq!(
        h.wait_error(0),
        (ERR_INTERRUPTED, 0, slot, u32::from(cmd::OP_SAXPY))
    );
    assert!(h.wait_irq(8) >= 1, "queue 0's error interrupt");
    assert_ne!(h.rd32(INT_STATUS) & int_error(0), 0);
    assert_eq!(h.qr(0, Q_HEAD), 0);
    assert_eq!(
        h.guest_read(FENCES + 8, 8),
        [0; 8],
        "the FENCE after it did not run"
    );
    assert_eq!(h.rd64(FENCE_COUNT_LO), 2, "the first FENCE and queue 1's");
    // The driver recovers the queue: the commands after the SAXPY run.
    h.recover(0);
    h.wait_idle(0);
    assert_eq!(h.guest_read(FENCES + 8, 8), 2u64.to_le_bytes());
    assert_eq!(h.rd64(FENCE_COUNT_LO), 3);
    assert!(h.wait_irq(5) >= 1);
    // It redoes the SAXPY from fresh inputs, with a correct result.
    h.guest_write(Y, &f32_bytes(&y));
    h.run(0, &[Command::saxpy(SAXPY_N, 2.0, g(X), g(Y))]);
    assert_eq!(
        bytes_f32(&h.guest_read(Y, SAXPY_N as usize * 4)),
        saxpy_ref(2.0, &x, &y)
    );
    assert_eq!(take_eventfd(&h.msix[8]).unwrap_or(0), 0, "no further error");
}

/// A mapped queue whose engine slept when its process died: the tail the guest stored
/// afterwards (its kick lost with the process) is in the page the replacement is handed, and
/// runs; handed no page, the replacement makes one holding the last published tail.
#[test]
fn a_replacement_takes_the_tails_the_guest_left_in_the_page() {
    use super::doorbells::GuestPage;
    let config = SoftGpuConfig {
        spin_us: 0,
        ..kill_config()
    };
    let fence = |v: u64| Command::fence(Operand::Guest(RAM1), v, None);
    let read_fence =
        |h: &Harness| u64::from_le_bytes(h.guest_read(RAM1, 8).try_into().expect("8 bytes"));
    for keep_page in [true, false] {
        let mut h = Harness::with_config(config);
        h.init();
        let page = GuestPage::map(&h.gpu);
        h.qw(0, Q_CONTROL, Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
        h.enqueue(0, &[fence(1)]);
        page.publish(0, h.tails[0]);
        h.qw(0, Q_DOORBELL, 0);
        h.wait_idle(0);
        wait_until("the engine sleeps", || page.need_kick(0));
        h.enqueue(0, &[fence(2)]);
        let tail = h.tails[0];
        assert!(page.publish(0, tail));
        let doorbells = h.gpu.doorbell_memfd().expect("page");
        let (bb, vram, windows) = die(h);
        let (mut r, _) = recover_with(config, &bb, vram, keep_page.then_some(doorbells), windows);
        let page = GuestPage::map(&r.gpu);
        if keep_page {
            r.tails[0] = tail;
            r.wait_idle(0);
            assert_eq!(read_fence(&r), 2, "the tail left in the page ran");
        } else {
            assert_eq!(
                page.tail(0),
                tail - 1,
                "a new page holds the published tail"
            );
            assert_eq!(read_fence(&r), 1);
            assert_eq!(r.qr(0, Q_CONTROL), Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
        }
    }
}
