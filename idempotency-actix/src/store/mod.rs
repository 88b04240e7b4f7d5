//! [`IdempotencyStore`]: the storage trait, its outcomes, and the backends.
//!
//! A store offers the few atomic steps of the protocol, not get/set primitives:
//!
//! 1. [`begin`](IdempotencyStore::begin): atomically, either create an in-flight record
//!    holding the caller's fresh [`LeaseToken`] that expires after the lease, or report the
//!    record that is there (completed → replay, or a fingerprint mismatch; in flight →
//!    conflict).
//! 2. [`renew`](IdempotencyStore::renew): extend the lease while the handler still runs, only
//!    if the token still holds it.
//! 3. [`commit`](IdempotencyStore::commit): write the completed record with its TTL, only if
//!    the token still holds the lease, or the key is free (fencing: a holder that lost its
//!    lease never overwrites another request's record).
//! 4. [`release`](IdempotencyStore::release): delete the in-flight record, only if the token
//!    still holds it (after an error response, a panic, or a cancelled request); one that
//!    took the key over an abandoned token's marker puts that marker back.
//! 5. [`abandon`](IdempotencyStore::abandon): give up a `begin` that never answered (it timed
//!    out, or its request went away): whether that `begin` landed already, lands later or
//!    never, the token holds nothing afterwards.
//!
//! Every record lives under one key, so every step touches one key (Redis Cluster safe).

use std::future::Future;
use std::time::Duration;

use futures_util::future::LocalBoxFuture;

use crate::fingerprint::Fingerprint;
use crate::record::{RecordError, StoredResponse};
use crate::scope::StorageKey;

pub(crate) mod deadline;
mod inspection;
mod memory;
pub(crate) mod not_sent;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;

pub use self::inspection::{Deletion, RecordSnapshot, RecordState};
pub use self::memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "postgres")]
pub use self::postgres::{
    DEFAULT_TABLE, EXPIRY_BATCH, PostgresPool, PostgresStore, TableNameError,
};
#[cfg(feature = "redis-cluster")]
pub use self::redis::{RedisClusterClient, RedisClusterStore};
#[cfg(feature = "redis")]
pub use self::redis::{RedisPool, RedisStore, ReplicatedWrites};

/// The random token that identifies one holder of an in-flight record.
///
/// # Examples
///
/// ```
/// use idempotency_actix::LeaseToken;
///
/// assert_ne!(LeaseToken::generate(), LeaseToken::generate());
/// let token = LeaseToken::generate();
/// assert_eq!(token.as_str().len(), 32);
/// assert!(token.as_str().bytes().all(|digit| matches!(digit, b'0'..=b'9' | b'a'..=b'f')));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken([u8; TOKEN_LENGTH]);

/// The length of a token: 128 bits as lowercase hex.
const TOKEN_LENGTH: usize = 32;

impl LeaseToken {
    /// A fresh random token: 128 bits from the thread's cryptographically secure generator,
    /// as 32 lowercase hex digits.
    ///
    /// The generator (`rand`'s thread-local ChaCha, seeded from the operating system and
    /// reseeded periodically) makes no system call per token, and the token is held inline
    /// (no allocation), so tokens are cheap to make and to copy, unique and unguessable.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::LeaseToken;
    ///
    /// let token = LeaseToken::generate();
    /// assert_ne!(token, LeaseToken::generate());
    /// assert_eq!(token.as_str().len(), 32);
    /// ```
    pub fn generate() -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bits: u128 = rand::random();
        let mut digits = [0; TOKEN_LENGTH];
        for (index, digit) in digits.iter_mut().enumerate() {
            let nibble = (bits >> (4 * (TOKEN_LENGTH - 1 - index))) & 0xf;
            *digit = HEX[nibble as usize];
        }
        Self(digits)
    }

    /// The token as stores keep it.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::LeaseToken;
    ///
    /// let token = LeaseToken::generate();
    /// assert!(token.as_str().bytes().all(|digit| matches!(digit, b'0'..=b'9' | b'a'..=b'f')));
    /// ```
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// The token's digits as bytes, without the UTF-8 check `as_str` makes (the Redis
    /// store writes and compares them as bytes several times per request).
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LeaseToken").field(&self.as_str()).finish()
    }
}

/// What [`IdempotencyStore::begin`] found.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use actix_web::http::{Method, StatusCode};
/// use idempotency_actix::{BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
///     MemoryStore, StorageKey, StoredResponse};
///
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (store, lease) = (MemoryStore::new(), Duration::from_secs(30));
/// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
/// let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
/// let token = LeaseToken::generate();
/// assert_eq!(store.begin(&key, &print, &token, lease).await?, BeginOutcome::Acquired);
/// let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), None);
/// store.commit(&key, &print, &token, &response, Duration::from_secs(60)).await?;
///
/// let retry = store.begin(&key, &print, &LeaseToken::generate(), lease).await?;
/// assert_eq!(retry, BeginOutcome::Completed(response));
/// let other = Fingerprint::compute(&Method::POST, "/orders", "", b"[]", []);
/// let reused = store.begin(&key, &other, &LeaseToken::generate(), lease).await?;
/// assert_eq!(reused, BeginOutcome::FingerprintMismatch);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BeginOutcome {
    /// There was no record; an in-flight record holding the caller's token now exists. Run
    /// the handler, then commit or release.
    Acquired,
    /// A completed record with the same fingerprint: replay it.
    Completed(StoredResponse),
    /// A record with the same fingerprint is in flight (another request holds the lease).
    InFlight,
    /// A record (in flight or completed) exists for another fingerprint.
    FingerprintMismatch,
    /// The token was [abandoned](IdempotencyStore::abandon) before this `begin` landed:
    /// nothing was created. Only a `begin` that its caller gave up on can meet this, so the
    /// middleware never sees it for a request it still serves.
    Abandoned,
}

/// A store could not do what was asked. The client sees an opaque 503 (or, fail-open, an
/// unprotected run); the full error goes to the log.
///
/// # Examples
///
/// ```
/// use std::error::Error;
/// use std::time::Duration;
///
/// use idempotency_actix::{RecordError, StoreError};
///
/// let down = StoreError::Unavailable("connection refused".into());
/// assert_eq!(down.to_string(), "store unavailable: connection refused");
/// let timeout = StoreError::Timeout(Duration::from_secs(2));
/// assert_eq!(timeout.to_string(), "store did not answer within 2s");
/// // The cause stays the source:
/// let corrupt = StoreError::from(RecordError::Truncated);
/// assert_eq!(corrupt.source().map(ToString::to_string).as_deref(), Some("record is truncated"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No connection could be had, or the connection failed.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store did not answer within the store timeout.
    #[error("store did not answer within {0:?}")]
    Timeout(Duration),
    /// The store refused the operation and changed nothing: a Redis at `maxmemory` under
    /// `noeviction` refuses a new key's `begin`. Unlike after a timeout, there is no token
    /// to abandon.
    #[error("store refused the operation: {0}")]
    Refused(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store answered something this version cannot read.
    #[error("store returned an unreadable record: {0}")]
    Corrupt(#[from] RecordError),
    /// The store answered something the protocol does not allow.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The store does not offer this operation (an [`IdempotencyStore`] that keeps the
    /// default [`inspect`](IdempotencyStore::inspect) or
    /// [`delete`](IdempotencyStore::delete)).
    #[error("this store does not support {0}")]
    Unsupported(&'static str),
}

/// The storage trait: the atomic steps of the idempotency protocol.
///
/// Methods return `impl Future` without a `Send` bound: Actix runs each worker on one
/// thread. Implement it with plain `async fn`. The acceptance suite in the `tests` package
/// checks any implementation against the contract.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use idempotency_actix::{BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore,
///     LeaseToken, MemoryStore, StorageKey};
/// use actix_web::http::Method;
///
/// # actix_web::rt::System::new().block_on(async {
/// let store = MemoryStore::new();
/// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k").unwrap());
/// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
/// let lease = Duration::from_secs(30);
/// let token = LeaseToken::generate();
/// let first = store.begin(&key, &print, &token, lease).await.unwrap();
/// assert_eq!(first, BeginOutcome::Acquired);
/// let other = LeaseToken::generate();
/// assert_eq!(store.begin(&key, &print, &other, lease).await.unwrap(), BeginOutcome::InFlight);
/// # });
/// ```
pub trait IdempotencyStore: 'static {
    /// Creates the in-flight record holding `token`, or reports the record that exists.
    ///
    /// Idempotent for its token: an in-flight record that already holds `token` (a retry
    /// after a lost reply) counts as acquired. The caller generates the token, so it can
    /// [`abandon`](Self::abandon) the token of a `begin` it gave up on (a timeout), which
    /// may have created its record after all or may still land.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// assert_eq!(store.begin(&key, &print, &token, lease).await?, BeginOutcome::Acquired);
    /// // The same token again (a retry after a lost reply) still holds it:
    /// assert_eq!(store.begin(&key, &print, &token, lease).await?, BeginOutcome::Acquired);
    /// # Ok(())
    /// # }
    /// ```
    fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<BeginOutcome, StoreError>>;

    /// [`begin`](Self::begin), plus, when the record found is completed, how much longer the
    /// store keeps it at least (`None`: unknown). The PostgreSQL store reports the record's
    /// expiry; the Redis stores what is left of the ttl it was committed with,
    /// which is less (down to zero) once an [`abandon`](Self::abandon) kept the record
    /// longer: a replay cache then keeps its copy for less, never longer than the record.
    ///
    /// The [`ReplayCache`](crate::ReplayCache) keeps a completed record in process no longer
    /// than that, so a store that knows it in the same round trip should override this. The
    /// default calls `begin` and knows no lifetime: nothing from such a store is cached.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), None);
    /// store.begin(&key, &print, &token, lease).await?;
    /// store.commit(&key, &print, &token, &response, Duration::from_secs(3600)).await?;
    /// let retry = LeaseToken::generate();
    /// let (outcome, remaining) =
    ///     store.begin_with_remaining_ttl(&key, &print, &retry, lease).await?;
    /// assert_eq!(outcome, BeginOutcome::Completed(response));
    /// assert_eq!(remaining, None); // the memory store does not say; Redis and PostgreSQL do
    /// # Ok(())
    /// # }
    /// ```
    fn begin_with_remaining_ttl(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(BeginOutcome, Option<Duration>), StoreError>> {
        async move {
            let outcome = self.begin(key, fingerprint, token, lease).await?;
            Ok((outcome, None))
        }
    }

    /// Extends the lease to `lease` from now; `false` if `token` no longer holds it.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// store.begin(&key, &print, &token, lease).await?;
    /// assert!(store.renew(&key, &token, Duration::from_secs(60)).await?);
    /// assert!(!store.renew(&key, &LeaseToken::generate(), lease).await?); // not the holder
    /// # Ok(())
    /// # }
    /// ```
    fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>>;

    /// Stores the completed response for `ttl`; `false` if `token` no longer holds the lease
    /// and the key is not free (nothing was written). Idempotent: committing again with the
    /// token that completed the record answers `true` and changes nothing.
    ///
    /// Where the in-flight record of `token` is gone (its lease lapsed, or it was evicted or
    /// deleted) and the key is free, no request holding it (nothing there, an expired
    /// record, or only the marker of tokens other than `token`, see
    /// [`abandon`](Self::abandon)), the stores of this crate write the completed record
    /// (with `fingerprint`) in the same atomic step and answer `true`, so a retry gets the
    /// replay of this run rather than a second run. A store that answers `false` there
    /// instead is still correct, only less forgiving.
    ///
    /// `fingerprint` is the one the `begin` of `token` was given, so a store can write the
    /// whole completed record without reading it first (the Redis stores send it, and compare
    /// what they find with the in-flight record that `begin` wrote: given another
    /// fingerprint, they answer `false`), and every store of this crate writes it into a
    /// record written anew where the key is free.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), None);
    /// let ttl = Duration::from_secs(3600);
    /// store.begin(&key, &print, &token, lease).await?;
    /// assert!(store.commit(&key, &print, &token, &response, ttl).await?);
    /// assert!(store.commit(&key, &print, &token, &response, ttl).await?); // again: no change
    /// let other = LeaseToken::generate();
    /// assert!(!store.commit(&key, &print, &other, &response, ttl).await?); // the key is taken
    /// # Ok(())
    /// # }
    /// ```
    fn commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>>;

    /// Deletes the in-flight record; `false` if `token` no longer holds it.
    ///
    /// A record that took the key over the marker of abandoned tokens (see
    /// [`abandon`](Self::abandon)) leaves that marker in its place for the rest of the
    /// marker's time instead: a `begin` of one of those tokens landing after the release
    /// still creates nothing, while any other token's `begin` takes the key at once, as
    /// after any release.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// store.begin(&key, &print, &token, lease).await?;
    /// assert!(store.release(&key, &token).await?);
    /// assert!(!store.release(&key, &token).await?); // it holds nothing now
    /// let retry = LeaseToken::generate();
    /// assert_eq!(store.begin(&key, &print, &retry, lease).await?, BeginOutcome::Acquired);
    /// # Ok(())
    /// # }
    /// ```
    fn release(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
    ) -> impl Future<Output = Result<bool, StoreError>>;

    /// Gives up the `begin` of `token` that never answered (it timed out, or the request
    /// went away): it may have landed, may land later, or never. `true` once `token` holds
    /// nothing and never will: its in-flight record, if any, is gone, and the store keeps a
    /// marker for `remember_for` so that a `begin` of `token` landing later creates nothing
    /// (it answers [`BeginOutcome::Abandoned`]). The marker blocks no one: a `begin` with any
    /// other token takes the key as if it were free, and the record it writes keeps the
    /// marker's tokens out for the rest of the marker's time, whatever its request does next:
    /// its [`release`](Self::release) puts the marker back, its
    /// [`commit`](Self::commit) keeps the completed record at least as long (also where a
    /// commit writes its record anew over a marker), its abandon adds them to its own
    /// marker. `true` too when a completed record is
    /// there (a retry completed the key first), which the store then keeps for at least
    /// `remember_for`, as it would the marker: a late `begin` of `token` finds it and only
    /// replays it, even past the record's own ttl where that is shorter. `false`
    /// when another token's in-flight record is there: the caller tries again later, as a
    /// late `begin` of `token` can only land once that record is gone.
    ///
    /// The default calls [`release`](Self::release), which only wins over a `begin` that
    /// landed before it: the middleware then keeps trying for a lease, and a `begin` landing
    /// later than that blocks the key until its lease expires. Every store of this crate
    /// overrides it.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// // A `begin` of `token` timed out: give the token up, whether or not it landed.
    /// assert!(store.abandon(&key, &token, lease).await?);
    /// // Landing late, that `begin` creates nothing; any other token takes the key.
    /// assert_eq!(store.begin(&key, &print, &token, lease).await?, BeginOutcome::Abandoned);
    /// let retry = LeaseToken::generate();
    /// assert_eq!(store.begin(&key, &print, &retry, lease).await?, BeginOutcome::Acquired);
    /// // The retry's handler fails, its key is released: the marker is back, the next
    /// // retry runs at once, and the abandoned `begin` still creates nothing.
    /// assert!(store.release(&key, &retry).await?);
    /// assert_eq!(store.begin(&key, &print, &token, lease).await?, BeginOutcome::Abandoned);
    /// let next = LeaseToken::generate();
    /// assert_eq!(store.begin(&key, &print, &next, lease).await?, BeginOutcome::Acquired);
    /// # Ok(())
    /// # }
    /// ```
    fn abandon(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        remember_for: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> {
        let _ = remember_for;
        self.release(key, token)
    }

    /// The record under `key` as it is now, for support and operations (see
    /// [`Inspector`](crate::Inspector)): its state, expiry and stored status and headers,
    /// and the stored body only if `with_body`. `None` when there is no live record.
    ///
    /// Not part of the request path. Every store of this crate implements it; the default
    /// answers [`StoreError::Unsupported`].
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// assert!(store.inspect(&key, false).await?.is_none());
    /// store.begin(&key, &print, &token, lease).await?;
    /// let record = store.inspect(&key, false).await?.ok_or("no record")?;
    /// assert_eq!(record.state, RecordState::InFlight);
    /// # Ok(())
    /// # }
    /// ```
    fn inspect(
        &self,
        key: &StorageKey,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<RecordSnapshot>, StoreError>> {
        let _ = (key, with_body);
        std::future::ready(Err(StoreError::Unsupported("inspection")))
    }

    /// Deletes the record under `key` in one atomic step: a completed record always, an
    /// in-flight one only if `force` (otherwise it answers [`Deletion::InFlight`] and
    /// changes nothing).
    ///
    /// Not part of the request path. Every store of this crate implements it; the default
    /// answers [`StoreError::Unsupported`].
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use actix_web::http::{Method, StatusCode};
    /// # use idempotency_actix::{
    /// #     BeginOutcome, Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken,
    /// #     MemoryStore, RecordState, StorageKey, StoredResponse,
    /// # };
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("doc:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// let (token, lease) = (LeaseToken::generate(), Duration::from_secs(30));
    /// store.begin(&key, &print, &token, lease).await?;
    /// assert_eq!(store.delete(&key, false).await?, Deletion::InFlight);
    /// assert_eq!(store.delete(&key, true).await?, Deletion::Deleted);
    /// assert_eq!(store.delete(&key, true).await?, Deletion::NotFound);
    /// # Ok(())
    /// # }
    /// ```
    fn delete(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> impl Future<Output = Result<Deletion, StoreError>> {
        let _ = (key, force);
        std::future::ready(Err(StoreError::Unsupported("deletion")))
    }
}

/// The object-safe form of [`IdempotencyStore`] the middleware keeps behind an `Rc`.
pub(crate) trait DynStore {
    /// The store itself, for the features only one backend offers (transactional routes).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn as_any(&self) -> &dyn std::any::Any;

    fn begin<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        token: &'a LeaseToken,
        lease: Duration,
    ) -> LocalBoxFuture<'a, Result<(BeginOutcome, Option<Duration>), StoreError>>;

    fn renew<'a>(
        &'a self,
        key: &'a StorageKey,
        token: &'a LeaseToken,
        lease: Duration,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>>;

    fn commit<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        token: &'a LeaseToken,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>>;

    fn release<'a>(
        &'a self,
        key: &'a StorageKey,
        token: &'a LeaseToken,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>>;

    fn abandon<'a>(
        &'a self,
        key: &'a StorageKey,
        token: &'a LeaseToken,
        remember_for: Duration,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>>;
}

impl<T: IdempotencyStore> DynStore for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn begin<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        token: &'a LeaseToken,
        lease: Duration,
    ) -> LocalBoxFuture<'a, Result<(BeginOutcome, Option<Duration>), StoreError>> {
        Box::pin(IdempotencyStore::begin_with_remaining_ttl(
            self,
            key,
            fingerprint,
            token,
            lease,
        ))
    }

    fn renew<'a>(
        &'a self,
        key: &'a StorageKey,
        token: &'a LeaseToken,
        lease: Duration,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(IdempotencyStore::renew(self, key, token, lease))
    }

    fn commit<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        token: &'a LeaseToken,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(IdempotencyStore::commit(
            self,
            key,
            fingerprint,
            token,
            response,
            ttl,
        ))
    }

    fn release<'a>(
        &'a self,
        key: &'a StorageKey,
        token: &'a LeaseToken,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(IdempotencyStore::release(self, key, token))
    }

    fn abandon<'a>(
        &'a self,
        key: &'a StorageKey,
        token: &'a LeaseToken,
        remember_for: Duration,
    ) -> LocalBoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(IdempotencyStore::abandon(self, key, token, remember_for))
    }
}
