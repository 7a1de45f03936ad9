//! Optional CPU pinning, for diagnosis only (the default runs pin nothing).
//!
//! On a 2-vCPU VM a blocking ping-pong has two stable placements: both threads on one vCPU
//! (wake-ups are context switches) or one thread per vCPU (every wake-up is an IPI to a halted
//! vCPU). Which one a pair of threads lands in depends on where they were created and on other
//! load, so unpinned figures are a mixture; `--pin-client`/`--pin-helpers` make the placement
//! explicit. Threads created by the device (softgpu engines) inherit the client's mask.

use std::sync::OnceLock;

use anyhow::{Context, Result};

static HELPERS: OnceLock<Option<usize>> = OnceLock::new();

fn pin_current(cpu: usize) -> std::io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)?;
    Ok(())
}

/// Pins the calling (main, client) thread and remembers where helper threads go.
pub fn setup(client: Option<usize>, helpers: Option<usize>) -> Result<()> {
    if let Some(c) = client {
        pin_current(c).with_context(|| format!("pin the client thread to CPU {c}"))?;
    }
    let _ = HELPERS.set(helpers);
    Ok(())
}

/// Called first thing in every server / floor thread this crate spawns.
pub fn helper() {
    if let Some(Some(cpu)) = HELPERS.get() {
        let _ = pin_current(*cpu);
    }
}

/// A description for the results.
pub fn describe(client: Option<usize>, helpers: Option<usize>) -> String {
    match (client, helpers) {
        (None, None) => "none".into(),
        (c, h) => format!(
            "client thread: {}, server/floor threads: {}",
            c.map_or_else(|| "any".into(), |c| format!("CPU {c}")),
            h.map_or_else(|| "any".into(), |c| format!("CPU {c}"))
        ),
    }
}
