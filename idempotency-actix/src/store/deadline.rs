//! The deadline of the store operation being polled, for a store that keeps it itself.
//!
//! The engine bounds every store operation by the store timeout. A Tokio timer per
//! operation costs about a thousand instructions (put into the timer wheel when the
//! operation first waits, taken out when it ends), most of a replay's store step on the
//! store's own Redis connection. That connection keeps the deadlines of the commands it
//! waits for with one timer for all of them instead (`redis::direct`): a command still
//! unanswered at its deadline is answered with a timeout error then.
//!
//! While the engine polls an operation, [`polling`] makes its deadline the [`current`] one;
//! a future that will wake the operation by that deadline whatever happens (the
//! connection's reply, or its timeout) says so with [`kept`] when it waits. The engine arms
//! a timer of its own only when a poll leaves the operation waiting on anything else
//! (connecting, another store).

use std::cell::Cell;
use std::time::Instant;

thread_local! {
    static CURRENT: Cell<Option<Instant>> = const { Cell::new(None) };
    static KEPT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `poll` with `deadline` as the current deadline. Returns what it returned, and
/// whether what it left waiting keeps the deadline ([`kept`] was called during it).
pub(crate) fn polling<T>(deadline: Instant, poll: impl FnOnce() -> T) -> (T, bool) {
    let scope = Scope {
        outer: CURRENT.replace(Some(deadline)),
        outer_kept: KEPT.replace(false),
    };
    let output = poll();
    let kept = KEPT.get();
    drop(scope);
    (output, kept)
}

/// The deadline of the store operation being polled on this thread, if one is.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn current() -> Option<Instant> {
    CURRENT.get()
}

/// Says that the operation being polled waits on something that wakes it by the
/// [`current`] deadline, answered or not.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn kept() {
    KEPT.set(true);
}

/// Puts back the deadline of an enclosing poll, even if the inner one panics.
struct Scope {
    outer: Option<Instant>,
    outer_kept: bool,
}

impl Drop for Scope {
    fn drop(&mut self) {
        CURRENT.set(self.outer);
        KEPT.set(self.outer_kept);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_deadline_is_current_only_while_polled_and_nests() {
        let outer = Instant::now() + Duration::from_secs(2);
        let inner = outer + Duration::from_secs(1);
        assert_eq!(current(), None);
        let ((), kept_outer) = polling(outer, || {
            assert_eq!(current(), Some(outer));
            let ((), kept_inner) = polling(inner, || {
                assert_eq!(current(), Some(inner));
                kept();
            });
            assert!(kept_inner);
            assert_eq!(current(), Some(outer));
        });
        assert!(!kept_outer, "the inner poll's wait is not the outer one's");
        assert_eq!(current(), None);
    }

    #[test]
    fn a_panicking_poll_leaves_no_deadline_behind() {
        let deadline = Instant::now();
        let panicked = std::panic::catch_unwind(|| {
            polling(deadline, || {
                kept();
                panic!("a store panicked");
            })
        });
        assert!(panicked.is_err());
        assert_eq!(current(), None);
        assert!(!KEPT.get());
    }
}
