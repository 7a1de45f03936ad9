//! Test knobs: environment variables that make a worker slow or chatty on purpose, so that
//! the tests can prove the daemon does not wait on it. Honoured by debug builds only (the
//! ones the tests run); a release build ignores them, so nobody can slow a production
//! worker through its environment.
//!
//! | variable | effect |
//! |---|---|
//! | `SWITCHYARD_TEST_READY_DELAY=ENDPOINT:MS` | the worker of `ENDPOINT` waits `MS` ms before it says it is ready |
//! | `SWITCHYARD_TEST_STATS_MS=MS` | workers report their stats every `MS` ms, even when nothing happened |
//! | `SWITCHYARD_TEST_JAIL_PROBE=DIR` | a worker (or `serve`), once jailed or not (`--no-jail`), tries what the jail forbids and logs the outcome ([`crate::jail::probe_if_asked`]) |
//! | `SWITCHYARD_TEST_JAIL_SECCOMP=log` | the seccomp filter logs the system calls it would refuse (the kernel's audit log) and allows them: how the allow-lists are checked against the tests |
//! | `SWITCHYARD_TEST_PAUSE=POINT` | the daemon thread reaching `POINT` stops there for good (a test then kills the daemon at that point): `failover-planned` (a failover's target reserved, the worker not asked yet), `failover-asked` (the worker asked to continue on the target, the daemon not told it did) |

use std::time::Duration;

/// The knob's value, in debug builds.
fn var(name: &str) -> Option<String> {
    if cfg!(debug_assertions) {
        std::env::var(name).ok()
    } else {
        None
    }
}

/// How long the worker of `endpoint` delays its ready (`SWITCHYARD_TEST_READY_DELAY`).
pub fn ready_delay(endpoint: &str) -> Option<Duration> {
    let v = var("SWITCHYARD_TEST_READY_DELAY")?;
    let (id, ms) = v.rsplit_once(':')?;
    (id == endpoint)
        .then(|| ms.parse().ok().map(Duration::from_millis))
        .flatten()
}

/// Stops the calling thread for good if `SWITCHYARD_TEST_PAUSE` names `point`, saying so
/// in the log first (what a test waits for before it kills the daemon).
pub fn pause(point: &str) {
    if var("SWITCHYARD_TEST_PAUSE").as_deref() == Some(point) {
        tracing::warn!(point, "test knob: paused here for good");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// The directory of the jail probe (`SWITCHYARD_TEST_JAIL_PROBE`).
pub fn jail_probe() -> Option<String> {
    var("SWITCHYARD_TEST_JAIL_PROBE")
}

/// Whether the seccomp filter only logs (`SWITCHYARD_TEST_JAIL_SECCOMP=log`).
pub fn jail_seccomp_log() -> bool {
    var("SWITCHYARD_TEST_JAIL_SECCOMP").as_deref() == Some("log")
}

/// The stats period, and whether empty reports are sent too (`SWITCHYARD_TEST_STATS_MS`).
pub fn stats_period() -> Option<Duration> {
    var("SWITCHYARD_TEST_STATS_MS")?
        .parse()
        .ok()
        .map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_ready_delay_names_its_endpoint() {
        // Parsing only: the environment is the process's, shared by the tests.
        let parse = |v: &str, id: &str| {
            let (e, ms) = v.rsplit_once(':')?;
            (e == id).then(|| ms.parse::<u64>().ok()).flatten()
        };
        assert_eq!(parse("slow:1500", "slow"), Some(1500));
        assert_eq!(parse("slow:1500", "fast"), None);
        assert_eq!(parse("slow", "slow"), None);
    }
}
