//! `nested-bench`: what a register access from a guest costs on each path, measured in a nested
//! host (`scripts/bench-nested.sh`; docs/performance.md "Nested host").
//!
//! Boots one L1 (TCG, `-cpu EPYC`, `intel-iommu` + two `edu`s) that runs `sy-nested
//! mmio-bench`: an L2 under the real cloud-hypervisor times 32-bit reads from user space of
//! (1) edu assigned directly (VFIO in L1, no exit), (2) a register cloud-hypervisor emulates
//! (an exit to the VMM), (3) the softgpu's trapped BAR0 over vfio-user (the exit, then the
//! socket to switchyard). L1 also measures its AF_UNIX ping-pong, the floor of the socket leg.
//! Prints a table with ratios against the floors of the same run and writes
//! `target/bench/nested.json`. Absolute times under TCG mean little; the ratios do.
//!
//! ```text
//! nested-bench [--quick]      # --quick: 200 reads per path instead of 2000 (CI)
//! ```

#![forbid(unsafe_code)]

use anyhow::{Context, Result, bail};
use serde_json::Value;
use switchyard_guest_tests::{Guest, GuestEnv, GuestSpec};

fn us(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN) / 1000.0
}

fn main() -> Result<()> {
    let quick = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--quick") => true,
        Some(other) => bail!("unknown argument `{other}` (nested-bench [--quick])"),
    };
    let (mmio, irq) = if quick {
        ("mmio-bench-quick", "irq-bench-quick")
    } else {
        ("mmio-bench", "irq-bench")
    };
    let env = GuestEnv::discover()?;
    let dir = env.log_dir("nested_bench")?;
    let spec = GuestSpec::nested_with_devices(&env, &[mmio, irq], 2, false)?;
    eprintln!(
        "nested-bench: booting L1 ({mmio}, {irq}); logs in {}",
        dir.display()
    );
    let out = Guest::boot(&env, &dir, &spec)?
        .wait()
        .with_context(|| format!("L1 did not finish cleanly; see {}", dir.display()))?;
    let results: Vec<Value> = out
        .serial
        .lines()
        .filter_map(|l| l.trim().strip_prefix("NESTED-RESULT "))
        .filter_map(|j| serde_json::from_str(j).ok())
        .collect();
    let find = |name: &str| -> Result<Value> {
        let r = results
            .iter()
            .find(|r| r["scenario"] == name)
            .cloned()
            .with_context(|| {
                format!(
                    "no result for {name} in {}",
                    dir.join("serial.log").display()
                )
            })?;
        if r["ok"] != true {
            bail!("{name} failed in L1: {r}");
        }
        Ok(r)
    };
    let r = find(mmio)?;
    let q = find(irq)?;
    let rows = &r["rows"];
    let direct = rows["direct"]["read_ns"]["p50"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let exit = rows["vmm-emulated"]["read_ns"]["p50"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let sock = r["l1_socket_rtt_ns"]["p50"].as_f64().unwrap_or(f64::NAN);
    println!(
        "\nMMIO read from L2 user space, {} reads per path (cloud-hypervisor v54 in a TCG L1)\n",
        r["count"]
    );
    println!("| path | p50 µs | p90 µs | p99 µs | × direct | × VMM exit |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (key, name) in [
        ("direct", "edu assigned directly (VFIO in L1, no exit)"),
        (
            "vmm-emulated",
            "register emulated by cloud-hypervisor (exit to the VMM)",
        ),
        (
            "vfio-user-trapped",
            "softgpu BAR0 trapped, over vfio-user to switchyard",
        ),
    ] {
        let t = &rows[key]["read_ns"];
        let p50 = t["p50"].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} |",
            us(&t["p50"]),
            us(&t["p90"]),
            us(&t["p99"]),
            p50 / direct,
            p50 / exit
        );
    }
    let trapped = rows["vfio-user-trapped"]["read_ns"]["p50"]
        .as_f64()
        .unwrap_or(f64::NAN);
    println!(
        "\nL1 AF_UNIX ping-pong p50 {:.1} µs; the vfio-user leg (trapped − VMM exit) is {:.1} µs = {:.2}× that floor",
        sock / 1000.0,
        (trapped - exit) / 1000.0,
        (trapped - exit) / sock
    );
    let floor = q["vfio_in_l1_us"]["p50"].as_f64().unwrap_or(f64::NAN);
    let sock = q["l1_socket_rtt_ns"]["p50"].as_f64().unwrap_or(f64::NAN) / 1000.0;
    println!(
        "\nedu's MSI to an eventfd, raised by a register write, {} rounds (L1 user space)\n",
        q["rounds"]
    );
    println!("| path | raise → eventfd p50 µs | p90 µs | × VFIO in L1 | write round trip p50 µs |");
    println!("|---|---:|---:|---:|---:|");
    let row = |name: &str, v: &Value, write: &Value| {
        let p50 = v["p50"].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {name} | {p50:.1} | {:.1} | {:.2} | {} |",
            v["p90"].as_f64().unwrap_or(f64::NAN),
            p50 / floor,
            write["p50"]
                .as_f64()
                .map_or("–".to_owned(), |w| format!("{w:.1}"))
        );
    };
    row(
        "VFIO in L1 (the floor: MMIO write, the kernel signals the eventfd)",
        &q["vfio_in_l1_us"],
        &Value::Null,
    );
    row(
        "switchyard, client eventfds handed to VFIO",
        &q["switchyard_eventfd_to_vfio"]["raise_to_eventfd_us"],
        &q["switchyard_eventfd_to_vfio"]["write_rtt_us"],
    );
    row(
        "switchyard, interrupt relayed by a server thread",
        &q["switchyard_relay"]["raise_to_eventfd_us"],
        &q["switchyard_relay"]["write_rtt_us"],
    );
    println!(
        "\nrelayed / handed to VFIO (p50): {:.2}; L1 AF_UNIX ping-pong p50 {sock:.1} µs",
        q["relay_vs_direct_p50"].as_f64().unwrap_or(f64::NAN)
    );
    let bench_dir = env.repo.join("target/bench");
    std::fs::create_dir_all(&bench_dir)?;
    let path = bench_dir.join("nested.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&serde_json::json!({ "mmio": r, "irq": q }))?,
    )?;
    println!("results: {}", path.display());
    Ok(())
}
