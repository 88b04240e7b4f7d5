//! [`MemoryStoreBuilder`]: the byte budget and shard count of a [`MemoryStore`].

use std::sync::{Mutex, PoisonError};

use super::MemoryStore;
use super::entry::MIN_SHARD_BUDGET;

/// The settings of a [`MemoryStore`]: how many bytes it may hold and across how many
/// independently locked shards.
///
/// [`build`](Self::build) makes a store of its own; [`shared`](Self::shared) hands out the
/// process-wide store for these settings, which is what
/// [`Idempotency::memory_with`](crate::Idempotency::memory_with) uses so that every worker
/// of an `HttpServer` shares one store.
///
/// # Examples
///
/// ```
/// use idempotency_actix::MemoryStore;
///
/// let store = MemoryStore::builder().max_bytes(8 * 1024 * 1024).build();
/// assert_eq!(store.max_bytes(), 8 * 1024 * 1024);
/// assert_eq!(store.used_bytes(), 0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStoreBuilder {
    max_bytes: usize,
    shards: Option<usize>,
}

impl MemoryStoreBuilder {
    /// The default byte budget: 64 MiB, room for about 60 000 records of a few hundred
    /// bytes of body and headers each (a record costs about 600 bytes more than its body and
    /// headers), or 60 of the largest stored bodies (1 MiB).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{MemoryStore, MemoryStoreBuilder};
    ///
    /// assert_eq!(MemoryStore::new().max_bytes(), MemoryStoreBuilder::DEFAULT_MAX_BYTES);
    /// assert_eq!(MemoryStoreBuilder::DEFAULT_MAX_BYTES, 64 * 1024 * 1024);
    /// ```
    pub const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

    /// The most shards a store is split into by default.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStoreBuilder as Builder;
    ///
    /// // The default budget is split into the most shards:
    /// let shards = Builder::DEFAULT_MAX_BYTES / Builder::MIN_SHARD_BYTES;
    /// assert_eq!(shards, Builder::DEFAULT_MAX_SHARDS);
    /// ```
    pub const DEFAULT_MAX_SHARDS: usize = 16;

    /// The smallest share of the budget a shard gets by default: a shard must hold the
    /// largest stored body (1 MiB by default) with room to spare.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{DEFAULT_MAX_STORED_BODY, MemoryStoreBuilder};
    ///
    /// assert!(MemoryStoreBuilder::MIN_SHARD_BYTES > DEFAULT_MAX_STORED_BODY);
    /// ```
    pub const MIN_SHARD_BYTES: usize = 4 * 1024 * 1024;

    pub(super) const fn new() -> Self {
        Self {
            max_bytes: Self::DEFAULT_MAX_BYTES,
            shards: None,
        }
    }

    /// The most bytes the store holds: bodies, headers, keys, lease tokens and a fixed
    /// overhead per record (default [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES)).
    ///
    /// When a new record would not fit, completed records are evicted, soonest to expire
    /// first; in-flight records never are. See [`MemoryStore`] for what that means for
    /// clients.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// let store = MemoryStore::builder().max_bytes(256 * 1024 * 1024).build();
    /// assert_eq!(store.max_bytes(), 256 * 1024 * 1024);
    /// ```
    #[must_use]
    pub const fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Splits the store into `shards` parts, each with its own lock and an equal share of
    /// the byte budget; a record lives in the shard its key hashes to.
    ///
    /// By default one shard per [`MIN_SHARD_BYTES`](Self::MIN_SHARD_BYTES) of budget, at
    /// least 1 and at most [`DEFAULT_MAX_SHARDS`](Self::DEFAULT_MAX_SHARDS) (16 for the
    /// default 64 MiB). More shards let more workers use the store at once; fewer leave
    /// each shard room for larger records (a response that does not fit in a shard's
    /// share, less what in-flight records hold there, is stored without its body, or with
    /// its status alone if its headers are that large).
    ///
    /// # Panics
    ///
    /// If `shards` is zero (a configuration mistake).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::MemoryStore;
    ///
    /// // Many workers, small records: 64 shards of 256 KiB each.
    /// let store = MemoryStore::builder().max_bytes(16 * 1024 * 1024).shards(64).build();
    /// assert_eq!(store.max_bytes(), 16 * 1024 * 1024);
    /// ```
    #[must_use]
    pub const fn shards(mut self, shards: usize) -> Self {
        assert!(shards > 0, "MemoryStoreBuilder::shards: at least one shard");
        self.shards = Some(shards);
        self
    }

    /// The number of shards these settings give.
    pub(super) fn shard_count(&self) -> usize {
        self.shards.unwrap_or_else(|| {
            (self.max_bytes / Self::MIN_SHARD_BYTES).clamp(1, Self::DEFAULT_MAX_SHARDS)
        })
    }

    /// The byte budget.
    pub(super) fn budget(&self) -> usize {
        self.max_bytes
    }

    /// A new store of its own with these settings.
    ///
    /// # Panics
    ///
    /// If a shard's share of the budget cannot hold even one in-flight record (about 1.2 KB:
    /// a budget that small, or that many shards, is a configuration mistake): such a store
    /// would refuse every new key. The share is checked for a key prefix of up to 64 bytes;
    /// [`Idempotency::key_prefix`](crate::Idempotency::key_prefix) checks a longer one
    /// against the store it is set on.
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
    /// let settings = MemoryStore::builder().max_bytes(16 * 1024 * 1024);
    /// let (mine, yours) = (settings.build(), settings.build());
    /// mine.begin(&key, &print, &LeaseToken::generate(), lease).await?;
    /// assert_eq!((mine.len(), yours.len()), (1, 0)); // each `build` makes a store of its own
    /// # Ok(())
    /// # }
    /// ```
    pub fn build(self) -> MemoryStore {
        self.check();
        MemoryStore::from_settings(self)
    }

    /// Panics if a shard's share of the budget cannot hold one in-flight record.
    fn check(&self) {
        let share = self.max_bytes / self.shard_count();
        assert!(
            share >= MIN_SHARD_BUDGET,
            "MemoryStoreBuilder: a shard's share of max_bytes ({share} of {} bytes in {} \
             shards) cannot hold one in-flight record (it takes at least {MIN_SHARD_BUDGET}): \
             raise max_bytes or lower shards",
            self.max_bytes,
            self.shard_count()
        );
    }

    /// The process-wide store with these settings, made on first use: every call with the
    /// same settings (from any worker or app in the process) gets a handle on the same
    /// records.
    ///
    /// # Panics
    ///
    /// As [`build`](Self::build) does.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use actix_web::http::Method;
    /// use idempotency_actix::{Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    ///     MemoryStore, StorageKey};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let settings = MemoryStore::builder().max_bytes(16 * 1024 * 1024);
    /// let (worker_1, worker_2) = (settings.shared(), settings.shared());
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k").unwrap());
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let lease = Duration::from_secs(30);
    /// worker_1.begin(&key, &print, &LeaseToken::generate(), lease).await.unwrap();
    /// assert_eq!(worker_2.len(), 1);
    /// # });
    /// ```
    pub fn shared(self) -> MemoryStore {
        static SHARED: Mutex<Vec<(MemoryStoreBuilder, MemoryStore)>> = Mutex::new(Vec::new());
        let settings = self.resolved();
        settings.check();
        // Nothing panics while this lock is held, so a poisoned lock is still consistent.
        let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, store)) = shared.iter().find(|(known, _)| *known == settings) {
            return store.clone();
        }
        let store = settings.build();
        shared.push((settings, store.clone()));
        store
    }

    /// The same settings with the shard count spelled out, so that settings that make the
    /// same store compare equal.
    fn resolved(self) -> Self {
        Self {
            shards: Some(self.shard_count()),
            ..self
        }
    }
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        Self::new()
    }
}
