//! A host-side softgpu driver used by the integration tests, written from the register table in
//! the softgpu crate docs. It runs over any vfio-user client through [`Transport`], so the same
//! workload is exercised with our client and with the `vfio_user` crate's client.

#![allow(dead_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Duration;

use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;
use switchyard_softgpu::{BAR_REGS, BAR_VRAM};

use super::{GuestMemory, wait_for};

/// Config space region index.
pub const CONFIG: u32 = 7;

/// What the driver needs from a vfio-user client.
pub trait Transport {
    fn region_read(&mut self, region: u32, offset: u64, buf: &mut [u8]);
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]);
    fn dma_map(&mut self, iova: u64, size: u64, file: &File, offset: u64);
    fn set_msix_eventfds(&mut self, start: u32, fds: &[&File]);
}

/// Guest physical layout used by the tests: two DMA windows backed by one memfd, so transfers
/// that cross `WINDOW_SIZE` scatter across mappings.
pub const GUEST_IOVA: u64 = 0x1_0000_0000;
pub const WINDOW_SIZE: u64 = 16 << 20;
pub const GUEST_SIZE: u64 = 2 * WINDOW_SIZE;
/// Ring of queue q at `GUEST_IOVA + q * 0x10000`.
pub const RING_ENTRIES: u32 = 256;

pub fn guest(off: u64) -> Operand {
    Operand::Guest(GUEST_IOVA + off)
}

pub struct Driver<T: Transport> {
    pub t: T,
    pub mem: GuestMemory,
    tails: Vec<u32>,
    pub completion: Vec<File>,
    pub error: Vec<File>,
}

impl<T: Transport> Driver<T> {
    /// Maps guest memory, enables memory/bus master and MSI-X, wires all 16 vectors to
    /// eventfds.
    pub fn new(t: T) -> Self {
        Self::with_memory(t, GuestMemory::new(GUEST_SIZE))
    }

    /// Like [`Driver::new`] on existing guest memory (e.g. a migration destination's VMM,
    /// which keeps the guest's RAM).
    pub fn with_memory(mut t: T, mem: GuestMemory) -> Self {
        t.dma_map(GUEST_IOVA, WINDOW_SIZE, &mem.file, 0);
        t.dma_map(
            GUEST_IOVA + WINDOW_SIZE,
            WINDOW_SIZE,
            &mem.file,
            WINDOW_SIZE,
        );
        let mut d = Driver {
            t,
            mem,
            tails: vec![0; 8],
            completion: vec![],
            error: vec![],
        };
        d.wire_interrupts();
        d.enable_device();
        d
    }

    pub fn wire_interrupts(&mut self) {
        let fds: Vec<File> = (0..MSIX_VECTORS)
            .map(|_| switchyard_device::irq::new_eventfd().expect("eventfd"))
            .collect();
        let refs: Vec<&File> = fds.iter().collect();
        // Send in batches of 8 like QEMU does with max_msg_fds.
        for (i, chunk) in refs.chunks(8).enumerate() {
            self.t.set_msix_eventfds((i * 8) as u32, chunk);
        }
        let mut it = fds.into_iter();
        self.completion = it.by_ref().take(8).collect();
        self.error = it.collect();
    }

    pub fn enable_device(&mut self) {
        let cmd = self.cfg16(0x04) | 0x6;
        self.t.region_write(CONFIG, 0x04, &cmd.to_le_bytes());
        let msix = self.find_cap(0x11).expect("MSI-X capability");
        let ctl = self.cfg16(msix + 2) | 0x8000;
        self.t.region_write(CONFIG, msix + 2, &ctl.to_le_bytes());
    }

    pub fn cfg16(&mut self, off: u64) -> u16 {
        let mut b = [0u8; 2];
        self.t.region_read(CONFIG, off, &mut b);
        u16::from_le_bytes(b)
    }

    pub fn cfg32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.t.region_read(CONFIG, off, &mut b);
        u32::from_le_bytes(b)
    }

    /// Walks the capability list; returns the offset of capability `id`.
    pub fn find_cap(&mut self, id: u8) -> Option<u64> {
        let mut b = [0u8; 1];
        self.t.region_read(CONFIG, 0x34, &mut b);
        let mut p = u64::from(b[0]);
        let mut hops = 0;
        while p != 0 && hops < 48 {
            let mut h = [0u8; 2];
            self.t.region_read(CONFIG, p, &mut h);
            if h[0] == id {
                return Some(p);
            }
            p = u64::from(h[1]);
            hops += 1;
        }
        None
    }

    pub fn caps(&mut self) -> Vec<u8> {
        let mut out = vec![];
        let mut b = [0u8; 1];
        self.t.region_read(CONFIG, 0x34, &mut b);
        let mut p = u64::from(b[0]);
        while p != 0 && out.len() < 48 {
            let mut h = [0u8; 2];
            self.t.region_read(CONFIG, p, &mut h);
            out.push(h[0]);
            p = u64::from(h[1]);
        }
        out
    }

    pub fn r32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.t.region_read(BAR_REGS, off, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn r64(&mut self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.t.region_read(BAR_REGS, off, &mut b);
        u64::from_le_bytes(b)
    }

    pub fn w32(&mut self, off: u64, v: u32) {
        self.t.region_write(BAR_REGS, off, &v.to_le_bytes());
    }

    pub fn w64(&mut self, off: u64, v: u64) {
        self.t.region_write(BAR_REGS, off, &v.to_le_bytes());
    }

    pub fn ring_iova(q: u32) -> u64 {
        GUEST_IOVA + u64::from(q) * 0x10000
    }

    pub fn setup_queue(&mut self, q: u32) {
        self.w64(queue_reg(q, Q_RING_BASE_LO), Self::ring_iova(q));
        self.w32(queue_reg(q, Q_RING_SIZE), RING_ENTRIES);
        self.w32(queue_reg(q, Q_CONTROL), Q_CONTROL_ENABLE);
        self.tails[q as usize] = self.r32(queue_reg(q, Q_TAIL));
    }

    /// Writes commands into the ring (no doorbell); returns the new tail.
    pub fn enqueue(&mut self, q: u32, cmds: &[Command]) -> u32 {
        let mut tail = self.tails[q as usize];
        for c in cmds {
            let slot = u64::from(tail & (RING_ENTRIES - 1));
            let off = Self::ring_iova(q) - GUEST_IOVA + slot * 64;
            self.mem.write(off, &c.encode());
            tail = tail.wrapping_add(1);
        }
        self.tails[q as usize] = tail;
        tail
    }

    /// Writes commands into the ring and rings the doorbell once.
    pub fn submit(&mut self, q: u32, cmds: &[Command]) {
        let tail = self.enqueue(q, cmds);
        self.w32(queue_reg(q, Q_DOORBELL), tail);
    }

    /// Sets the driver's idea of queue `q`'s tail (a driver taking over a device, e.g. after
    /// a migration).
    pub fn set_tail(&mut self, q: u32, tail: u32) {
        self.tails[q as usize] = tail;
    }

    /// Puts queue `q` (set up) in mapped-doorbell mode.
    pub fn map_queue(&mut self, q: u32) {
        self.w32(queue_reg(q, Q_CONTROL), Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
    }

    /// Writes commands into the ring and publishes the tail through the doorbell page,
    /// kicking when the device asks; returns whether it kicked.
    pub fn submit_mapped(&mut self, page: &DoorbellPage, q: u32, cmds: &[Command]) -> bool {
        let tail = self.enqueue(q, cmds);
        let kick = page.publish(q, tail);
        if kick {
            self.w32(queue_reg(q, Q_DOORBELL), 0);
        }
        kick
    }

    /// Waits until the queue consumed everything or stopped on an error; returns its status.
    pub fn wait_queue(&mut self, q: u32) -> u32 {
        let tail = self.tails[q as usize];
        let r = wait_for(Duration::from_secs(60), || {
            let head = self.r32(queue_reg(q, Q_HEAD));
            let status = self.r32(queue_reg(q, Q_STATUS));
            (status == Q_STATUS_ERROR || (head == tail && status == Q_STATUS_IDLE))
                .then_some(status)
        });
        r.expect("queue did not finish")
    }

    /// Runs commands on a queue and asserts they all completed.
    pub fn run(&mut self, q: u32, cmds: &[Command]) {
        self.submit(q, cmds);
        let st = self.wait_queue(q);
        assert_eq!(
            st,
            Q_STATUS_IDLE,
            "queue {q} error code {}",
            self.r32(queue_reg(q, Q_ERROR_CODE))
        );
    }

    pub fn vram_read(&mut self, off: u64, buf: &mut [u8]) {
        for (i, chunk) in buf.chunks_mut(1 << 16).enumerate() {
            self.t.region_read(BAR_VRAM, off + (i << 16) as u64, chunk);
        }
    }

    pub fn vram_write(&mut self, off: u64, data: &[u8]) {
        for (i, chunk) in data.chunks(1 << 16).enumerate() {
            self.t.region_write(BAR_VRAM, off + (i << 16) as u64, chunk);
        }
    }

    pub fn write_f32s(&self, off: u64, v: &[f32]) {
        let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
        self.mem.write(off, &bytes);
    }

    pub fn read_f32s(&self, off: u64, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * 4];
        self.mem.read(off, &mut b);
        b.chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Waits for an eventfd to be signalled; returns the count.
pub fn wait_eventfd(f: &File, timeout: Duration) -> Option<u64> {
    wait_for(timeout, || switchyard_device::irq::take_eventfd(f))
}

/// Deterministic pseudo-random f32 data in [-1, 1).
pub fn data(seed: u32, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

// Host references of SAXPY, GEMM and REDUCE in the documented order: the in-guest driver's.
pub use sygpu_driver::reference::{gemm as gemm_ref, reduce as reduce_ref, saxpy as saxpy_ref};

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Raw fd helper.
pub fn raw(f: &File) -> i32 {
    f.as_raw_fd()
}

/// The client's mapping of BAR0's doorbell page, made from the region's sparse mmap area the
/// way a VMM maps it for the guest.
pub struct DoorbellPage(vm_memory::MmapRegion<()>);

impl DoorbellPage {
    pub fn map(client: &mut switchyard_client::Client) -> DoorbellPage {
        let info = client.region_info(BAR_REGS).expect("BAR0 info");
        let areas = info.sparse_areas.expect("BAR0 has sparse mmap areas");
        assert_eq!(areas.len(), 1);
        let (offset, size) = (areas[0].offset, areas[0].size);
        assert_eq!((offset, size), (DOORBELL_PAGE, DOORBELL_PAGE_SIZE));
        let file = info.fd.expect("BAR0's descriptor");
        let region = vm_memory::MmapRegion::<()>::from_file(
            vm_memory::FileOffset::new(file, info.info.offset + offset),
            size as usize,
        )
        .expect("map the doorbell page");
        DoorbellPage(region)
    }

    fn word(q: u32, reg: u64) -> usize {
        (u64::from(q) * DB_STRIDE + reg) as usize
    }

    /// Queue `q`'s `DB_TAIL` as the page holds it.
    pub fn tail(&self, q: u32) -> u32 {
        use vm_memory::{Bytes, VolatileMemory};
        self.0
            .as_volatile_slice()
            .load::<u32>(Self::word(q, DB_TAIL), std::sync::atomic::Ordering::SeqCst)
            .expect("load DB_TAIL")
    }

    /// The driver's protocol: tail store, full fence, `DB_NEED_KICK` read.
    pub fn publish(&self, q: u32, tail: u32) -> bool {
        use std::sync::atomic::{Ordering, fence};
        use vm_memory::{Bytes, VolatileMemory};
        let page = self.0.as_volatile_slice();
        fence(Ordering::Release);
        page.store(tail, Self::word(q, DB_TAIL), Ordering::SeqCst)
            .expect("store DB_TAIL");
        fence(Ordering::SeqCst);
        page.load::<u32>(Self::word(q, DB_NEED_KICK), Ordering::SeqCst)
            .expect("load DB_NEED_KICK")
            != 0
    }
}
