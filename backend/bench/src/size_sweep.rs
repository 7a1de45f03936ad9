//! Round-trip latency against the access size.

use std::path::Path;

use anyhow::Result;

use crate::cases::{FULL_POINT, QUICK_SHORT, Settings};
use crate::report::Row;
use crate::round_trip::RoundTrips;
use crate::servers::DeviceKind;
use crate::stats::Plan;

/// Sizes of the latency-vs-size sweep.
pub const SWEEP_SIZES: [u32; 7] = [4, 64, 512, 4096, 32 << 10, 256 << 10, 1 << 20];

/// REGION_READ / REGION_WRITE round trips of growing size on the register file's 1 MiB
/// region, against the floors and the peer (no targets).
pub fn size_sweep(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let reps = s.reps().min(2);
    let plan = s.plan(QUICK_SHORT, FULL_POINT);
    RoundTrips {
        group: "size-sweep",
        variants: &[
            (DeviceKind::RegFile, None),
            (DeviceKind::RegFile, Some(s.spin)),
        ],
        sizes: &SWEEP_SIZES,
        region: 1,
        offset: 0,
        reps,
        plan: Plan {
            samples: plan.samples / reps,
            blocks: plan.blocks / reps,
            ..plan
        },
        target: false,
    }
    .run(dir, s, rows)
}
