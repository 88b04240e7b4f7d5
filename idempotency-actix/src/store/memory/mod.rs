//! [`MemoryStore`]: an in-process store for development, tests and single-instance apps,
//! bounded by bytes.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{BeginOutcome, Deletion, IdempotencyStore, LeaseToken, RecordSnapshot, StoreError};
use crate::fingerprint::Fingerprint;
use crate::log_interval::LogInterval;
use crate::record::StoredResponse;
use crate::scope::StorageKey;

mod builder;
mod entry;
mod eviction_log;
mod shard;
mod shard_report;

pub use self::builder::MemoryStoreBuilder;
use self::eviction_log::EvictionLog;
use self::shard::{Begun, Found, Full, HashedKey, Shard};

/// An in-process store with the same semantics as the Redis store, expiry included, that
/// never holds more than a byte budget (64 MiB by default).
///
/// Cloning is cheap and clones share one store, so every worker of an `HttpServer` sees the
/// same records when each gets a clone. [`Idempotency::memory`](crate::Idempotency::memory)
/// and [`Idempotency::memory_with`](crate::Idempotency::memory_with) use a process-wide
/// instance ([`MemoryStoreBuilder::shared`]) for that reason.
///
/// # Memory
///
/// Every record is charged its key, lease token, stored headers and body, and a fixed
/// overhead for the maps that hold it; [`used_bytes`](Self::used_bytes) never exceeds
/// [`max_bytes`](Self::max_bytes) (set with [`MemoryStoreBuilder::max_bytes`]). A completed
/// record keeps its response encoded in one allocation (status, headers and body, as the
/// Redis store's records do), which a replay decodes without copying the body.
///
/// When a new record does not fit, the store **evicts completed records, soonest to expire
/// first**. Evicting a completed record shortens the idempotency window of its key: a retry
/// that arrives after the eviction runs the handler again, as it would after the ttl. The
/// evictions are counted ([`evictions`](Self::evictions)) and logged as a warning at most
/// once every 10 s. Soonest to expire, rather than least recently used, because it takes
/// from each key the least of its remaining window, drops short-lived routes' records
/// first, and costs nothing on a replay; with one ttl for all routes it is simply the
/// oldest record first.
///
/// **In-flight records are never evicted** (that would let a duplicate run while the
/// first request still runs). In-flight records may take half the budget, so that they
/// always have room to complete: a new key is refused ([`StoreError::Refused`], which
/// leaves nothing behind: 503 when failing closed) only when in-flight records alone hold
/// half the budget, and accepted again as soon as some complete or are released. A
/// response that does not fit even then is stored without its body, as a response over the
/// stored-body limit is, so its retries are still never run again; one whose headers alone
/// do not fit either is stored with its status alone (replayed with
/// `Idempotent-Body-Omitted: true` and none of its headers).
///
/// The budget is split evenly between shards, each with its own lock, chosen by a hash of
/// the key ([`MemoryStoreBuilder::shards`]), so workers rarely wait for one another; the
/// bounds above hold per shard. Expiry and eviction follow an index ordered by expiry: each
/// operation costs amortized O(log n), whatever the number of records (one that evicts or
/// reclaims many records pays O(log n) for each, and a record goes once).
///
/// It does not reach other processes: use the Redis store for more than one instance.
///
/// # Examples
///
/// ```
/// use actix_web::{App, HttpServer};
/// use idempotency_actix::{Idempotency, MemoryStore};
///
/// let store = MemoryStore::builder().max_bytes(256 * 1024 * 1024).build();
/// let app_factory = move || App::new().wrap(Idempotency::new(store.clone()));
/// # let _ = app_factory;
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Storage keys are blake3 digests of the client's key: foldhash's quality hasher,
    /// seeded per store, spreads them as well as SipHash for a fraction of its cost (about
    /// 300 instructions less per store operation, callgrind).
    hasher: foldhash::quality::RandomState,
    max_bytes: usize,
    evictions: EvictionLog,
    /// The warnings of responses cut to fit, at most one per 10 s (a store whose shards are
    /// small for its responses cuts every one).
    trimmed: LogInterval,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::builder().build()
    }
}

impl MemoryStore {
    /// An empty store of its own with the default settings (64 MiB).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{MemoryStore, MemoryStoreBuilder};
    ///
    /// let store = MemoryStore::new();
    /// assert!(store.is_empty());
    /// assert_eq!(store.max_bytes(), MemoryStoreBuilder::DEFAULT_MAX_BYTES);
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Settings for a store: its byte budget and shard count.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// let store = MemoryStore::builder().max_bytes(32 * 1024 * 1024).shards(4).build();
    /// assert_eq!(store.max_bytes(), 32 * 1024 * 1024);
    /// ```
    pub const fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::new()
    }

    /// The process-wide store with the default settings, which
    /// [`Idempotency::memory`](crate::Idempotency::memory) uses.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::http::Method;
    /// use idempotency_actix::{
    ///     Fingerprint, IdempotencyKey, IdempotencyStore, Inspector, LeaseToken, MemoryStore,
    ///     RecordState, StorageKey,
    /// };
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (worker_1, worker_2) = (MemoryStore::shared(), MemoryStore::shared());
    /// let key = StorageKey::new("idempotency:", b"", &IdempotencyKey::parse(b"shared-doc")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let token = LeaseToken::generate();
    /// worker_1.begin(&key, &print, &token, Duration::from_secs(30)).await?;
    /// let seen = Inspector::new(worker_2).lookup(b"", "shared-doc").await?;
    /// assert_eq!(seen.map(|record| record.state), Some(RecordState::InFlight));
    /// # worker_1.release(&key, &token).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn shared() -> Self {
        Self::builder().shared()
    }

    fn from_settings(settings: MemoryStoreBuilder) -> Self {
        let shard_count = settings.shard_count();
        let max_bytes = settings.budget();
        let shard_bytes = max_bytes / shard_count;
        Self {
            inner: Arc::new(Inner {
                shards: (0..shard_count)
                    .map(|_| Mutex::new(Shard::new(shard_bytes)))
                    .collect(),
                hasher: foldhash::quality::RandomState::default(),
                max_bytes,
                evictions: EvictionLog::new(),
                trimmed: LogInterval::new(),
            }),
        }
    }

    /// How many entries the store holds: records in flight or completed, markers of
    /// abandoned tokens ([`IdempotencyStore::abandon`], which inspection does not count as
    /// records), and entries expired and not yet reclaimed.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use std::time::Duration;
    /// # use actix_web::http::Method;
    /// # use idempotency_actix::{
    /// #     Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, StorageKey,
    /// # };
    /// # let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// # let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// # let lease = Duration::from_secs(30);
    /// let store = MemoryStore::new();
    /// assert_eq!(store.len(), 0);
    /// store.begin(&key, &print, &LeaseToken::generate(), lease).await?;
    /// assert_eq!(store.len(), 1);
    /// // The marker of an abandoned token is an entry too, though no record.
    /// let other = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"other")?);
    /// store.abandon(&other, &LeaseToken::generate(), lease).await?;
    /// assert_eq!(store.len(), 2);
    /// # Ok(())
    /// # }
    /// ```
    pub fn len(&self) -> usize {
        self.shards().map(|shard| shard.len()).sum()
    }

    /// Whether the store holds no entry (see [`len`](Self::len)).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use std::time::Duration;
    /// # use actix_web::http::Method;
    /// # use idempotency_actix::{
    /// #     Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, StorageKey,
    /// # };
    /// # let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// # let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// # let lease = Duration::from_secs(30);
    /// let store = MemoryStore::new();
    /// assert!(store.is_empty());
    /// store.begin(&key, &print, &LeaseToken::generate(), lease).await?;
    /// assert!(!store.is_empty());
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the records it holds are charged; never more than
    /// [`max_bytes`](Self::max_bytes).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use std::time::Duration;
    /// # use actix_web::http::Method;
    /// # use idempotency_actix::{
    /// #     Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, StorageKey,
    /// # };
    /// # let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// # let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// # let lease = Duration::from_secs(30);
    /// let store = MemoryStore::new();
    /// assert_eq!(store.used_bytes(), 0);
    /// store.begin(&key, &print, &LeaseToken::generate(), lease).await?;
    /// assert!(store.used_bytes() > 0 && store.used_bytes() <= store.max_bytes());
    /// # Ok(())
    /// # }
    /// ```
    pub fn used_bytes(&self) -> usize {
        self.shards().map(|shard| shard.used_bytes()).sum()
    }

    /// Its byte budget.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// let store = MemoryStore::builder().max_bytes(8 * 1024 * 1024).build();
    /// assert_eq!(store.max_bytes(), 8 * 1024 * 1024);
    /// ```
    pub fn max_bytes(&self) -> usize {
        self.inner.max_bytes
    }

    /// How many completed records were evicted before their ttl to make room, since the
    /// store was made.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::http::{Method, StatusCode};
    /// use actix_web::web::Bytes;
    /// use idempotency_actix::{
    ///     Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, MemoryStore, StorageKey,
    ///     StoredResponse,
    /// };
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::builder().max_bytes(64 * 1024).shards(1).build();
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let body = Some(Bytes::from(vec![0; 8192]));
    /// let response = StoredResponse::new(StatusCode::OK, Vec::new(), body);
    /// for n in 0..16 {
    ///     let key = IdempotencyKey::parse(format!("k{n}").as_bytes())?;
    ///     let key = StorageKey::new("doc:", b"", &key);
    ///     let token = LeaseToken::generate();
    ///     store.begin(&key, &print, &token, Duration::from_secs(30)).await?;
    ///     store.commit(&key, &print, &token, &response, Duration::from_secs(60)).await?;
    /// }
    /// assert!(store.evictions() > 0); // 16 bodies of 8 KiB in 64 KiB
    /// assert!(store.used_bytes() <= store.max_bytes());
    /// # Ok(())
    /// # }
    /// ```
    pub fn evictions(&self) -> u64 {
        self.inner.evictions.total()
    }

    /// Panics if a shard's share of the budget cannot hold one in-flight record under a
    /// key after `prefix`: with that prefix the store would refuse every new key (503),
    /// empty as it is. The builder checks the share against prefixes of up to 64 bytes;
    /// [`Idempotency::key_prefix`](crate::Idempotency::key_prefix) calls this for longer ones.
    pub(crate) fn check_key_prefix(&self, prefix: &str) {
        let share = self.inner.max_bytes / self.inner.shards.len();
        let least = entry::least_shard_budget(prefix.len());
        assert!(
            share >= least,
            "Idempotency::key_prefix: under a key prefix of {} bytes, a memory store shard \
             needs at least {least} bytes to hold one in-flight record, but its share is \
             {share} of {} bytes in {} shards, so every new key would be refused: shorten \
             the prefix, raise max_bytes or lower shards",
            prefix.len(),
            self.inner.max_bytes,
            self.inner.shards.len()
        );
    }

    fn shards(&self) -> impl Iterator<Item = MutexGuard<'_, Shard>> {
        self.inner.shards.iter().map(lock)
    }

    /// Runs `operation` on the shard of `key`, then counts and logs what it reported (its
    /// evictions, a response cut to fit) once the lock is released.
    fn on_shard<T>(
        &self,
        key: &StorageKey,
        operation: impl FnOnce(&mut Shard, HashedKey<'_>, Instant) -> T,
    ) -> T {
        let shards = &self.inner.shards;
        let key = HashedKey {
            key: key.as_str(),
            hash: self.inner.hasher.hash_one(key.as_str()),
        };
        // The shard from bits the shard's own table does not use to place the key (it takes
        // the low bits for the bucket and the top 7 for its control bytes): keys of one shard
        // still spread over all of its buckets.
        let index = ((key.hash >> 32) % shards.len() as u64) as usize;
        let (result, report, now) = {
            let mut shard = lock(&shards[index]);
            let now = Instant::now();
            let result = operation(&mut shard, key, now);
            (result, shard.take_report(), now)
        };
        let max_bytes = self.inner.max_bytes;
        self.inner
            .evictions
            .record(report.evictions, max_bytes, now);
        report.log(max_bytes, &self.inner.trimmed, now);
        result
    }

    /// The refusal of a new record that does not fit: nothing was written (so the engine
    /// abandons no token, whose marker would take room from completed records).
    fn full(&self) -> StoreError {
        let share = self.inner.max_bytes / self.inner.shards.len();
        StoreError::Refused(
            format!(
                "the memory store is full of in-flight records (a shard's share is {share} of \
                 {} bytes)",
                self.inner.max_bytes
            )
            .into(),
        )
    }
}

/// Locks a shard. Nothing panics while a shard is locked (no user code runs there), so a
/// poisoned lock is still consistent.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

impl IdempotencyStore for MemoryStore {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        let begun = self
            .on_shard(key, |shard, key, now| {
                shard.begin(key, fingerprint, token, lease, now)
            })
            .map_err(|Full| self.full())?;
        match begun {
            Begun::Decided(outcome) => Ok(outcome),
            Begun::Completed(stored) => Ok(BeginOutcome::Completed(StoredResponse::decode_shared(
                stored,
            )?)),
        }
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.on_shard(key, |shard, key, now| shard.renew(key, token, lease, now)))
    }

    async fn commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.on_shard(key, |shard, key, now| {
            shard.commit(key, fingerprint, token, response, ttl, now)
        })
        .map_err(|Full| self.full())
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        Ok(self.on_shard(key, |shard, key, now| shard.release(key, token, now)))
    }

    async fn abandon(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        remember_for: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.on_shard(key, |shard, key, now| {
            shard.abandon(key, token, remember_for, now)
        }))
    }

    async fn inspect(
        &self,
        key: &StorageKey,
        with_body: bool,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        let found = self.on_shard(key, |shard, key, now| shard.inspect(key, now));
        Ok(match found {
            None => None,
            Some((Found::InFlight, expires_in)) => {
                Some(RecordSnapshot::in_flight(Some(expires_in)))
            }
            Some((Found::Completed(stored), expires_in)) => Some(RecordSnapshot::completed(
                StoredResponse::decode_shared(stored)?,
                Some(expires_in),
                with_body,
            )),
        })
    }

    async fn delete(&self, key: &StorageKey, force: bool) -> Result<Deletion, StoreError> {
        Ok(self.on_shard(key, |shard, key, now| shard.delete(key, force, now)))
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("max_bytes", &self.inner.max_bytes)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
