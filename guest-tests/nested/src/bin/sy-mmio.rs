//! `sy-mmio`: times MMIO reads of one BAR register from guest user space (no driver, no VFIO),
//! for the nested MMIO benchmark: the same loop against a device assigned directly, a device
//! the VMM emulates, and a device served over vfio-user shows what each path costs.
//!
//! ```text
//! sy-mmio --id VID:DID [--nth K] [--bar N] [--offset O] [--count N] [--label L] [--expect V]
//! ```
//!
//! `--expect V`: every read must return V (a register that never changes, read while the
//! server behind it is killed and replaced); the JSON counts the reads that did not, and the
//! exit code is 1 if any.
//!
//! Finds the K-th (default 0) PCI function with that ID in sysfs, turns on memory decoding in
//! its COMMAND register (through the sysfs `config` file), mmaps `resourceN` and times `count`
//! 32-bit volatile reads at `offset`, one by one (percentiles) and as one batch (mean without
//! the clock's own cost). Prints `SY-MMIO {json}`; exit 0 on success. A device bound to a
//! driver that claimed its BARs needs `iomem=relaxed` on the kernel command line.

#![forbid(unsafe_code)]

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::json;
use sygpu_driver::mmio::BarMap;
use sygpu_driver::sysfs::{parse_hex, resource_size};

struct Args {
    vendor: u16,
    device: u16,
    nth: usize,
    bar: usize,
    offset: u64,
    count: usize,
    label: String,
    expect: Option<u32>,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        vendor: 0,
        device: 0,
        nth: 0,
        bar: 0,
        offset: 0,
        count: 2000,
        label: String::new(),
        expect: None,
    };
    let mut id = None;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        let num = |s: String| -> Result<u64> {
            parse_hex(&s)
                .filter(|_| s.starts_with("0x"))
                .or_else(|| s.parse().ok())
                .with_context(|| format!("bad number `{s}`"))
        };
        match k.as_str() {
            "--id" => id = Some(v()?),
            "--nth" => a.nth = usize::try_from(num(v()?)?)?,
            "--bar" => a.bar = usize::try_from(num(v()?)?)?,
            "--offset" => a.offset = num(v()?)?,
            "--count" => a.count = usize::try_from(num(v()?)?)?,
            "--label" => a.label = v()?,
            "--expect" => a.expect = Some(u32::try_from(num(v()?)?)?),
            other => bail!("unknown argument `{other}`"),
        }
    }
    let id = id.context("--id VID:DID is required")?;
    let (v, d) = id.split_once(':').context("--id wants VID:DID")?;
    a.vendor = u16::from_str_radix(v, 16).context("vendor id")?;
    a.device = u16::from_str_radix(d, 16).context("device id")?;
    if a.bar > 5 || a.count == 0 || !a.offset.is_multiple_of(4) {
        bail!("--bar 0..5, --count > 0, --offset 4-byte aligned");
    }
    Ok(a)
}

fn find(vendor: u16, device: u16, nth: usize) -> Result<String> {
    let mut found = vec![];
    for e in fs::read_dir("/sys/bus/pci/devices")? {
        let p = e?.path();
        let rd = |f: &str| {
            fs::read_to_string(p.join(f))
                .ok()
                .and_then(|s| parse_hex(s.trim()))
        };
        if rd("vendor") == Some(u64::from(vendor)) && rd("device") == Some(u64::from(device)) {
            found.push(
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    found.sort();
    found.get(nth).cloned().with_context(|| {
        format!("no PCI device {vendor:04x}:{device:04x} number {nth} (found {found:?})")
    })
}

fn enable_memory(dir: &Path) -> Result<()> {
    let cfg = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("config"))?;
    let mut cmd = [0u8; 2];
    cfg.read_exact_at(&mut cmd, 4)?;
    let v = u16::from_le_bytes(cmd) | 0x2;
    cfg.write_all_at(&v.to_le_bytes(), 4)?;
    Ok(())
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn run(a: &Args) -> Result<serde_json::Value> {
    let bdf = find(a.vendor, a.device, a.nth)?;
    let dir = Path::new("/sys/bus/pci/devices").join(&bdf);
    let driver = fs::read_link(dir.join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    enable_memory(&dir).context("enable memory decoding")?;
    let res = fs::read_to_string(dir.join("resource"))?;
    let size = resource_size(&res, a.bar).context("resource file")?;
    if size < a.offset + 4 {
        bail!(
            "BAR{} is {size} bytes; offset {:#x} is outside",
            a.bar,
            a.offset
        );
    }
    let path = dir.join(format!("resource{}", a.bar));
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    let bar =
        BarMap::map(&file, 0, &[(0, size)]).with_context(|| format!("mmap {}", path.display()))?;
    let first = bar.r32(a.offset);
    for _ in 0..a.count.min(50) {
        std::hint::black_box(bar.r32(a.offset));
    }
    let mut each = Vec::with_capacity(a.count);
    let mut mismatches = 0u64;
    let mut first_mismatch = None;
    for i in 0..a.count {
        let t = Instant::now();
        let v = bar.r32(a.offset);
        each.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        if a.expect.is_some_and(|e| e != v) {
            mismatches += 1;
            first_mismatch.get_or_insert((i, v));
        }
    }
    let t = Instant::now();
    for _ in 0..a.count {
        std::hint::black_box(bar.r32(a.offset));
    }
    let batch_ns = t.elapsed().as_nanos() as f64 / a.count as f64;
    each.sort_unstable();
    Ok(json!({
        "label": a.label,
        "bdf": bdf,
        "id": format!("{:04x}:{:04x}", a.vendor, a.device),
        "driver": driver,
        "bar": a.bar,
        "offset": a.offset,
        "value": format!("{first:#010x}"),
        "expect": a.expect.map(|e| format!("{e:#010x}")),
        "mismatches": mismatches,
        "first_mismatch": first_mismatch.map(|(i, v)| json!({ "read": i, "value": format!("{v:#010x}") })),
        "count": a.count,
        "read_ns": {
            "min": each[0],
            "p50": percentile(&each, 0.5),
            "p90": percentile(&each, 0.9),
            "p99": percentile(&each, 0.99),
            "max": each[each.len() - 1],
            "batch_mean": batch_ns,
        },
    }))
}

fn main() {
    let r = parse_args().and_then(|a| run(&a));
    match r {
        Ok(v) => {
            println!("SY-MMIO {v}");
            if v["mismatches"].as_u64().is_some_and(|n| n > 0) {
                std::process::exit(1);
            }
        }
        Err(e) => {
            println!("SY-MMIO {}", json!({ "error": format!("{e:#}") }));
            std::process::exit(1);
        }
    }
}
