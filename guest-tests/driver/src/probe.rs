//! `--probe`: the no-IOMMU check. No VFIO at all: the device is found and checked through
//! `/sys/bus/pci/devices/<bdf>` (identity, capability list from the `config` file), memory
//! decoding is enabled through the `config` file, and BAR0 is reached by mmapping `resource0`.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use crate::mmio::BarMap;
use crate::pci;
use crate::regs::*;
use crate::say;
use crate::summary::ProbeSummary;
use crate::sysfs::Sysfs;

/// Runs the probe on the real `/sys`.
pub fn probe(bdf: Option<&str>) -> ProbeSummary {
    probe_in(&Sysfs::system(), bdf)
}

/// Runs the probe on a sysfs tree.
pub fn probe_in(sys: &Sysfs, bdf: Option<&str>) -> ProbeSummary {
    let start = Instant::now();
    let mut s = ProbeSummary {
        result: "fail",
        ..ProbeSummary::default()
    };
    let res = probe_steps(sys, bdf, &mut s);
    s.duration_ms = start.elapsed().as_millis() as u64;
    match res {
        Ok(()) => s.result = "pass",
        Err(e) => {
            say!("probe: FAIL: {e}");
            s.reason = Some(e);
        }
    }
    s
}

/// Reads 256 bytes of config space through the sysfs `config` file.
pub(crate) fn read_config(f: &std::fs::File, path: &std::path::Path) -> Result<Vec<u8>, String> {
    let mut cfg = vec![0u8; 256];
    let n = f
        .read_at(&mut cfg, 0)
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    if n < 256 {
        return Err(format!(
            "{} gave {n} bytes (need 256; run as root)",
            path.display()
        ));
    }
    Ok(cfg)
}

fn write_command(f: &std::fs::File, v: u16) -> Result<u16, String> {
    f.write_all_at(&v.to_le_bytes(), pci::PCI_COMMAND as u64)
        .map_err(|e| format!("write command register {v:#06x}: {e}"))?;
    let mut b = [0u8; 2];
    f.read_exact_at(&mut b, pci::PCI_COMMAND as u64)
        .map_err(|e| format!("read command register: {e}"))?;
    Ok(u16::from_le_bytes(b))
}

/// Undoes what the probe changed, whatever happened in between.
struct Restore {
    cfg: Option<(std::fs::File, u16)>,
    power: Option<(std::path::PathBuf, String)>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some((f, cmd)) = self.cfg.take() {
            let _ = f.write_all_at(&cmd.to_le_bytes(), pci::PCI_COMMAND as u64);
        }
        if let Some((p, old)) = self.power.take() {
            let _ = crate::sysfs::sysfs_write(&p, &old);
        }
    }
}

fn probe_steps(sys: &Sysfs, bdf: Option<&str>, s: &mut ProbeSummary) -> Result<(), String> {
    let dev = sys.find_softgpu(bdf)?;
    s.bdf = Some(dev.bdf.clone());
    say!("probe: {dev}");
    let dir = sys.device_dir(&dev.bdf);
    let mut restore = Restore {
        cfg: None,
        power: None,
    };
    // A bound but idle driver (vfio-pci) lets runtime PM put the function in D3hot, where the
    // BARs do not decode; an mmap of resource0 does not wake it. Keep it in D0 while probing.
    let power = dir.join("power/control");
    if dev.driver.is_some()
        && let Ok(old) = std::fs::read_to_string(&power)
    {
        let old = old.trim().to_string();
        if old != "on" {
            crate::sysfs::sysfs_write(&power, "on")?;
            s.runtime_pm_forced_on = true;
            restore.power = Some((power.clone(), old));
        }
    }

    let cfg_path = dir.join("config");
    let cfg_file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&cfg_path)
        .map_err(|e| format!("open {}: {e}", cfg_path.display()))?;
    let cfg = read_config(&cfg_file, &cfg_path)?;
    let (vendor, device, class) = pci::identity(&cfg);
    (s.vendor, s.device, s.class) = (vendor, device, class);
    if (vendor, device, class) != (PCI_VENDOR, PCI_DEVICE, PCI_CLASS) || class != dev.class {
        return Err(format!(
            "config space identity {vendor:04x}:{device:04x} class {class:06x} (sysfs class {:06x})",
            dev.class
        ));
    }
    let caps = pci::capabilities(&cfg)?;
    s.capabilities = caps.iter().map(|c| c.0).collect();
    say!(
        "probe: capabilities {}",
        caps.iter()
            .map(|(id, off)| format!("{id:#04x}@{off:#04x}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for (want, name) in [(CAP_PM, "PM"), (CAP_PCIE, "PCI Express")] {
        if !s.capabilities.contains(&want) {
            return Err(format!("capability {name} ({want:#04x}) missing"));
        }
    }
    let mode = crate::irq::IrqMode::detect(&s.capabilities)?;
    say!("probe: interrupt mode {}", mode.label());
    let pm = pci::find_capability(&cfg, CAP_PM).unwrap_or(0);
    s.power_state = (pci::le16(&cfg, usize::from(pm) + 4) & 3) as u8;
    if s.power_state != 0 {
        return Err(format!(
            "function is in D{} (PMCSR), its BARs do not decode{}",
            s.power_state,
            if dev.driver.is_some() {
                " (a bound driver let runtime PM suspend it)"
            } else {
                ""
            }
        ));
    }

    // Memory space through the config file: off (checked), then on (checked).
    let cmd = pci::le16(&cfg, pci::PCI_COMMAND);
    s.memory_was_enabled = cmd & pci::PCI_COMMAND_MEMORY != 0;
    restore.cfg = Some((
        cfg_file
            .try_clone()
            .map_err(|e| format!("dup {}: {e}", cfg_path.display()))?,
        cmd,
    ));
    let off = write_command(&cfg_file, cmd & !pci::PCI_COMMAND_MEMORY)?;
    let on = write_command(&cfg_file, cmd | pci::PCI_COMMAND_MEMORY)?;
    s.config_write_ok = off & pci::PCI_COMMAND_MEMORY == 0 && on & pci::PCI_COMMAND_MEMORY != 0;
    say!(
        "probe: command register {cmd:#06x}: memory space off -> {off:#06x}, on -> {on:#06x}, D{}",
        s.power_state
    );
    if !s.config_write_ok {
        return Err(format!(
            "memory space bit did not follow config writes (off -> {off:#06x}, on -> {on:#06x})"
        ));
    }

    let size = sys.bar_size(&dev.bdf, 0)?;
    s.bar0_bytes = size;
    if size < BAR0_SIZE {
        return Err(format!("BAR0 is {size} bytes, expected {BAR0_SIZE}"));
    }
    let res_path = dir.join("resource0");
    let res = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&res_path)
        .map_err(|e| format!("open {}: {e}", res_path.display()))?;
    let bar = BarMap::map(&res, 0, &[(0, BAR0_SIZE)])
        .map_err(|e| format!("mmap {}: {e}", res_path.display()))?;
    let magic = bar.r32(MAGIC);
    s.magic = String::from_utf8_lossy(&magic.to_le_bytes()).into_owned();
    s.version = bar.r32(VERSION);
    s.features = bar.r32(FEATURES);
    s.num_queues = bar.r32(NUM_QUEUES);
    s.vram_bytes = bar.r64(VRAM_SIZE);
    let old = bar.r32(SCRATCH);
    s.scratch_ok = [0x1234_5678_u32, 0xdead_beef, !old].iter().all(|&v| {
        bar.w32(SCRATCH, v);
        bar.r32(SCRATCH) == v
    });
    bar.w32(SCRATCH, old);
    drop(bar);
    say!(
        "probe: resource0 mmap: MAGIC {magic:#010x} ({:?}) VERSION {:#010x} FEATURES {:#x} NUM_QUEUES {} VRAM {} MiB SCRATCH {}",
        s.magic,
        s.version,
        s.features,
        s.num_queues,
        s.vram_bytes >> 20,
        if s.scratch_ok { "ok" } else { "BROKEN" }
    );
    drop(restore);
    if magic != MAGIC_VALUE {
        return Err(format!(
            "MAGIC reads {magic:#010x}, expected {MAGIC_VALUE:#010x}"
        ));
    }
    if !s.scratch_ok {
        return Err("SCRATCH does not read back what was written".into());
    }
    if !(1..=8).contains(&s.num_queues) {
        return Err(format!("NUM_QUEUES reads {}", s.num_queues));
    }
    if s.version != VERSION_VALUE {
        return Err(format!("VERSION reads {:#x}", s.version));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sysfs::tests::FakeSys;
    use std::fs;

    /// The probe against a fake sysfs whose `resource0` is a plain file holding register
    /// values (a file has no side effects, so SCRATCH reads back trivially).
    #[test]
    fn probe_fake_device() {
        let f = FakeSys::new();
        f.add_device("0000:00:04.0", (0x1234, 0x5347, 0x030200), None, None);
        let dir = f.root().join("devices/pci0000:00/0000:00:04.0");
        fs::write(dir.join("config"), crate::pci::tests::softgpu_like()).expect("config");
        let mut bar = vec![0u8; BAR0_SIZE as usize];
        bar[0..4].copy_from_slice(b"SYGP");
        bar[4..8].copy_from_slice(&VERSION_VALUE.to_le_bytes());
        bar[8..12].copy_from_slice(&0xffu32.to_le_bytes());
        bar[12..16].copy_from_slice(&2u32.to_le_bytes());
        bar[16..24].copy_from_slice(&(64u64 << 20).to_le_bytes());
        fs::write(dir.join("resource0"), &bar).expect("bar");
        let s = probe_in(&Sysfs::new(f.root()), None);
        assert_eq!(s.reason, None);
        assert_eq!(s.result, "pass");
        assert_eq!(s.capabilities, vec![1, 0x10, 0x11]);
        assert_eq!(s.magic, "SYGP");
        assert_eq!(s.num_queues, 2);
        assert_eq!(s.vram_bytes, 64 << 20);
        assert!(!s.memory_was_enabled);
        assert!(s.config_write_ok);
        assert_eq!(s.power_state, 0);
        assert!(!s.runtime_pm_forced_on, "no driver bound");
        // The command register was restored afterwards.
        let cfg = fs::read(dir.join("config")).expect("read");
        assert_eq!(crate::pci::le16(&cfg, 4) & 2, 0);

        // Wrong magic fails with a reason.
        bar[0] = b'X';
        fs::write(dir.join("resource0"), &bar).expect("bar");
        let s = probe_in(&Sysfs::new(f.root()), Some("0000:00:04.0"));
        assert_eq!(s.result, "fail");
        assert!(
            s.reason.as_deref().is_some_and(|r| r.contains("MAGIC")),
            "{s:?}"
        );
    }

    /// Bound to a driver with runtime PM on `auto`: forced `on` during the probe, restored
    /// after; a function in D3hot is refused before any MMIO.
    #[test]
    fn probe_runtime_pm_and_d3() {
        let f = FakeSys::new();
        f.add_device(
            "0000:00:04.0",
            (0x1234, 0x5347, 0x030200),
            Some("vfio-pci"),
            Some(1),
        );
        let dir = f.root().join("devices/pci0000:00/0000:00:04.0");
        fs::create_dir_all(dir.join("power")).expect("mkdir");
        fs::write(dir.join("power/control"), "auto\n").expect("write");
        let mut cfg = crate::pci::tests::softgpu_like();
        cfg[4] = 0x06; // memory + bus master already on
        cfg[0x44] = 0x03; // PMCSR: D3hot
        fs::write(dir.join("config"), &cfg).expect("config");
        let s = probe_in(&Sysfs::new(f.root()), None);
        assert_eq!(s.result, "fail");
        assert_eq!(s.power_state, 3);
        assert!(
            s.reason.as_deref().is_some_and(|r| r.contains("D3")),
            "{s:?}"
        );
        assert!(s.runtime_pm_forced_on);
        assert_eq!(
            fs::read_to_string(dir.join("power/control")).expect("read"),
            "auto",
            "runtime PM restored"
        );
    }
}
