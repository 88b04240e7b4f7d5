//! [`Entry`]: one record as the memory store holds it, and the bytes it is charged.

use std::mem::size_of;
use std::time::Instant;

use actix_web::web::Bytes;

use crate::fingerprint::Fingerprint;
use crate::store::LeaseToken;

/// Where an entry sits in its shard's expiry index: its expiry, then a sequence number that
/// tells apart entries expiring at the same instant.
pub(super) type ExpiryKey = (Instant, u64);

/// One record: in flight (a lease held by a token), completed (a response to replay), or
/// the marker of an abandoned token.
pub(super) struct Entry {
    /// The record's key, and its hash under the store's hasher.
    pub(super) key: Box<str>,
    pub(super) hash: u64,
    pub(super) fingerprint: Fingerprint,
    pub(super) state: EntryState,
    pub(super) expires_at: Instant,
    pub(super) seq: u64,
    /// What the entry is charged against the byte budget, fixed when it is written.
    pub(super) bytes: usize,
}

pub(super) enum EntryState {
    /// Held by a token; with the marker it took the key over, if it did, which its release
    /// puts back (see [`TakenOver`]).
    InFlight(LeaseToken, Option<Box<TakenOver>>),
    Completed(LeaseToken, Bytes),
    /// The marker of abandoned tokens (latest last, at most
    /// [`REMEMBERED_TOKENS`](super::shard::REMEMBERED_TOKENS)): a `begin` of one of them
    /// creates nothing, any other token's `begin` replaces the marker. Indexed, evicted and
    /// reclaimed as completed records are.
    Abandoned(Vec<LeaseToken>),
}

/// The marker of abandoned tokens that an in-flight record took the key over: its tokens
/// and its expiry. The record keeps them out for the rest of the marker's time, whatever
/// its holder does: its release puts the marker back, its commit keeps the completed record
/// at least as long, its abandon adds them to its own marker.
pub(super) struct TakenOver {
    pub(super) tokens: Vec<LeaseToken>,
    pub(super) expires_at: Instant,
}

impl Entry {
    pub(super) fn expiry_key(&self) -> ExpiryKey {
        (self.expires_at, self.seq)
    }

    /// Whether this is the record under `key`.
    pub(super) fn is(&self, key: super::shard::HashedKey<'_>) -> bool {
        self.hash == key.hash && *self.key == *key.key
    }

    pub(super) fn is_live(&self, now: Instant) -> bool {
        self.expires_at > now
    }

    /// Whether the entry is in flight (indexed and budgeted as such).
    pub(super) fn is_in_flight(&self) -> bool {
        matches!(self.state, EntryState::InFlight(..))
    }

    /// Whether `token` holds this entry's lease.
    pub(super) fn is_held_by(&self, token: &LeaseToken) -> bool {
        matches!(&self.state, EntryState::InFlight(holder, _) if holder == token)
    }
}

/// What the allocator adds to each heap allocation on average (its bookkeeping and the
/// rounding up to a size class).
const ALLOCATION_OVERHEAD: usize = 32;

/// The fixed cost of every entry: its slot in the shard's map (the entry, with the key's
/// pointer and hash), its slot in an expiry index (expiry key and hash), plus the
/// allocations of the key and of the token. Hash tables and B-tree nodes are never full, so
/// both slots are counted twice.
const ENTRY_OVERHEAD: usize =
    2 * size_of::<Entry>() + 2 * size_of::<(ExpiryKey, u64)>() + 2 * ALLOCATION_OVERHEAD;

/// The least budget a shard can work with: its in-flight half holds one in-flight record
/// under a storage key of 64 hex digits after a prefix of up to 64 bytes. A smaller shard
/// would refuse every new key, empty as it is; a longer prefix needs
/// [`least_shard_budget`].
pub(super) const MIN_SHARD_BUDGET: usize = least_shard_budget(64);

/// The least budget a shard can work with under keys after a prefix of `prefix_len` bytes:
/// its in-flight half holds one in-flight record under such a key (the prefix, 64 hex
/// digits) held by a lease token (32 digits).
pub(super) const fn least_shard_budget(prefix_len: usize) -> usize {
    2 * (ENTRY_OVERHEAD + prefix_len + 64 + 32)
}

/// The bytes an in-flight record under `key` held by `token` is charged.
pub(super) fn in_flight_bytes(key: &str, token: &LeaseToken) -> usize {
    ENTRY_OVERHEAD + key.len() + token.as_bytes().len()
}

/// The bytes the marker of `tokens` under `key` is charged.
pub(super) fn marker_bytes(key: &str, tokens: &[LeaseToken]) -> usize {
    ENTRY_OVERHEAD + key.len() + ALLOCATION_OVERHEAD + tokens_bytes(tokens)
}

/// The bytes an in-flight record under `key` held by `token` is charged when it took the
/// key over the marker of `tokens`, which it carries.
pub(super) fn in_flight_over_marker_bytes(
    key: &str,
    token: &LeaseToken,
    tokens: &[LeaseToken],
) -> usize {
    in_flight_bytes(key, token)
        + size_of::<TakenOver>()
        + 2 * ALLOCATION_OVERHEAD
        + tokens_bytes(tokens)
}

/// The bytes a list of abandoned tokens is charged.
fn tokens_bytes(tokens: &[LeaseToken]) -> usize {
    tokens
        .iter()
        .map(|token| size_of::<LeaseToken>() + ALLOCATION_OVERHEAD + token.as_bytes().len())
        .sum()
}

/// The bytes a completed record under `key` is charged: the in-flight cost plus its
/// encoded response (status, headers and body in one allocation).
pub(super) fn completed_bytes(key: &str, token: &LeaseToken, encoded_len: usize) -> usize {
    in_flight_bytes(key, token) + ALLOCATION_OVERHEAD + encoded_len
}
