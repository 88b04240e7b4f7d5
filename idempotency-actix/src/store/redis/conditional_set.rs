//! [`ConditionalSet`]: whether the server takes `SET … IFEQ`, learnt from the first commit
//! that tries it.
//!
//! `SET key value IFEQ expected` (Valkey ≥ 8.1, Redis ≥ 8.4) writes only over a value equal
//! to `expected`: a compare-and-write in one plain command, which is all a fenced commit
//! needs (the in-flight record `begin` wrote is the expected value). A plain command costs
//! a fraction of a function call inside the server, so a store commits that way wherever it
//! can. A server without `IFEQ` refuses the command as a syntax error and writes nothing;
//! the store then commits by function, until it opens a connection anew (a server
//! restarted or replaced, as in an upgrade, may take `IFEQ` now); then the next commit tries
//! `IFEQ` once more.

use std::sync::atomic::{AtomicU8, Ordering};

use super::protocol::CommitBy;

/// Commits try `SET … IFEQ`.
const TRY: u8 = 0;
/// A server refused `IFEQ`: commits go by function until a connection is opened anew.
const REFUSED: u8 = 1;
/// Commits go by function for good (see [`ConditionalSet::by_function_only`]).
const FUNCTION_ONLY: u8 = 2;

/// Whether commits still try `SET … IFEQ`: until a server refuses it, and again on the next
/// connection.
#[derive(Debug, Default)]
pub(crate) struct ConditionalSet {
    state: AtomicU8,
}

impl ConditionalSet {
    /// How to send the next commit: as `SET … IFEQ` unless a server refused it on this
    /// connection.
    pub(crate) fn commit_by(&self) -> CommitBy {
        if self.state.load(Ordering::Relaxed) == TRY {
            CommitBy::ConditionalSet
        } else {
            CommitBy::Function
        }
    }

    /// A server refused `SET … IFEQ`: commits go by function until a connection is opened
    /// anew.
    pub(crate) fn refuse(&self) {
        if self
            .state
            .compare_exchange(TRY, REFUSED, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::debug!(
                "idempotency: the Redis server has no SET … IFEQ (Valkey ≥ 8.1, Redis ≥ 8.4); \
                 commits go by function"
            );
        }
    }

    /// A connection was opened anew, perhaps to another server or version: the next commit
    /// tries `SET … IFEQ` again (one refused by a server without it writes nothing).
    pub(crate) fn reconsider(&self) {
        let _ = self
            .state
            .compare_exchange(REFUSED, TRY, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Commits go by function for good, whatever the server takes.
    pub(crate) fn by_function_only(&self) {
        self.state.store(FUNCTION_ONLY, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_holds_until_a_connection_is_opened_anew() {
        let conditional_set = ConditionalSet::default();
        assert_eq!(conditional_set.commit_by(), CommitBy::ConditionalSet);
        conditional_set.refuse();
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
        conditional_set.reconsider();
        assert_eq!(conditional_set.commit_by(), CommitBy::ConditionalSet);
    }

    #[test]
    fn commits_by_function_only_stay_so_on_a_new_connection() {
        let conditional_set = ConditionalSet::default();
        conditional_set.by_function_only();
        conditional_set.reconsider();
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
        conditional_set.refuse();
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
    }
}
