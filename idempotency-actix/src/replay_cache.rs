//! [`ReplayCache`]: completed records kept in process, so a replay costs no store round trip.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::fingerprint::Fingerprint;
use crate::instrument::{EvictionSource, record_evictions};
use crate::record::StoredResponse;
use crate::scope::StorageKey;
use crate::store::BeginOutcome;

/// An opt-in, in-process cache of completed records: a retry whose record is cached is
/// answered without asking the store (no round trip, no store CPU).
///
/// A completed record never changes, so a cached copy answers exactly what the store would:
/// the same status, headers and body with `Idempotent-Replayed: true`, and 422 for a request
/// with another fingerprint. In-flight records are never cached: a key that is not cached
/// goes to the store as usual, and a completed record found there is cached for the rest of
/// its TTL (as the store reports it), never longer.
///
/// What it trades:
///
/// * memory in every instance, bounded by `max_bytes` (bodies, headers and keys, and about
///   560 bytes per entry of the cache's own, so small records count for more than their
///   bytes; the least useful entries are evicted first, in batches: between two, the
///   entries just cached hold at most about an eighth of the bound more, and the entries
///   the workers are caching at that moment);
/// * a record deleted from the store by hand (an operator, `DEL` in Redis) stays replayable
///   from the caches that hold it until its TTL runs out. (Records expire by their TTL
///   everywhere; the TTL of a Redis record is computed from the clock of the instance that
///   committed it, so clocks should agree to within a small fraction of the TTL.)
///
/// Clones share one cache: create it once, outside `HttpServer::new`, and pass a clone to
/// every worker's [`Idempotency`](crate::Idempotency). Use one cache per store. It serves
/// stores that report the remaining TTL of what `begin` finds
/// ([`IdempotencyStore::begin_with_remaining_ttl`](crate::IdempotencyStore::begin_with_remaining_ttl)):
/// the Redis, Redis Cluster and PostgreSQL stores. The in-process `MemoryStore` gains
/// nothing from it and reports none, so nothing of it is cached. A transactional route
/// (`#[idempotent(transactional)]`) claims its key inside a transaction of its own, which
/// reads the record from the table: its replays are neither answered from the cache nor
/// cached.
///
/// # Examples
///
/// ```
/// use actix_web::{App, HttpServer};
/// # #[cfg(feature = "redis")]
/// use idempotency_actix::{Idempotency, RedisStore, ReplayCache};
///
/// # #[cfg(feature = "redis")]
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = RedisStore::pool("redis://127.0.0.1:6379")?; // connects on first use
/// let cache = ReplayCache::with_max_bytes(64 * 1024 * 1024);
/// let server = HttpServer::new(move || {
///     App::new().wrap(Idempotency::redis(pool.clone()).replay_cache(cache.clone()))
/// });
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "redis"))] fn main() {}
/// ```
#[derive(Clone)]
pub struct ReplayCache {
    entries: moka::sync::Cache<String, Arc<Entry>>,
    max_bytes: u64,
    /// What the entries cached since the cache last settled weigh, about: the cache counts
    /// an insert, and evicts for it, only once it settles its pending writes.
    unsettled: Arc<AtomicU64>,
    /// Taken by an insert that settles: the others that would settle meanwhile wait for it,
    /// rather than caching on while it runs.
    settling: Arc<Mutex<()>>,
}

/// One cached completed record.
struct Entry {
    fingerprint: Fingerprint,
    response: StoredResponse,
    /// How long the store keeps the record from when it was cached.
    remaining: Duration,
}

/// What an entry costs besides its key, its headers and its body: the entry's allocations
/// and the cache's bookkeeping (its table, its queues, its timer). Measured with a counting
/// allocator: 200 000 inserts of `201 {"id":N}` with one `Content-Type` into a 4 MiB cache
/// left 623 bytes allocated per entry held, of which the key, the header and the body
/// took 115 (the header's slot in its `Vec` 72 more).
const ENTRY_OVERHEAD: usize = 480;

/// What a header costs besides its name and value: its slot in the entry's `Vec`.
const HEADER_OVERHEAD: usize = 80;

/// Once the entries cached since the cache last settled weigh `max_bytes / SETTLE_SHARE`,
/// an insert settles them (counts them and evicts for them) before it returns, rather than
/// leaving them to the cache's next batch. The cache settles by itself only every 64 writes,
/// and while one worker settles, the others' inserts queue up behind it, up to 384: bodies
/// of a sixty-fourth of the bound, left to the batches, held 24 MiB in a 4 MiB cache with
/// two workers. Counted in bytes, what waits stays at about an eighth of the bound, plus an
/// entry per worker.
const SETTLE_SHARE: u64 = 8;

impl Entry {
    fn weight(&self, key: &str) -> u32 {
        let headers: usize = self
            .response
            .headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + HEADER_OVERHEAD)
            .sum();
        let body = self.response.body.as_ref().map_or(0, |body| body.len());
        u32::try_from(ENTRY_OVERHEAD + key.len() + headers + body).unwrap_or(u32::MAX)
    }
}

/// Each entry lives for the rest of its record's TTL.
struct RemainingTtl;

impl moka::Expiry<String, Arc<Entry>> for RemainingTtl {
    fn expire_after_create(
        &self,
        _key: &String,
        entry: &Arc<Entry>,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(entry.remaining)
    }

    /// An entry cached over another under the same key (two requests that both missed the
    /// cache) lives for the rest of its own record, not of the one it replaces (moka's
    /// default keeps the old expiry): the record may have changed in between.
    fn expire_after_update(
        &self,
        _key: &String,
        entry: &Arc<Entry>,
        _updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.remaining)
    }
}

impl ReplayCache {
    /// A cache that holds at most about `max_bytes` of records (bodies, headers, keys and
    /// the cache's bookkeeping for each).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ReplayCache;
    ///
    /// let cache = ReplayCache::with_max_bytes(64 * 1024 * 1024);
    /// // Clones share it: hand one to each worker's `Idempotency::replay_cache`.
    /// let for_a_worker = cache.clone();
    /// assert_eq!(for_a_worker.max_bytes(), 64 * 1024 * 1024);
    /// ```
    pub fn with_max_bytes(max_bytes: u64) -> Self {
        Self {
            entries: moka::sync::Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|key: &String, entry: &Arc<Entry>| entry.weight(key))
                .expire_after(RemainingTtl)
                .eviction_listener(|_key, _entry, cause| {
                    // Evicted to stay within `max_bytes`; expiry at the record's TTL is not.
                    if cause == moka::notification::RemovalCause::Size {
                        record_evictions(EvictionSource::ReplayCache, 1);
                    }
                })
                .build(),
            max_bytes,
            unsettled: Arc::new(AtomicU64::new(0)),
            settling: Arc::new(Mutex::new(())),
        }
    }

    /// The bound given to [`with_max_bytes`](Self::with_max_bytes).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ReplayCache;
    ///
    /// assert_eq!(ReplayCache::with_max_bytes(1 << 20).max_bytes(), 1 << 20);
    /// ```
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The cached answer for a request with `fingerprint` under `key`: a replay, or a
    /// mismatch; `None` when the record is not cached.
    pub(crate) fn lookup(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> Option<BeginOutcome> {
        let entry = self.entries.get(key.as_str())?;
        Some(if entry.fingerprint == *fingerprint {
            BeginOutcome::Completed(entry.response.clone())
        } else {
            BeginOutcome::FingerprintMismatch
        })
    }

    /// Caches a completed record that the store keeps for `remaining` more.
    pub(crate) fn insert(
        &self,
        key: &StorageKey,
        fingerprint: Fingerprint,
        response: StoredResponse,
        remaining: Duration,
    ) {
        if remaining.is_zero() {
            return;
        }
        let mut entry = Entry {
            fingerprint,
            response,
            remaining,
        };
        let key = key.as_str().to_owned();
        let weight = u64::from(entry.weight(&key));
        if weight > self.max_bytes {
            // The cache would turn it away: not worth a copy of its body.
            return;
        }
        // A body decoded from a store's reply may be a slice of a larger buffer (the whole
        // record); a copy keeps only what the entry weighs alive.
        entry.response.body = entry
            .response
            .body
            .map(|body| actix_web::web::Bytes::copy_from_slice(&body));
        self.entries.insert(key, Arc::new(entry));
        // Counted once the insert is among the cache's pending writes: a settling applies
        // every insert counted before it starts.
        let threshold = self.max_bytes / SETTLE_SHARE;
        if self.unsettled.fetch_add(weight, Ordering::AcqRel) + weight >= threshold {
            // Without this, a run of large bodies held dozens of them beyond the bound (67 MiB
            // in a 4 MiB cache), and workers caching at once hundreds (see `SETTLE_SHARE`).
            let _settling = self.settling.lock().unwrap_or_else(PoisonError::into_inner);
            // Another insert may have settled this one while it waited.
            let counted = self.unsettled.load(Ordering::Acquire);
            if counted >= threshold {
                self.entries.run_pending_tasks();
                self.unsettled.fetch_sub(counted, Ordering::AcqRel);
            }
        }
    }
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("max_bytes", &self.max_bytes)
            .field("entries", &self.entries.entry_count())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use actix_web::http::StatusCode;
    use actix_web::web::Bytes;

    use super::*;
    use crate::key::IdempotencyKey;

    fn key(name: &str) -> StorageKey {
        StorageKey::new(
            "test:",
            b"",
            &IdempotencyKey::parse(name.as_bytes()).unwrap(),
        )
    }

    fn response(body: &'static [u8]) -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: Some(Bytes::from_static(body)),
        }
    }

    /// What the entries held now weigh, those the cache has yet to evict included.
    fn held_bytes(cache: &ReplayCache) -> u64 {
        cache
            .entries
            .iter()
            .map(|(key, entry)| u64::from(entry.weight(&key)))
            .sum()
    }

    #[test]
    fn a_run_of_large_bodies_stays_within_about_twice_the_bound() {
        let max_bytes = 4 << 20;
        let cache = ReplayCache::with_max_bytes(max_bytes);
        let print = Fingerprint::from_bytes([1; 32]);
        let body = Bytes::from(vec![b'x'; 1 << 20]);
        let mut most = 0;
        for i in 0..300 {
            let large = StoredResponse {
                body: Some(body.clone()),
                ..response(b"")
            };
            cache.insert(
                &key(&format!("k{i}")),
                print,
                large,
                Duration::from_secs(60),
            );
            most = most.max(held_bytes(&cache));
        }
        assert!(most <= 2 * max_bytes, "held {most} bytes at most");
    }

    #[test]
    fn workers_caching_at_once_hold_at_most_about_an_eighth_more_than_the_bound() {
        // Bodies just under a sixty-fourth of the bound: left to the cache's batches, the
        // inserts of the other workers queued up while one settled a batch (up to 384 of
        // them), and the cache held 24 to 29 MiB in its 4 MiB.
        let max_bytes = 4 << 20;
        let cache = ReplayCache::with_max_bytes(max_bytes);
        let body = Bytes::from(vec![b'x'; usize::try_from(max_bytes / 64).unwrap() - 1024]);
        let done = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (cache, done) = (cache.clone(), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut most = 0;
                while !done.load(Ordering::Relaxed) {
                    most = most.max(held_bytes(&cache));
                }
                most
            })
        };
        let workers: Vec<_> = (0..4)
            .map(|worker| {
                let (cache, body) = (cache.clone(), body.clone());
                std::thread::spawn(move || {
                    for i in 0..1_000 {
                        let light = StoredResponse {
                            body: Some(body.clone()),
                            ..response(b"")
                        };
                        let print = Fingerprint::from_bytes([1; 32]);
                        let name = format!("w{worker}-{i}");
                        cache.insert(&key(&name), print, light, Duration::from_secs(60));
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        let most = watcher.join().unwrap();
        // An eighth of the bound, and an entry per worker (64 KiB each): a quarter in all.
        assert!(
            most <= max_bytes + max_bytes / 4,
            "held {most} bytes at most"
        );
    }

    #[test]
    fn a_cached_record_replays_for_its_fingerprint_and_mismatches_for_another() {
        let cache = ReplayCache::with_max_bytes(1 << 20);
        let print = Fingerprint::from_bytes([1; 32]);
        assert_eq!(cache.lookup(&key("a"), &print), None);
        cache.insert(&key("a"), print, response(b"one"), Duration::from_secs(60));
        assert_eq!(
            cache.lookup(&key("a"), &print),
            Some(BeginOutcome::Completed(response(b"one")))
        );
        assert_eq!(
            cache.lookup(&key("a"), &Fingerprint::from_bytes([2; 32])),
            Some(BeginOutcome::FingerprintMismatch)
        );
    }

    #[test]
    fn an_entry_is_gone_once_its_ttl_has_passed() {
        let cache = ReplayCache::with_max_bytes(1 << 20);
        let print = Fingerprint::from_bytes([1; 32]);
        cache.insert(
            &key("a"),
            print,
            response(b"one"),
            Duration::from_millis(30),
        );
        cache.insert(&key("b"), print, response(b"two"), Duration::ZERO);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(cache.lookup(&key("a"), &print), None);
        assert_eq!(cache.lookup(&key("b"), &print), None);
    }

    #[test]
    fn a_record_cached_again_lives_no_longer_than_its_own_remaining_ttl() {
        // Two requests that both missed the cache cache what the store answered each; when
        // the record changed in between (deleted by hand, the key run again under a shorter
        // ttl), the later one is cached for its own rest, not for the earlier one's.
        let cache = ReplayCache::with_max_bytes(1 << 20);
        let (earlier, later) = (
            Fingerprint::from_bytes([1; 32]),
            Fingerprint::from_bytes([2; 32]),
        );
        cache.insert(
            &key("a"),
            earlier,
            response(b"one"),
            Duration::from_secs(60),
        );
        cache.insert(
            &key("a"),
            later,
            response(b"two"),
            Duration::from_millis(30),
        );
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(cache.lookup(&key("a"), &later), None);
    }

    #[test]
    fn a_record_larger_than_the_cache_is_not_kept() {
        let cache = ReplayCache::with_max_bytes(100);
        let print = Fingerprint::from_bytes([1; 32]);
        cache.insert(
            &key("a"),
            print,
            response(&[0; 1000]),
            Duration::from_secs(60),
        );
        cache.entries.run_pending_tasks();
        assert_eq!(cache.lookup(&key("a"), &print), None);
    }
}
