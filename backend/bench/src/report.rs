//! Result rows, the text table and the JSON document.

use serde::{Deserialize, Serialize};

use crate::stats::Summary;

/// What a row's numbers are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit {
    /// Latency in microseconds (lower is better).
    Micros,
    /// Latency in milliseconds (lower is better): downtimes.
    Millis,
    /// Throughput in GB/s, 10^9 bytes per second (higher is better).
    GBps,
    /// Million writes per second (higher is better).
    Mwps,
}

impl Unit {
    /// Label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Unit::Micros => "µs",
            Unit::Millis => "ms",
            Unit::GBps => "GB/s",
            Unit::Mwps => "Mw/s",
        }
    }

    /// Whether larger values are better.
    pub fn higher_is_better(self) -> bool {
        !matches!(self, Unit::Micros | Unit::Millis)
    }
}

/// Percentiles of one contender, in the row's unit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    /// What was measured.
    pub name: String,
    /// Median, in the row's unit.
    pub p50: f64,
    /// 99th percentile: for latencies the slow tail; for throughputs the throughput of the
    /// 99th-percentile (slow) sample.
    pub p99: f64,
    /// Samples.
    pub n: usize,
}

impl Figure {
    /// Converts a latency summary (ns) into the row's unit. `work` is bytes (GB/s) or writes
    /// (Mw/s) per sample; ignored for latencies.
    pub fn from_summary(name: &str, s: &Summary, unit: Unit, work: f64) -> Figure {
        let conv = |ns: f64| -> f64 {
            match unit {
                Unit::Micros => ns / 1e3,
                Unit::Millis => ns / 1e6,
                // bytes per ns == GB/s; writes per ns * 1e3 == Mw/s.
                Unit::GBps => work / ns.max(1.0),
                Unit::Mwps => work / ns.max(1.0) * 1e3,
            }
        };
        Figure {
            name: name.to_owned(),
            p50: conv(s.p50),
            p99: conv(s.p99),
            n: s.n,
        }
    }
}

/// A target a row is held to.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Target {
    /// Bound on ours/floor: an upper bound for latencies, a lower bound for throughputs.
    pub floor_ratio: f64,
    /// Also required to beat the peer (when there is one).
    pub beat_peer: bool,
    /// Latencies only: an allowance added to the bound, in the row's unit, for targets of the
    /// form "ours ≤ floor_ratio × floor + plus" (the swap's "≤ 1.2× state memcpy + 1 ms").
    #[serde(default)]
    pub plus: f64,
}

impl Target {
    /// An absolute latency bound in the row's unit (the restart's "≤ 50 ms"): the form above
    /// with `floor_ratio` 0, i.e. `ours ≤ bound` whatever the floor. The row keeps its floor
    /// for the ratio; the bound alone decides whether the target is met.
    pub const fn absolute(bound: f64) -> Target {
        Target {
            floor_ratio: 0.0,
            beat_peer: false,
            plus: bound,
        }
    }
}

/// One line of the results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Group: `round-trip`, `decompose`, `size-sweep`, `posted`, `write-multi`, `copy`,
    /// `interrupt`, `doorbell`, `dirty-report`, `swap`, `migration`, `journal`, `custody`,
    /// `restart`, `move`, `api`.
    pub group: String,
    /// Human-readable case name.
    pub case: String,
    /// Operation key for plots (`read`, `write`, `g2v`, `v2g`, ...).
    pub op: String,
    /// Server variant (`softgpu blocking`, `regfile spin 50µs`, ...).
    pub variant: String,
    /// Transfer size in bytes, where it varies.
    pub size: Option<u64>,
    /// Unit of every number in the row.
    pub unit: Unit,
    /// Ours.
    pub ours: Option<Figure>,
    /// The floor measured with it.
    pub floor: Option<Figure>,
    /// ours/floor at p50.
    pub ratio: Option<f64>,
    /// The peer measured with it.
    pub peer: Option<Figure>,
    /// ours/peer at p50.
    pub peer_ratio: Option<f64>,
    /// The target, if the issue sets one for this row.
    pub target: Option<Target>,
    /// Whether the target is met.
    pub met: Option<bool>,
    /// Anything a reader needs to interpret the row.
    pub note: String,
}

impl Row {
    /// A row with ours, optional floor and peer; computes ratios and whether the target is met.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        group: &str,
        case: String,
        op: &str,
        variant: &str,
        size: Option<u64>,
        unit: Unit,
        ours: Figure,
        floor: Option<Figure>,
        peer: Option<Figure>,
        target: Option<Target>,
        note: String,
    ) -> Row {
        let ratio = floor.as_ref().map(|f| ours.p50 / f.p50);
        let peer_ratio = peer.as_ref().map(|p| ours.p50 / p.p50);
        let met = target.map(|t| {
            // An absolute bound needs no floor.
            let absolute = floor.is_none() && t.floor_ratio == 0.0 && t.plus > 0.0;
            let floor_ok = (absolute && ours.p50 <= t.plus)
                || ratio.is_some_and(|r| {
                    if unit.higher_is_better() {
                        r >= t.floor_ratio
                    } else if t.plus > 0.0 {
                        floor
                            .as_ref()
                            .is_some_and(|f| ours.p50 <= t.floor_ratio * f.p50 + t.plus)
                    } else {
                        r <= t.floor_ratio
                    }
                });
            let peer_ok = !t.beat_peer
                || peer_ratio.is_none_or(|r| {
                    if unit.higher_is_better() {
                        r > 1.0
                    } else {
                        r < 1.0
                    }
                });
            floor_ok && peer_ok
        });
        Row {
            group: group.to_owned(),
            case,
            op: op.to_owned(),
            variant: variant.to_owned(),
            size,
            unit,
            ours: Some(ours),
            floor,
            ratio,
            peer,
            peer_ratio,
            target,
            met,
            note,
        }
    }
}

/// Where the numbers come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo.
    pub cpu: String,
    /// Online CPUs.
    pub cpus: usize,
    /// Kernel release.
    pub kernel: String,
    /// 1-minute load average when the run started.
    pub loadavg_start: String,
}

impl Machine {
    /// Reads /proc.
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).trim().to_owned())
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        let loadavg_start = std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
            .to_owned();
        Machine {
            cpu,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel,
            loadavg_start,
        }
    }
}

/// The JSON document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// `quick` or `full`.
    pub mode: String,
    /// Adaptive-polling budget of the "spin" rows, µs.
    pub spin_us: u64,
    /// CPU pinning (`none` unless the diagnosis options were given).
    #[serde(default)]
    pub pinning: String,
    /// The machine.
    pub machine: Machine,
    /// Load average when the run ended.
    pub loadavg_end: String,
    /// Wall time of the run, seconds.
    pub seconds: f64,
    /// The rows.
    pub rows: Vec<Row>,
}

fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        // Two significant digits below 0.1 (a memcpy of a few KiB in ms), not "0.00".
        Some(x) if x > 0.0 && x < 0.1 => {
            let decimals = (-x.log10()).ceil() as usize + 1;
            format!("{x:.decimals$}")
        }
        Some(x) => format!("{x:.2}"),
    }
}

fn ratio(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(r) if r >= 100.0 => format!("{r:.0}×"),
        Some(r) => format!("{r:.2}×"),
    }
}

/// `1 ms`, `250 µs`: an amount in a latency unit, in ms from 1 ms on.
fn amount(v: f64, unit: Unit) -> String {
    let ms = match unit {
        Unit::Micros => v / 1e3,
        Unit::Millis => v,
        Unit::GBps | Unit::Mwps => return format!("{} {}", num(Some(v)), unit.label()),
    };
    if ms >= 1.0 {
        format!("{ms} ms")
    } else {
        format!("{} µs", ms * 1e3)
    }
}

fn target_text(row: &Row) -> String {
    match row.target {
        None => "-".into(),
        Some(t) => {
            let op = if row.unit.higher_is_better() {
                "≥"
            } else {
                "≤"
            };
            if t.floor_ratio == 0.0 && t.plus > 0.0 && !row.unit.higher_is_better() {
                return format!("{op}{}", amount(t.plus, row.unit));
            }
            let mut s = format!("{op}{:.2}× floor", t.floor_ratio);
            if t.plus > 0.0 && !row.unit.higher_is_better() {
                s.push_str(&format!(" + {}", amount(t.plus, row.unit)));
            }
            if t.beat_peer && row.peer.is_some() {
                s.push_str(", < peer");
            }
            s
        }
    }
}

/// The table columns.
pub const COLUMNS: [&str; 12] = [
    "case",
    "variant",
    "unit",
    "p50",
    "p99",
    "floor p50",
    "ratio",
    "peer p50",
    "peer ratio",
    "target",
    "met?",
    "n",
];

/// One row's cells, in [`COLUMNS`] order.
pub fn cells(row: &Row) -> [String; 12] {
    let n = row
        .ours
        .as_ref()
        .map_or_else(|| "-".into(), |o| o.n.to_string());
    let met = match row.met {
        None => "-".to_owned(),
        Some(true) => "yes".to_owned(),
        Some(false) => "NO".to_owned(),
    };
    if row.ours.is_none() {
        return [
            row.case.clone(),
            "-".into(),
            "-".into(),
            "not yet implemented".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ];
    }
    [
        row.case.clone(),
        row.variant.clone(),
        row.unit.label().into(),
        num(row.ours.as_ref().map(|f| f.p50)),
        num(row.ours.as_ref().map(|f| f.p99)),
        num(row.floor.as_ref().map(|f| f.p50)),
        ratio(row.ratio),
        num(row.peer.as_ref().map(|f| f.p50)),
        ratio(row.peer_ratio),
        target_text(row),
        met,
        n,
    ]
}

/// The rows as an aligned text table.
pub fn text_table(rows: &[Row]) -> String {
    let all: Vec<[String; 12]> = rows.iter().map(cells).collect();
    let mut widths = COLUMNS.map(|c| c.chars().count());
    for r in &all {
        for (w, c) in widths.iter_mut().zip(r.iter()) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(widths.iter()).enumerate() {
            let pad = w.saturating_sub(c.chars().count());
            if i <= 2 {
                s.push_str(c);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str(&" ".repeat(pad));
                s.push_str(c);
            }
            s.push_str("  ");
        }
        s.trim_end().to_owned()
    };
    let mut out = String::new();
    let header: Vec<String> = COLUMNS.iter().map(|c| (*c).to_owned()).collect();
    out.push_str(&line(&header));
    out.push('\n');
    let mut group = "";
    for (row, c) in rows.iter().zip(all.iter()) {
        if row.group != group {
            group = &row.group;
            out.push_str(&format!("-- {group}\n"));
        }
        out.push_str(&line(c));
        out.push('\n');
    }
    out
}

/// The rows as a Markdown table (for docs/performance.md).
pub fn markdown_table(rows: &[Row]) -> String {
    let mut out = format!("| {} |\n", COLUMNS.join(" | "));
    out.push_str(&format!(
        "|{}\n",
        COLUMNS
            .iter()
            .enumerate()
            .map(|(i, _)| if i <= 2 { "---|" } else { "---:|" })
            .collect::<String>()
    ));
    for row in rows {
        out.push_str(&format!("| {} |\n", cells(row).join(" | ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figure(p50: f64) -> Figure {
        Figure {
            name: "x".into(),
            p50,
            p99: p50,
            n: 1,
        }
    }

    fn row(unit: Unit, ours: f64, floor: f64, peer: Option<f64>, target: Target) -> Row {
        Row::new(
            "g",
            "case".into(),
            "op",
            "variant",
            None,
            unit,
            figure(ours),
            Some(figure(floor)),
            peer.map(figure),
            Some(target),
            String::new(),
        )
    }

    const FLOOR_ONLY: Target = Target {
        floor_ratio: 0.9,
        beat_peer: false,
        plus: 0.0,
    };

    #[test]
    fn throughput_target_is_a_lower_bound() {
        // 9.5 GB/s against a 10 GB/s floor: 0.95× ≥ 0.9×.
        let r = row(Unit::GBps, 9.5, 10.0, None, FLOOR_ONLY);
        assert!((r.ratio.expect("ratio") - 0.95).abs() < 1e-9);
        assert_eq!(r.met, Some(true));
        assert_eq!(target_text(&r), "≥0.90× floor");
        // 0.85× misses it.
        assert_eq!(
            row(Unit::GBps, 8.5, 10.0, None, FLOOR_ONLY).met,
            Some(false)
        );
    }

    #[test]
    fn latency_target_is_an_upper_bound() {
        let t = Target {
            floor_ratio: 1.1,
            beat_peer: false,
            plus: 0.0,
        };
        // 12 µs against a 10 µs floor: 1.2× > 1.1×.
        let r = row(Unit::Micros, 12.0, 10.0, None, t);
        assert!((r.ratio.expect("ratio") - 1.2).abs() < 1e-9);
        assert_eq!(r.met, Some(false));
        assert_eq!(target_text(&r), "≤1.10× floor");
        assert_eq!(row(Unit::Micros, 10.5, 10.0, None, t).met, Some(true));
    }

    #[test]
    fn beat_peer_needs_a_strictly_better_p50() {
        let t = Target {
            floor_ratio: 1.1,
            beat_peer: true,
            plus: 0.0,
        };
        let better = row(Unit::Micros, 10.5, 10.0, Some(11.0), t);
        assert_eq!(better.met, Some(true));
        assert_eq!(target_text(&better), "≤1.10× floor, < peer");
        assert_eq!(
            row(Unit::Micros, 10.5, 10.0, Some(10.5), t).met,
            Some(false)
        );
        // Within the floor bound but slower than the peer: not met.
        assert_eq!(
            row(Unit::Micros, 10.5, 10.0, Some(10.0), t).met,
            Some(false)
        );
        // Throughput: higher is better against the peer too.
        let t = Target {
            floor_ratio: 0.9,
            beat_peer: true,
            plus: 0.0,
        };
        assert_eq!(row(Unit::Mwps, 1.0, 1.0, Some(0.5), t).met, Some(true));
        assert_eq!(row(Unit::Mwps, 1.0, 1.0, Some(2.0), t).met, Some(false));
    }

    #[test]
    fn additive_allowance_on_latency_targets() {
        // The swap's target: ≤ 1.2× a 0.1 µs memcpy + 1 ms.
        let t = Target {
            floor_ratio: 1.2,
            beat_peer: false,
            plus: 1000.0,
        };
        let r = row(Unit::Micros, 900.0, 0.1, None, t);
        assert_eq!(r.met, Some(true));
        assert_eq!(target_text(&r), "≤1.20× floor + 1 ms");
        assert_eq!(row(Unit::Micros, 1000.2, 0.1, None, t).met, Some(false));
        let t = Target { plus: 0.25, ..t };
        let r = row(Unit::Millis, 2.0, 1.5, None, t);
        assert_eq!(r.met, Some(true), "2 ≤ 1.2 × 1.5 + 0.25");
        assert_eq!(target_text(&r), "≤1.20× floor + 250 µs");
    }

    #[test]
    fn absolute_target_ignores_the_floor_but_keeps_the_ratio() {
        // The restart's target: ≤ 50 ms whatever the process-start floor.
        let t = Target::absolute(50.0);
        let r = row(Unit::Millis, 12.0, 1.5, None, t);
        assert_eq!(r.met, Some(true));
        assert!((r.ratio.expect("ratio") - 8.0).abs() < 1e-9);
        assert_eq!(target_text(&r), "≤50 ms");
        assert_eq!(row(Unit::Millis, 50.5, 60.0, None, t).met, Some(false));
        assert_eq!(row(Unit::Millis, 50.0, 0.1, None, t).met, Some(true));
    }

    #[test]
    fn small_numbers_keep_two_significant_digits() {
        assert_eq!(num(Some(0.00123)), "0.0012");
        assert_eq!(num(Some(0.05)), "0.050");
        assert_eq!(num(Some(0.5)), "0.50");
        assert_eq!(num(Some(0.0)), "0.00");
        assert_eq!(num(Some(1234.0)), "1234");
        assert_eq!(ratio(Some(1234.4)), "1234×");
    }

    #[test]
    fn no_target_no_verdict_and_no_floor_misses() {
        let r = Row::new(
            "g",
            "case".into(),
            "op",
            "variant",
            None,
            Unit::Micros,
            figure(1.0),
            None,
            None,
            None,
            String::new(),
        );
        assert_eq!((r.ratio, r.met), (None, None));
        assert_eq!(target_text(&r), "-");
        let r = Row::new(
            "g",
            "case".into(),
            "op",
            "variant",
            None,
            Unit::Micros,
            figure(1.0),
            None,
            None,
            Some(FLOOR_ONLY),
            String::new(),
        );
        assert_eq!(r.met, Some(false));
    }
}
