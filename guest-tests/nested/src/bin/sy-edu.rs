//! `sy-edu`: a user-space driver for QEMU's `edu` device (1234:11e8) inside a guest, over Linux
//! VFIO (type1, so the guest needs a vIOMMU). It runs the same checks whether edu is assigned
//! to this guest directly or reaches it through Switchyard's passthrough backend (a
//! `vfio-user-pci` device served from a host that owns the real edu): identity, liveness,
//! factorial with its MSI, and edu's DMA engine both ways between guest memory and the device's
//! buffer, with the bytes compared.
//!
//! ```text
//! sy-edu [--bdf B] [--timeout SECONDS] [--pause SECONDS] [--loop SECONDS] [--again SECONDS]
//! ```
//!
//! `--pause`: after the checks, with DMA buffers mapped and MSI enabled, print
//! `SY-EDU: pause`, wait that long (the host may replace the server meanwhile), print
//! `SY-EDU: resumed` and run factorials with their MSI and the DMA round trip again.
//!
//! `--loop`: after the checks, keep the device busy (liveness + factorial with its MSI, round
//! after round) for that long: the load under which a test removes the device on the host.
//!
//! `--again`: when the device is lost during `--loop`, let go of it (the host's VMM can unplug
//! it only then), wait up to that long for it to be removed and for an edu to be plugged in
//! (a guest-visible failover: a fresh device in the same slot), print `SY-EDU: gone` and
//! `SY-EDU: back bdf=B`, and run the checks on it again: their summary is one
//! `SY-EDU-AGAIN {json}` line, and the exit code is the rerun's.
//!
//! Progress lines `SY-EDU: ...`, then one `SY-EDU-SUMMARY {json}`; exit 0 on `"pass"`, 3 when
//! the device stopped answering during `--loop` (`"device-lost"`), 1 on any other failure.
//! edu's DMA addresses are 28 bits wide: the buffers sit at IOVA 1 MiB.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use switchyard_sys::DmaMapping;
use sygpu_driver::irq::IrqMode;
use sygpu_driver::mmio::BarMap;
use sygpu_driver::sysfs::Sysfs;
use sygpu_driver::vfio::Vfio;
use vm_memory::VolatileMemory;
use vm_memory::mmap::MmapRegion;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const EDU_VENDOR: u16 = 0x1234;
const EDU_DEVICE: u16 = 0x11e8;
const REG_ID: u64 = 0x00;
const REG_LIVENESS: u64 = 0x04;
const REG_FACTORIAL: u64 = 0x08;
const REG_STATUS: u64 = 0x20;
const REG_IRQ_STATUS: u64 = 0x24;
const REG_IRQ_RAISE: u64 = 0x60;
const REG_IRQ_ACK: u64 = 0x64;
const REG_DMA_SRC: u64 = 0x80;
const REG_DMA_DST: u64 = 0x88;
const REG_DMA_COUNT: u64 = 0x90;
const REG_DMA_CMD: u64 = 0x98;
const STATUS_COMPUTING: u32 = 0x01;
const STATUS_IRQ_ON_FACT: u32 = 0x80;
const IRQ_FACT: u32 = 0x01;
const IRQ_DMA: u32 = 0x100;
const DMA_START: u64 = 0x1;
const DMA_TO_RAM: u64 = 0x2;
const DMA_IRQ: u64 = 0x4;
/// edu's own DMA buffer, in its address space.
const EDU_BUF: u64 = 0x40000;
const DMA_LEN: usize = 4096;
const IOVA_OUT: u64 = 0x10_0000;
const IOVA_IN: u64 = 0x10_1000;

macro_rules! say {
    ($($t:tt)*) => { println!("SY-EDU: {}", format!($($t)*)) };
}

struct Edu {
    bar: BarMap,
    irq: EventFd,
    timeout: Duration,
    interrupts: u64,
}

impl Edu {
    /// Waits for the MSI (eventfd), then checks and acknowledges `bit` in the IRQ status.
    fn wait_irq(&mut self, bit: u32, what: &str) -> Result<Duration> {
        let t = Instant::now();
        loop {
            match self.irq.read() {
                Ok(n) => {
                    self.interrupts += n;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ensure!(
                        t.elapsed() < self.timeout,
                        "no MSI for {what} within {:?} (IRQ status {:#x})",
                        self.timeout,
                        self.bar.r32(REG_IRQ_STATUS)
                    );
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => return Err(e).context("read the MSI eventfd"),
            }
        }
        let took = t.elapsed();
        let st = self.bar.r32(REG_IRQ_STATUS);
        ensure!(
            st & bit != 0,
            "MSI for {what} but IRQ status {st:#x} lacks {bit:#x}"
        );
        self.bar.w32(REG_IRQ_ACK, bit);
        Ok(took)
    }
}

/// The device stopped answering while `--loop` kept it busy.
#[derive(Debug)]
struct DeviceLost;

impl std::fmt::Display for DeviceLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the device stopped answering")
    }
}

impl std::error::Error for DeviceLost {}

/// One round of load: a liveness write/read and a factorial with its MSI.
fn load_round(edu: &mut Edu, n: u64) -> Result<()> {
    let v = (n as u32).wrapping_mul(0x9e37_79b9);
    edu.bar.w32(REG_LIVENESS, v);
    let r = edu.bar.r32(REG_LIVENESS);
    ensure!(r == !v, "liveness: wrote {v:#x}, read {r:#x}");
    let k = (n % 12) as u32 + 1;
    edu.bar.w32(REG_STATUS, STATUS_IRQ_ON_FACT);
    edu.bar.w32(REG_FACTORIAL, k);
    edu.wait_irq(IRQ_FACT, "a factorial")?;
    let f = edu.bar.r32(REG_FACTORIAL);
    let want: u32 = (1..=k).product();
    ensure!(f == want, "{k}! = {f}, want {want}");
    Ok(())
}

fn find_edu(sys: &Sysfs, bdf: Option<&str>) -> Result<String> {
    let list = sys.list().map_err(anyhow::Error::msg)?;
    list.iter()
        .find(|d| {
            d.vendor == EDU_VENDOR
                && d.device == EDU_DEVICE
                && bdf.is_none_or(|b| b == d.bdf.as_str())
        })
        .map(|d| d.bdf.clone())
        .with_context(|| {
            format!(
                "no edu (1234:11e8) device{}",
                bdf.map(|b| format!(" at {b}")).unwrap_or_default()
            )
        })
}

fn dma_buffer(vfio: &Vfio, iova: u64) -> Result<DmaMapping> {
    let mem = MmapRegion::<()>::new(DMA_LEN).context("DMA buffer")?;
    DmaMapping::new(vfio.iommu(), iova, mem)
        .with_context(|| format!("VFIO_IOMMU_MAP_DMA at {iova:#x}"))
}

/// guest memory (`out`, a pattern from `seed`) -> edu's buffer -> other guest memory (`inb`,
/// cleared first), each with its MSI; the bytes compared. Returns both transfer times.
fn dma_round_trip(
    edu: &mut Edu,
    out: &DmaMapping,
    inb: &DmaMapping,
    seed: u8,
) -> Result<(Duration, Duration)> {
    let pattern: Vec<u8> = (0..DMA_LEN)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    out.memory()
        .get_slice(0, DMA_LEN)
        .context("buffer slice")?
        .copy_from(&pattern);
    inb.memory()
        .get_slice(0, DMA_LEN)
        .context("buffer slice")?
        .copy_from(&[0u8; DMA_LEN]);
    let dma = |edu: &mut Edu, src: u64, dst: u64, cmd: u64, what: &str| -> Result<Duration> {
        edu.bar.w64(REG_DMA_SRC, src);
        edu.bar.w64(REG_DMA_DST, dst);
        edu.bar.w64(REG_DMA_COUNT, DMA_LEN as u64);
        edu.bar.w64(REG_DMA_CMD, cmd | DMA_START | DMA_IRQ);
        let took = edu.wait_irq(IRQ_DMA, what)?;
        ensure!(
            edu.bar.r64(REG_DMA_CMD) & DMA_START == 0,
            "{what}: DMA still running after its MSI"
        );
        Ok(took)
    };
    let to_dev = dma(edu, IOVA_OUT, EDU_BUF, 0, "DMA guest memory -> edu")?;
    let to_ram = dma(edu, EDU_BUF, IOVA_IN, DMA_TO_RAM, "DMA edu -> guest memory")?;
    let mut got = vec![0u8; DMA_LEN];
    inb.memory()
        .get_slice(0, DMA_LEN)
        .context("buffer slice")?
        .copy_to(&mut got);
    let diff = got.iter().zip(&pattern).filter(|(a, b)| a != b).count();
    ensure!(
        diff == 0,
        "DMA round trip: {diff} of {DMA_LEN} bytes differ"
    );
    Ok((to_dev, to_ram))
}

fn run(
    bdf: Option<&str>,
    timeout: Duration,
    loop_for: Option<Duration>,
    pause: Option<Duration>,
    s: &mut serde_json::Map<String, Value>,
    config: &mut Option<std::fs::File>,
) -> Result<()> {
    let sys = Sysfs::system();
    let bdf = find_edu(&sys, bdf)?;
    s.insert("bdf".into(), json!(bdf));
    // Held past the run: reads through it fail once the device is removed, even when a new
    // device sits at the same address by the time anyone looks.
    *config = std::fs::File::open(sys.device_dir(&bdf).join("config")).ok();
    let (dev, outcome) = sys.bind_vfio_pci(&bdf).map_err(anyhow::Error::msg)?;
    let group = dev
        .iommu_group
        .or_else(|| sys.read_device(&bdf).ok().and_then(|d| d.iommu_group))
        .context("no IOMMU group (the guest needs a vIOMMU)")?;
    say!("{bdf}: vfio-pci ({outcome:?}), IOMMU group {group}");
    let vfio = Vfio::open(&sys.device_dir(&bdf), group, timeout).map_err(anyhow::Error::msg)?;
    let bar = vfio.map_region(0).map_err(anyhow::Error::msg)?;
    // Memory space and bus mastering.
    let mut cmd = [0u8; 2];
    vfio.cfg_read(4, &mut cmd).map_err(anyhow::Error::msg)?;
    let c = u16::from_le_bytes(cmd) | 0x6;
    vfio.cfg_write(4, &c.to_le_bytes())
        .map_err(anyhow::Error::msg)?;
    let irq = EventFd::new(EFD_NONBLOCK).context("eventfd")?;
    vfio.enable_irqs(IrqMode::Msi, vec![&irq])
        .map_err(anyhow::Error::msg)?;
    let mut edu = Edu {
        bar,
        irq,
        timeout,
        interrupts: 0,
    };

    let id = edu.bar.r32(REG_ID);
    s.insert("id".into(), json!(format!("{id:#010x}")));
    ensure!(
        id & 0xffff == 0x00ed,
        "identification register {id:#x} (want ..00ed)"
    );
    say!("identification {id:#010x}");

    for v in [0x1234_5678u32, 0xdead_beef, 0] {
        edu.bar.w32(REG_LIVENESS, v);
        let r = edu.bar.r32(REG_LIVENESS);
        ensure!(
            r == !v,
            "liveness: wrote {v:#x}, read {r:#x} (want {:#x})",
            !v
        );
    }
    s.insert("liveness_ok".into(), json!(true));
    say!("liveness ok");

    // An interrupt raised by hand.
    edu.bar.w32(REG_IRQ_RAISE, 0x4000);
    let raise = edu.wait_irq(0x4000, "a raised interrupt")?;
    say!("raised interrupt delivered in {raise:?}");

    edu.bar.w32(REG_STATUS, STATUS_IRQ_ON_FACT);
    edu.bar.w32(REG_FACTORIAL, 10);
    let fact_irq = edu.wait_irq(IRQ_FACT, "the factorial")?;
    let t = Instant::now();
    while edu.bar.r32(REG_STATUS) & STATUS_COMPUTING != 0 {
        ensure!(t.elapsed() < timeout, "factorial still computing");
        std::thread::sleep(Duration::from_millis(1));
    }
    let f = edu.bar.r32(REG_FACTORIAL);
    ensure!(f == 3_628_800, "10! = {f}");
    edu.bar.w32(REG_STATUS, 0);
    s.insert("factorial_ok".into(), json!(true));
    say!("10! = {f}, MSI after {fact_irq:?}");

    // DMA: guest memory -> edu's buffer -> other guest memory.
    let out = dma_buffer(&vfio, IOVA_OUT)?;
    let inb = dma_buffer(&vfio, IOVA_IN)?;
    let (to_dev, to_ram) = dma_round_trip(&mut edu, &out, &inb, 0x5a)?;
    s.insert("dma_bytes_verified".into(), json!(DMA_LEN));
    s.insert(
        "dma_ms".into(),
        json!([to_dev.as_secs_f64() * 1e3, to_ram.as_secs_f64() * 1e3]),
    );
    say!("DMA {DMA_LEN} bytes both ways verified ({to_dev:?}, {to_ram:?})");
    if let Some(p) = pause {
        // Everything is set up (DMA windows, MSI): the host may replace the server now. The
        // same checks again then show the device reached through the replacement.
        say!("pause {p:?} (the host may replace the server now)");
        std::thread::sleep(p);
        say!("resumed");
        for n in 0..3 {
            load_round(&mut edu, n).context("after the pause")?;
        }
        dma_round_trip(&mut edu, &out, &inb, 0xa5).context("after the pause")?;
        s.insert("after_pause_ok".into(), json!(true));
        say!("after the pause: factorials with MSI and DMA both ways verified");
    }
    if let Some(d) = loop_for {
        say!("loop start ({d:?})");
        edu.timeout = timeout.min(Duration::from_secs(5));
        let t = Instant::now();
        let mut n = 0u64;
        let mut lost = None;
        let mut next_report = Duration::from_secs(1);
        while t.elapsed() < d {
            if let Err(e) = load_round(&mut edu, n) {
                lost = Some(e);
                break;
            }
            n += 1;
            if t.elapsed() >= next_report {
                say!("loop rounds={n}");
                next_report += Duration::from_secs(1);
            }
        }
        s.insert("loop_rounds".into(), json!(n));
        s.insert("interrupts".into(), json!(edu.interrupts));
        if let Some(e) = lost {
            say!("device lost after {n} rounds: {e:#}");
            s.insert("device_lost".into(), json!(format!("{e:#}")));
            return Err(e.context(DeviceLost));
        }
        say!("loop done: {n} rounds");
    }
    s.insert("interrupts".into(), json!(edu.interrupts));
    vfio.disable_irqs(IrqMode::Msi)
        .map_err(anyhow::Error::msg)?;
    for m in [out, inb] {
        m.unmap().context("VFIO_IOMMU_UNMAP_DMA")?;
    }
    Ok(())
}

/// Waits until the device whose config file is `config` is removed, then until an edu is
/// present; returns its address.
fn wait_replaced(config: Option<std::fs::File>, within: Duration) -> Result<String> {
    use std::os::unix::fs::FileExt;
    let t = Instant::now();
    if let Some(f) = config {
        let mut b = [0u8; 1];
        while f.read_at(&mut b, 0).is_ok_and(|n| n == 1) {
            ensure!(t.elapsed() < within, "the lost device was not removed");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    say!("gone after {:?}", t.elapsed());
    let sys = Sysfs::system();
    loop {
        if let Ok(bdf) = find_edu(&sys, None) {
            // Let the kernel finish adding it (its IOMMU group).
            std::thread::sleep(Duration::from_millis(500));
            say!("back bdf={bdf} after {:?}", t.elapsed());
            return Ok(bdf);
        }
        ensure!(t.elapsed() < within, "no edu came back within {within:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn main() {
    let mut bdf = None;
    let mut again = None;
    let mut timeout = Duration::from_secs(30);
    let mut loop_for = None;
    let mut pause = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--bdf", Some(b)) => bdf = Some(b),
            ("--timeout", Some(t)) => match t.parse() {
                Ok(secs) => timeout = Duration::from_secs(secs),
                Err(_) => {
                    eprintln!("sy-edu: bad --timeout `{t}`");
                    std::process::exit(2);
                }
            },
            ("--loop", Some(t)) => match t.parse() {
                Ok(secs) => loop_for = Some(Duration::from_secs(secs)),
                Err(_) => {
                    eprintln!("sy-edu: bad --loop `{t}`");
                    std::process::exit(2);
                }
            },
            ("--pause", Some(t)) => match t.parse() {
                Ok(secs) => pause = Some(Duration::from_secs(secs)),
                Err(_) => {
                    eprintln!("sy-edu: bad --pause `{t}`");
                    std::process::exit(2);
                }
            },
            ("--again", Some(t)) => match t.parse() {
                Ok(secs) => again = Some(Duration::from_secs(secs)),
                Err(_) => {
                    eprintln!("sy-edu: bad --again `{t}`");
                    std::process::exit(2);
                }
            },
            _ => {
                eprintln!(
                    "usage: sy-edu [--bdf B] [--timeout SECONDS] [--pause SECONDS] [--loop SECONDS] [--again SECONDS]"
                );
                std::process::exit(2);
            }
        }
    }
    let mut s = serde_json::Map::new();
    let started = Instant::now();
    let mut config = None;
    // Everything of the device (its VFIO descriptors, mappings, eventfd) is let go of when
    // `run` returns.
    let r = run(
        bdf.as_deref(),
        timeout,
        loop_for,
        pause,
        &mut s,
        &mut config,
    );
    let (result, code) = outcome(r, &mut s, started);
    println!("SY-EDU-SUMMARY {}", Value::Object(s));
    let Some(within) = again.filter(|_| result == "device-lost") else {
        std::process::exit(code);
    };
    let mut s = serde_json::Map::new();
    let started = Instant::now();
    let r = wait_replaced(config, within).and_then(|bdf| {
        s.insert(
            "wait_ms".into(),
            json!(started.elapsed().as_millis() as u64),
        );
        run(Some(&bdf), timeout, None, None, &mut s, &mut None)
    });
    let (_, code) = outcome(r, &mut s, started);
    println!("SY-EDU-AGAIN {}", Value::Object(s));
    std::process::exit(code);
}

/// Records a run's result (and duration) in its summary: the result and the exit code.
fn outcome(
    r: Result<()>,
    s: &mut serde_json::Map<String, Value>,
    started: Instant,
) -> (&'static str, i32) {
    s.insert(
        "duration_ms".into(),
        json!(started.elapsed().as_millis() as u64),
    );
    let (result, code) = match r {
        Ok(()) => ("pass", 0),
        Err(e) => {
            say!("FAILED: {e:#}");
            s.insert("error".into(), json!(format!("{e:#}")));
            if e.is::<DeviceLost>() {
                ("device-lost", 3)
            } else {
                ("fail", 1)
            }
        }
    };
    s.insert("result".into(), json!(result));
    (result, code)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dma_buffers_fit_edus_28_bit_dma_mask() {
        for iova in [super::IOVA_OUT, super::IOVA_IN] {
            assert!(iova + super::DMA_LEN as u64 <= 1 << 28);
        }
    }
}
