//! The client's side of the device: VFIO's region and IRQ indexes, edu's registers, the DMA
//! windows, [`Edu`] (a vfio-user client with the accesses every run makes), memfds and
//! eventfds.

use std::fs::File;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use switchyard_client::Client;
use switchyard_proto::DmaLoggingRange;
use switchyard_proto::consts::*;

use crate::{Result, ensure};

pub const BAR0: u32 = 0;
pub const ROM: u32 = 6;
pub const CONFIG: u32 = 7;
pub const MSI_INDEX: u32 = 1;
pub const MSIX_INDEX: u32 = 2;

pub const EDU_ID: u64 = 0x00;
pub const EDU_LIVENESS: u64 = 0x04;
pub const EDU_FACT: u64 = 0x08;
pub const EDU_STATUS: u64 = 0x20;
pub const EDU_IRQ_STATUS: u64 = 0x24;
pub const EDU_IRQ_RAISE: u64 = 0x60;
pub const EDU_IRQ_ACK: u64 = 0x64;
const EDU_DMA_SRC: u64 = 0x80;
const EDU_DMA_DST: u64 = 0x88;
const EDU_DMA_COUNT: u64 = 0x90;
const EDU_DMA_CMD: u64 = 0x98;
pub const EDU_BUFFER: u64 = 0x40000;
/// edu raises this interrupt status bit when a DMA with the IRQ bit completes.
const EDU_DMA_IRQ: u32 = 0x100;

/// The client's DMA window: below edu's 28-bit DMA mask, 2 pages.
pub const IOVA: u64 = 0x0010_0000;
pub const WINDOW: u64 = 0x2000;
/// A read-only window, one page.
pub const IOVA_RO: u64 = 0x0020_0000;

pub struct Edu {
    pub c: Client,
}

impl Edu {
    pub fn cfg_read32(&mut self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.c
            .region_read(CONFIG, off, &mut b)
            .map_err(|e| format!("config read {off:#x}: {e}"))?;
        Ok(u32::from_le_bytes(b))
    }

    pub fn cfg_read16(&mut self, off: u64) -> Result<u16> {
        let mut b = [0u8; 2];
        self.c
            .region_read(CONFIG, off, &mut b)
            .map_err(|e| format!("config read {off:#x}: {e}"))?;
        Ok(u16::from_le_bytes(b))
    }

    pub fn cfg_write(&mut self, off: u64, data: &[u8]) -> Result<()> {
        self.c
            .region_write(CONFIG, off, data)
            .map_err(|e| format!("config write {off:#x}: {e}"))
    }

    pub fn rd32(&mut self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.c
            .region_read(BAR0, off, &mut b)
            .map_err(|e| format!("BAR0 read {off:#x}: {e}"))?;
        Ok(u32::from_le_bytes(b))
    }

    pub fn wr32(&mut self, off: u64, v: u32) -> Result<()> {
        self.c
            .region_write(BAR0, off, &v.to_le_bytes())
            .map_err(|e| format!("BAR0 write {off:#x}: {e}"))
    }

    pub fn wr64(&mut self, off: u64, v: u64) -> Result<()> {
        self.c
            .region_write(BAR0, off, &v.to_le_bytes())
            .map_err(|e| format!("BAR0 write {off:#x}: {e}"))
    }

    pub fn rd64(&mut self, off: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.c
            .region_read(BAR0, off, &mut b)
            .map_err(|e| format!("BAR0 read {off:#x}: {e}"))?;
        Ok(u64::from_le_bytes(b))
    }

    /// DMA_MAP of all of `file` (`size` bytes) at `iova`, read/write or read-only.
    pub fn map(&mut self, iova: u64, size: u64, writable: bool, file: &File) -> Result<()> {
        let mut flags = VFIO_USER_F_DMA_REGION_READ;
        if writable {
            flags |= VFIO_USER_F_DMA_REGION_WRITE;
        }
        self.c
            .dma_map(iova, size, flags, Some((file.as_fd(), 0)))
            .map_err(|e| format!("DMA_MAP {iova:#x}: {e}"))
    }

    /// DMA_LOGGING_START over the window at [`IOVA`] with 4 KiB pages; the page size.
    pub fn log_window(&mut self) -> Result<u64> {
        self.c
            .dma_logging_start(
                4096,
                &[DmaLoggingRange {
                    iova: IOVA,
                    length: WINDOW,
                }],
            )
            .map_err(|e| format!("DMA_LOGGING_START: {e}"))
    }

    /// SET_IRQS: `fds` become the eventfds of vectors `start..` of `index`.
    pub fn set_eventfds(&mut self, index: u32, start: u32, fds: &[&File]) -> Result<()> {
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        self.c
            .set_irqs(
                index,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                start,
                fds.len() as u32,
                &borrowed,
            )
            .map_err(|e| format!("SET_IRQS {index} from {start}: {e}"))
    }

    /// SET_IRQS disabling `index`.
    pub fn disable_irqs(&mut self, index: u32) -> Result<()> {
        self.c
            .set_irqs(
                index,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                0,
                &[],
            )
            .map_err(|e| format!("SET_IRQS disable {index}: {e}"))
    }

    /// Offsets of the capabilities, by ID, walking the list the client sees.
    pub fn capabilities(&mut self) -> Result<Vec<(u8, u64)>> {
        let mut caps = vec![];
        let mut p = u64::from(self.cfg_read32(0x34)? as u8 & 0xfc);
        while p != 0 && caps.len() < 48 {
            let head = self.cfg_read16(p)?;
            caps.push((head as u8, p));
            p = u64::from((head >> 8) as u8 & 0xfc);
        }
        Ok(caps)
    }

    /// Starts one edu DMA and waits for it (bit 0 of the command clears), with its interrupt.
    pub fn dma(&mut self, src: u64, dst: u64, count: u64, to_ram: bool, irq: &File) -> Result<()> {
        self.wr64(EDU_DMA_SRC, src)?;
        self.wr64(EDU_DMA_DST, dst)?;
        self.wr64(EDU_DMA_COUNT, count)?;
        let cmd = 1 | if to_ram { 2 } else { 0 } | 4;
        self.wr64(EDU_DMA_CMD, cmd)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.rd64(EDU_DMA_CMD)? & 1 != 0 {
            ensure(Instant::now() < deadline, || {
                "edu DMA did not complete in 10 s".into()
            })?;
            std::thread::sleep(Duration::from_millis(5));
        }
        let n = wait_eventfd(irq, Duration::from_secs(5))?;
        let status = self.rd32(EDU_IRQ_STATUS)?;
        ensure(status & EDU_DMA_IRQ != 0, || {
            format!("DMA interrupt arrived ({n}) but status is {status:#x}")
        })?;
        self.wr32(EDU_IRQ_ACK, EDU_DMA_IRQ)?;
        Ok(())
    }
}

/// A memfd of `size` bytes.
pub fn memfd(name: &str, size: u64) -> Result<File> {
    let f = File::from(
        rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| format!("memfd: {e}"))?,
    );
    f.set_len(size).map_err(|e| format!("memfd size: {e}"))?;
    Ok(f)
}

/// Waits until the (non-blocking) eventfd has a count, and returns it.
pub fn wait_eventfd(fd: &File, timeout: Duration) -> Result<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut b = [0u8; 8];
        match rustix::io::read(fd, &mut b) {
            Ok(8) => return Ok(u64::from_ne_bytes(b)),
            Ok(n) => return Err(format!("short eventfd read ({n})")),
            Err(rustix::io::Errno::AGAIN) => {}
            Err(e) => return Err(format!("eventfd read: {e}")),
        }
        if Instant::now() >= deadline {
            return Err(format!("no interrupt within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn eventfd() -> Result<File> {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .map(File::from)
    .map_err(|e| format!("eventfd: {e}"))
}
