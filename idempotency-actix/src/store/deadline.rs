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
    static POLLED: Cell<Polled> = const { Cell::new(Polled { deadline: None, kept: false }) };
}

/// What the thread knows of the store operation it polls.
#[derive(Clone, Copy)]
struct Polled {
    /// The operation's deadline, while one is polled.
    deadline: Option<Instant>,
    /// Whether what the poll left waiting keeps that deadline.
    kept: bool,
}

/// Runs `poll` with `deadline` as the current deadline. Returns what it returned, and
/// whether what it left waiting keeps the deadline ([`kept`] was called during it).
pub(crate) fn polling<T>(deadline: Instant, poll: impl FnOnce() -> T) -> (T, bool) {
    let outer = Restore(POLLED.replace(Polled {
        deadline: Some(deadline),
        kept: false,
    }));
    let output = poll();
    let kept = POLLED.get().kept;
    drop(outer);
    (output, kept)
}

/// The deadline of the store operation being polled on this thread, if one is.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn current() -> Option<Instant> {
    POLLED.get().deadline
}

/// Says that the operation being polled waits on something that wakes it by the
/// [`current`] deadline, answered or not.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn kept() {
    POLLED.set(Polled {
        kept: true,
        ..POLLED.get()
    });
}

/// Puts back what an enclosing poll knew, even if the inner one panics.
struct Restore(Polled);

impl Drop for Restore {
    fn drop(&mut self) {
        POLLED.set(self.0);
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
        assert!(!POLLED.get().kept);
    }
}
