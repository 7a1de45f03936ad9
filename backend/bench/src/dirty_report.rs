//! `DMA_LOGGING_REPORT` of a whole window against scanning a bitmap of the same size.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::cases::{Settings, fig, human, scattered_pages};
use crate::floors::{BitmapScan, SharedBitmap, WireScan};
use crate::report::{Row, Target, Unit};
use crate::servers::Switchyard;
use crate::stats::{Contender, Plan, interleaved};

/// IOVA of the window the dirty-report case maps.
const DIRTY_IOVA: u64 = 1 << 40;

/// `DMA_LOGGING_REPORT` of a whole window of 1/16/64 GiB with 0.1/1/10 % of its pages dirty,
/// against reading and clearing a bitmap of the same size (the floor) and against that
/// scan plus moving the bitmap over AF_UNIX (the wire floor).
pub fn dirty_report(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    const GIB: u64 = 1 << 30;
    let sizes: &[u64] = if s.quick {
        &[GIB]
    } else {
        &[GIB, 16 * GIB, 64 * GIB]
    };
    let percents = [0.1f64, 1.0, 10.0];
    let plan = s.plan(Plan::new(1, 4, 2), Plan::new(3, 60, 6));
    let (server, dma) = Switchyard::start_regfile_with_dma(dir, "dirty")?;
    let mut client = server.connect(s.stall_timeout())?;
    client
        .dma_logging_start(4096, &[])
        .context("DMA_LOGGING_START")?;
    // Report request: header 16 + feature 8 + report 24; the reply adds the bitmap.
    let head = 16 + 8 + 24;
    for &size in sizes {
        let mem = memfd::MemfdOptions::default()
            .create("dirty-guest")
            .context("memfd")?
            .into_file();
        mem.set_len(size).context("size the guest memory")?;
        let rw = switchyard_proto::consts::VFIO_USER_F_DMA_REGION_READ
            | switchyard_proto::consts::VFIO_USER_F_DMA_REGION_WRITE;
        client
            .dma_map(
                DIRTY_IOVA,
                size,
                rw,
                Some((std::os::fd::AsFd::as_fd(&mem), 0)),
            )
            .context("map the window")?;
        let pages = size / 4096;
        let words = pages.div_ceil(64) as usize;
        let bitmap = SharedBitmap::new(words);
        let mut scan = BitmapScan::new(bitmap.clone());
        let mut wire = WireScan::start(bitmap.clone(), head, head)?;
        let mut direct_out = vec![1u8; words * 8];
        for pct in percents {
            let n = ((pages as f64) * pct / 100.0).round() as u64;
            let dirty = scattered_pages(pages, n, size ^ n);
            let mut results = {
                let (c, dma, dirty, bm) = (&mut client, &dma, &dirty, &bitmap);
                let mut cs = vec![
                    Contender::new("switchyard", move || {
                        for p in dirty {
                            dma.mark_dirty(DIRTY_IOVA + p * 4096, 1)?;
                        }
                        let t0 = Instant::now();
                        let bits = c.dma_logging_report_ref(DIRTY_IOVA, size, 4096)?;
                        let t = t0.elapsed();
                        // Outside the timing: every dirty page came back.
                        let set: u64 = bits.iter().map(|b| u64::from(b.count_ones())).sum();
                        if set != dirty.len() as u64 {
                            bail!("report has {set} pages, {} were dirtied", dirty.len());
                        }
                        Ok(t)
                    }),
                    Contender::new("scan floor", || {
                        bm.set(dirty);
                        Ok(scan.scan())
                    }),
                ];
                let w = &mut wire;
                cs.push(Contender::new("wire floor", move || {
                    bm.set(dirty);
                    w.report()
                }));
                let direct_out = &mut direct_out;
                cs.push(Contender::new("direct", move || {
                    for p in dirty {
                        dma.mark_dirty(DIRTY_IOVA + p * 4096, 1)?;
                    }
                    let t0 = Instant::now();
                    dma.report_dirty(DIRTY_IOVA, size, 4096, direct_out)?;
                    Ok(t0.elapsed())
                }));
                interleaved(&mut cs, plan)?
            };
            let [ours, floor, wire_s, direct] = results.as_mut_slice() else {
                bail!("four contenders, four results");
            };
            let case = format!("DMA_LOGGING_REPORT {} mapped, {pct}% dirty", human(size));
            let ours_fig = fig("switchyard", ours, Unit::Micros, 0.0)?;
            let floor_fig = fig(
                "read+clear scan of the same bitmap",
                floor,
                Unit::Micros,
                0.0,
            )?;
            let note = format!(
                "one window, 4 KiB pages, {n} scattered dirty pages, {} KiB bitmap; untimed: the device marks the pages",
                words * 8 / 1024
            );
            rows.push(Row::new(
                "dirty-report",
                case.clone(),
                "report",
                "regfile blocking",
                Some(size),
                Unit::Micros,
                ours_fig.clone(),
                Some(fig(
                    "read+clear scan of the same bitmap",
                    floor,
                    Unit::Micros,
                    0.0,
                )?),
                None,
                Some(Target {
                    floor_ratio: 1.5,
                    beat_peer: false,
                    plus: 0.0,
                }),
                note.clone(),
            ));
            rows.push(Row::new(
                "dirty-report",
                case.clone(),
                "report-direct",
                "DmaSpace::report_dirty in process",
                Some(size),
                Unit::Micros,
                fig("report_dirty", direct, Unit::Micros, 0.0)?,
                Some(floor_fig.clone()),
                None,
                Some(Target {
                    floor_ratio: 1.5,
                    beat_peer: false,
                    plus: 0.0,
                }),
                "decomposition: the server's flip and drain alone, no message".into(),
            ));
            rows.push(Row::new(
                "dirty-report",
                case,
                "report-wire",
                "regfile blocking",
                Some(size),
                Unit::Micros,
                ours_fig,
                Some(fig(
                    "scan + AF_UNIX request/reply of the same bytes",
                    wire_s,
                    Unit::Micros,
                    0.0,
                )?),
                None,
                None,
                note,
            ));
        }
        client
            .dma_unmap(DIRTY_IOVA, size, 0)
            .context("unmap the window")?;
    }
    drop(client);
    server.shutdown()
}
