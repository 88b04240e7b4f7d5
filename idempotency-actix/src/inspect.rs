//! [`Inspector`]: look up or delete one record by (scope, key), for support and operations.

use std::time::Duration;

use crate::key::{IdempotencyKey, KeyError};
use crate::scope::StorageKey;
use crate::store::{Deletion, IdempotencyStore, RecordSnapshot, StoreError};

/// Looks up and deletes single records by the key a client sent and its scope, on any
/// store: what support staff need to see why a retry got a replay, a 409 or a 422, or to let
/// a client run a request again.
///
/// Give it the store and the key prefix the app uses
/// ([`Idempotency::key_prefix`](crate::Idempotency::key_prefix), `idempotency:` by
/// default). The scope is what the app's [`KeyScope`](crate::KeyScope) takes from the
/// request (a header's value, the function's answer), empty for the global scope. The key
/// is the header's value, in either form (`"abc"` or `abc`).
///
/// Deleting a completed record makes the next request with its key run the handler again.
/// Deleting an in-flight record is refused ([`Deletion::InFlight`]) unless forced: its
/// handler may still be running, and forcing lets a retry run it again meanwhile. Its
/// commit finds the record gone: where the key is still free, it writes the completed
/// record anew (a warning in the log), and later retries get the replay; where a retry
/// has taken the key meanwhile, it stores nothing, and that retry's run is the one that is
/// kept. Force only a record whose request is known to be dead. Instances with a
/// [`ReplayCache`](crate::ReplayCache) keep replaying a deleted completed record they have
/// cached until its TTL runs out.
///
/// A Redis key of another type under the prefix (another program's, or a record of the
/// hash format of 0.1 development builds), for which every request is refused with 503
/// while it lives, fails a lookup and a deletion with [`StoreError::Corrupt`] holding
/// [`RecordError::OtherType`](crate::RecordError::OtherType);
/// [`force_delete`](Self::force_delete) deletes it.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{Deletion, Inspector, MemoryStore, RecordState};
///
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// // ... the app ran with `Idempotency::new(store.clone())` ...
/// let inspector = Inspector::new(store);
/// match inspector.lookup(b"", "\"order-1\"").await? {
///     Some(record) if record.state == RecordState::Completed => {
///         println!("replays {:?}, {:?} more", record.status, record.expires_in);
///     }
///     Some(_) => println!("still running"),
///     None => println!("no record: the next request runs the handler"),
/// }
/// assert_eq!(inspector.delete(b"", "order-1").await?, Deletion::NotFound);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Inspector<S> {
    store: S,
    prefix: String,
    timeout: Duration,
}

/// Why an [`Inspector`] could not answer.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{InspectionError, Inspector, KeyError, MemoryStore};
///
/// # actix_web::rt::System::new().block_on(async {
/// let inspector = Inspector::new(MemoryStore::new());
/// let answer = inspector.lookup(b"", "").await;
/// assert!(matches!(answer, Err(InspectionError::InvalidKey(KeyError::Empty))));
/// # });
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InspectionError {
    /// The key is not a valid idempotency key.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<S: IdempotencyStore> Inspector<S> {
    /// An inspector of `store` under the default key prefix, `idempotency:`.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{Inspector, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new(); // a clone of the app's store
    /// let inspector = Inspector::new(store);
    /// assert!(inspector.lookup(b"", "order-1").await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(store: S) -> Self {
        Self {
            store,
            prefix: "idempotency:".to_owned(),
            timeout: Duration::from_secs(2),
        }
    }

    /// The key prefix the app uses, if not the default.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{Inspector, MemoryStore};
    ///
    /// // For an app that calls `Idempotency::key_prefix("shop:")`:
    /// let inspector = Inspector::new(MemoryStore::new()).key_prefix("shop:");
    /// assert!(inspector.storage_key(b"", "order-1")?.as_str().starts_with("shop:"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long each lookup or deletion may take before it fails with
    /// [`StoreError::Timeout`] (2 s by default, as the middleware's store timeout), so that a
    /// store that does not answer never hangs a support tool. A deletion that timed out may
    /// still have landed: look the record up again. `Duration::MAX` waits as long as the
    /// store takes.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{Inspector, MemoryStore};
    ///
    /// let inspector = Inspector::new(MemoryStore::new()).timeout(Duration::from_secs(5));
    /// # let _ = inspector;
    /// ```
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Where the record of `key` in `scope` is stored. A key of any length is looked up
    /// (the app may take keys longer than [`MAX_KEY_LENGTH`](crate::MAX_KEY_LENGTH): see
    /// [`Idempotency::max_key_length`](crate::Idempotency::max_key_length)).
    ///
    /// # Errors
    ///
    /// When `key` is not a valid idempotency key.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyKey, Inspector, MemoryStore, StorageKey};
    ///
    /// let inspector = Inspector::new(MemoryStore::new());
    /// let key = inspector.storage_key(b"tenant-a", "\"order-1\"")?;
    /// let order_1 = IdempotencyKey::parse(b"order-1")?;
    /// assert_eq!(key, StorageKey::new("idempotency:", b"tenant-a", &order_1));
    /// assert!(inspector.storage_key(b"", "").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn storage_key(&self, scope: &[u8], key: &str) -> Result<StorageKey, KeyError> {
        let key = IdempotencyKey::parse_within(key.as_bytes(), usize::MAX)?;
        Ok(StorageKey::new(&self.prefix, scope, &key))
    }

    /// The record of `key` in `scope`: its state, expiry, stored status and headers and the
    /// body's size, without the body. `None` when there is none.
    ///
    /// # Errors
    ///
    /// When `key` is invalid or the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::StatusCode;
    /// use idempotency_actix::{Inspector, MemoryStore, RecordState};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// # use actix_web::{App, HttpResponse, http::Method, test, web};
    /// # let idempotency = idempotency_actix::Idempotency::new(store.clone());
    /// # let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// # let handler = || async { HttpResponse::Created().body("order 7") };
    /// # let app = test::init_service(app.route("/", web::post().to(handler))).await;
    /// # let request = test::TestRequest::post().insert_header(("Idempotency-Key", "order-1"));
    /// # test::call_service(&app, request.to_request()).await;
    /// // ... the app answered a request with `Idempotency-Key: order-1` with 201 ...
    /// let record = Inspector::new(store).lookup(b"", "order-1").await?.ok_or("no record")?;
    /// assert_eq!(record.state, RecordState::Completed);
    /// assert_eq!(record.status, Some(StatusCode::CREATED));
    /// assert_eq!(record.body_size, Some(7));
    /// assert!(record.body.is_none()); // `lookup_with_body` has it
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lookup(
        &self,
        scope: &[u8],
        key: &str,
    ) -> Result<Option<RecordSnapshot>, InspectionError> {
        self.inspect(scope, key, false).await
    }

    /// The record of `key` in `scope`, with the stored body.
    ///
    /// # Errors
    ///
    /// When `key` is invalid or the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{Inspector, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// # use actix_web::{App, HttpResponse, http::Method, test, web};
    /// # let idempotency = idempotency_actix::Idempotency::new(store.clone());
    /// # let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// # let handler = || async { HttpResponse::Created().body("order 7") };
    /// # let app = test::init_service(app.route("/", web::post().to(handler))).await;
    /// # let request = test::TestRequest::post().insert_header(("Idempotency-Key", "order-1"));
    /// # test::call_service(&app, request.to_request()).await;
    /// // ... the app answered a request with `Idempotency-Key: order-1` with 201 ...
    /// let inspector = Inspector::new(store);
    /// let record = inspector.lookup_with_body(b"", "order-1").await?.ok_or("no record")?;
    /// assert_eq!(record.body.as_deref(), Some(&b"order 7"[..]));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lookup_with_body(
        &self,
        scope: &[u8],
        key: &str,
    ) -> Result<Option<RecordSnapshot>, InspectionError> {
        self.inspect(scope, key, true).await
    }

    /// Deletes the completed record of `key` in `scope`; an in-flight one is left alone
    /// and reported as [`Deletion::InFlight`].
    ///
    /// # Errors
    ///
    /// When `key` is invalid or the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{Deletion, Inspector, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// # use actix_web::{App, HttpResponse, http::Method, test, web};
    /// # let idempotency = idempotency_actix::Idempotency::new(store.clone());
    /// # let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// # let handler = || async { HttpResponse::Created().body("order 7") };
    /// # let app = test::init_service(app.route("/", web::post().to(handler))).await;
    /// # let request = test::TestRequest::post().insert_header(("Idempotency-Key", "order-1"));
    /// # test::call_service(&app, request.to_request()).await;
    /// // ... the app answered a request with `Idempotency-Key: order-1` with 201 ...
    /// let inspector = Inspector::new(store);
    /// assert_eq!(inspector.delete(b"", "order-1").await?, Deletion::Deleted);
    /// assert_eq!(inspector.delete(b"", "order-1").await?, Deletion::NotFound);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn delete(&self, scope: &[u8], key: &str) -> Result<Deletion, InspectionError> {
        self.remove(scope, key, false).await
    }

    /// Deletes the record of `key` in `scope`, even in flight (see the type's docs for
    /// what that risks), or whatever else the key holds on Redis (a key of another type).
    ///
    /// # Errors
    ///
    /// When `key` is invalid or the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::http::Method;
    /// use idempotency_actix::{Deletion, Fingerprint, IdempotencyKey, IdempotencyStore, Inspector,
    ///     LeaseToken, MemoryStore, StorageKey};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// # let key = StorageKey::new("idempotency:", b"", &IdempotencyKey::parse(b"stuck")?);
    /// # let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// # store.begin(&key, &print, &LeaseToken::generate(), Duration::from_secs(30)).await?;
    /// // ... the request with the key `stuck` is in flight, and known to be dead ...
    /// let inspector = Inspector::new(store);
    /// assert_eq!(inspector.delete(b"", "stuck").await?, Deletion::InFlight);
    /// assert_eq!(inspector.force_delete(b"", "stuck").await?, Deletion::Deleted);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn force_delete(&self, scope: &[u8], key: &str) -> Result<Deletion, InspectionError> {
        self.remove(scope, key, true).await
    }

    async fn inspect(
        &self,
        scope: &[u8],
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordSnapshot>, InspectionError> {
        let key = self.storage_key(scope, key)?;
        Ok(self.within(self.store.inspect(&key, with_body)).await?)
    }

    async fn remove(
        &self,
        scope: &[u8],
        key: &str,
        force: bool,
    ) -> Result<Deletion, InspectionError> {
        let key = self.storage_key(scope, key)?;
        Ok(self.within(self.store.delete(&key, force)).await?)
    }

    /// Runs `operation` for at most the timeout, polled under that deadline
    /// (`store::deadline`), as the middleware polls its store operations: the Redis stores'
    /// connections then know it, answer by it, and leave a connection that went silent past
    /// it, as for the middleware's own requests.
    async fn within<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        // A timeout past what the clock can count (`Duration::MAX`, meant as "no timeout")
        // ends in 30 years, as Tokio's timer does, instead of overflowing.
        let now = std::time::Instant::now();
        let deadline = now
            .checked_add(self.timeout)
            .or_else(|| now.checked_add(Duration::from_secs(30 * 365 * 24 * 60 * 60)))
            .unwrap_or(now);
        let mut operation = std::pin::pin!(operation);
        let polled = std::future::poll_fn(|cx| {
            crate::store::deadline::polling(deadline, || operation.as_mut().poll(cx)).0
        });
        match actix_rt::time::timeout(self.timeout, polled).await {
            // A connection that kept the deadline answers with an error of its own.
            Ok(Err(_)) if std::time::Instant::now() >= deadline => {
                Err(StoreError::Timeout(self.timeout))
            }
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MemoryStore;

    /// A support tool that means "no timeout" (`Duration::MAX`, or a timeout read from its
    /// command line) gets its answer: the deadline saturates instead of overflowing.
    #[actix_web::test]
    async fn an_endless_timeout_answers() {
        let inspector = Inspector::new(MemoryStore::new()).timeout(Duration::MAX);
        assert!(matches!(inspector.lookup(b"", "k").await, Ok(None)));
        assert!(matches!(
            inspector.delete(b"", "k").await,
            Ok(Deletion::NotFound)
        ));
    }
}
