//! The device's figures from the source servers' logs, and the VRAM fill and its check.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use switchyard_guest_tests::{Server, wait_until};

use crate::{CHUNK, Case};

/// What the source servers logged about the devices' side of the migration: the times
/// (`stop_copy_ms`, `stream_read_ms`, `precopy_ms`) of the slowest device, the stream counts
/// of all.
pub(crate) fn device_figures(logs: &[String]) -> BTreeMap<&'static str, f64> {
    let mut all: BTreeMap<&'static str, f64> = BTreeMap::new();
    for log in logs {
        for (name, v) in one_device(log) {
            let e = all.entry(name).or_insert(0.0);
            *e = if name.ends_with("_ms") {
                e.max(v)
            } else {
                *e + v
            };
        }
    }
    all
}

fn one_device(log: &str) -> BTreeMap<&'static str, f64> {
    let mut fig = BTreeMap::new();
    // `migration state` lines carry `arc=.. from=STATE to=STATE`; match whole words so that
    // `to=PreCopy` is not `to=PreCopyP2p`.
    let stamp = |word: &str| {
        log.lines()
            .find(|l| l.contains("migration state") && l.split_whitespace().any(|w| w == word))
            .and_then(seconds_of_day)
    };
    let ms = |a: f64, b: f64| (b - a).rem_euclid(86_400.0) * 1000.0;
    let precopy = stamp("to=PreCopy");
    let stop = stamp("to=StopCopy");
    if let (Some(a), Some(b)) = (stop, stamp("from=StopCopy")) {
        fig.insert("stop_copy_ms", ms(a, b));
    }
    // The stream's last byte read (its end record): the device's share of the downtime.
    // QEMU leaves STOP_COPY only in its clean-up after the migration completed, so the time
    // in STOP_COPY above also holds the rest of QEMU's switchover.
    let read = log
        .lines()
        .find(|l| l.contains("outgoing migration stream complete"))
        .and_then(seconds_of_day);
    if let (Some(a), Some(b)) = (stop, read) {
        fig.insert("stream_read_ms", ms(a, b));
    }
    if let (Some(a), Some(b)) = (precopy, stop) {
        fig.insert("precopy_ms", ms(a, b));
    }
    let closed = log
        .lines()
        .find(|l| l.contains("outgoing migration stream closed"));
    if let Some(l) = closed {
        for (key, name) in [
            ("rounds", "device_rounds"),
            ("pages_sent", "device_pages_sent"),
            ("padding", "device_padding_bytes"),
        ] {
            let v = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok());
            fig.extend(v.map(|v| (name, v)));
        }
    }
    fig
}

/// The time of day of a tracing line's leading `YYYY-MM-DDTHH:MM:SS.ffffffZ`, in seconds.
fn seconds_of_day(line: &str) -> Option<f64> {
    let (_, time) = line.split_whitespace().next()?.split_once('T')?;
    let mut t = time.strip_suffix('Z')?.splitn(3, ':');
    let (h, m): (f64, f64) = (t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    let s: f64 = t.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// The fill's 1 MiB chunk at byte `offset`: splitmix64 of each 8-byte word's index (no page
/// of it is zero).
fn fill_chunk(buf: &mut [u8], offset: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        let mut z = (offset / 8 + i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        w.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
}

/// The VRAM memfd of `server` (opened through its `/proc/PID/fd`), and its size.
pub(crate) fn vram_file(server: &Server) -> Result<(File, u64)> {
    let pid = server
        .pid()
        .map(|p| std::path::PathBuf::from(format!("/proc/{p}")))
        .with_context(|| format!("the server of {} is not running", server.socket.display()))?;
    let found = wait_until(Duration::from_secs(10), "the server's VRAM memfd", || {
        std::fs::read_dir(pid.join("fd"))
            .ok()?
            .flatten()
            .find_map(|e| {
                let target = std::fs::read_link(e.path()).ok()?;
                let vram = target
                    .to_string_lossy()
                    .starts_with("/memfd:switchyard-softgpu-vram");
                vram.then(|| e.path())
            })
    })?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&found)
        .with_context(|| format!("open {}", found.display()))?;
    let len = file.metadata()?.len();
    Ok((file, len))
}

/// Writes the fill into the first [`FILL_QUARTERS`](crate::FILL_QUARTERS) quarters of the server's VRAM.
pub(crate) fn fill_vram(server: &Server, case: &Case) -> Result<()> {
    let (vram, len) = vram_file(server)?;
    let want = case.vram_mib.unwrap_or(0) << 20;
    ensure!(len == want, "VRAM memfd is {len} bytes, not {want}");
    let mut buf = vec![0u8; CHUNK as usize];
    for off in (0..case.fill_bytes()).step_by(CHUNK as usize) {
        fill_chunk(&mut buf, off);
        vram.write_all_at(&buf, off)?;
    }
    Ok(())
}

/// The destination's VRAM holds the fill and zeros behind it.
pub(crate) fn check_vram(vram: &File, case: &Case) -> Result<()> {
    let (mut got, mut want) = (vec![0u8; CHUNK as usize], vec![0u8; CHUNK as usize]);
    let (mut bad_pages, mut first) = (0u64, None);
    for off in (0..case.vram_mib.unwrap_or(0) << 20).step_by(CHUNK as usize) {
        vram.read_exact_at(&mut got, off)?;
        if off < case.fill_bytes() {
            fill_chunk(&mut want, off);
        } else {
            want.fill(0);
        }
        for (i, (g, w)) in got.chunks(4096).zip(want.chunks(4096)).enumerate() {
            if g != w {
                bad_pages += 1;
                first.get_or_insert(off + 4096 * i as u64);
            }
        }
    }
    ensure!(
        bad_pages == 0,
        "destination VRAM differs from the source's in {bad_pages} pages (first at {:#x})",
        first.unwrap_or(0)
    );
    Ok(())
}
