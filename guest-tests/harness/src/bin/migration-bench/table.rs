//! The table: medians and ranges per case, ratios against the floor and the goals.

use serde_json::{Value, json};

use crate::{COLUMNS, Case, FILL_QUARTERS, MIB, Sample};

/// Median, min and max of figure `name` over a case's runs (`None` when no run has it).
fn stat(samples: &[Sample], name: &str) -> Option<(f64, f64, f64)> {
    let mut v: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.fig.get(name).copied())
        .collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = match n {
        0 => return None,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    Some((median, v[0], v[n - 1]))
}

/// `median` or `median (min-max)`, divided by `scale`, with `prec` decimals.
fn show(s: Option<(f64, f64, f64)>, runs: usize, scale: f64, prec: usize) -> String {
    match s {
        None => "-".into(),
        Some((m, lo, hi)) if runs > 1 && lo != hi => {
            format!(
                "{:.prec$} ({:.prec$}-{:.prec$})",
                m / scale,
                lo / scale,
                hi / scale
            )
        }
        Some((m, ..)) => format!("{:.prec$}", m / scale),
    }
}

/// Prints the table; returns its rows as JSON.
pub(crate) fn print_table(
    results: &[(Case, Vec<Sample>, Vec<String>)],
    params: &Value,
    runs: usize,
) -> Value {
    let floor = results
        .iter()
        .find(|r| r.0.vram_mib.is_none())
        .and_then(|r| stat(&r.1, "downtime_ms"))
        .map(|s| s.0);
    let floor_stream = results
        .iter()
        .find(|r| r.0.vram_mib.is_none())
        .and_then(|r| stat(&r.1, "stream_bytes"))
        .map_or(0.0, |s| s.0);
    let bandwidth = params["max-bandwidth"].as_f64().filter(|b| *b > 0.0);
    let mut head: Vec<String> = ["case", "ok"].map(String::from).to_vec();
    for c in &COLUMNS {
        head.push(c.0.to_owned());
        match c.1 {
            "total_ms" => head.push("x goal".into()),
            "downtime_ms" => head.push("x floor".into()),
            _ => {}
        }
    }
    let mut rows = vec![head];
    let mut out = Vec::new();
    for (case, samples, failures) in results {
        let ratio = stat(samples, "downtime_ms")
            .zip(floor)
            .filter(|(_, f)| *f > 0.0)
            .map(|(d, f)| d.0 / f);
        // Idle cases: converge within the time their data (VRAM data and the floor's RAM
        // stream) needs at the bandwidth, plus 50 %.
        let goal_ms = bandwidth
            .filter(|_| !case.writing && case.vram_mib.is_some())
            .map(|b| 1.5 * (case.data_bytes() as f64 + floor_stream) / b * 1000.0);
        let goal = stat(samples, "total_ms").zip(goal_ms).map(|(t, g)| t.0 / g);
        let mut row = vec![
            case.label.to_owned(),
            format!("{}/{}", samples.len(), samples.len() + failures.len()),
        ];
        for &(_, name, scale, prec) in &COLUMNS {
            row.push(show(stat(samples, name), runs, scale, prec));
            match name {
                "total_ms" => row.push(goal.map_or("-".into(), |r| format!("{r:.2}"))),
                "downtime_ms" => row.push(ratio.map_or("-".into(), |r| format!("{r:.2}"))),
                _ => {}
            }
        }
        rows.push(row);
        let mut j = json!({
            "case": case.id,
            "label": case.label,
            "device": case.device(),
            "vram_filled_bytes": case.fill_bytes(),
            "devices": case.devices,
            "vram_trapped": case.trapped,
            "soak_seconds": case
                .writing
                .then(|| case.soak_seconds(bandwidth.unwrap_or(crate::DEFAULT_BANDWIDTH))),
            "goal_ms": goal_ms,
            "total_vs_goal": goal,
            "runs_ok": samples.len(),
            "failures": failures,
            "downtime_vs_floor": ratio,
            "samples": samples.iter().map(|s| json!({
                "figures": s.fig, "check": s.check, "query_migrate": s.status,
            })).collect::<Vec<_>>(),
        });
        let names: std::collections::BTreeSet<&str> =
            samples.iter().flat_map(|s| s.fig.keys().copied()).collect();
        for name in names {
            if let Some((m, lo, hi)) = stat(samples, name) {
                j[name] = json!({ "median": m, "min": lo, "max": hi });
            }
        }
        out.push(j);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    println!(
        "\nLive migration under the patched QEMU (TCG guest, 512 MiB, 1 vCPU), {runs} run(s) per \
         case, median{}; QEMU downtime-limit {} ms, max-bandwidth {} MiB/s\n",
        if runs > 1 { " (min-max)" } else { "" },
        params["downtime-limit"],
        params["max-bandwidth"]
            .as_f64()
            .map_or("?".into(), |b| format!("{:.0}", b / MIB)),
    );
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| match c {
                0 => format!("{cell:<w$}"),
                _ => format!("{cell:>w$}"),
            })
            .collect();
        println!("{}", cells.join("  ").trim_end());
        if i == 0 {
            println!(
                "{}",
                "-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1))
            );
        }
    }
    println!(
        "\nx goal (idle cases): total time / 1.5 x the time their data (VRAM data + the floor's \
         stream) needs at max-bandwidth; <= 1 meets the goal. x floor: downtime / the no-device \
         downtime. stream MiB: QEMU's ram.transferred (the whole stream, the device's share \
         included); device MiB: its vfio.transferred; padding MiB, STOP_COPY ms (the device's \
         stop to QEMU's STOP after completion), read ms (its stop to its stream's last byte \
         read: its share of the downtime; the slowest device), pages sent (all rounds): the \
         source servers' logs. VRAM cases: {}% of each device's VRAM filled with data before the \
         migration.",
        FILL_QUARTERS * 25
    );
    // Two devices against one of the same size: the goal is at most 1.2x the downtime.
    for (case, samples, _) in results.iter().filter(|r| r.0.devices > 1) {
        let one_case = results.iter().find(|r| {
            r.0.devices == 1
                && r.0.vram_mib == case.vram_mib
                && r.0.writing == case.writing
                && r.0.trapped == case.trapped
        });
        let (Some(two), Some(one)) = (
            stat(samples, "downtime_ms"),
            one_case.and_then(|r| stat(&r.1, "downtime_ms")),
        ) else {
            continue;
        };
        // QEMU's downtime is in whole ms; the devices' share (from the servers' logs, the
        // later of the two devices') is finer.
        let stop_copy = stat(samples, "stream_read_ms")
            .zip(one_case.and_then(|r| stat(&r.1, "stream_read_ms")))
            .filter(|(_, o)| o.0 > 0.0)
            .map_or(String::new(), |(t, o)| {
                format!(
                    "; device share (read ms) {:.1} ms = {:.2}x its {:.1} ms",
                    t.0,
                    t.0 / o.0,
                    o.0
                )
            });
        println!(
            "  {}: downtime {:.0} ms = {:.2}x the one-device VM's {:.0} ms{stop_copy}",
            case.id,
            two.0,
            two.0 / one.0.max(1.0),
            one.0
        );
    }
    for (case, samples, failures) in results {
        if let Some(s) = samples.last() {
            println!("  {}: {}", case.id, s.check);
        }
        for f in failures {
            println!("  {}: FAILED {f}", case.id);
        }
    }
    Value::Array(out)
}
