//! [`ConditionalSet`]: whether commits go by `SET … IFEQ`, learnt from the server each
//! connection reaches and from the first commit that tries it.
//!
//! `SET key value IFEQ expected` (Valkey ≥ 8.1, Redis ≥ 8.4) writes only over a value equal
//! to `expected`: a compare-and-write in one plain command, which is all a fenced commit
//! needs (the in-flight record `begin` wrote is the expected value). A plain command costs
//! a fraction of a function call inside the server, so a store commits that way where it
//! can trust it: on Valkey only (see `server_kind`: Redis 8.6.3 was seen to write such a
//! `SET` into another key). Every connection opened asks which server it reached; on
//! Valkey the next commit tries `IFEQ`, elsewhere commits go by function. A Valkey without
//! `IFEQ` (before 8.1) refuses the command as a syntax error and writes nothing; the store
//! then commits by function until it opens a connection anew (a server restarted or
//! replaced, as in an upgrade, may take `IFEQ` now).

use std::sync::atomic::{AtomicU8, Ordering};

use super::protocol::CommitBy;
use super::server_kind::ServerKind;

/// Commits try `SET … IFEQ`.
const TRY: u8 = 0;
/// A server refused `IFEQ`, or is not one trusted with it (or no connection has told yet):
/// commits go by function until a connection to Valkey is opened.
const BY_FUNCTION: u8 = 1;
/// Commits go by function for good (see [`ConditionalSet::by_function_only`]).
const FUNCTION_ONLY: u8 = 2;

/// Whether commits try `SET … IFEQ`: on Valkey, until it refuses it, and again on the next
/// connection to Valkey.
#[derive(Debug)]
pub(crate) struct ConditionalSet {
    state: AtomicU8,
}

impl Default for ConditionalSet {
    /// By function, until a connection finds Valkey.
    fn default() -> Self {
        Self {
            state: AtomicU8::new(BY_FUNCTION),
        }
    }
}

impl ConditionalSet {
    /// How to send the next commit: as `SET … IFEQ` where the last connection opened
    /// reached Valkey and it has not refused `IFEQ` since.
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
            .compare_exchange(TRY, BY_FUNCTION, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::debug!(
                "idempotency: the Valkey server has no SET … IFEQ (Valkey ≥ 8.1); commits go \
                 by function"
            );
        }
    }

    /// A connection was opened anew, to `server` (perhaps another server or version): on
    /// Valkey the next commit tries `SET … IFEQ` (one refused by a server without it writes
    /// nothing); elsewhere commits go by function.
    pub(crate) fn reconsider(&self, server: ServerKind) {
        let next = match server {
            ServerKind::Valkey => TRY,
            ServerKind::Other => BY_FUNCTION,
        };
        let _ = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |state| {
                (state != FUNCTION_ONLY).then_some(next)
            });
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
        conditional_set.reconsider(ServerKind::Valkey);
        assert_eq!(conditional_set.commit_by(), CommitBy::ConditionalSet);
        conditional_set.refuse();
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
        conditional_set.reconsider(ServerKind::Valkey);
        assert_eq!(conditional_set.commit_by(), CommitBy::ConditionalSet);
    }

    /// Redis (whatever its version) and servers that do not say which they are get commits
    /// by function, as does a store before its first connection.
    #[test]
    fn only_valkey_is_sent_set_ifeq() {
        let conditional_set = ConditionalSet::default();
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
        conditional_set.reconsider(ServerKind::Other);
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
        conditional_set.reconsider(ServerKind::Valkey);
        assert_eq!(conditional_set.commit_by(), CommitBy::ConditionalSet);
        conditional_set.reconsider(ServerKind::Other);
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
    }

    #[test]
    fn commits_by_function_only_stay_so_on_a_new_connection() {
        let conditional_set = ConditionalSet::default();
        conditional_set.by_function_only();
        conditional_set.reconsider(ServerKind::Valkey);
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
        conditional_set.refuse();
        assert_eq!(conditional_set.commit_by(), CommitBy::Function);
    }
}
