//! The `cuda` board's VRAM across a device reset, on the fake GPU that pins pages as
//! `cuMemHostRegister` does (`switchyard_cuda::fake`): the GPU's registration of the VRAM
//! memfd and what BAR2 and a migration read must stay the same pages.
#![forbid(unsafe_code)]

mod common;

use common::cuda::Board;
use common::driver::guest;
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
