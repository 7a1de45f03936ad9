//! The demo: start a softgpu, boot a guest, run the in-guest driver's workload with a short
//! progress display, print a result table. Run through `scripts/demo.sh`, which sets up and
//! builds everything first.
//!
//! Output goes through `say!`: when stdout is closed (`scripts/demo.sh | head`) the demo stops,
//! stops the guest and the server, and exits 0 without a message, instead of panicking.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use switchyard_guest_tests::{Guest, GuestEnv, GuestSpec, Server, complete_lines};
use switchyard_qemu::VfioUserDevice;

/// Stdout is gone (the reader closed the pipe): the demo ends quietly.
#[derive(Debug)]
struct StdoutClosed(std::io::Error);

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cannot write to stdout: {}", self.0)
    }
}

impl std::error::Error for StdoutClosed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// `println!` that returns an error instead of panicking when stdout cannot be written.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err(StdoutClosed)?
    }};
}

fn main() -> ExitCode {
    match demo() {
        Ok(()) => ExitCode::SUCCESS,
        // Whoever read our output stopped reading (e.g. `| head`): nothing more to say, and
        // the guest and the server were stopped on the way out.
        Err(e)
            if e.downcast_ref::<StdoutClosed>()
                .is_some_and(|c| c.0.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}

fn demo() -> anyhow::Result<()> {
    let env = GuestEnv::discover().context("the demo needs scripts/setup.sh to have run")?;
    let dir = env.log_dir("demo")?;
    let device = std::env::var("SWITCHYARD_DEMO_DEVICE")
        .unwrap_or_else(|_| "softgpu,vram=64M,queues=2".into());
    say!("switchyard demo: softgpu ({device}) served over vfio-user to a QEMU guest (TCG)");
    let t0 = Instant::now();
    let mut server = Server::start(&env, &dir, &device).context("starting switchyard serve")?;
    say!(
        "  [{:5.1}s] server listening on {}",
        t0.elapsed().as_secs_f64(),
        server.socket.display()
    );
    let mut spec = GuestSpec::new("sygpu-driver");
    spec.iommu = true;
    spec.devices = vec![VfioUserDevice::new("gpu0", &server.socket)];
    let mut guest = Guest::boot(&env, &dir, &spec).context("booting the guest")?;
    let booted = Instant::now();
    say!(
        "  [{:5.1}s] guest booted (QEMU vfio-user-pci, intel-iommu, driver via VFIO)",
        t0.elapsed().as_secs_f64()
    );
    let mut shown = 0usize;
    let summary = loop {
        // Exit status before the text: whatever QEMU wrote before it exited is read below.
        let exited = guest.exited();
        let text = guest.serial_text();
        // QEMU may be in the middle of a line: only complete lines count.
        let lines: Vec<&str> = complete_lines(&text).lines().collect();
        for l in lines.iter().skip(shown) {
            let l = l.trim();
            if let Some(p) = l.strip_prefix("SYGPU:") {
                say!("  [{:5.1}s] {}", t0.elapsed().as_secs_f64(), p.trim());
            } else if l.starts_with("GUEST: pci") && l.contains("0x1234") {
                say!(
                    "  [{:5.1}s] guest sees {}",
                    t0.elapsed().as_secs_f64(),
                    l.trim_start_matches("GUEST: pci ")
                );
            }
        }
        shown = lines.len();
        if let Some(s) = lines
            .iter()
            .find_map(|l| l.trim().strip_prefix("SYGPU-SUMMARY"))
        {
            break serde_json::from_str::<serde_json::Value>(s.trim())
                .context("parsing the driver summary")?;
        }
        if lines.iter().any(|l| l.trim() == "GUEST: poweroff") {
            bail!(
                "the guest powered off without a result; logs in {}",
                dir.display()
            );
        }
        if let Some(status) = exited {
            bail!(
                "QEMU exited ({status}) without a result; logs in {}",
                dir.display()
            );
        }
        if booted.elapsed() > spec.timeout {
            bail!(
                "no result after {} s; logs in {}",
                spec.timeout.as_secs(),
                dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = guest.wait().context("waiting for the guest to power off")?;
    let _ = server.terminate();
    let n = |k: &str| {
        summary[k]
            .as_u64()
            .map_or_else(|| "-".to_owned(), |v| v.to_string())
    };
    let s = |k: &str| summary[k].as_str().unwrap_or("-").to_owned();
    say!();
    say!("  {:<28} {}", "result", s("result"));
    say!("  {:<28} {}", "jobs run", n("jobs_run"));
    say!(
        "  {:<28} {}",
        "results verified bit-for-bit",
        n("jobs_verified")
    );
    say!(
        "  {:<28} {}",
        "bytes moved by the engines",
        n("bytes_moved")
    );
    let ok = |k: &str| if summary[k] == true { "ok" } else { "FAILED" };
    let irqs = summary["interrupts"]["total"].as_u64().unwrap_or(0);
    let mode = summary["irq_mode"].as_str().unwrap_or("msix");
    say!(
        "  {:<28} {irqs} ({} fences waited by interrupt, {mode})",
        "interrupts delivered",
        n("fence_irq_waits")
    );
    say!(
        "  {:<28} {}",
        "bad-DMA error + recovery",
        ok("error_test_ok")
    );
    say!("  {:<28} {}", "VRAM via mmapped BAR", ok("vram_mmap_ok"));
    say!(
        "  {:<28} {} ms",
        "driver run time (guest)",
        n("duration_ms")
    );
    say!(
        "  {:<28} {:.1} s",
        "total (boot to poweroff)",
        out.elapsed.as_secs_f64()
    );
    say!("  logs: {}", dir.display());
    if summary["result"] != "pass" {
        bail!("the in-guest driver reported a failure: {summary}");
    }
    Ok(())
}
