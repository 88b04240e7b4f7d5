//! [`ConditionalSet`]: whether the server takes `SET … IFEQ`, learnt from the first commit
//! that tries it.
//!
//! `SET key value IFEQ expected` (Valkey ≥ 8.1, Redis ≥ 8.4) writes only over a value equal
//! to `expected`: a compare-and-write in one plain command, which is all a fenced commit
//! needs (the in-flight record `begin` wrote is the expected value). A plain command costs
//! a fraction of a function call inside the server, so a store commits that way wherever it
//! can. A server without `IFEQ` refuses the command as a syntax error and writes nothing;
//! the store then commits by function, and keeps doing so.

use std::sync::atomic::{AtomicBool, Ordering};

use super::protocol::CommitBy;

/// Whether commits still try `SET … IFEQ`: until a server refuses it once.
#[derive(Debug, Default)]
pub(crate) struct ConditionalSet {
    refused: AtomicBool,
}

impl ConditionalSet {
    /// How to send the next commit: as `SET … IFEQ` until a server refused it.
    pub(crate) fn commit_by(&self) -> CommitBy {
        if self.refused.load(Ordering::Relaxed) {
            CommitBy::Function
        } else {
            CommitBy::ConditionalSet
        }
    }

    /// A server refused `SET … IFEQ`: commits go by function from now on.
    pub(crate) fn refuse(&self) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                "idempotency: the Redis server has no SET … IFEQ (Valkey ≥ 8.1, Redis ≥ 8.4); \
                 commits go by function"
            );
        }
    }
}
