//! [`LogInterval`]: lets a log line that every request could write through at most once per
//! interval, and counts the ones it holds back.
//!
//! A store that is down, or a memory store full of keys still in flight, fails every new
//! key's `begin`: logged per request, a flood of keys (or plain traffic during an outage)
//! would write a line per request. The metrics count every one of them; the log says that
//! it happens, and how often since its last line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often one kind of repeated line is let through, at most.
pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The rate limit of one kind of log line (shared by threads).
pub(crate) struct LogInterval {
    /// When the next line may be logged, in milliseconds since `started`.
    next_at_ms: AtomicU64,
    /// The lines held back since the last one let through.
    held_back: AtomicU64,
    started: Instant,
}

impl LogInterval {
    pub(crate) fn new() -> Self {
        Self {
            next_at_ms: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
            started: Instant::now(),
        }
    }

    /// Whether a line may be logged at `now`: `Some` with how many were held back since
    /// the last one let through, or `None` when this one is held back (and counted).
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let now_ms = u64::try_from(now.saturating_duration_since(self.started).as_millis())
            .unwrap_or(u64::MAX);
        let due = self.next_at_ms.load(Ordering::Relaxed);
        let next = now_ms.saturating_add(LOG_INTERVAL.as_millis() as u64);
        if now_ms < due
            || self
                .next_at_ms
                .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.held_back.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.held_back.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lets_one_line_through_per_interval_and_counts_the_rest() {
        let interval = LogInterval::new();
        let start = interval.started;
        assert_eq!(interval.admit(start), Some(0));
        assert_eq!(interval.admit(start + Duration::from_secs(1)), None);
        assert_eq!(interval.admit(start + Duration::from_secs(9)), None);
        assert_eq!(interval.admit(start + LOG_INTERVAL), Some(2));
        assert_eq!(interval.admit(start + LOG_INTERVAL * 2), Some(0));
    }
}
