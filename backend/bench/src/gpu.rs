//! A minimal softgpu driver for the benchmarks: guest memory is a memfd the client maps into
//! the server with DMA_MAP and into this process with `mmap` (through vm-memory, so no unsafe
//! code here); rings and fence slots live in its first MiB, bulk data after it.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_proto::consts::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_CONFIG_REGION_INDEX,
    VFIO_PCI_MSIX_IRQ_INDEX, VFIO_USER_F_DMA_REGION_READ, VFIO_USER_F_DMA_REGION_WRITE,
};
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

/// IOVA of guest memory.
pub const GUEST_IOVA: u64 = 0x1_0000_0000;
/// Rings, fence slots: the first MiB of guest memory.
pub const CONTROL_SIZE: u64 = 1 << 20;
/// Entries per ring.
pub const RING_ENTRIES: u32 = 256;
/// Queues the benchmark uses (the softgpu's default and what [`crate::servers`] starts).
pub const QUEUES: u32 = 2;

fn ring_offset(q: u32) -> u64 {
    u64::from(q) * 0x1_0000
}

/// Offset of queue `q`'s fence slot in guest memory.
pub fn fence_offset(q: u32) -> u64 {
    0x8_0000 + u64::from(q) * 64
}

/// Offset of the bulk data area in guest memory.
pub const DATA_OFFSET: u64 = CONTROL_SIZE;

/// The driver state.
#[derive(Debug)]
pub struct Gpu {
    /// The client connected to the softgpu server.
    pub client: Client,
    _memfd: File,
    mem: MmapRegion<()>,
    tails: [u32; QUEUES as usize],
    /// The eventfd wired to MSI-X vector 0.
    pub irq: File,
    /// BAR0's doorbell page, once mapped ([`Gpu::map_doorbells`]).
    doorbells: Option<MmapRegion<()>>,
}

impl Gpu {
    /// Maps `data_size` bytes of guest data (plus the control MiB), enables memory space, bus
    /// mastering and MSI-X, wires MSI-X vector 0 to an eventfd and enables every queue. Guest
    /// memory is a memfd sealed against shrinking, as QEMU's `memory-backend-memfd` makes it
    /// (the server accesses it directly).
    pub fn setup(client: Client, data_size: u64) -> Result<Gpu> {
        Self::setup_with(client, data_size, true)
    }

    /// [`Gpu::setup`] with guest memory `sealed` or not (an unsealed memfd may shrink under
    /// the server, which then accesses it through its fault-safe path).
    pub fn setup_with(mut client: Client, data_size: u64, sealed: bool) -> Result<Gpu> {
        let size = CONTROL_SIZE + data_size;
        let mfd = memfd::MemfdOptions::default()
            .allow_sealing(sealed)
            .create("bench-guest")
            .context("memfd")?;
        mfd.as_file().set_len(size).context("size guest memory")?;
        if sealed {
            mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow])
                .context("seal guest memory")?;
        }
        let memfd = mfd.into_file();
        let mem = MmapRegion::<()>::from_file(
            FileOffset::new(memfd.try_clone().context("dup memfd")?, 0),
            usize::try_from(size)?,
        )
        .context("mmap guest memory")?;
        client
            .dma_map(
                GUEST_IOVA,
                size,
                VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE,
                Some((memfd.as_fd(), 0)),
            )
            .context("DMA_MAP")?;

        let irq = File::from(rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC,
        )?);
        client
            .set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD,
                0,
                1,
                &[irq.as_fd()],
            )
            .context("SET_IRQS")?;

        let mut gpu = Gpu {
            client,
            _memfd: memfd,
            mem,
            tails: [0; QUEUES as usize],
            irq,
            doorbells: None,
        };
        // PCI command: memory space + bus master.
        let cmd = gpu.cfg16(0x04)? | 0x6;
        gpu.cfg_write16(0x04, cmd)?;
        let msix = gpu.find_cap(0x11)?.context("no MSI-X capability")?;
        let ctl = gpu.cfg16(msix + 2)? | 0x8000;
        gpu.cfg_write16(msix + 2, ctl)?;

        for q in 0..QUEUES {
            gpu.w32(
                queue_reg(q, Q_RING_BASE_LO),
                (GUEST_IOVA + ring_offset(q)) as u32,
            )?;
            gpu.w32(
                queue_reg(q, Q_RING_BASE_HI),
                ((GUEST_IOVA + ring_offset(q)) >> 32) as u32,
            )?;
            gpu.w32(queue_reg(q, Q_RING_SIZE), RING_ENTRIES)?;
            gpu.w32(queue_reg(q, Q_CONTROL), Q_CONTROL_ENABLE)?;
            let tail = gpu.r32(queue_reg(q, Q_TAIL))?;
            if let Some(t) = gpu.tails.get_mut(q as usize) {
                *t = tail;
            }
            if gpu.r32(queue_reg(q, Q_STATUS))? != Q_STATUS_IDLE {
                bail!("queue {q} did not become idle");
            }
        }
        Ok(gpu)
    }

    fn cfg16(&mut self, off: u64) -> Result<u64> {
        let mut b = [0u8; 2];
        self.client
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b)?;
        Ok(u64::from(u16::from_le_bytes(b)))
    }

    fn cfg_write16(&mut self, off: u64, v: u64) -> Result<()> {
        self.client
            .region_write(VFIO_PCI_CONFIG_REGION_INDEX, off, &(v as u16).to_le_bytes())?;
        Ok(())
    }

    fn find_cap(&mut self, id: u64) -> Result<Option<u64>> {
        let mut p = self.cfg16(0x34)? & 0xff;
        for _ in 0..48 {
            if p == 0 {
                break;
            }
            let h = self.cfg16(p)?;
            if h & 0xff == id {
                return Ok(Some(p));
            }
            p = h >> 8;
        }
        Ok(None)
    }

    /// Reads a BAR0 register.
    pub fn r32(&mut self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.client.region_read(BAR_REGS, off, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Writes a BAR0 register (waits for the reply).
    pub fn w32(&mut self, off: u64, v: u32) -> Result<()> {
        self.client.region_write(BAR_REGS, off, &v.to_le_bytes())?;
        Ok(())
    }

    /// Writes bytes into guest memory.
    pub fn mem_write(&self, off: u64, data: &[u8]) -> Result<()> {
        let s = self.mem.get_slice(usize::try_from(off)?, data.len())?;
        s.write_slice(data, 0)?;
        Ok(())
    }

    /// Reads a u64 from guest memory (acquire load).
    pub fn mem_load_u64(&self, off: u64) -> Result<u64> {
        let s = self.mem.as_volatile_slice();
        Ok(s.load::<u64>(usize::try_from(off)?, Ordering::Acquire)?)
    }

    /// Puts `cmds` into queue `q`'s ring (no doorbell); returns the new tail.
    pub fn enqueue(&mut self, q: u32, cmds: &[Command]) -> Result<u32> {
        let Some(tail) = self.tails.get_mut(q as usize) else {
            bail!("no queue {q}");
        };
        let mut t = *tail;
        let mut writes = Vec::with_capacity(cmds.len());
        for c in cmds {
            let slot = u64::from(t & (RING_ENTRIES - 1));
            writes.push((ring_offset(q) + slot * 64, c.encode()));
            t = t.wrapping_add(1);
        }
        *tail = t;
        for (off, bytes) in writes {
            self.mem_write(off, &bytes)?;
        }
        Ok(t)
    }

    /// Rings queue `q`'s doorbell, posted (as QEMU sends BAR writes) or waiting for the reply.
    pub fn doorbell(&mut self, q: u32, tail: u32, posted: bool) -> Result<()> {
        let off = queue_reg(q, Q_DOORBELL);
        if posted {
            self.client
                .region_write_posted(BAR_REGS, off, &tail.to_le_bytes())?;
        } else {
            self.client
                .region_write(BAR_REGS, off, &tail.to_le_bytes())?;
        }
        Ok(())
    }

    /// Puts queue `q` in mapped-doorbell mode and maps BAR0's doorbell page (once) from the
    /// region's sparse mmap area, as a VMM maps it into the guest.
    pub fn map_doorbells(&mut self, q: u32) -> Result<()> {
        if self.doorbells.is_none() {
            let info = self.client.region_info(BAR_REGS).context("BAR0 info")?;
            let area = info
                .sparse_areas
                .as_ref()
                .and_then(|a| a.first().copied())
                .context("BAR0 offers no mmap area")?;
            if (area.offset, area.size) != (DOORBELL_PAGE, DOORBELL_PAGE_SIZE) {
                bail!("BAR0's mmap area is not the doorbell page: {area:?}");
            }
            let file = info.fd.context("BAR0 came without a descriptor")?;
            let page = MmapRegion::<()>::from_file(
                FileOffset::new(file, info.info.offset + area.offset),
                usize::try_from(area.size)?,
            )
            .context("mmap the doorbell page")?;
            self.doorbells = Some(page);
        }
        self.w32(queue_reg(q, Q_CONTROL), Q_CONTROL_ENABLE | Q_CONTROL_MAPPED)?;
        if self.r32(queue_reg(q, Q_CONTROL))? & Q_CONTROL_MAPPED == 0 {
            bail!("queue {q} did not enter mapped mode");
        }
        Ok(())
    }

    /// Publishes queue `q`'s tail through the doorbell page (tail store, full fence, then the
    /// `DB_NEED_KICK` read) and kicks if the device asks; returns whether it kicked.
    pub fn publish(&mut self, q: u32, tail: u32) -> Result<bool> {
        let page = self.doorbells.as_ref().context("doorbells not mapped")?;
        let slot = usize::try_from(u64::from(q) * DB_STRIDE)?;
        let s = page.as_volatile_slice();
        std::sync::atomic::fence(Ordering::Release);
        s.store(tail, slot + DB_TAIL as usize, Ordering::SeqCst)?;
        std::sync::atomic::fence(Ordering::SeqCst);
        let kick = s.load::<u32>(slot + DB_NEED_KICK as usize, Ordering::SeqCst)? != 0;
        if kick {
            self.doorbell(q, tail, true)?;
        }
        Ok(kick)
    }

    /// Checks that no queue is in error (after a run).
    pub fn check_queues(&mut self) -> Result<()> {
        for q in 0..QUEUES {
            if self.r32(queue_reg(q, Q_STATUS))? == Q_STATUS_ERROR {
                let code = self.r32(queue_reg(q, Q_ERROR_CODE))?;
                bail!("queue {q} stopped with error code {code}");
            }
        }
        Ok(())
    }
}

/// A guest-memory operand.
pub fn guest(off: u64) -> Operand {
    Operand::Guest(GUEST_IOVA + off)
}
