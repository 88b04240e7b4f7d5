//! [`MemoryStore`]: an in-process store for development, tests and single-instance apps.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::{BeginOutcome, Deletion, IdempotencyStore, LeaseToken, RecordSnapshot, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::StoredResponse;
use crate::scope::StorageKey;

/// An in-process store with the same semantics as the Redis store, expiry included.
///
/// Cloning is cheap and clones share one map, so every worker of an `HttpServer` sees the
/// same records when each gets a clone. [`Idempotency::memory`](crate::Idempotency::memory)
/// uses one process-wide instance ([`MemoryStore::shared`]) for that reason.
///
/// Memory is bounded: expired records are reclaimed by an amortized sweep (each sweep runs
/// after as many operations as there were records at the last one), and the store holds at
/// most [`max_records`](Self::max_records) live records (100 000 by default): a new key
/// beyond that is a store error (503 when failing closed) until records expire, never an
/// eviction of a live record (which would let its handler run again).
///
/// It does not reach other processes: use the Redis store for more than one instance.
///
/// # Examples
///
/// ```
/// use actix_web::{App, HttpServer};
/// use idempotency_actix::{Idempotency, MemoryStore};
///
/// let store = MemoryStore::new();
/// let app_factory = move || App::new().wrap(Idempotency::new(store.clone()));
/// # let _ = app_factory;
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Records>>,
    max_records: usize,
}

/// The default most records a [`MemoryStore`] holds.
const DEFAULT_MAX_RECORDS: usize = 100_000;

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
            max_records: DEFAULT_MAX_RECORDS,
        }
    }
}

#[derive(Default)]
struct Records {
    by_key: HashMap<String, Record>,
    operations_until_sweep: usize,
}

struct Record {
    fingerprint: Fingerprint,
    state: RecordState,
    expires_at: Instant,
}

enum RecordState {
    InFlight(LeaseToken),
    Completed(LeaseToken, StoredResponse),
}

impl MemoryStore {
    /// An empty store of its own.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same store, holding at most `max_records` live records.
    #[must_use]
    pub fn max_records(mut self, max_records: usize) -> Self {
        self.max_records = max_records;
        self
    }

    /// The process-wide store that [`Idempotency::memory`](crate::Idempotency::memory) uses.
    pub fn shared() -> Self {
        static SHARED: OnceLock<MemoryStore> = OnceLock::new();
        SHARED.get_or_init(Self::new).clone()
    }

    /// How many records (live or not yet reclaimed) the store holds.
    pub fn len(&self) -> usize {
        self.records().by_key.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn records(&self) -> MutexGuard<'_, Records> {
        // A panic while holding the lock cannot leave a record half-written (every update is
        // a single insert or remove), so a poisoned lock is still consistent.
        let mut records = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        records.sweep_if_due(Instant::now());
        records
    }
}

impl Records {
    fn sweep_if_due(&mut self, now: Instant) {
        if self.operations_until_sweep > 0 {
            self.operations_until_sweep -= 1;
            return;
        }
        self.sweep(now);
    }

    fn sweep(&mut self, now: Instant) {
        self.by_key.retain(|_, record| record.expires_at > now);
        self.operations_until_sweep = self.by_key.len().max(64);
    }

    /// The live record under `key` whose state is in flight with `token`.
    fn held_by(
        &mut self,
        key: &StorageKey,
        token: &LeaseToken,
        now: Instant,
    ) -> Option<&mut Record> {
        self.by_key.get_mut(key.as_str()).filter(|record| {
            record.expires_at > now
                && matches!(&record.state, RecordState::InFlight(holder) if holder == token)
        })
    }
}

/// `now + duration`, saturating far in the future instead of overflowing.
fn expiry(now: Instant, duration: Duration) -> Instant {
    now.checked_add(duration)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 60 * 60)))
        .unwrap_or(now)
}

impl IdempotencyStore for MemoryStore {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        if let Some(record) = records
            .by_key
            .get(key.as_str())
            .filter(|r| r.expires_at > now)
        {
            return Ok(match &record.state {
                RecordState::InFlight(holder) if holder == token => BeginOutcome::Acquired,
                _ if record.fingerprint != *fingerprint => BeginOutcome::FingerprintMismatch,
                RecordState::InFlight(_) => BeginOutcome::InFlight,
                RecordState::Completed(_, response) => BeginOutcome::Completed(response.clone()),
            });
        }
        if records.by_key.len() >= self.max_records {
            records.sweep(now);
            if records.by_key.len() >= self.max_records {
                return Err(StoreError::Unavailable(
                    format!(
                        "the memory store holds its maximum of {} records",
                        self.max_records
                    )
                    .into(),
                ));
            }
        }
        records.by_key.insert(
            key.as_str().to_owned(),
            Record {
                fingerprint: *fingerprint,
                state: RecordState::InFlight(token.clone()),
                expires_at: expiry(now, lease),
            },
        );
        Ok(BeginOutcome::Acquired)
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        Ok(records
            .held_by(key, token, now)
            .map(|record| record.expires_at = expiry(now, lease))
            .is_some())
    }

    async fn commit(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        let Some(record) = records
            .by_key
            .get_mut(key.as_str())
            .filter(|r| r.expires_at > now)
        else {
            return Ok(false);
        };
        Ok(match &record.state {
            RecordState::InFlight(holder) if holder == token => {
                record.state = RecordState::Completed(token.clone(), response.clone());
                record.expires_at = expiry(now, ttl);
                true
            }
            // Committing twice with one token succeeds without writing again.
            RecordState::Completed(committer, _) => committer == token,
            RecordState::InFlight(_) => false,
        })
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        let held = records.held_by(key, token, now).is_some();
        if held {
            records.by_key.remove(key.as_str());
        }
        Ok(held)
    }

    async fn inspect(
        &self,
        key: &StorageKey,
        with_body: bool,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        let now = Instant::now();
        let records = self.records();
        let Some(record) = records
            .by_key
            .get(key.as_str())
            .filter(|r| r.expires_at > now)
        else {
            return Ok(None);
        };
        let expires_in = Some(record.expires_at - now);
        Ok(Some(match &record.state {
            RecordState::InFlight(_) => RecordSnapshot::in_flight(expires_in),
            RecordState::Completed(_, response) => {
                RecordSnapshot::completed(response.clone(), expires_in, with_body)
            }
        }))
    }

    async fn delete(&self, key: &StorageKey, force: bool) -> Result<Deletion, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        let Some(record) = records
            .by_key
            .get(key.as_str())
            .filter(|r| r.expires_at > now)
        else {
            return Ok(Deletion::NotFound);
        };
        if matches!(record.state, RecordState::InFlight(_)) && !force {
            return Ok(Deletion::InFlight);
        }
        records.by_key.remove(key.as_str());
        Ok(Deletion::Deleted)
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("max_records", &self.max_records)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;
    use actix_web::http::Method;

    #[actix_web::test]
    async fn expired_records_are_reclaimed() {
        let store = MemoryStore::new();
        let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
        for i in 0..1_000 {
            let key = IdempotencyKey::parse(format!("k{i}").as_bytes()).unwrap();
            let key = StorageKey::new("t:", b"", &key);
            store
                .begin(
                    &key,
                    &print,
                    &LeaseToken::generate(),
                    Duration::from_millis(1),
                )
                .await
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
        // Enough operations to trigger a sweep.
        for _ in 0..=1_000 {
            let _ = store.len();
        }
        assert!(store.len() < 100, "{} records kept", store.len());
    }
}
