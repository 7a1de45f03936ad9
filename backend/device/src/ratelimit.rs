//! Rate-limited warnings: a peer that makes the same thing fail a million times a second must
//! not turn the log into the bottleneck (or fill the disk).
//!
//! One [`LogLimiter`] per call site and per client: the first occurrence is logged in full,
//! further ones within the interval are only counted, and one summary line with the count is
//! logged when the next occurrence comes after the interval or when the client goes
//! ([`LogLimiter::flush`]). No allocation per occurrence; a mutex held for a few instructions
//! (sites are error paths, possibly on several threads).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Interval of the limiters used by the server and the devices.
pub const LOG_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct Window {
    /// When the last occurrence was logged in full (`None`: nothing logged yet).
    logged_at: Option<Instant>,
    /// Occurrences counted but not logged since then.
    suppressed: u64,
}

/// Decides which occurrences of one warning are logged; see the [module docs](self).
#[derive(Debug)]
pub struct LogLimiter {
    what: &'static str,
    interval: Duration,
    window: Mutex<Window>,
}

impl LogLimiter {
    /// A limiter for the warning `what` (named in its summary lines), logging at most one
    /// occurrence per `interval`.
    pub fn new(what: &'static str, interval: Duration) -> Self {
        Self {
            what,
            interval,
            window: Mutex::new(Window::default()),
        }
    }

    /// Records one occurrence; `true` if the caller should log it in full. A summary of the
    /// occurrences suppressed before it is logged first.
    pub fn allow(&self) -> bool {
        let now = Instant::now();
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        if w.logged_at
            .is_some_and(|t| now.saturating_duration_since(t) < self.interval)
        {
            w.suppressed = w.suppressed.saturating_add(1);
            return false;
        }
        w.logged_at = Some(now);
        let suppressed = std::mem::take(&mut w.suppressed);
        drop(w);
        self.summary(suppressed);
        true
    }

    /// Logs the summary of what was suppressed since the last full line, if anything, and
    /// starts afresh (the next occurrence is logged in full): for a client that goes away.
    pub fn flush(&self) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let suppressed = std::mem::take(&mut w.suppressed);
        w.logged_at = None;
        drop(w);
        self.summary(suppressed);
    }

    /// Occurrences counted but not yet summarised.
    pub fn suppressed(&self) -> u64 {
        self.window
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .suppressed
    }

    fn summary(&self, suppressed: u64) {
        if suppressed > 0 {
            tracing::warn!(what = self.what, suppressed, "repeated warning suppressed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_is_logged_then_counted_until_the_interval_passes() {
        let l = LogLimiter::new("test", Duration::from_millis(50));
        assert!(l.allow(), "first occurrence");
        for _ in 0..1000 {
            assert!(!l.allow());
        }
        assert_eq!(l.suppressed(), 1000);
        std::thread::sleep(Duration::from_millis(60));
        assert!(l.allow(), "the first one after the interval");
        assert_eq!(l.suppressed(), 0, "summarised");
        assert!(!l.allow());
        l.flush();
        assert_eq!(l.suppressed(), 0);
        assert!(l.allow(), "a fresh start after a flush");
    }
}
