//! `edu-client --conformance BDF`: the device conformance suite on the passthrough kind, in
//! this process (see the crate documentation).

use switchyard_conformance::{Groups, Moves, Subject};

/// What the passthrough kind offers besides the core: migration (quiesce, reset and replay)
/// and recovery in a replacement process (reset and replay); no swap, no relocation (its state
/// is in the hardware), no work counters.
const VFIO_GROUPS: Groups = Groups {
    migration: true,
    swap: false,
    recovery: true,
    relocation: Moves::No,
    telemetry: false,
};

/// `--conformance BDF`: the conformance suite on `vfio,host=BDF`, every check whatever fails.
pub fn run_conformance(bdf: &str) -> std::process::ExitCode {
    let subject = Subject::kind_kv(switchyard_vfio::VfioKind, &format!("host={bdf}"))
        .named(format!("vfio({bdf})"))
        .declares(VFIO_GROUPS);
    let results = switchyard_conformance::run_all(&subject);
    let mut failed = Vec::new();
    for (check, r) in &results {
        match r {
            Ok(()) => println!("CONFORMANCE: {check} ok"),
            Err(why) => {
                println!("CONFORMANCE: {check} FAIL {}", why.replace('\n', " | "));
                failed.push(*check);
            }
        }
    }
    let summary = serde_json::json!({
        "result": if failed.is_empty() { "pass" } else { "fail" },
        "checks": results.len(),
        "failed": failed,
    });
    println!("CONFORMANCE-SUMMARY {summary}");
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
