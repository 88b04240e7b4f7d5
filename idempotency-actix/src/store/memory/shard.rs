//! [`Shard`]: one lock's worth of a memory store: its records, their expiry indices and its
//! byte budget.
//!
//! Every record is in the map and in exactly one of two indices ordered by expiry: one for
//! in-flight records, one for completed ones and the markers of abandoned tokens. Both are
//! kept exact (an entry whose expiry changes is moved, a removed record leaves its index at
//! once), so they never hold more entries than the map. Expired records are reclaimed from
//! the front of the indices a few per operation, and eviction takes the front of the
//! completed index: every record costs O(log n) to evict or reclaim, once, so a step is
//! amortized O(log n) (a commit that makes room for a large response may evict many), and
//! none walks the records.
//!
//! A key is hashed once per operation, by the store (which also picks the shard with that
//! hash): the map is a [`HashTable`] that takes the hash as given, each record keeps its
//! own, and the indices name records by hash and sequence number, so evicting or reclaiming
//! a record hashes nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use actix_web::web::Bytes;
use hashbrown::HashTable;

use super::entry::{self, Entry, EntryState, ExpiryKey, TakenOver};
use super::shard_report::{ShardReport, Trimmed};
use crate::fingerprint::Fingerprint;
use crate::record::StoredResponse;
use crate::store::{BeginOutcome, Deletion, LeaseToken};

/// How many abandoned tokens one marker remembers; an older one is forgotten.
pub(super) const REMEMBERED_TOKENS: usize = 16;

/// At most this many expired records of each index are reclaimed per operation. Each
/// operation adds at most one record, so expired records never pile up, and no request
/// pays for reclaiming a large batch that expired at once.
const RECLAIMED_PER_OPERATION: usize = 4;

/// What `begin` found: an outcome decided, or a completed record, which the store decodes
/// once the shard's lock is released.
pub(super) enum Begun {
    Decided(BeginOutcome),
    Completed(Bytes),
}

/// A live record, as inspection found it (a completed one still encoded).
pub(super) enum Found {
    InFlight,
    Completed(Bytes),
}

/// The in-flight records alone leave no room for the record asked for.
#[derive(Debug)]
pub(super) struct Full;

/// A key and its hash under the store's hasher.
#[derive(Clone, Copy)]
pub(super) struct HashedKey<'a> {
    pub(super) key: &'a str,
    pub(super) hash: u64,
}

/// An index: each record's expiry key, and its hash to find it in the map.
type ExpiryIndex = BTreeMap<ExpiryKey, u64>;

pub(super) struct Shard {
    records: HashTable<Entry>,
    in_flight: ExpiryIndex,
    completed: ExpiryIndex,
    used_bytes: usize,
    in_flight_bytes: usize,
    max_bytes: usize,
    next_seq: u64,
    /// What to count and log once the lock is released, since [`take_report`](Self::take_report).
    report: ShardReport,
}

impl Shard {
    pub(super) fn new(max_bytes: usize) -> Self {
        Self {
            records: HashTable::new(),
            in_flight: BTreeMap::new(),
            completed: BTreeMap::new(),
            used_bytes: 0,
            in_flight_bytes: 0,
            max_bytes,
            next_seq: 0,
            report: ShardReport::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    pub(super) fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// What happened since the last call that is to be counted or logged.
    pub(super) fn take_report(&mut self) -> ShardReport {
        std::mem::take(&mut self.report)
    }

    pub(super) fn begin(
        &mut self,
        key: HashedKey<'_>,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
        now: Instant,
    ) -> Result<Begun, Full> {
        self.reclaim_expired(now);
        if let Some(record) = self.get(key) {
            if record.is_live(now) {
                return Ok(match &record.state {
                    EntryState::InFlight(holder, _) if holder == token => {
                        Begun::Decided(BeginOutcome::Acquired)
                    }
                    EntryState::Abandoned(abandoned) if abandoned.contains(token) => {
                        Begun::Decided(BeginOutcome::Abandoned)
                    }
                    // Another token's marker blocks no one: the key is taken as if free, and
                    // the in-flight record carries the marker for the rest of its time.
                    EntryState::Abandoned(abandoned) => {
                        let taken_over = TakenOver {
                            tokens: abandoned.clone(),
                            expires_at: record.expires_at,
                        };
                        self.remove(key);
                        return self.create(key, fingerprint, token, lease, now, Some(taken_over));
                    }
                    _ if record.fingerprint != *fingerprint => {
                        Begun::Decided(BeginOutcome::FingerprintMismatch)
                    }
                    EntryState::InFlight(..) => Begun::Decided(BeginOutcome::InFlight),
                    EntryState::Completed(_, stored) => Begun::Completed(stored.clone()),
                });
            }
            self.remove(key);
        }
        self.create(key, fingerprint, token, lease, now, None)
    }

    /// Creates the in-flight record of `token` under `key`, where there is none; carrying
    /// the marker it took the key over, if any. A shard whose in-flight half has room for
    /// the record but not for the marker it carries takes the key without it (as earlier
    /// versions did) rather than refuse it.
    fn create(
        &mut self,
        key: HashedKey<'_>,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
        now: Instant,
        taken_over: Option<TakenOver>,
    ) -> Result<Begun, Full> {
        // In-flight records may take half the budget: the other half is room for them to
        // complete, so a shard full of them can always commit.
        self.reclaim_expired_in_flight(now);
        let fits = |bytes: usize| self.in_flight_bytes + bytes <= self.max_bytes / 2;
        let (bytes, taken_over) = match taken_over {
            Some(taken) => {
                match entry::in_flight_over_marker_bytes(key.key, token, &taken.tokens) {
                    bytes if fits(bytes) => (bytes, Some(Box::new(taken))),
                    _ => (entry::in_flight_bytes(key.key, token), None),
                }
            }
            None => (entry::in_flight_bytes(key.key, token), None),
        };
        if !fits(bytes) {
            return Err(Full);
        }
        self.make_room(bytes, now)?;
        let state = EntryState::InFlight(*token, taken_over);
        self.insert(key, *fingerprint, state, expiry(now, lease), bytes);
        Ok(Begun::Decided(BeginOutcome::Acquired))
    }

    /// Inserts a record under `key`, where there is none, in the index of its state, and
    /// charges its `bytes` (room was made for them).
    fn insert(
        &mut self,
        key: HashedKey<'_>,
        fingerprint: Fingerprint,
        state: EntryState,
        expires_at: Instant,
        bytes: usize,
    ) {
        let entry = Entry {
            key: Box::from(key.key),
            hash: key.hash,
            fingerprint,
            state,
            expires_at,
            seq: self.next_seq(),
            bytes,
        };
        self.used_bytes += bytes;
        if entry.is_in_flight() {
            self.in_flight_bytes += bytes;
            self.in_flight.insert(entry.expiry_key(), key.hash);
        } else {
            self.completed.insert(entry.expiry_key(), key.hash);
        }
        self.records
            .insert_unique(key.hash, entry, |record| record.hash);
    }

    pub(super) fn renew(
        &mut self,
        key: HashedKey<'_>,
        token: &LeaseToken,
        lease: Duration,
        now: Instant,
    ) -> bool {
        self.reclaim_expired(now);
        let Some(record) = held_mut(&mut self.records, key, token, now) else {
            return false;
        };
        if let Some(hash) = self.in_flight.remove(&record.expiry_key()) {
            record.expires_at = expiry(now, lease);
            self.in_flight.insert(record.expiry_key(), hash);
        }
        true
    }

    /// Completes the record held by `token`. A record that does not fit even once every
    /// completed record is evicted (in-flight records fill the shard, or the response alone
    /// is larger than the shard) is completed without its body, as a response over the
    /// stored-body limit is, so a retry still never runs the handler again; if that does
    /// not fit either (headers larger than the room completions have), with its status
    /// alone; [`Full`] if even that does not fit.
    ///
    /// Where the key is free, the completed record (of `fingerprint`) is written anew, and a
    /// retry gets the replay: nothing is there, or an expired record (the in-flight one of
    /// a handler that blocked its worker for longer than the lease, say), or another
    /// token's marker, which blocks no one. Should even the record without its body not
    /// fit, that expired record or marker is gone all the same: the former would be
    /// reclaimed anyway, and in this store a `begin` runs whole when first polled, so no
    /// abandoned one lands late.
    pub(super) fn commit(
        &mut self,
        key: HashedKey<'_>,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
        now: Instant,
    ) -> Result<bool, Full> {
        self.reclaim_expired(now);
        // The record's bytes where `token` holds it, and the expiry of a marker the key was
        // taken over.
        let (held_bytes, marker_expiry) = match self.get(key).filter(|record| record.is_live(now)) {
            None => (None, None),
            Some(record) => match &record.state {
                // Committing twice with one token succeeds without writing again.
                EntryState::Completed(committer, _) => return Ok(committer == token),
                EntryState::InFlight(holder, _) if holder != token => return Ok(false),
                EntryState::Abandoned(abandoned) if abandoned.contains(token) => {
                    return Ok(false);
                }
                EntryState::Abandoned(_) => (None, Some(record.expires_at)),
                EntryState::InFlight(_, taken_over) => (
                    Some(record.bytes),
                    taken_over.as_ref().map(|taken| taken.expires_at),
                ),
            },
        };
        // Over a marker, the completed record keeps the marker's tokens out for the rest of
        // its time, as an abandon keeps a completed record it finds.
        let expires_at =
            marker_expiry.map_or(expiry(now, ttl), |marker| marker.max(expiry(now, ttl)));
        let Some(in_flight_bytes) = held_bytes else {
            self.remove(key);
            let (stored, bytes) = self.fit(key, token, response, 0, now)?;
            let state = EntryState::Completed(*token, stored);
            self.insert(key, *fingerprint, state, expires_at, bytes);
            self.report.written_anew = true;
            return Ok(true);
        };
        let (stored, bytes) = self.fit(key, token, response, in_flight_bytes, now)?;
        let Some(record) = self.records.find_mut(key.hash, |record| record.is(key)) else {
            return Ok(false);
        };
        let Some(hash) = self.in_flight.remove(&record.expiry_key()) else {
            return Ok(false);
        };
        record.state = EntryState::Completed(*token, stored);
        record.expires_at = expires_at;
        record.bytes = bytes;
        self.completed.insert(record.expiry_key(), hash);
        self.in_flight_bytes -= in_flight_bytes;
        // The completed record can be the smaller one: an in-flight record that carries a
        // marker (see `TakenOver`) completed with a short response.
        self.used_bytes = self.used_bytes + bytes - in_flight_bytes;
        Ok(true)
    }

    /// `response` encoded for the completed record of `token` under `key`, and that record's
    /// bytes, with room made for them beyond the `replaced` bytes of the record it replaces:
    /// without its body if the whole does not fit, with its status alone if that does not
    /// fit either (see [`commit`](Self::commit)).
    fn fit(
        &mut self,
        key: HashedKey<'_>,
        token: &LeaseToken,
        response: &StoredResponse,
        replaced: usize,
        now: Instant,
    ) -> Result<(Bytes, usize), Full> {
        // One exact-size allocation holds the whole response, encoded: the byte count is the
        // memory the store holds (a captured body may sit in a larger buffer), and a record
        // costs one allocation to make and one to free when it is evicted.
        let stored = Bytes::from(response.encode());
        let bytes = entry::completed_bytes(key.key, token, stored.len());
        if self.make_room(bytes.saturating_sub(replaced), now).is_ok() {
            return Ok((stored, bytes));
        }
        let without_body = StoredResponse {
            body: None,
            ..response.clone()
        };
        let stored = Bytes::from(without_body.encode());
        let bytes = entry::completed_bytes(key.key, token, stored.len());
        if self.make_room(bytes.saturating_sub(replaced), now).is_ok() {
            self.report.trimmed = Some(Trimmed::Body);
            return Ok((stored, bytes));
        }
        // Headers too large for the room that completions have: completed with the status
        // alone rather than refused, or the commit would be retried for the whole ttl and
        // every retry of the request would get 409 meanwhile, never its replay.
        let status_only = StoredResponse::new(response.status, Vec::new(), None);
        let stored = Bytes::from(status_only.encode());
        let bytes = entry::completed_bytes(key.key, token, stored.len());
        self.make_room(bytes.saturating_sub(replaced), now)?;
        self.report.trimmed = Some(Trimmed::Headers);
        Ok((stored, bytes))
    }

    /// Abandons `token` (see [`IdempotencyStore::abandon`](crate::IdempotencyStore::abandon)):
    /// its in-flight record, an expired record or nothing is replaced by the marker of
    /// `token`, kept for `remember_for`; a marker there takes `token` too, as does the marker
    /// the token's in-flight record took the key over (kept for the rest of its time at
    /// least); a completed record is kept for at least `remember_for`; `false` when another
    /// token's in-flight record is there. When even the marker does not fit, the record is
    /// still removed: in this store a `begin` runs whole when first polled, so none can land
    /// late anyway.
    pub(super) fn abandon(
        &mut self,
        key: HashedKey<'_>,
        token: &LeaseToken,
        remember_for: Duration,
        now: Instant,
    ) -> bool {
        self.reclaim_expired(now);
        let mut tokens = Vec::new();
        let mut expires_at = expiry(now, remember_for);
        if let Some(record) = self.get(key).filter(|record| record.is_live(now)) {
            match &record.state {
                EntryState::InFlight(holder, taken_over) if holder == token => {
                    if let Some(taken) = taken_over {
                        tokens.extend_from_slice(latest(&taken.tokens));
                        expires_at = expires_at.max(taken.expires_at);
                    }
                }
                EntryState::Abandoned(earlier) => tokens.extend_from_slice(latest(earlier)),
                EntryState::Completed(..) => {
                    self.keep_completed(key, expires_at);
                    return true;
                }
                EntryState::InFlight(..) => return false,
            }
        }
        tokens.push(*token);
        self.remove(key);
        self.mark(key, tokens, expires_at, now);
        true
    }

    /// Writes the marker of `tokens` under `key`, where there is no record, until
    /// `expires_at`; nothing where even that does not fit (in this store a `begin` runs
    /// whole when first polled, so none lands late anyway).
    fn mark(
        &mut self,
        key: HashedKey<'_>,
        tokens: Vec<LeaseToken>,
        expires_at: Instant,
        now: Instant,
    ) {
        let bytes = entry::marker_bytes(key.key, &tokens);
        if self.make_room(bytes, now).is_err() {
            return;
        }
        let no_fingerprint = Fingerprint::from_bytes([0; 32]);
        let state = EntryState::Abandoned(tokens);
        self.insert(key, no_fingerprint, state, expires_at, bytes);
    }

    /// Keeps the completed record under `key` until `until` at least.
    fn keep_completed(&mut self, key: HashedKey<'_>, until: Instant) {
        let Some(record) = self
            .records
            .find_mut(key.hash, |record| record.is(key))
            .filter(|record| record.expires_at < until)
        else {
            return;
        };
        if let Some(hash) = self.completed.remove(&record.expiry_key()) {
            record.expires_at = until;
            self.completed.insert(record.expiry_key(), hash);
        }
    }

    /// Deletes the in-flight record held by `token`; one that took the key over a marker
    /// leaves that marker in its place for the rest of the marker's time.
    pub(super) fn release(&mut self, key: HashedKey<'_>, token: &LeaseToken, now: Instant) -> bool {
        self.reclaim_expired(now);
        let Some(record) = held_mut(&mut self.records, key, token, now) else {
            return false;
        };
        let taken_over = match &mut record.state {
            EntryState::InFlight(_, taken_over) => taken_over.take(),
            _ => None,
        };
        self.remove(key);
        if let Some(taken) = taken_over.filter(|taken| taken.expires_at > now) {
            self.mark(key, taken.tokens, taken.expires_at, now);
        }
        true
    }

    /// The live record under `key`, for inspection.
    pub(super) fn inspect(
        &mut self,
        key: HashedKey<'_>,
        now: Instant,
    ) -> Option<(Found, Duration)> {
        self.reclaim_expired(now);
        let record = self.get(key).filter(|record| record.is_live(now))?;
        let expires_in = record.expires_at - now;
        match &record.state {
            EntryState::InFlight(..) => Some((Found::InFlight, expires_in)),
            EntryState::Completed(_, stored) => {
                Some((Found::Completed(stored.clone()), expires_in))
            }
            // The marker of an abandoned token is no record.
            EntryState::Abandoned(_) => None,
        }
    }

    /// Deletes the live record under `key`; an in-flight one only if `force`.
    pub(super) fn delete(&mut self, key: HashedKey<'_>, force: bool, now: Instant) -> Deletion {
        self.reclaim_expired(now);
        let Some(record) = self.get(key).filter(|record| {
            record.is_live(now) && !matches!(record.state, EntryState::Abandoned(_))
        }) else {
            return Deletion::NotFound;
        };
        if record.is_in_flight() && !force {
            return Deletion::InFlight;
        }
        self.remove(key);
        Deletion::Deleted
    }

    /// Makes room for `extra` more bytes by evicting completed records, soonest to expire
    /// first; [`Full`] (evicting nothing) when in-flight records alone leave too little.
    fn make_room(&mut self, extra: usize, now: Instant) -> Result<(), Full> {
        if self.used_bytes + extra <= self.max_bytes {
            return Ok(());
        }
        self.reclaim_expired_in_flight(now);
        if self.in_flight_bytes + extra > self.max_bytes {
            return Err(Full);
        }
        while self.used_bytes + extra > self.max_bytes {
            let Some((expiry_key, hash)) = self.completed.pop_first() else {
                return Err(Full);
            };
            let evicted = self.forget(expiry_key, hash);
            // A live marker of abandoned tokens goes too, but it is no record: no retry
            // runs its handler again for its loss.
            if expiry_key.0 > now
                && evicted.is_some_and(|entry| matches!(entry.state, EntryState::Completed(..)))
            {
                self.report.evictions += 1;
            }
        }
        Ok(())
    }

    /// Reclaims every expired in-flight record: they are not in flight any more, and must
    /// not count as such when deciding whether there is room. Each is reclaimed once, so this
    /// stays amortized O(log n).
    fn reclaim_expired_in_flight(&mut self, now: Instant) {
        while let Some((expiry_key, hash)) = pop_expired(&mut self.in_flight, now) {
            self.forget(expiry_key, hash);
        }
    }

    /// Reclaims a few expired records from the front of each index.
    fn reclaim_expired(&mut self, now: Instant) {
        for _ in 0..RECLAIMED_PER_OPERATION {
            let Some((expiry_key, hash)) = pop_expired(&mut self.completed, now) else {
                break;
            };
            self.forget(expiry_key, hash);
        }
        for _ in 0..RECLAIMED_PER_OPERATION {
            let Some((expiry_key, hash)) = pop_expired(&mut self.in_flight, now) else {
                break;
            };
            self.forget(expiry_key, hash);
        }
    }

    /// Removes the record under `key` from the map and from its index.
    fn remove(&mut self, key: HashedKey<'_>) {
        let Ok(found) = self.records.find_entry(key.hash, |record| record.is(key)) else {
            return;
        };
        let (record, _) = found.remove();
        let index = if record.is_in_flight() {
            &mut self.in_flight
        } else {
            &mut self.completed
        };
        index.remove(&record.expiry_key());
        self.discharge(&record);
    }

    /// Removes the record that an index named (`expiry_key`, `hash`) from the map; its index
    /// entry is already gone.
    fn forget(&mut self, expiry_key: ExpiryKey, hash: u64) -> Option<Entry> {
        let found = self
            .records
            .find_entry(hash, |record| record.expiry_key() == expiry_key);
        let (record, _) = found.ok()?.remove();
        self.discharge(&record);
        Some(record)
    }

    /// The record under `key`, if any (live or not).
    fn get(&self, key: HashedKey<'_>) -> Option<&Entry> {
        self.records.find(key.hash, |record| record.is(key))
    }

    /// Takes a removed record's bytes off the counts.
    fn discharge(&mut self, record: &Entry) {
        self.used_bytes -= record.bytes;
        if record.is_in_flight() {
            self.in_flight_bytes -= record.bytes;
        }
    }

    /// Whether the map, the indices and the byte counts agree (for tests).
    #[cfg(test)]
    pub(super) fn is_consistent(&self) -> bool {
        let indexed = |index: &ExpiryIndex, in_flight: bool| {
            index.iter().all(|(expiry_key, hash)| {
                self.records
                    .find(*hash, |record| record.expiry_key() == *expiry_key)
                    .is_some_and(|record| {
                        record.hash == *hash && record.is_in_flight() == in_flight
                    })
            })
        };
        let in_flight_bytes: usize = self
            .records
            .iter()
            .filter(|record| record.is_in_flight())
            .map(|record| record.bytes)
            .sum();
        self.records.len() == self.in_flight.len() + self.completed.len()
            && indexed(&self.in_flight, true)
            && indexed(&self.completed, false)
            && self
                .records
                .iter()
                .map(|record| record.bytes)
                .sum::<usize>()
                == self.used_bytes
            && in_flight_bytes == self.in_flight_bytes
            && self.used_bytes <= self.max_bytes
    }

    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }
}

/// The live in-flight record under `key` in `records` held by `token`, if any.
fn held_mut<'a>(
    records: &'a mut HashTable<Entry>,
    key: HashedKey<'_>,
    token: &LeaseToken,
    now: Instant,
) -> Option<&'a mut Entry> {
    records
        .find_mut(key.hash, |record| record.is(key))
        .filter(|record| record.is_live(now) && record.is_held_by(token))
}

/// The latest of the abandoned tokens `earlier` (latest last) that a marker keeps beside one
/// more.
fn latest(earlier: &[LeaseToken]) -> &[LeaseToken] {
    &earlier[earlier.len() - earlier.len().min(REMEMBERED_TOKENS - 1)..]
}

/// Takes the first entry of `index` if it expired at `now` or before.
fn pop_expired(index: &mut ExpiryIndex, now: Instant) -> Option<(ExpiryKey, u64)> {
    let entry = index.first_entry()?;
    (entry.key().0 <= now).then(|| entry.remove_entry())
}

/// `now + duration`, saturating far in the future instead of overflowing.
fn expiry(now: Instant, duration: Duration) -> Instant {
    now.checked_add(duration)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 60 * 60)))
        .unwrap_or(now)
}
