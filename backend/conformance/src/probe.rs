//! What the checks share: a device on a context as the server holds it, accesses that turn a
//! device's panic into a finding naming the access, and config-space helpers.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use switchyard_device::config::regs;
use switchyard_device::kind::Build;
use switchyard_device::{
    CONFIG_REGION_INDEX, DeviceContext, DeviceDescription, DeviceError, DmaSpace, Interrupts,
    PciDevice, RemoteDma,
};

use crate::Subject;

/// The VFIO maximum vector counts a server sizes its interrupts to until the device has
/// described itself.
const MAX_IRQS: [u32; 5] = [1, 1, 2048, 1, 1];

/// The message of a panic payload.
pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// A fresh context, as a server makes one before the device is built: no DMA window, no
/// eventfd, no memory object.
pub(crate) fn context() -> DeviceContext {
    DeviceContext {
        dma: Arc::new(DmaSpace::new(16)),
        irqs: Arc::new(Interrupts::new(&MAX_IRQS)),
        waits: Default::default(),
        memory: Default::default(),
    }
}

/// A device in its slot: the context it was built on, with its DMA observer, dirty source
/// and interrupt counts installed as the server installs them.
pub(crate) struct Slot {
    pub(crate) name: String,
    pub(crate) ctx: DeviceContext,
    pub(crate) device: Box<dyn PciDevice>,
}

impl Subject {
    /// A fresh device on a fresh context.
    pub(crate) fn slot(&self, check: &str) -> Slot {
        self.slot_with(check, Build::new)
    }

    /// A device built from `build(ctx)` on a fresh context.
    pub(crate) fn slot_with(
        &self,
        check: &str,
        build: impl FnOnce(DeviceContext) -> Build,
    ) -> Slot {
        let ctx = context();
        let name = format!("{}: {check}", self.name());
        let device = catch_unwind(AssertUnwindSafe(|| self.build(build(ctx.clone()))))
            .unwrap_or_else(|p| {
                panic!(
                    "{name}: building the device panicked: {}",
                    panic_message(&*p)
                )
            })
            .unwrap_or_else(|e| panic!("{name}: the device cannot be built: {}", chain(&e)));
        Slot::install(name, ctx, device)
    }
}

/// An error and its sources, on one line.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl Slot {
    /// `device` takes the slot of `ctx` (what `Server::new` and a swap do).
    pub(crate) fn install(name: String, ctx: DeviceContext, device: Box<dyn PciDevice>) -> Self {
        ctx.dma.set_observer(device.dma_observer());
        ctx.dma.set_dirty_source(device.dirty_source());
        ctx.irqs.reconfigure(&device.description().irq_counts());
        Self { name, ctx, device }
    }

    /// Panics with `what` prefixed by the subject and check.
    pub(crate) fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!("{}: {what}", self.name)
    }

    pub(crate) fn desc(&self) -> &DeviceDescription {
        self.device.description()
    }

    /// Runs `f` on the device; a panic is a finding naming `what`.
    pub(crate) fn guarded<R>(
        &mut self,
        what: impl Fn() -> String,
        f: impl FnOnce(&mut dyn PciDevice) -> R,
    ) -> R {
        let device = &mut *self.device;
        match catch_unwind(AssertUnwindSafe(|| f(device))) {
            Ok(r) => r,
            Err(p) => panic!("{}: {} panicked: {}", self.name, what(), panic_message(&*p)),
        }
    }

    /// A `REGION_READ` of `len` bytes; a panic is a finding.
    pub(crate) fn read(
        &mut self,
        region: u32,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, DeviceError> {
        let mut buf = vec![0u8; len];
        self.guarded(
            || format!("region {region}: a read of {len} bytes at {offset:#x}"),
            |d| d.region_read(region, offset, &mut buf),
        )
        .map(|()| buf)
    }

    /// A `REGION_WRITE`; a panic is a finding.
    pub(crate) fn write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        self.guarded(
            || {
                format!(
                    "region {region}: a write of {} bytes at {offset:#x}",
                    data.len()
                )
            },
            |d| d.region_write(region, offset, data),
        )
    }

    /// A read that must be served.
    pub(crate) fn must_read(&mut self, region: u32, offset: u64, len: usize) -> Vec<u8> {
        self.read(region, offset, len).unwrap_or_else(|e| {
            self.fail(format_args!(
                "region {region}: a read of {len} bytes at {offset:#x} was refused: {}",
                chain(&e)
            ))
        })
    }

    /// A write that must be served.
    pub(crate) fn must_write(&mut self, region: u32, offset: u64, data: &[u8]) {
        if let Err(e) = self.write(region, offset, data) {
            self.fail(format_args!(
                "region {region}: a write of {} bytes at {offset:#x} was refused: {}",
                data.len(),
                chain(&e)
            ))
        }
    }

    pub(crate) fn cfg16(&mut self, offset: usize) -> u16 {
        let b = self.must_read(CONFIG_REGION_INDEX, offset as u64, 2);
        u16::from_le_bytes([b[0], b[1]])
    }

    pub(crate) fn cfg32(&mut self, offset: usize) -> u32 {
        let b = self.must_read(CONFIG_REGION_INDEX, offset as u64, 4);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Size of the config space region.
    pub(crate) fn config_size(&self) -> u64 {
        self.desc()
            .regions
            .get(CONFIG_REGION_INDEX as usize)
            .map_or(0, |r| r.size)
    }

    /// The whole config space, read a dword at a time.
    pub(crate) fn config(&mut self) -> Vec<u8> {
        let size = self.config_size();
        if size < 256 {
            self.fail(format_args!(
                "the config space region is {size} bytes (a PCI function has at least 256)"
            ));
        }
        let mut out = Vec::with_capacity(size as usize);
        for off in (0..size).step_by(4) {
            out.extend(self.must_read(CONFIG_REGION_INDEX, off, 4));
        }
        out
    }

    /// The header fields a driver cannot change.
    pub(crate) fn read_only_header(&mut self) -> Vec<(&'static str, u32)> {
        vec![
            ("vendor id", u32::from(self.cfg16(regs::VENDOR_ID))),
            ("device id", u32::from(self.cfg16(regs::DEVICE_ID))),
            ("revision and class", self.cfg32(regs::REVISION)),
            ("header type", u32::from(self.cfg8(regs::HEADER_TYPE))),
            ("subsystem", self.cfg32(regs::SUBSYS_VENDOR)),
            ("capability pointer", u32::from(self.cfg8(regs::CAP_PTR))),
            ("interrupt pin", u32::from(self.cfg8(regs::INT_PIN))),
        ]
    }

    pub(crate) fn cfg8(&mut self, offset: usize) -> u8 {
        self.must_read(CONFIG_REGION_INDEX, offset as u64, 1)[0]
    }

    /// Changes what a driver can change in the config space, as a driver bringing the device
    /// up does: memory decoding and bus mastering on, the first memory BAR at an address of
    /// its own. Fails if nothing changed (a check comparing such a state with another could
    /// not tell a restored device from a fresh one).
    pub(crate) fn program(&mut self) {
        let before = self.config();
        let cmd = self.cfg16(regs::COMMAND) | regs::CMD_MEMORY | regs::CMD_BUS_MASTER;
        self.must_write(
            CONFIG_REGION_INDEX,
            regs::COMMAND as u64,
            &cmd.to_le_bytes(),
        );
        if let Some((index, size)) = self.first_memory_bar() {
            let off = regs::BAR0 + 4 * index;
            let lo = self.cfg32(off);
            // Size-aligned, below 4 GiB when the BAR fits there, above it otherwise.
            let addr: u64 = if size <= 1 << 28 {
                0xd000_0000
            } else {
                size.saturating_mul(4)
            };
            self.must_write(
                CONFIG_REGION_INDEX,
                off as u64,
                &((addr as u32) | (lo & 0xf)).to_le_bytes(),
            );
            if lo & 0b110 == 0b100 {
                self.must_write(
                    CONFIG_REGION_INDEX,
                    off as u64 + 4,
                    &((addr >> 32) as u32).to_le_bytes(),
                );
            }
        }
        if self.config() == before {
            self.fail("writing COMMAND (memory, bus master) and a BAR's address changed nothing in the config space");
        }
    }

    /// The index and size of the first memory BAR.
    pub(crate) fn first_memory_bar(&mut self) -> Option<(usize, u64)> {
        for index in 0..6usize {
            let size = self.desc().regions.get(index).map_or(0, |r| r.size);
            if size == 0 {
                continue;
            }
            if self.cfg32(regs::BAR0 + 4 * index) & 1 == 0 {
                return Some((index, size));
            }
        }
        None
    }

    /// The client leaves, handled as the server's `client_gone` does: the device parked
    /// (when it can be), the client's DMA transport, windows and eventfds dropped, then the
    /// device told.
    pub(crate) fn disconnect(&mut self) {
        let quiesce = self.device.swappable().map(|w| w.quiesce());
        let parked = quiesce.as_ref().map(|q| q.park());
        self.ctx.dma.set_remote(None);
        self.ctx.dma.unmap_all();
        self.ctx.irqs.clear();
        self.guarded(
            || "client_disconnected()".into(),
            |d| d.client_disconnected(),
        );
        drop(parked);
    }

    /// Asserts that the device still answers: the config space and the last dword of every
    /// readable region are served.
    pub(crate) fn answers(&mut self, when: &str) {
        let _ = self.config();
        let regions: Vec<(u32, u64)> = (0u32..)
            .zip(&self.desc().regions)
            .filter(|(i, r)| r.read && r.size >= 4 && *i != CONFIG_REGION_INDEX)
            .map(|(i, r)| (i, r.size))
            .collect();
        for (i, size) in regions {
            if let Err(e) = self.read(i, (size - 4) & !3, 4) {
                self.fail(format_args!(
                    "{when}: region {i}'s last dword is not served: {}",
                    chain(&e)
                ));
            }
        }
    }

    /// Asserts the config space is `expected`, naming the first differing dwords.
    pub(crate) fn assert_config(&mut self, expected: &[u8], what: &str) {
        let now = self.config();
        if now != expected {
            let diffs: Vec<String> = now
                .chunks(4)
                .zip(expected.chunks(4))
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .take(8)
                .map(|(i, (a, b))| {
                    format!(
                        "{:#05x}: {:#010x} (expected {:#010x})",
                        i * 4,
                        le32(a),
                        le32(b)
                    )
                })
                .collect();
            self.fail(format_args!(
                "{what}: the config space differs ({} bytes vs {}); first dwords: {}",
                now.len(),
                expected.len(),
                diffs.join(", ")
            ));
        }
    }
}

fn le32(b: &[u8]) -> u32 {
    let mut w = [0u8; 4];
    w[..b.len().min(4)].copy_from_slice(&b[..b.len().min(4)]);
    u32::from_le_bytes(w)
}

/// A client's message-only DMA window that counts every access reaching it (and fails it).
#[derive(Debug, Default)]
pub(crate) struct Sensor {
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
}

impl RemoteDma for Sensor {
    fn read(&self, _iova: u64, _buf: &mut [u8]) -> Result<(), i32> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        Err(libc::EIO)
    }

    fn write(&self, _iova: u64, _data: &[u8]) -> Result<(), i32> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        Err(libc::EIO)
    }
}
