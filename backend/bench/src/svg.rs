//! A hand-written SVG plot of the results: round-trip latency (p50 and p99) against size with
//! the floors and the peer, COPY throughput against size with the memcpy floors (single
//! thread for one queue, two threads for two queues), DMA_LOGGING_REPORT latency against
//! the mapped size with its floors, and swap and migration downtime against the VRAM size
//! with the migration floors.

use std::fmt::Write as _;

use crate::cases::human;
use crate::report::{Results, Row, Unit};

struct Series {
    name: String,
    color: &'static str,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

struct Panel<'a> {
    title: &'a str,
    xlabel: &'a str,
    ylabel: &'a str,
    ylog: bool,
    series: Vec<Series>,
}

const W: f64 = 560.0;
const H: f64 = 380.0;
const ML: f64 = 64.0;
const MR: f64 = 16.0;
const MT: f64 = 34.0;
const MB: f64 = 120.0;
/// Panels per row of the plot.
const COLUMNS: usize = 3;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn nice_num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned()
    } else {
        format!("{v:.2}")
    }
}

fn panel(out: &mut String, ox: f64, oy: f64, p: &Panel<'_>) {
    let pts: Vec<(f64, f64)> = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|&(x, y)| x > 0.0 && y > 0.0 && y.is_finite())
        .collect();
    let _ = write!(
        out,
        r#"<g transform="translate({ox},{oy})"><text x="{}" y="20" text-anchor="middle" font-size="14" font-weight="bold">{}</text>"#,
        W / 2.0,
        esc(p.title)
    );
    if pts.is_empty() {
        out.push_str("</g>");
        return;
    }
    let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in &pts {
        xmin = xmin.min(x);
        xmax = xmax.max(x);
        ymin = ymin.min(y);
        ymax = ymax.max(y);
    }
    let (lxmin, lxmax) = (xmin.log2(), xmax.log2().max(xmin.log2() + 1.0));
    let (ty0, ty1) = if p.ylog {
        (
            ymin.log10().floor(),
            ymax.log10().ceil().max(ymin.log10().floor() + 1.0),
        )
    } else {
        (0.0, ymax * 1.1)
    };
    let pw = W - ML - MR;
    let ph = H - MT - MB;
    let sx = |x: f64| ML + (x.log2() - lxmin) / (lxmax - lxmin) * pw;
    let sy = |y: f64| {
        let t = if p.ylog { y.log10() } else { y };
        MT + ph - (t - ty0) / (ty1 - ty0) * ph
    };
    // Frame and grid.
    let _ = write!(
        out,
        r##"<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
    );
    let yticks: Vec<f64> = if p.ylog {
        let mut v = Vec::new();
        let mut e = ty0;
        while e <= ty1 + 1e-9 {
            for m in [1.0, 2.0, 5.0] {
                let y = m * 10f64.powf(e);
                if y.log10() >= ty0 - 1e-9 && y.log10() <= ty1 + 1e-9 {
                    v.push(y);
                }
            }
            e += 1.0;
        }
        v
    } else {
        let step = [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
            .into_iter()
            .find(|s| ty1 / s <= 8.0)
            .unwrap_or(100.0);
        (0..=((ty1 / step) as usize))
            .map(|i| i as f64 * step)
            .collect()
    };
    for y in yticks {
        let py = sy(y);
        let _ = write!(
            out,
            r##"<line x1="{ML}" x2="{}" y1="{py:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end" font-size="10">{}</text>"##,
            ML + pw,
            ML - 4.0,
            py + 3.0,
            nice_num(y)
        );
    }
    let mut xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    for x in xs {
        let px = sx(x);
        let _ = write!(
            out,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{MT}" y2="{}" stroke="#eee"/><text x="{px:.1}" y="{}" text-anchor="middle" font-size="10">{}</text>"##,
            MT + ph,
            MT + ph + 14.0,
            esc(&human(x as u64))
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="11">{}</text><text transform="translate(14,{}) rotate(-90)" text-anchor="middle" font-size="11">{}</text>"#,
        ML + pw / 2.0,
        MT + ph + 30.0,
        esc(p.xlabel),
        MT + ph / 2.0,
        esc(p.ylabel)
    );
    // Lines.
    for s in &p.series {
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|&&(x, y)| x > 0.0 && y > 0.0 && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        if path.is_empty() {
            continue;
        }
        let dash = if s.dashed {
            r#" stroke-dasharray="5,3""#
        } else {
            ""
        };
        let _ = write!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="1.6"{dash}/>"#,
            path.join(" "),
            s.color
        );
        for pt in &path {
            if let Some((x, y)) = pt.split_once(',') {
                let _ = write!(
                    out,
                    r#"<circle cx="{x}" cy="{y}" r="2.2" fill="{}"/>"#,
                    s.color
                );
            }
        }
    }
    // Legend, two columns below the axis.
    for (i, s) in p.series.iter().enumerate() {
        let col = (i % 2) as f64;
        let row = (i / 2) as f64;
        let lx = ML + col * (pw / 2.0);
        let ly = MT + ph + 48.0 + row * 15.0;
        let dash = if s.dashed {
            r#" stroke-dasharray="5,3""#
        } else {
            ""
        };
        let _ = write!(
            out,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="2"{dash}/><text x="{}" y="{}" font-size="10">{}</text>"#,
            lx + 22.0,
            s.color,
            lx + 26.0,
            ly + 3.5,
            esc(&s.name)
        );
    }
    out.push_str("</g>");
}

/// p50 and p99 points of one series pair.
type Pair = (Vec<(f64, f64)>, Vec<(f64, f64)>);

fn sweep_series(rows: &[Row], op: &str) -> Vec<Series> {
    let sweep: Vec<&Row> = rows
        .iter()
        .filter(|r| r.group == "size-sweep" && r.op == op)
        .collect();
    let pick = |variant_contains: &str, get: &dyn Fn(&Row) -> Option<(f64, f64)>| -> Pair {
        let mut p50 = Vec::new();
        let mut p99 = Vec::new();
        for r in sweep
            .iter()
            .filter(|r| r.variant.contains(variant_contains))
        {
            if let (Some(size), Some((a, b))) = (r.size, get(r)) {
                p50.push((size as f64, a));
                p99.push((size as f64, b));
            }
        }
        (p50, p99)
    };
    let ours = |r: &Row| r.ours.as_ref().map(|f| (f.p50, f.p99));
    let floor = |r: &Row| r.floor.as_ref().map(|f| (f.p50, f.p99));
    let peer = |r: &Row| r.peer.as_ref().map(|f| (f.p50, f.p99));
    let mut out = Vec::new();
    let mut add = |name: &str, color: &'static str, (p50, p99): Pair| {
        out.push(Series {
            name: format!("{name} p50"),
            color,
            dashed: false,
            points: p50,
        });
        out.push(Series {
            name: format!("{name} p99"),
            color,
            dashed: true,
            points: p99,
        });
    };
    add("switchyard blocking", "#1f77b4", pick("blocking", &ours));
    add("floor (blocking echo)", "#7f7f7f", pick("blocking", &floor));
    add("switchyard spin", "#2ca02c", pick("spin", &ours));
    add("floor (spinning echo)", "#bcbd22", pick("spin", &floor));
    add("vfio_user peer", "#d62728", pick("blocking", &peer));
    out
}

fn copy_series(rows: &[Row]) -> Vec<Series> {
    let copy: Vec<&Row> = rows
        .iter()
        .filter(|r| r.group == "copy" && (r.op == "g2v" || r.op == "v2g"))
        .collect();
    let mut out = Vec::new();
    let combos = [
        ("g2v", "1 queue", "guest→VRAM, 1 queue", "#1f77b4", false),
        ("g2v", "2 queues", "guest→VRAM, 2 queues", "#1f77b4", true),
        ("v2g", "1 queue", "VRAM→guest, 1 queue", "#2ca02c", false),
        ("v2g", "2 queues", "VRAM→guest, 2 queues", "#2ca02c", true),
    ];
    for (op, variant, name, color, dashed) in combos {
        let points = copy
            .iter()
            .filter(|r| r.op == op && r.variant.contains(variant))
            .filter_map(|r| Some((r.size? as f64, r.ours.as_ref()?.p50)))
            .collect();
        out.push(Series {
            name: format!("{name} p50"),
            color,
            dashed,
            points,
        });
    }
    // Each queue count has its own floor (guest→VRAM run's; VRAM→guest is measured too).
    for (variant, name, dashed) in [
        ("1 queue", "single-thread memcpy p50", false),
        ("2 queues", "2-thread memcpy p50", true),
    ] {
        let points = copy
            .iter()
            .filter(|r| r.op == "g2v" && r.variant.contains(variant))
            .filter_map(|r| Some((r.size? as f64, r.floor.as_ref()?.p50)))
            .collect();
        out.push(Series {
            name: name.into(),
            color: "#7f7f7f",
            dashed,
            points,
        });
    }
    out
}

/// The p50 of a row's own figure.
fn p50_ours(r: &Row) -> Option<f64> {
    r.ours.as_ref().map(|f| f.p50)
}

/// The p50 of a row's floor.
fn p50_floor(r: &Row) -> Option<f64> {
    r.floor.as_ref().map(|f| f.p50)
}

fn series(name: &str, color: &'static str, dashed: bool, points: Vec<(f64, f64)>) -> Series {
    Series {
        name: name.into(),
        color,
        dashed,
        points,
    }
}

fn dirty_series(rows: &[Row]) -> Vec<Series> {
    let at = |op: &str, pct: &str, get: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter()
            .filter(|r| r.group == "dirty-report" && r.op == op && r.case.contains(pct))
            .filter_map(|r| Some((r.size? as f64, get(r)?)))
            .collect()
    };
    let (ours, floor) = (p50_ours, p50_floor);
    vec![
        series(
            "report, 1% dirty p50",
            "#1f77b4",
            false,
            at("report", " 1% dirty", &ours),
        ),
        series(
            "report, 10% dirty p50",
            "#1f77b4",
            true,
            at("report", "10% dirty", &ours),
        ),
        series(
            "server drain only, 1% p50",
            "#2ca02c",
            false,
            at("report-direct", " 1% dirty", &ours),
        ),
        series(
            "floor: scan + AF_UNIX, 1% p50",
            "#bcbd22",
            false,
            at("report-wire", " 1% dirty", &floor),
        ),
        series(
            "floor: bitmap scan, 1% p50",
            "#7f7f7f",
            false,
            at("report", " 1% dirty", &floor),
        ),
    ]
}

fn downtime_series(rows: &[Row]) -> Vec<Series> {
    // Swap rows are in µs, migration rows in ms; the panel is in ms.
    let at = |op: &str, variant: &str, get: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter()
            .filter(|r| r.op == op && r.variant.contains(variant))
            .filter_map(|r| {
                let ms = match r.unit {
                    Unit::Micros => get(r)? / 1e3,
                    Unit::Millis => get(r)?,
                    Unit::GBps | Unit::Mwps => return None,
                };
                Some((r.size? as f64, ms))
            })
            .collect()
    };
    let (ours, floor) = (p50_ours, p50_floor);
    vec![
        series(
            "swap: slot held, idle p50",
            "#1f77b4",
            false,
            at("swap-held", "idle", &ours),
        ),
        series(
            "swap: slot held, busy p50",
            "#17becf",
            false,
            at("swap-held", "busy", &ours),
        ),
        series(
            "swap: engine stall, busy p50",
            "#9467bd",
            false,
            at("swap-stall", "busy", &ours),
        ),
        series(
            "migration: stop-copy only p50",
            "#d62728",
            false,
            at("mig-stop-copy", "", &ours),
        ),
        series(
            "migration: pre-copy, idle p50",
            "#2ca02c",
            false,
            at("mig-pre-copy", "", &ours),
        ),
        series(
            "migration: pre-copy, 10% p50",
            "#ff7f0e",
            false,
            at("mig-pre-copy-dirty", "", &ours),
        ),
        series(
            "migration: vram_mmap=off, idle p50",
            "#8c564b",
            false,
            at("mig-pre-copy-trapped", "", &ours),
        ),
        series(
            "migration: vram_mmap=off, 10% p50",
            "#e377c2",
            false,
            at("mig-pre-copy-trapped-dirty", "", &ours),
        ),
        series(
            "floor: memcpy, stop-copy bytes",
            "#7f7f7f",
            true,
            at("mig-stop-copy", "", &floor),
        ),
        series(
            "floor: memcpy, pre-copy dirtied bytes",
            "#bcbd22",
            true,
            at("mig-pre-copy-dirty", "", &floor),
        ),
    ]
}

/// Renders the plot.
pub fn render(results: &Results) -> String {
    let panels = [
        Panel {
            title: "REGION_READ round trip (regfile)",
            xlabel: "transfer size",
            ylabel: "latency, µs (log)",
            ylog: true,
            series: sweep_series(&results.rows, "read"),
        },
        Panel {
            title: "REGION_WRITE round trip (regfile)",
            xlabel: "transfer size",
            ylabel: "latency, µs (log)",
            ylog: true,
            series: sweep_series(&results.rows, "write"),
        },
        Panel {
            title: "softgpu COPY throughput",
            xlabel: "transfer size",
            ylabel: "GB/s (log)",
            ylog: true,
            series: copy_series(&results.rows),
        },
        Panel {
            title: "DMA_LOGGING_REPORT vs mapped size",
            xlabel: "mapped size",
            ylabel: "latency, µs (log)",
            ylog: true,
            series: dirty_series(&results.rows),
        },
        Panel {
            title: "Swap and migration downtime vs VRAM size",
            xlabel: "VRAM size",
            ylabel: "downtime, ms (log)",
            ylog: true,
            series: downtime_series(&results.rows),
        },
    ];
    let columns = COLUMNS.min(panels.len());
    let panel_rows = panels.len().div_ceil(COLUMNS);
    let total_w = W * columns as f64;
    let total_h = H * panel_rows as f64 + 24.0;
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" font-family="sans-serif" viewBox="0 0 {total_w} {total_h}"><rect width="100%" height="100%" fill="white"/>"#,
    );
    for (i, p) in panels.iter().enumerate() {
        let (col, row) = (i % COLUMNS, i / COLUMNS);
        panel(&mut out, col as f64 * W, row as f64 * H, p);
    }
    let _ = write!(
        out,
        r##"<text x="8" y="{}" font-size="10" fill="#555">{} mode; {} ({} CPUs), kernel {}; p99 dashed (downtime panel: floors dashed); spin = adaptive polling {} µs</text></svg>"##,
        total_h - 8.0,
        esc(&results.mode),
        esc(&results.machine.cpu),
        results.machine.cpus,
        esc(&results.machine.kernel),
        results.spin_us
    );
    out.push('\n');
    out
}
