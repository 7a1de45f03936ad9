//! The `cuda` board on the fake GPU (`switchyard_cuda::fake`): its VRAM across a device reset
//! (the fake pins pages as `cuMemHostRegister` does: the GPU's registration of the VRAM memfd
//! and what BAR2 and a migration read must stay the same pages), and its device replaced by
//! a successor (a worker's move between boards of one spec, `serve`'s swap soak) still running
//! its commands on the GPU. The last two run `switchyard` processes on `gpu=fake`, which only a
//! build with the `fake-gpu` feature has (`scripts/test.sh` builds it).
#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use common::ServerProcess;
use common::cuda::{Board, Ran, reduce_ran};
use common::driver::{Driver, guest};
use common::ours::Ours;
use common::supervised::{connect, endpoint_of, supervisor};
use switchyard_daemon::MoveOutcome;
use switchyard_kinds::DeviceSpec;
use switchyard_softgpu::cmd::{Command, Operand};

#[test]
fn after_a_reset_the_gpu_and_bar2_still_share_vram() {
    let board = Board::start(None);
    let mut d = board.connect();
    d.setup_queue(0);
    // VRAM registered with the GPU (its pages pinned) and used there.
    d.vram_write(0, &[0x11; 4096]);
    d.run(
        0,
        &[Command::copy(
            Operand::Vram(0),
            Operand::Vram(0x1_0000),
            4096,
        )],
    );
    let offloaded = board.accel().0;
    assert_eq!(offloaded, 1, "on the GPU");

    // The driver resets the device (it does at every probe): VRAM reads as zeros.
    d.t.0.device_reset().expect("reset");
    d.enable_device();
    d.setup_queue(0);
    let mut got = vec![0xffu8; 4096];
    d.vram_read(0x1_0000, &mut got);
    assert!(got.iter().all(|&b| b == 0), "VRAM zeroed by the reset");

    // What BAR2 writes the GPU reads, and what the GPU writes BAR2 reads.
    d.vram_write(0x2000, &[0x22; 4096]);
    d.run(
        0,
        &[
            Command::copy(Operand::Vram(0x2000), Operand::Vram(0x2_0000), 4096),
            Command::copy(Operand::Vram(0x1_0000), guest(0x10_0000), 4096),
        ],
    );
    assert_eq!(board.accel().0, offloaded + 2, "both on the GPU");
    d.vram_read(0x2_0000, &mut got);
    assert!(
        got.iter().all(|&b| b == 0x22),
        "the GPU's copy reaches the memfd: {:02x?}",
        &got[..8]
    );
    let mut out = vec![0xffu8; 4096];
    d.mem.read(0x10_0000, &mut out);
    assert!(
        out.iter().all(|&b| b == 0),
        "the GPU reads the zeroed VRAM, not the pages it held before the reset: {:02x?}",
        &out[..8]
    );
}

/// A move between two boards of one spec (two partitions of a GPU, two boards of the same
/// options: the move carries no target spec) leaves the device on the GPU: the worker has its
/// own kind make the successor its own, as a move between specs has the target's. Before, the
/// successor ran every command on the CPU from then on.
#[test]
fn a_cuda_device_moved_between_boards_of_one_spec_runs_on_its_gpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = supervisor();
    let spec = DeviceSpec::parse("cuda,gpu=fake,vram=16M,queues=2").expect("spec");
    let socket = endpoint_of(&sup, dir.path(), "ep", spec);
    let mut d = Driver::new(Ours(connect(&socket)));
    d.setup_queue(0);
    assert_eq!(reduce_ran(&mut d, 0), Ran::Gpu, "before the moves");
    for (i, to) in ["p1", "p0"].into_iter().enumerate() {
        match sup.move_device("ep", to, false, Duration::from_secs(30)) {
            Ok(MoveOutcome::Moved(_)) => {}
            other => panic!("move {i} to {to}: {other:?}"),
        }
        assert_eq!(reduce_ran(&mut d, i as u64 + 1), Ran::Gpu, "after move {i}");
    }
}

/// `serve --swap-every-ms` on a `cuda` device: each successor is made a device of the served
/// spec, so the commands keep running on the GPU across the swaps (before, on the CPU from the
/// first swap on).
#[test]
fn a_cuda_device_swapped_by_the_swap_soak_runs_on_its_gpu() {
    let server =
        ServerProcess::start_with(&["--device", "cuda,gpu=fake,vram=16M", "--swap-every-ms", "5"]);
    let client = switchyard_client::Client::connect(&server.socket).expect("connect");
    let mut d = Driver::new(Ours(client));
    d.setup_queue(0);
    let swaps = |s: &ServerProcess| s.log_text().matches("device swapped").count();
    for seed in 0..3 {
        let before = swaps(&server);
        common::wait_until("two more swaps", Duration::from_secs(20), || {
            swaps(&server) >= before + 2
        });
        assert_eq!(
            reduce_ran(&mut d, seed),
            Ran::Gpu,
            "after {} swaps",
            swaps(&server)
        );
    }
}
