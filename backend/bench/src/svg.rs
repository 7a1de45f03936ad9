//! The SVG plot of the results, drawn with `plotters`' SVG backend: round-trip latency (p50
//! and p99) against size with the floors and the peer, COPY throughput against size with the
//! memcpy floors (single thread for one queue, two threads for two queues),
//! DMA_LOGGING_REPORT latency against the mapped size with its floors, and swap and migration
//! downtime against the VRAM size with the migration floors. Every axis is logarithmic.
//!
//! Only the SVG backend is built: text is written as `<text>` elements for the viewer to
//! render, and laid out with `plotters`' built-in size estimate (no system fonts).

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::{
    BindKeyPoints, ChartBuilder, Circle, Color, DashedLineSeries, DrawingArea,
    DrawingAreaErrorKind, DrawingBackend, IntoDrawingArea, IntoFont, IntoLogRange, LineSeries,
    PathElement, RGBColor, Rectangle, SVGBackend, ShapeStyle, Text, TextStyle, WHITE,
};
use plotters::style::FontStyle;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::cases::human;
use crate::report::{Results, Row, Unit};

/// The colours of the series (matplotlib's tab10).
mod tab10 {
    use plotters::prelude::RGBColor;

    pub const BLUE: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
    pub const ORANGE: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
    pub const GREEN: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
    pub const RED: RGBColor = RGBColor(0xd6, 0x27, 0x28);
    pub const PURPLE: RGBColor = RGBColor(0x94, 0x67, 0xbd);
    pub const BROWN: RGBColor = RGBColor(0x8c, 0x56, 0x4b);
    pub const PINK: RGBColor = RGBColor(0xe3, 0x77, 0xc2);
    pub const GREY: RGBColor = RGBColor(0x7f, 0x7f, 0x7f);
    pub const OLIVE: RGBColor = RGBColor(0xbc, 0xbd, 0x22);
    pub const CYAN: RGBColor = RGBColor(0x17, 0xbe, 0xcf);
}

const FRAME: RGBColor = RGBColor(0x44, 0x44, 0x44);
const GRID: RGBColor = RGBColor(0xdd, 0xdd, 0xdd);
const GRID_LIGHT: RGBColor = RGBColor(0xee, 0xee, 0xee);
const FOOTNOTE: RGBColor = RGBColor(0x55, 0x55, 0x55);

struct Series {
    name: String,
    color: RGBColor,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// One panel: both axes logarithmic.
struct Panel<'a> {
    title: &'a str,
    xlabel: &'a str,
    ylabel: &'a str,
    series: Vec<Series>,
}

/// Size of one panel, px.
const W: u32 = 560;
const H: u32 = 380;
/// Height of the chart (title, plot, axis labels) within a panel; the legend is below it.
const CHART_H: u32 = 290;
/// Width of the y axis labels, px; the legend lines up with the plot's left edge.
const Y_LABELS: u32 = 60;
const MARGIN: u32 = 8;
const MARGIN_RIGHT: u32 = 18;
/// Height of the footnote below the panels.
const FOOTER: u32 = 24;
/// Panels per row of the plot.
const COLUMNS: usize = 3;

/// A sans-serif font of `px` pixels as the SVG shows it (the SVG backend writes
/// `font-size` as the requested size / 1.24).
fn font(px: f64) -> TextStyle<'static> {
    ("sans-serif", px * 1.24).into_font().into()
}

fn bold(px: f64) -> TextStyle<'static> {
    ("sans-serif", px * 1.24, FontStyle::Bold)
        .into_font()
        .into()
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

/// Points that a log-log plot can show.
fn plottable(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    points
        .iter()
        .copied()
        .filter(|&(x, y)| x > 0.0 && x.is_finite() && y > 0.0 && y.is_finite())
        .collect()
}

/// The y axis: its range (whole decades around the data), the labelled ticks and the
/// unlabelled grid lines. Up to three decades are labelled at 1, 2 and 5 × 10^k; wider
/// ranges only at the powers of ten, with grid lines at 2 and 5 × 10^k.
struct YAxis {
    range: (f64, f64),
    labelled: Vec<f64>,
    grid: Vec<f64>,
}

fn y_axis(ymin: f64, ymax: f64) -> YAxis {
    let e0 = ymin.log10().floor();
    let e1 = ymax.log10().ceil().max(e0 + 1.0);
    let dense = e1 - e0 <= 3.0;
    let (mut labelled, mut grid) = (Vec::new(), Vec::new());
    let mut e = e0;
    while e < e1 {
        let decade = 10f64.powf(e);
        labelled.push(decade);
        let between = [2.0 * decade, 5.0 * decade];
        if dense {
            labelled.extend(between);
        } else {
            grid.extend(between);
        }
        e += 1.0;
    }
    labelled.push(10f64.powf(e1));
    YAxis {
        range: (10f64.powf(e0), 10f64.powf(e1)),
        labelled,
        grid,
    }
}

type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel<'_>) -> Drawn<DB> {
    let (chart_area, legend_area) = area.split_vertically(CHART_H);
    let pts: Vec<(f64, f64)> = p.series.iter().flat_map(|s| plottable(&s.points)).collect();
    let title = bold(14.0);
    if pts.is_empty() {
        chart_area.draw(&Text::new(
            format!("{} (no data)", p.title),
            (W as i32 / 2, MARGIN as i32),
            title.pos(Pos::new(HPos::Center, VPos::Top)),
        ))?;
        return Ok(());
    }
    let mut xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let (ymin, ymax) = pts.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &(_, y)| {
        (lo.min(y), hi.max(y))
    });
    // A quarter of an octave either side keeps the end points off the frame; a single size
    // gets an octave either side.
    let pad = if xs.len() > 1 { 2f64.powf(0.25) } else { 2.0 };
    let (xlo, xhi) = (xs[0] / pad, xs[xs.len() - 1] * pad);
    let y = y_axis(ymin, ymax);
    let (ylo, yhi) = y.range;

    let mut chart = ChartBuilder::on(&chart_area)
        .caption(p.title, title)
        .margin(MARGIN)
        .margin_right(MARGIN_RIGHT)
        .x_label_area_size(40)
        .y_label_area_size(Y_LABELS)
        .build_cartesian_2d(
            (xlo..xhi).log_scale().with_key_points(xs),
            (ylo..yhi)
                .log_scale()
                .with_key_points(y.labelled)
                .with_light_points(y.grid),
        )?;
    chart
        .configure_mesh()
        .bold_line_style(GRID)
        .light_line_style(GRID_LIGHT)
        .axis_style(FRAME)
        .label_style(font(10.0))
        .axis_desc_style(font(11.0))
        .x_label_formatter(&|x| human(x.round() as u64))
        .y_label_formatter(&|y| nice_num(*y))
        .x_desc(p.xlabel)
        .y_desc(p.ylabel)
        .draw()?;
    chart.draw_series(std::iter::once(Rectangle::new(
        [(xlo, ylo), (xhi, yhi)],
        FRAME.stroke_width(1),
    )))?;
    for s in &p.series {
        let points = plottable(&s.points);
        let line = s.color.stroke_width(2);
        if s.dashed {
            chart.draw_series(DashedLineSeries::new(points.iter().copied(), 5, 3, line))?;
        } else {
            chart.draw_series(LineSeries::new(points.iter().copied(), line))?;
        }
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 2, s.color.filled())))?;
    }
    legend(&legend_area, &p.series)
}

/// The legend, two columns below the axis, under the plot.
fn legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, series: &[Series]) -> Drawn<DB> {
    let left = (MARGIN + Y_LABELS) as i32;
    let column = (W - MARGIN - Y_LABELS - MARGIN_RIGHT) as i32 / 2;
    for (i, s) in series.iter().enumerate() {
        let x = left + (i % 2) as i32 * column;
        let y = 8 + (i / 2) as i32 * 15;
        let line = ShapeStyle::from(s.color).stroke_width(2);
        let ends = vec![(x, y), (x + 22, y)];
        if s.dashed {
            area.draw(&DashedPathElement::new(ends, 5, 3, line))?;
        } else {
            area.draw(&PathElement::new(ends, line))?;
        }
        area.draw(&Text::new(
            s.name.as_str(),
            (x + 26, y),
            font(10.0).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
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
    let mut add = |name: &str, color: RGBColor, (p50, p99): Pair| {
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
    add("switchyard blocking", tab10::BLUE, pick("blocking", &ours));
    add(
        "floor (blocking echo)",
        tab10::GREY,
        pick("blocking", &floor),
    );
    add("switchyard spin", tab10::GREEN, pick("spin", &ours));
    add("floor (spinning echo)", tab10::OLIVE, pick("spin", &floor));
    add("vfio_user peer", tab10::RED, pick("blocking", &peer));
    out
}

fn copy_series(rows: &[Row]) -> Vec<Series> {
    let copy: Vec<&Row> = rows
        .iter()
        .filter(|r| r.group == "copy" && (r.op == "g2v" || r.op == "v2g"))
        .collect();
    // `ends_with`: the "…, 1 queue, unsealed guest RAM" rows (the pread/pwrite path) are
    // not part of the 1-queue line; matched too, they zig-zagged it at every size.
    let mut out = Vec::new();
    let combos = [
        ("g2v", "1 queue", "guest→VRAM, 1 queue", tab10::BLUE, false),
        ("g2v", "2 queues", "guest→VRAM, 2 queues", tab10::BLUE, true),
        ("v2g", "1 queue", "VRAM→guest, 1 queue", tab10::GREEN, false),
        (
            "v2g",
            "2 queues",
            "VRAM→guest, 2 queues",
            tab10::GREEN,
            true,
        ),
    ];
    for (op, variant, name, color, dashed) in combos {
        let points = copy
            .iter()
            .filter(|r| r.op == op && r.variant.ends_with(variant))
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
            .filter(|r| r.op == "g2v" && r.variant.ends_with(variant))
            .filter_map(|r| Some((r.size? as f64, r.floor.as_ref()?.p50)))
            .collect();
        out.push(Series {
            name: name.into(),
            color: tab10::GREY,
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

fn series(name: &str, color: RGBColor, dashed: bool, points: Vec<(f64, f64)>) -> Series {
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
            tab10::BLUE,
            false,
            at("report", " 1% dirty", &ours),
        ),
        series(
            "report, 10% dirty p50",
            tab10::BLUE,
            true,
            at("report", "10% dirty", &ours),
        ),
        series(
            "server drain only, 1% p50",
            tab10::GREEN,
            false,
            at("report-direct", " 1% dirty", &ours),
        ),
        series(
            "floor: scan + AF_UNIX, 1% p50",
            tab10::OLIVE,
            false,
            at("report-wire", " 1% dirty", &floor),
        ),
        series(
            "floor: bitmap scan, 1% p50",
            tab10::GREY,
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
            tab10::BLUE,
            false,
            at("swap-held", "idle", &ours),
        ),
        series(
            "swap: slot held, busy p50",
            tab10::CYAN,
            false,
            at("swap-held", "busy", &ours),
        ),
        series(
            "swap: engine stall, busy p50",
            tab10::PURPLE,
            false,
            at("swap-stall", "busy", &ours),
        ),
        series(
            "migration: stop-copy only p50",
            tab10::RED,
            false,
            at("mig-stop-copy", "", &ours),
        ),
        series(
            "migration: pre-copy, idle p50",
            tab10::GREEN,
            false,
            at("mig-pre-copy", "", &ours),
        ),
        series(
            "migration: pre-copy, 10% p50",
            tab10::ORANGE,
            false,
            at("mig-pre-copy-dirty", "", &ours),
        ),
        series(
            "migration: vram_mmap=off, idle p50",
            tab10::BROWN,
            false,
            at("mig-pre-copy-trapped", "", &ours),
        ),
        series(
            "migration: vram_mmap=off, 10% p50",
            tab10::PINK,
            false,
            at("mig-pre-copy-trapped-dirty", "", &ours),
        ),
        series(
            "floor: memcpy, stop-copy bytes",
            tab10::GREY,
            true,
            at("mig-stop-copy", "", &floor),
        ),
        series(
            "floor: memcpy, pre-copy dirtied bytes",
            tab10::OLIVE,
            true,
            at("mig-pre-copy-dirty", "", &floor),
        ),
    ]
}

/// Renders the plot.
pub fn render(results: &Results) -> Result<String> {
    let panels = [
        Panel {
            title: "REGION_READ round trip (regfile)",
            xlabel: "transfer size",
            ylabel: "latency, µs (log)",
            series: sweep_series(&results.rows, "read"),
        },
        Panel {
            title: "REGION_WRITE round trip (regfile)",
            xlabel: "transfer size",
            ylabel: "latency, µs (log)",
            series: sweep_series(&results.rows, "write"),
        },
        Panel {
            title: "softgpu COPY throughput",
            xlabel: "transfer size",
            ylabel: "GB/s (log)",
            series: copy_series(&results.rows),
        },
        Panel {
            title: "DMA_LOGGING_REPORT vs mapped size",
            xlabel: "mapped size",
            ylabel: "latency, µs (log)",
            series: dirty_series(&results.rows),
        },
        Panel {
            title: "Swap and migration downtime vs VRAM size",
            xlabel: "VRAM size",
            ylabel: "downtime, ms (log)",
            series: downtime_series(&results.rows),
        },
    ];
    let columns = COLUMNS.min(panels.len());
    let panel_rows = panels.len().div_ceil(COLUMNS);
    let size = (W * columns as u32, H * panel_rows as u32 + FOOTER);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).context("plot background")?;
        let (grid, footer) = root.split_vertically(size.1 - FOOTER);
        for (area, p) in grid.split_evenly((panel_rows, columns)).iter().zip(&panels) {
            panel(area, p).with_context(|| format!("plot panel {}", p.title))?;
        }
        let note = format!(
            "{} mode; {} ({} CPUs), kernel {}; p99 dashed (downtime panel: floors dashed); spin = adaptive polling {} µs",
            results.mode,
            results.machine.cpu,
            results.machine.cpus,
            results.machine.kernel,
            results.spin_us
        );
        footer
            .draw(&Text::new(
                note,
                (8, FOOTER as i32 / 2),
                font(10.0)
                    .color(&FOOTNOTE)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))
            .context("plot footnote")?;
        root.present().context("plot")?;
    }
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Figure, Machine};

    fn fig(p50: f64) -> Option<Figure> {
        Some(Figure {
            name: "x".into(),
            p50,
            p99: p50 * 3.0,
            n: 10,
        })
    }

    /// A row with `ours`, a floor at a tenth of it and a peer at twice it.
    fn row(group: &str, case: &str, op: &str, variant: &str, size: u64, unit: Unit) -> Row {
        let v = (size as f64).log2();
        Row {
            group: group.into(),
            case: case.into(),
            op: op.into(),
            variant: variant.into(),
            size: Some(size),
            unit,
            ours: fig(v),
            floor: fig(v / 10.0),
            ratio: None,
            peer: fig(v * 2.0),
            peer_ratio: None,
            target: None,
            met: None,
            note: String::new(),
        }
    }

    fn results(rows: Vec<Row>) -> Results {
        Results {
            mode: "quick".into(),
            spin_us: 50,
            pinning: "none".into(),
            machine: Machine {
                cpu: "Test CPU <&>".into(),
                cpus: 2,
                kernel: "6.0".into(),
                loadavg_start: String::new(),
            },
            loadavg_end: String::new(),
            seconds: 1.0,
            rows,
        }
    }

    /// Rows for every panel, three sizes each.
    fn every_panel() -> Vec<Row> {
        let mut rows = Vec::new();
        for size in [4, 4096, 1 << 20] {
            for op in ["read", "write"] {
                for variant in ["regfile blocking", "regfile spin 50µs"] {
                    rows.push(row("size-sweep", "", op, variant, size, Unit::Micros));
                }
            }
        }
        for size in [4096, 1 << 20, 64 << 20] {
            for op in ["g2v", "v2g"] {
                for variant in [
                    "softgpu, 1 queue",
                    "softgpu, 1 queue, unsealed guest RAM",
                    "softgpu, 2 queues",
                ] {
                    rows.push(row("copy", "", op, variant, size, Unit::GBps));
                }
            }
        }
        for size in [1 << 30, 4 << 30, 16 << 30] {
            for (op, pct) in [
                ("report", " 1% dirty"),
                ("report", "10% dirty"),
                ("report-direct", " 1% dirty"),
                ("report-wire", " 1% dirty"),
            ] {
                rows.push(row("dirty-report", pct, op, "", size, Unit::Micros));
            }
        }
        for size in [64 << 20, 256 << 20, 1 << 30] {
            for (op, variant) in [
                ("swap-held", "idle"),
                ("swap-held", "busy"),
                ("swap-stall", "busy"),
            ] {
                rows.push(row("swap", "", op, variant, size, Unit::Micros));
            }
            for op in [
                "mig-stop-copy",
                "mig-pre-copy",
                "mig-pre-copy-dirty",
                "mig-pre-copy-trapped",
                "mig-pre-copy-trapped-dirty",
            ] {
                rows.push(row("migration", "", op, "", size, Unit::Millis));
            }
        }
        rows
    }

    /// Whether the SVG has a `<text>` element reading `text`.
    fn has_text(svg: &str, text: &str) -> bool {
        svg.contains(&format!(">\n{text}\n</text>"))
    }

    #[test]
    fn every_panel_has_its_series_legend_and_labels() {
        let results = results(every_panel());
        let svg = render(&results).expect("render");
        assert!(svg.starts_with("<svg"), "{svg:.100}");
        assert!(svg.trim_end().ends_with("</svg>"));
        for title in [
            "REGION_READ round trip (regfile)",
            "REGION_WRITE round trip (regfile)",
            "softgpu COPY throughput",
            "DMA_LOGGING_REPORT vs mapped size",
            "Swap and migration downtime vs VRAM size",
        ] {
            assert!(has_text(&svg, title), "no panel {title}");
        }
        assert!(!svg.contains("(no data)"));
        let rows = &results.rows;
        let all: Vec<Series> = [
            sweep_series(rows, "read"),
            sweep_series(rows, "write"),
            copy_series(rows),
            dirty_series(rows),
            downtime_series(rows),
        ]
        .into_iter()
        .flatten()
        .collect();
        for s in &all {
            assert_eq!(s.points.len(), 3, "{}", s.name);
            assert!(has_text(&svg, &s.name), "no legend {}", s.name);
        }
        // A marker per point.
        assert_eq!(svg.matches("<circle").count(), all.len() * 3);
        for label in [
            "4 B",
            "4 KiB",
            "1 MiB",
            "64 MiB",
            "16 GiB",
            "latency, µs (log)",
        ] {
            assert!(has_text(&svg, label), "no label {label}");
        }
        // Text is escaped.
        assert!(svg.contains("Test CPU &lt;&amp;&gt;"));
    }

    #[test]
    fn no_rows_still_draws_every_title() {
        let svg = render(&results(Vec::new())).expect("render");
        assert_eq!(svg.matches("(no data)").count(), 5);
    }

    #[test]
    fn y_axis_spans_whole_decades() {
        let y = y_axis(12.0, 3000.0);
        assert_eq!(y.range, (10.0, 10_000.0));
        assert_eq!(y.labelled.len(), 10);
        assert!(y.grid.is_empty());
        // Six decades: labels at the powers of ten only.
        let y = y_axis(0.011, 1800.0);
        assert_eq!(y.range.1, 10_000.0);
        assert_eq!(y.labelled.len(), 7);
        assert_eq!(y.grid.len(), 12);
    }
}
