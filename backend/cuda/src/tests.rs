//! The backend's bookkeeping on the fake GPU, without a server: VRAM's GPU copy and its
//! staleness, what is declined, registrations, a lost board.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use switchyard_device::{DmaProt, DmaSpace};
use switchyard_softgpu::accel::{AccelDevice, AccelOutcome, AccelTarget, Accelerator};
use switchyard_softgpu::cmd::{Command, Operand};

use crate::device::{CHUNK, CudaAccel, CudaDevice};
use crate::fake::FakeGpu;

const VRAM: u64 = 4 << 20;

pub(crate) fn memfd(len: u64) -> File {
    let f = memfd::MemfdOptions::default()
        .create("cuda-test")
        .expect("memfd")
        .into_file();
    f.set_len(len).expect("size");
    f
}

fn open(fake: &FakeGpu) -> (Arc<dyn AccelDevice>, Arc<File>) {
    open_with(fake, VRAM, 2, &Arc::new(DmaSpace::default()))
}

/// A device of `vram_size` bytes of VRAM and `queues` queues on `fake`, for a client's `dma`.
pub(crate) fn open_with(
    fake: &FakeGpu,
    vram_size: u64,
    queues: usize,
    dma: &Arc<DmaSpace>,
) -> (Arc<dyn AccelDevice>, Arc<File>) {
    let vram = Arc::new(memfd(vram_size));
    let dev = CudaAccel::new(Arc::new(fake.clone()))
        .open(AccelTarget {
            vram: vram.clone(),
            vram_size,
            queues,
            dma: dma.clone(),
        })
        .expect("open");
    (dev, vram)
}

fn stats(dev: &Arc<dyn AccelDevice>) -> (u64, u64, u64) {
    let d = dev
        .as_any()
        .downcast_ref::<CudaDevice<FakeGpu>>()
        .expect("fake");
    let s = d.stats();
    (
        s.offloaded.load(Ordering::SeqCst),
        s.declined.load(Ordering::SeqCst),
        s.uploads.load(Ordering::SeqCst),
    )
}

pub(crate) fn read_at(f: &File, off: u64, len: usize) -> Vec<u8> {
    let mut f = f;
    let mut v = vec![0u8; len];
    f.seek(SeekFrom::Start(off)).expect("seek");
    f.read_exact(&mut v).expect("read");
    v
}

pub(crate) fn write_at(f: &File, off: u64, data: &[u8]) {
    let mut f = f;
    f.seek(SeekFrom::Start(off)).expect("seek");
    f.write_all(data).expect("write");
}

#[test]
fn vram_is_uploaded_once_per_chunk_and_again_after_a_host_write() {
    let fake = FakeGpu::new();
    let (dev, vram) = open(&fake);
    write_at(&vram, 0, &[7u8; 8192]);
    // VRAM → VRAM: the source's chunk is uploaded (stale from the start), then the copy
    // runs on the GPU copy and is written through.
    let c = Command::copy(Operand::Vram(0), Operand::Vram(CHUNK), 8192);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(
        read_at(&vram, CHUNK, 8192),
        vec![7u8; 8192],
        "written through"
    );
    let (_, _, uploads) = stats(&dev);
    assert_eq!(
        uploads, 2,
        "the source's chunk, and the destination's (the copy covers only part of it)"
    );
    // Again: nothing to upload.
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(stats(&dev).2, 2);
    // A write the device did not make (a BAR2 write): announced, the chunk is uploaded
    // again and the GPU sees it.
    write_at(&vram, 100, &[9u8; 4]);
    dev.host_wrote(100, 4);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(stats(&dev).2, 3);
    assert_eq!(read_at(&vram, CHUNK + 100, 4), vec![9u8; 4]);
}

#[test]
fn operands_whose_result_depends_on_the_cpu_paths_order_are_declined() {
    let fake = FakeGpu::new();
    let (dev, _vram) = open(&fake);
    let declined = [
        // Overlapping VRAM copy (memmove on the CPU path).
        Command::copy(Operand::Vram(0), Operand::Vram(100), 4096),
        // A FILL of a partial word, of an unaligned start, of guest memory.
        Command::fill(Operand::Vram(0), 4099, 1),
        Command::fill(Operand::Vram(2), 4096, 1),
        // A guest operand outside every registered window.
        Command::copy(Operand::Guest(0x1000), Operand::Vram(0), 4096),
        // SAXPY with partly overlapping x and y; REDUCE of nothing.
        Command::saxpy(1024, 1.0, Operand::Vram(0), Operand::Vram(64)),
        Command::reduce(0, Operand::Vram(0), Operand::Vram(4096)),
        // GEMM whose C overlaps A.
        Command::gemm(
            16,
            16,
            16,
            Operand::Vram(0),
            Operand::Vram(8192),
            Operand::Vram(512),
        ),
    ];
    for c in &declined {
        assert_eq!(dev.run(0, c), AccelOutcome::Declined, "{c:?}");
    }
    assert_eq!(stats(&dev), (0, declined.len() as u64, 0));
    assert_eq!(fake.state.batches.load(Ordering::SeqCst), 0, "nothing ran");
    // SAXPY in place (x == y) is fine: each element reads before it writes.
    let c = Command::saxpy(1024, 2.0, Operand::Vram(0), Operand::Vram(0));
    assert_eq!(dev.run(1, &c), AccelOutcome::Done);
}

#[test]
fn windows_are_registered_as_mapped_and_commands_find_them() {
    let fake = FakeGpu::new();
    let (dev, vram) = open(&fake);
    let observer = dev.dma_observer().expect("an observer");
    let guest = memfd(1 << 20);
    write_at(&guest, 4096, &[0x5au8; 4096]);
    let rw = DmaProt {
        read: true,
        write: true,
    };
    observer
        .mapping(0x10_0000, 1 << 20, rw, Some((&guest, 0)))
        .expect("mapped");
    // Read-only and fd-less windows are accepted, not registered.
    let ro = DmaProt {
        read: true,
        write: false,
    };
    observer
        .mapping(0x40_0000, 1 << 20, ro, Some((&guest, 0)))
        .expect("read-only");
    observer
        .mapping(0x80_0000, 4096, rw, None)
        .expect("fd-less");
    assert_eq!(
        fake.state.registered.load(Ordering::SeqCst),
        2,
        "VRAM and one window"
    );
    let c = Command::copy(Operand::Guest(0x10_1000), Operand::Vram(0), 4096);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(read_at(&vram, 0, 4096), vec![0x5au8; 4096]);
    let ro_copy = Command::copy(Operand::Guest(0x40_1000), Operand::Vram(0), 4096);
    assert_eq!(dev.run(0, &ro_copy), AccelOutcome::Declined);
    // Unmapped: unregistered, and a command using it is declined (the CPU path faults it).
    observer.unmapped(0x10_0000, 1 << 20);
    assert_eq!(fake.state.registered.load(Ordering::SeqCst), 1);
    assert_eq!(dev.run(0, &c), AccelOutcome::Declined);
    drop(observer);
    drop(dev);
    assert_eq!(
        fake.state.registered.load(Ordering::SeqCst),
        0,
        "VRAM too, with the device"
    );
    assert_eq!(
        fake.state.allocated.load(Ordering::SeqCst),
        0,
        "GPU memory freed"
    );
}

#[test]
fn a_sticky_error_is_latched_and_every_later_command_is_lost() {
    let fake = FakeGpu::new();
    let (dev, _vram) = open(&fake);
    let c = Command::fill(Operand::Vram(0), 4096, 3);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    fake.state.lose.store(true, Ordering::SeqCst);
    let AccelOutcome::Lost(reason) = dev.run(0, &c) else {
        panic!("not lost");
    };
    assert!(reason.contains("ILLEGAL_ADDRESS"), "{reason}");
    let batches = fake.state.batches.load(Ordering::SeqCst);
    // Declined commands too: the board is lost, nothing runs anywhere on it.
    for q in [0, 1] {
        assert_eq!(dev.run(q, &c), AccelOutcome::Lost(reason.clone()));
        assert_eq!(
            dev.run(q, &Command::fill(Operand::Vram(0), 4099, 1)),
            AccelOutcome::Lost(reason.clone())
        );
    }
    assert_eq!(
        fake.state.batches.load(Ordering::SeqCst),
        batches,
        "no batch after the loss"
    );
}

#[test]
fn a_transient_error_marks_what_the_command_touched_stale() {
    let fake = FakeGpu::new();
    let (dev, vram) = open(&fake);
    write_at(&vram, 0, &[1u8; 4096]);
    let c = Command::copy(Operand::Vram(0), Operand::Vram(CHUNK), 4096);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    let uploads = stats(&dev).2;
    fake.state.hiccup.store(true, Ordering::SeqCst);
    assert_eq!(
        dev.run(0, &c),
        AccelOutcome::Declined,
        "the CPU path runs it"
    );
    // Both chunks are uploaded again before the next use.
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(stats(&dev).2, uploads + 2);
}

#[test]
fn a_failed_upload_leaves_the_chunks_an_output_would_have_covered_stale() {
    let fake = FakeGpu::new();
    let (dev, vram) = open(&fake);
    write_at(&vram, CHUNK, &vec![5u8; CHUNK as usize]);
    // Source chunk 0 is uploaded; chunk 1, overwritten whole, is taken without one. The
    // upload fails: the command does not run (the CPU path does).
    fake.state.hiccup.store(true, Ordering::SeqCst);
    let c = Command::copy(Operand::Vram(0), Operand::Vram(CHUNK), CHUNK);
    assert_eq!(dev.run(0, &c), AccelOutcome::Declined);
    // Chunk 1 is read next: uploaded, not taken as the GPU copy's zeros.
    let c = Command::copy(Operand::Vram(CHUNK), Operand::Vram(3 * CHUNK), 4096);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(read_at(&vram, 3 * CHUNK, 4096), vec![5u8; 4096]);
}

#[test]
fn large_outputs_are_computed_and_written_back_in_pieces() {
    let fake = FakeGpu::new();
    let vram_size = 64u64 << 20;
    let vram = Arc::new(memfd(vram_size));
    let accel = CudaAccel::new(Arc::new(fake.clone()));
    let dev = accel
        .open(AccelTarget {
            vram: vram.clone(),
            vram_size,
            queues: 1,
            dma: Arc::new(DmaSpace::default()),
        })
        .expect("open");
    // 16 MiB VRAM → VRAM: one upload of the stale source (adjacent chunks in one copy),
    // then 7 pieces of 2 MiB and the last 2 MiB as two of 1 MiB, each copied and written
    // back.
    let src: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
    write_at(&vram, 0, &src);
    let before = fake.state.copies.load(Ordering::SeqCst);
    let c = Command::copy(Operand::Vram(0), Operand::Vram(32 << 20), 16 << 20);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    // Uploaded: the source; not the destination, which the copy overwrites whole.
    assert_eq!(fake.state.copies.load(Ordering::SeqCst) - before, 1 + 9 + 9);
    assert!(
        read_at(&vram, 32 << 20, 16 << 20) == src,
        "written through, all pieces"
    );
    // GEMM 1024×2048×3 (C is 8 MiB): row blocks, each written back; bit-exact here (k = 3
    // sums in the CPU path's order on the fake).
    let (m, n, k) = (1024usize, 2048usize, 3usize);
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.25 - 1.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.5 - 2.0).collect();
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    write_at(&vram, 0, &bytes(&a));
    write_at(&vram, 1 << 20, &bytes(&b));
    dev.host_wrote(0, 2 << 20);
    let gemms = fake.state.gemms.load(Ordering::SeqCst);
    let g = Command::gemm(
        m as u64,
        n as u64,
        k as u64,
        Operand::Vram(0),
        Operand::Vram(1 << 20),
        Operand::Vram(8 << 20),
    );
    assert_eq!(dev.run(0, &g), AccelOutcome::Done);
    assert_eq!(
        fake.state.gemms.load(Ordering::SeqCst) - gemms,
        8,
        "8 row blocks"
    );
    let got = read_at(&vram, 8 << 20, m * n * 4);
    for (idx, chunk) in got.chunks(4).enumerate().step_by(997) {
        let (i, j) = (idx / n, idx % n);
        let want = (0..k).fold(0f32, |acc, p| acc + a[i * k + p] * b[p * n + j]);
        let v = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        assert_eq!(v.to_bits(), want.to_bits(), "C[{i}][{j}]");
    }
}

#[test]
fn a_window_mapped_before_the_device_is_registered_when_first_used() {
    let fake = FakeGpu::new();
    let vram = Arc::new(memfd(VRAM));
    let dma = Arc::new(DmaSpace::default());
    let guest = memfd(1 << 20);
    write_at(&guest, 0, &[0x77u8; 4096]);
    let rw = DmaProt {
        read: true,
        write: true,
    };
    // Mapped while another device had the slot (a move's successor, a swap).
    dma.map(
        0x10_0000,
        1 << 20,
        rw,
        Some((guest.try_clone().expect("dup"), 0)),
    )
    .expect("map");
    let accel = CudaAccel::new(Arc::new(fake.clone()));
    let dev = accel
        .open(AccelTarget {
            vram: vram.clone(),
            vram_size: VRAM,
            queues: 1,
            dma: dma.clone(),
        })
        .expect("open");
    assert_eq!(fake.state.registered.load(Ordering::SeqCst), 1, "VRAM only");
    let c = Command::copy(Operand::Guest(0x10_0000), Operand::Vram(0), 4096);
    assert_eq!(dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(read_at(&vram, 0, 4096), vec![0x77u8; 4096]);
    assert_eq!(
        fake.state.registered.load(Ordering::SeqCst),
        2,
        "registered on first use"
    );
    // Unmapped through the table (the device's observer installed as the server does).
    dma.set_observer(dev.dma_observer());
    dma.unmap(0x10_0000, 1 << 20).expect("unmap");
    assert_eq!(fake.state.registered.load(Ordering::SeqCst), 1);
    // Nothing there any more: declined (the CPU path faults it).
    assert_eq!(dev.run(0, &c), AccelOutcome::Declined);
}

#[test]
fn staging_stays_within_the_devices_budget() {
    use crate::device::staging_budget;
    let fake = FakeGpu::new();
    let (dev, _vram) = open(&fake);
    assert_eq!(staging_budget(VRAM), 64 << 20, "at least 64 MiB");
    assert_eq!(staging_budget(1 << 30), 256 << 20, "a quarter of VRAM");
    let observer = dev.dma_observer().expect("an observer");
    let guest = memfd(160 << 20);
    let rw = DmaProt {
        read: true,
        write: true,
    };
    observer
        .mapping(0x1000_0000, 160 << 20, rw, Some((&guest, 0)))
        .expect("mapped");
    let base = fake.state.allocated.load(Ordering::SeqCst);
    // Two 16 MiB operands: 32 MiB of staging, within 64 MiB.
    let small = Command::saxpy(
        4 << 20,
        1.0,
        Operand::Guest(0x1000_0000),
        Operand::Guest(0x1000_0000 + (32 << 20)),
    );
    assert_eq!(dev.run(0, &small), AccelOutcome::Done);
    assert_eq!(fake.state.allocated.load(Ordering::SeqCst) - base, 32 << 20);
    // Two 40 MiB operands would take 128 MiB: the CPU path runs it, nothing more is taken.
    let big = Command::saxpy(
        10 << 20,
        1.0,
        Operand::Guest(0x1000_0000),
        Operand::Guest(0x1000_0000 + (64 << 20)),
    );
    assert_eq!(dev.run(1, &big), AccelOutcome::Declined);
    let taken = fake.state.allocated.load(Ordering::SeqCst) - base;
    assert!(taken <= 64 << 20, "staging {taken} bytes past the budget");
    // The first queue's buffers still serve it.
    assert_eq!(dev.run(0, &small), AccelOutcome::Done);
}

#[test]
fn an_unmap_is_not_held_up_by_a_command_stuck_on_the_gpu() {
    use std::time::Duration;
    let fake = FakeGpu::new();
    let dma = Arc::new(DmaSpace::default());
    let (dev, _vram) = open_with(&fake, VRAM, 2, &dma);
    dma.set_observer(dev.dma_observer());
    let cuda = dev
        .as_any()
        .downcast_ref::<CudaDevice<FakeGpu>>()
        .expect("fake");
    let guest = memfd(1 << 20);
    write_at(&guest, 0, &[0x33u8; 4096]);
    for iova in [0x10_0000, 0x40_0000] {
        dma.map(
            iova,
            1 << 20,
            DmaProt::READ_WRITE,
            Some((guest.try_clone().expect("dup"), 0)),
        )
        .expect("map");
    }
    let registered = || fake.state.registered.load(Ordering::SeqCst);
    assert_eq!(registered(), 3, "VRAM and both windows");
    let from = |iova: u64| Command::copy(Operand::Guest(iova), Operand::Vram(0), 4096);
    let gate = &fake.state.gate;
    let long = Duration::from_secs(30);

    // Within the unmap wait: the unmap waits for the command using the window, and the
    // window is unregistered before the unmap is answered.
    cuda.set_unmap_wait(Duration::from_secs(600));
    gate.close();
    std::thread::scope(|s| {
        let command = s.spawn(|| dev.run(0, &from(0x10_0000)));
        assert!(gate.wait_held(1, long), "the command reached the GPU");
        let unmap = s.spawn(|| {
            dma.unmap(0x10_0000, 1 << 20).expect("unmap");
            registered()
        });
        gate.open();
        assert_eq!(command.join().expect("command"), AccelOutcome::Done);
        assert_eq!(
            unmap.join().expect("unmap"),
            2,
            "unregistered before the answer"
        );
    });
    assert_eq!(cuda.stats().late_unmaps.load(Ordering::SeqCst), 0);

    // A command stuck on the GPU (a stream that does not finish): the unmap is answered
    // after the unmap wait, with the GPU still stuck; the command keeps its registration.
    cuda.set_unmap_wait(Duration::from_millis(100));
    gate.close();
    std::thread::scope(|s| {
        let command = s.spawn(|| dev.run(1, &from(0x40_0000)));
        assert!(gate.wait_held(1, long), "the command reached the GPU");
        let (answered, answer) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _ = answered.send(dma.unmap(0x40_0000, 1 << 20).map_err(|e| e.to_string()));
        });
        assert_eq!(
            answer.recv_timeout(long).expect("the unmap is answered"),
            Ok(1)
        );
        assert_eq!(gate.held(), 1, "the command is still on the GPU");
        assert_eq!(cuda.stats().late_unmaps.load(Ordering::SeqCst), 1);
        assert_eq!(registered(), 2, "held by the command");
        // No new command finds the window (the CPU path faults it).
        assert_eq!(dev.run(0, &from(0x40_0000)), AccelOutcome::Declined);
        gate.open();
        assert_eq!(command.join().expect("command"), AccelOutcome::Done);
    });
    assert_eq!(registered(), 1, "unregistered when the command ended");
    assert_eq!(cuda.registered_windows(), 0);
}
