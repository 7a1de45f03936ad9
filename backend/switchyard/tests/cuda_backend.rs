//! The `cuda` board's execution backend on the fake GPU (CI has no GPU; the same tests run
//! against a real one in `scripts/gpu-check.sh`, see `cuda_gpu.rs`): a client drives the
//! softgpu's registers over vfio-user while its commands run on the accelerator. Checked:
//! every command's result against the CPU backend's (bit-exact, or within the documented
//! tolerance for GEMM and REDUCE), the GPU copy of VRAM kept coherent with the memfd both
//! ways, guest windows registered on map and unregistered on unmap and disconnect, a
//! transient GPU error falling back to the CPU path, and a lost GPU latching
//! `ERR_DEVICE_LOST` or, with a failover handling it, reporting the board failed with its
//! state intact.
#![forbid(unsafe_code)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::cuda::Board;
use common::driver::{Driver, GUEST_IOVA, WINDOW_SIZE, bits, data, guest, wait_eventfd};
use common::ours::Ours;
use switchyard_client::Client;
use switchyard_cuda::device::CudaAccel;
use switchyard_cuda::fake::FakeGpu;
use switchyard_server::{Server, ServerConfig};
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};

fn saxpy_ref(a: f32, x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(&x, &y)| y + a * x).collect()
}

/// The CPU backend's GEMM: k ascending, no fused multiply-add.
fn gemm_ref(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for p in 0..k {
                acc += a[i * k + p] * b[p * n + j];
            }
            c[i * n + j] = acc;
        }
    }
    c
}

/// The documented tolerance of GEMM and REDUCE on a GPU (another summation order, fused
/// multiply-adds): `|got − cpu| ≤ 2·terms·2⁻²³·Σ|products|`, the standard bound of a sum of
/// `terms` rounded products in any order, computed for each element.
fn within(got: f32, cpu: f32, terms: usize, abs_sum: f64) -> bool {
    let bound = 2.0 * terms as f64 * f64::from(f32::EPSILON) * abs_sum;
    (f64::from(got) - f64::from(cpu)).abs() <= bound
}

#[test]
fn commands_run_on_the_gpu_with_the_cpu_backends_results() {
    let board = Board::start(None);
    results_match_the_cpu_backend(&board);
    let st = &board.fake.state;
    assert_eq!(
        st.registrations.load(Ordering::SeqCst),
        3,
        "two windows and VRAM, each once"
    );
    assert!(
        st.kernels.load(Ordering::SeqCst) >= 3,
        "SAXPY and REDUCE ran as kernels: {st:?} {:?}",
        board.accel()
    );
    assert_eq!(
        st.gemms.load(Ordering::SeqCst),
        2,
        "both GEMMs ran on the GPU"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU (SY_GPU=UUID|ordinal): scripts/gpu-check.sh runs it"]
fn gpu_commands_have_the_cpu_backends_results() {
    let board = Board::start_real(64 << 20);
    results_match_the_cpu_backend(&board);
}

#[test]
#[ignore = "needs an NVIDIA GPU (SY_GPU=UUID|ordinal): scripts/gpu-check.sh runs it"]
fn gpu_gemm_4096_matches_the_cpu_backend_within_the_tolerance() {
    let board = Board::start_real(256 << 20);
    let mut d = Driver::with_memory(
        Ours(Client::connect(&board.socket).expect("connect")),
        common::GuestMemory::new(2 * WINDOW_SIZE),
    );
    d.setup_queue(0);
    let n = 4096usize;
    let bytes = (n * n * 4) as u64;
    let (a, b) = (data(11, n * n), data(12, n * n));
    // Through VRAM, 8 MiB of guest memory at a time (the guest windows are 16 MiB).
    for (i, (src, at)) in [(&a, 0u64), (&b, bytes)].into_iter().enumerate() {
        for (c, chunk) in src.chunks(2 << 20).enumerate() {
            d.write_f32s(0x20_0000, chunk);
            let off = at + (c as u64) * (8 << 20);
            d.run(
                0,
                &[Command::copy(
                    guest(0x20_0000),
                    Operand::Vram(off),
                    (chunk.len() * 4) as u64,
                )],
            );
        }
        eprintln!("operand {i} in VRAM");
    }
    let t = std::time::Instant::now();
    d.run(
        0,
        &[Command::gemm(
            n as u64,
            n as u64,
            n as u64,
            Operand::Vram(0),
            Operand::Vram(bytes),
            Operand::Vram(2 * bytes),
        )],
    );
    eprintln!("GEMM 4096 submitted to completion: {:?}", t.elapsed());
    // Rows 0, 1777 and 4095 against the CPU's arithmetic, through the BAR (the memfd).
    for row in [0usize, 1777, 4095] {
        let mut raw = vec![0u8; n * 4];
        d.vram_read(2 * bytes + (row * n * 4) as u64, &mut raw);
        let got: Vec<f32> = raw
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for j in (0..n).step_by(97) {
            let mut acc = 0f32;
            let mut abs = 0f64;
            for p in 0..n {
                let prod = a[row * n + p] * b[p * n + j];
                acc += prod;
                abs += f64::from(prod.abs());
            }
            assert!(
                within(got[j], acc, n, abs),
                "C[{row}][{j}] = {} vs {acc}",
                got[j]
            );
        }
    }
    let (offloaded, _, _) = board.accel();
    assert!(offloaded >= 1);
}

#[test]
#[ignore = "needs an NVIDIA GPU (SY_GPU=UUID|ordinal): scripts/gpu-check.sh runs it"]
fn gpu_windows_are_registered_on_map_and_unregistered_on_unmap() {
    let board = Board::start_real(64 << 20);
    {
        let mut d = board.connect();
        assert_eq!(board.accel().2, 2);
        let extra = common::GuestMemory::new(1 << 20);
        let iova = GUEST_IOVA + (1 << 30);
        let rw = switchyard_proto::consts::VFIO_USER_F_DMA_REGION_READ
            | switchyard_proto::consts::VFIO_USER_F_DMA_REGION_WRITE;
        d.t.0
            .dma_map(
                iova,
                1 << 20,
                rw,
                Some((std::os::fd::AsFd::as_fd(&extra.file), 0)),
            )
            .expect("map");
        assert_eq!(board.accel().2, 3);
        d.setup_queue(0);
        extra.write(0, &[0x42; 4096]);
        d.run(
            0,
            &[Command::copy(Operand::Guest(iova), Operand::Vram(0), 4096)],
        );
        d.t.0.dma_unmap(iova, 1 << 20, 0).expect("unmap");
        assert_eq!(board.accel().2, 2);
        let mut v = [0u8; 4096];
        d.vram_read(0, &mut v);
        assert!(v.iter().all(|&b| b == 0x42));
    }
}

/// The workload of the CPU backend's tests, checked against its results: bit-exact, or
/// within the documented tolerance (GEMM, REDUCE).
fn results_match_the_cpu_backend(board: &Board) {
    let mut d = board.connect();
    common::workload::check_identity(&mut d);
    // Both guest windows and VRAM are registered.
    assert_eq!(
        board.accel().2,
        2,
        "the client's two windows are registered"
    );
    assert_eq!(
        d.r64(MAX_GEMM_WORK_LO),
        1 << 36,
        "every GEMM of MAX_GEMM_DIM"
    );
    d.setup_queue(0);
    d.setup_queue(1);

    // COPY guest -> VRAM -> guest (inside one window: on the GPU).
    let len = 1u64 << 20;
    let pattern: Vec<u8> = (0..len as usize).map(|i| (i * 7 + i / 251) as u8).collect();
    d.mem.write(0x10_0000, &pattern);
    d.run(
        0,
        &[
            Command::copy(guest(0x10_0000), Operand::Vram(0x1000), len),
            Command::copy(Operand::Vram(0x1000), guest(0x30_0000), len),
        ],
    );
    let mut out = vec![0u8; len as usize];
    d.mem.read(0x30_0000, &mut out);
    assert!(out == pattern, "guest -> VRAM -> guest through the GPU");
    // Written through: the memfd (what BAR2 reads) has what the GPU copy has.
    let mut vram = vec![0u8; 4096];
    d.vram_read(0x1000 + 12345, &mut vram);
    assert_eq!(
        &vram[..],
        &pattern[12345..12345 + 4096],
        "VRAM through the BAR"
    );

    // A trapped BAR2 write makes the GPU copy stale: the next command sees the new bytes.
    d.vram_write(0x1000 + 8192, &[0xee; 100]);
    d.run(
        0,
        &[Command::copy(Operand::Vram(0x1000), guest(0x30_0000), len)],
    );
    d.mem.read(0x30_0000, &mut out);
    let mut expect = pattern.clone();
    expect[8192..8292].fill(0xee);
    assert!(out == expect, "a BAR2 write reaches the GPU's copy");

    // FILL in VRAM (whole words: the GPU) and of a partial word (the CPU path), then read.
    d.run(
        1,
        &[
            Command::fill(Operand::Vram(0x20_0000), 4096, 0xa1b2_c3d4),
            Command::fill(Operand::Vram(0x21_0000), 4099, 0x0102_0304),
        ],
    );
    let mut f = vec![0u8; 4096];
    d.vram_read(0x20_0000, &mut f);
    assert!(
        f.chunks(4).all(|c| c == [0xd4, 0xc3, 0xb2, 0xa1]),
        "VRAM fill"
    );
    d.vram_read(0x21_0000 + 4096, &mut f[..4]);
    assert_eq!(&f[..4], &[4, 3, 2, 0], "the partial word's fill");

    // SAXPY in guest memory and in VRAM: bit-exact (no fused multiply-add on either).
    let n = 10_000;
    let (x, y) = (data(1, n), data(2, n));
    let a = 1.75f32;
    d.write_f32s(0x40_0000, &x);
    d.write_f32s(0x41_0000, &y);
    d.run(
        0,
        &[Command::saxpy(
            n as u64,
            a,
            guest(0x40_0000),
            guest(0x41_0000),
        )],
    );
    assert_eq!(
        bits(&d.read_f32s(0x41_0000, n)),
        bits(&saxpy_ref(a, &x, &y)),
        "SAXPY"
    );
    d.write_f32s(0x41_0000, &y);
    let bytes = (n * 4) as u64;
    d.run(
        0,
        &[
            Command::copy(guest(0x40_0000), Operand::Vram(0x40_0000), bytes),
            Command::copy(guest(0x41_0000), Operand::Vram(0x50_0000), bytes),
            Command::saxpy(
                n as u64,
                a,
                Operand::Vram(0x40_0000),
                Operand::Vram(0x50_0000),
            ),
            Command::copy(Operand::Vram(0x50_0000), guest(0x42_0000), bytes),
        ],
    );
    assert_eq!(
        bits(&d.read_f32s(0x42_0000, n)),
        bits(&saxpy_ref(a, &x, &y)),
        "VRAM SAXPY"
    );

    // GEMM (guest and VRAM operands) and REDUCE within the tolerance.
    let (m, nn, k) = (48usize, 40usize, 33usize);
    let (ga, gb) = (data(3, m * k), data(4, k * nn));
    d.write_f32s(0x50_0000, &ga);
    d.write_f32s(0x51_0000, &gb);
    d.run(
        1,
        &[Command::gemm(
            m as u64,
            nn as u64,
            k as u64,
            guest(0x50_0000),
            guest(0x51_0000),
            guest(0x52_0000),
        )],
    );
    let cpu = gemm_ref(m, nn, k, &ga, &gb);
    let check_gemm = |got: &[f32], what: &str| {
        for i in 0..m {
            for j in 0..nn {
                let abs: f64 = (0..k)
                    .map(|p| f64::from((ga[i * k + p] * gb[p * nn + j]).abs()))
                    .sum();
                assert!(
                    within(got[i * nn + j], cpu[i * nn + j], k, abs),
                    "{what} [{i}][{j}]"
                );
            }
        }
    };
    check_gemm(&d.read_f32s(0x52_0000, m * nn), "GEMM");
    d.run(
        1,
        &[
            Command::copy(
                guest(0x50_0000),
                Operand::Vram(0x100_0000),
                (m * k * 4) as u64,
            ),
            Command::copy(
                guest(0x51_0000),
                Operand::Vram(0x110_0000),
                (k * nn * 4) as u64,
            ),
            Command::gemm(
                m as u64,
                nn as u64,
                k as u64,
                Operand::Vram(0x100_0000),
                Operand::Vram(0x110_0000),
                Operand::Vram(0x120_0000),
            ),
            Command::copy(
                Operand::Vram(0x120_0000),
                guest(0x53_0000),
                (m * nn * 4) as u64,
            ),
        ],
    );
    check_gemm(&d.read_f32s(0x53_0000, m * nn), "VRAM GEMM");
    let r = data(5, 100_000);
    d.write_f32s(0x60_0000, &r);
    d.run(
        0,
        &[Command::reduce(
            r.len() as u64,
            guest(0x60_0000),
            guest(0x70_0000),
        )],
    );
    let cpu_sum: f32 = r.iter().fold(0.0, |acc, v| acc + v);
    let abs: f64 = r.iter().map(|v| f64::from(v.abs())).sum();
    let got = d.read_f32s(0x70_0000, 1)[0];
    assert!(
        within(got, cpu_sum, r.len(), abs),
        "REDUCE {got} vs {cpu_sum}"
    );

    let (offloaded, declined, _) = board.accel();
    assert_eq!(offloaded, 15, "every other command ran on the GPU");
    assert_eq!(declined, 1, "only the partial-word FILL ran on the CPU");
}

#[test]
fn a_copy_across_windows_and_a_transient_error_run_on_the_cpu_path() {
    let board = Board::start(None);
    let mut d = board.connect();
    d.setup_queue(0);
    // 1 MiB straddling the two windows: no single registration holds it.
    let len = 1u64 << 20;
    let src = WINDOW_SIZE - len / 2;
    let pattern: Vec<u8> = (0..len as usize).map(|i| (i * 13) as u8).collect();
    d.mem.write(src, &pattern);
    d.run(
        0,
        &[
            Command::copy(guest(src), Operand::Vram(0), len),
            Command::copy(Operand::Vram(0), guest(0x20_0000), len),
        ],
    );
    let mut out = vec![0u8; len as usize];
    d.mem.read(0x20_0000, &mut out);
    assert!(out == pattern);
    assert_eq!(board.accel().1, 1, "the straddling copy was declined");
    // A GPU out of memory once: the CPU path computes it, the same result.
    let n = 4096;
    let (x, y) = (data(7, n), data(8, n));
    d.write_f32s(0x40_0000, &x);
    d.write_f32s(0x41_0000, &y);
    board.fake.state.hiccup.store(true, Ordering::SeqCst);
    d.run(
        0,
        &[Command::saxpy(
            n as u64,
            3.0,
            guest(0x40_0000),
            guest(0x41_0000),
        )],
    );
    assert_eq!(
        bits(&d.read_f32s(0x41_0000, n)),
        bits(&saxpy_ref(3.0, &x, &y))
    );
    assert_eq!(board.accel().1, 2, "declined after the transient error");
    // The GPU's copy of VRAM is not trusted after the failed batch: read back right.
    d.run(0, &[Command::copy(Operand::Vram(0), guest(0x30_0000), len)]);
    d.mem.read(0x30_0000, &mut out);
    assert!(out == pattern);
}

#[test]
fn windows_are_registered_on_map_and_unregistered_on_unmap_and_disconnect() {
    let board = Board::start(None);
    let registered = || board.fake.state.registered.load(Ordering::SeqCst);
    {
        let mut d = board.connect();
        assert_eq!((board.accel().2, registered()), (2, 3));
        // One more window, then its unmap.
        let extra = common::GuestMemory::new(1 << 20);
        let iova = GUEST_IOVA + (1 << 30);
        d.t.0
            .dma_map(
                iova,
                1 << 20,
                switchyard_proto::consts::VFIO_USER_F_DMA_REGION_READ
                    | switchyard_proto::consts::VFIO_USER_F_DMA_REGION_WRITE,
                Some((std::os::fd::AsFd::as_fd(&extra.file), 0)),
            )
            .expect("map");
        assert_eq!((board.accel().2, registered()), (3, 4));
        d.t.0.dma_unmap(iova, 1 << 20, 0).expect("unmap");
        assert_eq!(
            (board.accel().2, registered()),
            (2, 3),
            "unregistered before the unmap is answered"
        );
        // A read-only window is not registered (the CPU path reads it) but serves.
        d.t.0
            .dma_map(
                iova,
                1 << 20,
                switchyard_proto::consts::VFIO_USER_F_DMA_REGION_READ,
                Some((std::os::fd::AsFd::as_fd(&extra.file), 0)),
            )
            .expect("map read-only");
        assert_eq!(board.accel().2, 2);
        extra.write(0, &[0x42; 4096]);
        d.setup_queue(0);
        d.run(
            0,
            &[Command::copy(Operand::Guest(iova), Operand::Vram(0), 4096)],
        );
        let mut v = [0u8; 4096];
        d.vram_read(0, &mut v);
        assert!(v.iter().all(|&b| b == 0x42));
    }
    // The client left: its windows are gone, VRAM's registration stays.
    let gone = common::wait_for(Duration::from_secs(10), || {
        (registered() == 1).then_some(())
    });
    assert!(
        gone.is_some(),
        "registrations after the client left: {}",
        registered()
    );
}

#[test]
fn a_lost_gpu_latches_device_lost_on_every_queue_when_nobody_fails_it_over() {
    let board = Board::start(None);
    let mut d = board.connect();
    d.setup_queue(0);
    d.setup_queue(1);
    for f in &d.error {
        switchyard_device::irq::take_eventfd(f);
    }
    board.fake.state.lose.store(true, Ordering::SeqCst);
    let n = 1024;
    d.write_f32s(0x40_0000, &data(1, n));
    d.submit(
        0,
        &[Command::saxpy(
            n as u64,
            2.0,
            guest(0x40_0000),
            guest(0x41_0000),
        )],
    );
    assert_eq!(d.wait_queue(0), Q_STATUS_ERROR);
    assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_DEVICE_LOST);
    // Sticky: the other queue's next command fails the same way, never a wrong result.
    d.submit(1, &[Command::fill(Operand::Vram(0), 4096, 7)]);
    assert_eq!(d.wait_queue(1), Q_STATUS_ERROR);
    assert_eq!(d.r32(queue_reg(1, Q_ERROR_CODE)), ERR_DEVICE_LOST);
    // The queue's error interrupt told the driver at once (no timeout to wait out).
    assert!(
        wait_eventfd(&d.error[0], Duration::from_secs(10)).is_some(),
        "queue 0's error vector"
    );
    let lost = board
        .slot
        .with_as(|g: &mut SoftGpu| g.accelerator().map(|a| format!("{a:?}")))
        .flatten()
        .unwrap_or_default();
    assert!(
        lost.contains("ILLEGAL_ADDRESS"),
        "the device knows why: {lost}"
    );
}

#[test]
fn a_lost_gpu_is_reported_as_a_board_failure_with_its_state_intact() {
    let (tx, rx) = mpsc::channel();
    let board = Board::start(Some(tx));
    let mut d = board.connect();
    d.setup_queue(0);
    d.run(0, &[Command::fill(Operand::Vram(0), 8192, 0x1234_5678)]);
    board.fake.state.lose.store(true, Ordering::SeqCst);
    d.submit(0, &[Command::fill(Operand::Vram(0x1_0000), 4096, 9)]);
    let failure = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the board failure is reported");
    assert!(failure.state_intact, "{failure:?}");
    assert!(
        failure.reason.contains("accelerator was lost"),
        "{failure:?}"
    );
    assert!(failure.reason.contains("ILLEGAL_ADDRESS"), "{failure:?}");
    // Failed over: the command stays in flight (a replacement runs it), nothing is latched.
    // The engine reported from inside the command; it then lets go of it (no longer busy)
    // and stops. A snapshot quiesces the engines at a command boundary: it waits for that.
    board
        .slot
        .with_as(|g: &mut SoftGpu| g.snapshot())
        .expect("the slot holds a softgpu");
    assert_ne!(d.r32(queue_reg(0, Q_STATUS)), Q_STATUS_ERROR);
    assert_ne!(d.r32(queue_reg(0, Q_HEAD)), 2, "not completed");
    // What completed before is in the memfd (what a replacement continues from).
    let mut v = [0u8; 8];
    d.vram_read(4096, &mut v);
    assert_eq!(v, [0x78, 0x56, 0x34, 0x12, 0x78, 0x56, 0x34, 0x12]);
}

/// A pool with two `cuda` partitions of one GPU and a softgpu board. Without a GPU (CI), the
/// partitions are taken out of service at start with the reason, the daemon serves the
/// rest, and `serve --device cuda` refuses with the reason: nothing crashes.
#[test]
fn without_a_gpu_cuda_boards_are_out_of_service_with_the_reason() {
    let toml = "[[boards]]\nid = \"h0\"\nmodel = \"cuda\"\ngpu = \"GPU-00000000-0000-0000-0000-000000000000\"\nvram = \"256M\"\nqueues = 4\npartitions = [\n  { id = \"h0.p0\", vram = \"128M\", queues = 2 },\n  { id = \"h0.p1\", vram = \"128M\", queues = 2 },\n]\n\
[[boards]]\nid = \"s0\"\n\
[[pools]]\nname = \"gpu\"\nboards = [\"h0\"]\n\
[[pools]]\nname = \"cpu\"\nboards = [\"s0\"]\n";
    let mut d = common::daemon::Daemon::new().with_config(toml);
    d.launch();
    let boards = d.ctl_ok(&["boards", "--json"]);
    let boards: serde_json::Value = serde_json::from_str(&boards).expect("json");
    let h0 = boards
        .as_array()
        .and_then(|b| b.iter().find(|b| b["id"] == "h0"))
        .cloned()
        .unwrap_or_else(|| panic!("h0 in {boards}"));
    assert_eq!(h0["state"], "quarantined", "{h0}");
    let log = d.log();
    // No driver (CI), or a driver with no such GPU.
    assert!(
        log.contains("board quarantined")
            && (log.contains("no NVIDIA GPU can be listed")
                || log.contains("no GPU `GPU-00000000-0000-0000-0000-000000000000`")),
        "the reason is logged:\n{log}"
    );
    let out = d.ctl(&["create", "vm1", "--pool", "gpu"]);
    assert!(!out.status.success(), "no device in the GPU pool");
    d.ctl_ok(&["create", "vm2", "--pool", "cpu"]);
    let served = std::process::Command::new(common::daemon::EXE)
        .args(["serve", "--socket"])
        .arg(d.dir().join("x.sock"))
        .args(["--device", "cuda,gpu=0"])
        .output()
        .expect("serve");
    let err = String::from_utf8_lossy(&served.stderr);
    assert_eq!(served.status.code(), Some(1), "{err}");
    assert!(err.contains("GPU `0` is not usable"), "{err}");
}

/// A pool on a real GPU (`scripts/gpu-check.sh`, with `SWITCHYARD_BIN` the carried
/// binary): two partitions of one `cuda` board serving two guests side by side, each
/// seeing only its own VRAM; and a failover between two `cuda` boards of the GPU, the
/// guest's VRAM and jobs intact.
#[test]
#[ignore = "needs an NVIDIA GPU (SY_GPU=UUID|ordinal): scripts/gpu-check.sh runs it"]
fn gpu_pool_partitions_serve_side_by_side_and_fail_over() {
    use common::daemon::{Daemon, connect, socket_of};
    let gpu = std::env::var("SY_GPU").unwrap_or_else(|_| "0".into());
    let toml = format!(
        "[[boards]]\nid = \"h0\"\nmodel = \"cuda\"\ngpu = \"{gpu}\"\nvram = \"512M\"\nqueues = 4\npartitions = [\n  {{ id = \"h0.p0\", vram = \"256M\", queues = 2 }},\n  {{ id = \"h0.p1\", vram = \"256M\", queues = 2 }},\n]\n\
[[boards]]\nid = \"f0\"\nmodel = \"cuda\"\ngpu = \"{gpu}\"\nvram = \"128M\"\n\
[[boards]]\nid = \"f1\"\nmodel = \"cuda\"\ngpu = \"{gpu}\"\nvram = \"128M\"\n\
[[pools]]\nname = \"parts\"\nboards = [\"h0\"]\n\
[[pools]]\nname = \"fo\"\nboards = [\"f0\", \"f1\"]\nfailover = \"transparent\"\n\
[[boards]]\nid = \"c0\"\nmodel = \"cuda\"\ngpu = \"{gpu}\"\nvram = \"128M\"\n\
[[boards]]\nid = \"s0\"\nvram = \"128M\"\nvram_mmap = false\n\
[[pools]]\nname = \"mix\"\nboards = [\"c0\", \"s0\"]\n"
    );
    let mut d = Daemon::new().with_config(&toml).with_args(&["--faults"]);
    d.launch();
    eprintln!("{}", d.ctl_ok(&["boards"]));
    d.ctl_ok(&["create", "vm1", "--pool", "parts"]);
    d.ctl_ok(&["create", "vm2", "--pool", "parts"]);
    let mut g1 = connect(&socket_of(&d.endpoint("vm1")));
    let mut g2 = connect(&socket_of(&d.endpoint("vm2")));
    for g in [&mut g1, &mut g2] {
        g.setup_queue(0);
        g.setup_queue(1);
    }
    g1.run(0, &[Command::fill(Operand::Vram(0), 1 << 20, 0x1111_1111)]);
    g2.run(0, &[Command::fill(Operand::Vram(0), 1 << 20, 0x2222_2222)]);
    let t1 = thread::spawn(move || {
        for round in 0..200 {
            common::workload::fill_copy_round(&mut g1, round, round as u32 % 2);
        }
        g1
    });
    for round in 0..200 {
        common::workload::fill_copy_round(&mut g2, round, round as u32 % 2);
    }
    let mut g1 = t1.join().expect("vm1's jobs");
    let (mut a, mut b) = ([0u8; 4], [0u8; 4]);
    g1.vram_read(4096, &mut a);
    g2.vram_read(4096, &mut b);
    assert_eq!(
        (a, b),
        ([0x11; 4], [0x22; 4]),
        "each partition has its own VRAM"
    );
    // Failover between two boards of the GPU.
    d.ctl_ok(&["create", "vm3", "--pool", "fo"]);
    let mut g3 = connect(&socket_of(&d.endpoint("vm3")));
    g3.setup_queue(0);
    let kept: Vec<u8> = (0..4u32 << 20).map(|i| (i * 29 + 3) as u8).collect();
    g3.vram_write(0x80_0000, &kept);
    let before = d.endpoint("vm3")["lease"]["board"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    d.ctl_ok(&["fault", &before, "engine"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let e = d.endpoint("vm3");
        let now = e["lease"]["board"].as_str().unwrap_or_default().to_owned();
        if now != before && e.get("failover").is_none_or(|f| f.get("pending").is_none()) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no failover: {e}");
        thread::sleep(Duration::from_millis(50));
    }
    for round in 0..50 {
        common::workload::fill_copy_round(&mut g3, round, 0);
    }
    let mut back = vec![0u8; kept.len()];
    g3.vram_read(0x80_0000, &mut back);
    assert!(back == kept, "VRAM intact across the failover");
    // Moves between the GPU board and a CPU board of the same device, and back.
    d.ctl_ok(&["create", "vm4", "--pool", "mix"]);
    let mut g4 = connect(&socket_of(&d.endpoint("vm4")));
    g4.setup_queue(0);
    g4.vram_write(0x80_0000, &kept);
    let first = d.endpoint("vm4")["lease"]["board"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let other = if first == "c0" { "s0" } else { "c0" };
    for (i, to) in [other, first.as_str(), other].into_iter().enumerate() {
        let r = d
            .client()
            .post("/v1/endpoints/vm4/move", &serde_json::json!({ "to": to }))
            .unwrap_or_else(|e| panic!("move {i} to {to}: {e}"));
        eprintln!("move {i} to {to}: {}", r.body);
        assert_eq!(d.endpoint("vm4")["lease"]["board"], to);
        for round in 0..20 {
            common::workload::fill_copy_round(&mut g4, round, 0);
        }
        g4.vram_read(0x80_0000, &mut back);
        assert!(back == kept, "VRAM intact after move {i} to {to}");
    }
}

/// A move from the CPU to a (fake) GPU and back, by the worker's move sequence
/// (`move_in_slot`, the successor given the target's accelerator or none), under a client
/// whose jobs keep their results: VRAM and the queues move, and the commands run where the
/// device now is.
#[test]
fn a_device_moves_from_the_cpu_to_a_gpu_and_back_under_its_client() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let config = SoftGpuConfig {
        vram_mmap: false,
        ..SoftGpuConfig::default()
    };
    let mut server = Server::new(ServerConfig::new(&socket), move |ctx| {
        SoftGpu::new(config, ctx)
    })
    .expect("server");
    let slot = server.device_slot();
    let stop = server.stop_handle();
    let thread = thread::spawn(move || server.run().expect("run"));
    let mut d = Driver::new(Ours(Client::connect(&socket).expect("connect")));
    d.setup_queue(0);
    let kept: Vec<u8> = (0..4u32 << 20).map(|i| (i * 7 + 1) as u8).collect();
    d.vram_write(0x40_0000, &kept);
    let n = 8192;
    let (x, y) = (data(21, n), data(22, n));
    let fake = FakeGpu::new();
    let accel = CudaAccel::new(Arc::new(fake.clone()));
    let mut expect_y = y.clone();
    d.write_f32s(0x41_0000, &y);
    for (step, to_gpu) in [(0, true), (1, false), (2, true)] {
        let moving = slot.begin_move().expect("move guard");
        let report = switchyard_daemon::worker::move_in_slot(
            &slot,
            &moving,
            false,
            |next| {
                if to_gpu {
                    next.as_any_mut()
                        .downcast_mut::<SoftGpu>()
                        .expect("a softgpu")
                        .set_accelerator(&accel)
                        .map_err(|e| switchyard_daemon::worker::MoveError::Target(Box::new(e)))?;
                }
                Ok(())
            },
            |_| Ok(()),
        )
        .expect("moved");
        drop(moving);
        let on_gpu = slot
            .with_as(|g: &mut SoftGpu| g.accelerator().is_some())
            .expect("softgpu");
        assert_eq!(on_gpu, to_gpu, "step {step}: {report:?}");
        // The device as it was, and its commands where it now runs.
        let mut back = vec![0u8; kept.len()];
        d.vram_read(0x40_0000, &mut back);
        assert!(back == kept, "step {step}: VRAM moved");
        let batches = fake.state.batches.load(Ordering::SeqCst);
        d.write_f32s(0x40_0000, &x);
        d.run(
            0,
            &[Command::saxpy(
                n as u64,
                0.5,
                guest(0x40_0000),
                guest(0x41_0000),
            )],
        );
        expect_y = saxpy_ref(0.5, &x, &expect_y);
        assert_eq!(
            bits(&d.read_f32s(0x41_0000, n)),
            bits(&expect_y),
            "step {step}"
        );
        let ran_on_gpu = fake.state.batches.load(Ordering::SeqCst) > batches;
        assert_eq!(ran_on_gpu, to_gpu, "step {step}: where the SAXPY ran");
    }
    // The windows the client mapped before the GPU came were registered when first used.
    assert_eq!(
        fake.state.registered.load(Ordering::SeqCst),
        2,
        "VRAM and the window used"
    );
    stop.stop();
    let _ = thread.join();
}
