//! Idempotency-Key middleware for Actix Web: a protected request runs its handler once per
//! key; every retry with that key, on any instance, gets the stored response back.
//!
//! A client sends `Idempotency-Key: "<uuid>"` (the IETF draft's sf-string form, or the bare
//! form most clients send). The first request with a key runs the handler; its response is
//! stored (in Redis, PostgreSQL, or memory for development) and every retry with the same
//! key and the same request gets the same status, headers and body back, byte for byte,
//! with `Idempotent-Replayed: true`, without running the handler again.
//!
//! # Quickstart
//!
//! ```no_run
//! use actix_web::body::MessageBody;
//! use actix_web::dev::{ServiceRequest, ServiceResponse};
//! use actix_web::middleware::{Next, from_fn};
//! use actix_web::{App, Error, HttpMessage, HttpResponse, HttpServer, post, web};
//! # #[cfg(feature = "redis")]
//! use idempotency_actix::{Idempotency, KeyScope, RedisStore, idempotent};
//! # #[cfg(not(feature = "redis"))]
//! # use idempotency_actix::idempotent;
//!
//! #[idempotent(ttl = "24h")]
//! #[post("/orders")]
//! async fn create_order(order: web::Json<serde_json::Value>) -> HttpResponse {
//!     HttpResponse::Created().json(order.into_inner())
//! }
//!
//! /// Who is calling, as your authentication verified it.
//! #[derive(Clone)]
//! struct UserId(String);
//!
//! async fn authenticate(
//!     req: ServiceRequest,
//!     next: Next<impl MessageBody>,
//! ) -> Result<ServiceResponse<impl MessageBody>, Error> {
//!     let user = verify_token(&req)?; // a session, a JWT's `sub`, an API key's owner, …
//!     req.extensions_mut().insert(UserId(user));
//!     next.call(req).await
//! }
//! # fn verify_token(_: &ServiceRequest) -> Result<String, Error> { Ok("user-1".to_owned()) }
//!
//! # #[cfg(feature = "redis")]
//! #[actix_web::main]
//! async fn main() -> std::io::Result<()> {
//!     let pool = RedisStore::pool("redis://127.0.0.1:6379").expect("a valid Redis URL");
//!     HttpServer::new(move || {
//!         // Keys belong to the caller: two users sending the same key never share a response.
//!         let by_user = KeyScope::from_fn(|req| {
//!             req.extensions().get::<UserId>().map(|user| user.0.clone())
//!         });
//!         App::new()
//!             .wrap(Idempotency::redis(pool.clone()).scope(by_user))
//!             .wrap(from_fn(authenticate)) // wrapped last, so it runs first
//!             .service(create_order)
//!     })
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await
//! }
//! # #[cfg(not(feature = "redis"))] fn main() {}
//! ```
//!
//! Choosing the scope is part of setting up: see [`KeyScope`] for the patterns. An app that
//! chooses none has one key space for all callers and logs a warning at start saying so;
//! `KeyScope::global()` makes that choice explicit.
//!
//! # What clients see
//!
//! | situation | response |
//! |---|---|
//! | no key, key not required | the handler runs, nothing is stored |
//! | no key, `required` | 400 problem |
//! | malformed key (empty, over 255 characters, not printable ASCII, bad sf-string or parameter, a `;` after a bare key, repeated header, a list `k1, k2`) | 400 problem |
//! | first request with a key | the handler runs once; its response is returned as produced |
//! | retry after completion, same request | stored status, headers and body plus `Idempotent-Replayed: true` |
//! | retry with the same key, another method, path, query or body (its bytes as sent, compressed or not) | 422 problem (409 on a transactional route while the first runs) |
//! | retry while the first is still running | 409 problem with `Retry-After`; with `wait_for_completion`, the retry waits up to its bound and gets the replay (409 if the first is still running then) |
//! | handler answers 1xx (not a final response) | passed through as Actix sends it; never stored, key released |
//! | handler answers 204 or 304 | stored and replayed without a body or `Content-Length` |
//! | handler answers >= 400 or panics | response returned (a panic becomes a 500 problem); key released, a retry runs again (`store_errors` stores error responses instead, every status >= 400: a transient 500 or 503 and an extractor's 400 are replayed for the ttl too; a panic always releases the key) |
//! | keyed request body over the limit (1 MiB) | 413 problem; the handler does not run |
//! | keyed request that asks for a WebSocket upgrade (`Upgrade: websocket`), or a keyed `CONNECT` that declares no body | 400 problem at once; the handler does not run (its body has no end to fingerprint) |
//! | response body over the stored limit (1 MiB) | sent whole; the record completes without a body, so a retry never re-runs; the replay has the stored status and headers, an empty body and `Idempotent-Body-Omitted: true` |
//! | the worker at its cap of keyed work (1024 in flight, 256 detached) | 503 problem with `Retry-After`; the handler does not run |
//! | a new key while the process drains before it stops ([`Idempotency::drain`]) | 503 problem with `Retry-After` and `Connection: close`; the handler does not run (with [`FailMode::Open`], not even after a failed `begin`) |
//! | store unreachable, failing, or slower than the store timeout (2 s) | 503 problem with `Retry-After` (fail closed); [`FailMode::Open`] runs the handler unprotected and logs a warning, but for a retry that waited (`wait_for_completion`) and so knows its key in flight: 409; after a `begin` that did not answer, the run holds that `begin`'s token (a duplicate meeting its record gets 409) and its response is committed after it goes out, so once the store answers a retry gets the replay |
//! | `GET`, `HEAD`, `OPTIONS`, `TRACE`, `QUERY`, or unprotected routes | untouched, no store traffic |
//!
//! Problems are RFC 9457 `application/problem+json` documents with `type`, `title`,
//! `status` and `detail`; see [`IdempotencyError`].
//!
//! # Layers
//!
//! [`Idempotency`] on the `App` (or a scope or resource) brings the store and the defaults.
//! [`#[idempotent(...)]`](idempotent) protects one route with its own policy by attaching
//! [`IdempotentRoute`] to it; routes registered by hand use `IdempotentRoute` directly.
//! Untagged routes are protected only for the methods named with
//! [`Idempotency::protect_methods`]. When both layers apply, the request is processed once.
//!
//! # Stores
//!
//! * [`RedisStore`] (`Idempotency::redis(pool)`, Redis ≥ 7.0 or Valkey): takes a
//!   [`RedisPool`] (`RedisStore::pool(url)`, or a bb8 pool of bb8-redis connections the app
//!   built) and shares one multiplexed connection per worker: a light one of its own for a
//!   `redis://` or Unix-socket URL given to `RedisStore::pool`, redis-rs's otherwise. Two
//!   round trips for a new key, one for a replay, none for unprotected requests; every
//!   record is one key and every command or function touches one key. The commit is
//!   one plain `SET … IFEQ` on Valkey ≥ 8.1, else a function (on Redis too, whose 8.6.3
//!   was seen to write a `SET … IFEQ` into another key: `docs/redis-8-set-ifeq.md`).
//! * `RedisClusterStore` (`Idempotency::redis_cluster(client)`, feature `redis-cluster`):
//!   the same protocol on Redis Cluster (the commit always by function), through one
//!   shared async cluster connection per worker that follows slot moves and failovers.
//! * [`ReplicatedWrites`] (for either Redis store): each write waits for replicas, in the
//!   same round trip, so a failover to a replica that acknowledged it does not lose a lock
//!   or a committed record (a commit not acknowledged in time still sends its response and
//!   is retried in the background: README, "Replicated writes").
//! * [`ReplayCache`] (opt-in, `Idempotency::replay_cache`): completed records kept in
//!   process, so a replay costs no round trip at all.
//! * `PostgresStore` (feature `postgres`, `Idempotency::postgres(store)`): durable records,
//!   one row each, through a bb8 pool of tokio-postgres connections; the same round trips;
//!   and **transactional routes**: with `#[idempotent(transactional)]` the handler takes an
//!   `IdempotentTransaction` and writes through it, and its writes and its stored response
//!   commit together before the response leaves, or neither does (an error status, an
//!   error, a panic or a crash rolls both back; a crash after the commit is replayed).
//! * [`MemoryStore`] (`Idempotency::memory()`): in-process, for development, tests and
//!   single-instance apps; bounded by bytes (64 MiB by default,
//!   [`Idempotency::memory_with`] to change it). When full it evicts completed records,
//!   never in-flight ones: an evicted key's idempotency window ends early.
//! * Anything implementing [`IdempotencyStore`] (`Idempotency::new(store)`).
//!
//! # What is stored
//!
//! Records are stored under a blake3 digest of (scope, key), never the raw key (see
//! [`KeyScope`] to keep tenants apart). A record holds the fingerprint of the request
//! ([`Fingerprint`]: method, path, query and a digest of the body), the status, the replayed
//! headers ([`ReplayedHeaders`]: never `Set-Cookie`, `Date`, hop-by-hop or framing headers)
//! and the body as raw bytes.
//!
//! # Observability
//!
//! * **Tracing:** each protected request runs in one `idempotency` span with the fields
//!   `http.route` (the route pattern), `outcome` ([`Outcome`]) and
//!   `http.response.status_code`. Key values are never logged; the storage key (a digest)
//!   appears in DEBUG events only.
//! * **Metrics** (feature `metrics`): through the `metrics` facade, with no exporter in
//!   this crate: `idempotency_requests_total{route, outcome}`,
//!   `idempotency_store_operation_duration_seconds{operation, result}`,
//!   `idempotency_requests_in_flight{route}`,
//!   `idempotency_background_retries_total{operation}` and
//!   `idempotency_evictions_total{source}` ([`record_evictions`]). Labels have bounded
//!   values: `route` is the matched pattern, never the raw path or the key.
//! * **OpenAPI** (feature `utoipa`): `#[idempotent]` describes its route as
//!   `<handler>::IDEMPOTENCY` ([`ProtectedRoute`]); `IdempotencyOpenApi`, a
//!   `utoipa::Modify`, adds the `Idempotency-Key` header parameter, the 400, 409, 413, 422,
//!   500 and 503 problem responses and the `Idempotent-Replayed` header to those operations.
//! * **Inspection:** [`Inspector`] looks up and deletes one record by (scope, key) on any
//!   store, for support and operations; an in-flight record is deleted only when forced.
//!
//! ```
//! # #[cfg(feature = "utoipa")] {
//! use actix_web::{HttpResponse, post};
//! use idempotency_actix::{IdempotencyOpenApi, idempotent};
//!
//! #[idempotent]
//! #[utoipa::path(post, path = "/orders", responses((status = 201, description = "Created")))]
//! #[post("/orders")]
//! async fn create_order() -> HttpResponse {
//!     HttpResponse::Created().finish()
//! }
//!
//! const IDEMPOTENCY: IdempotencyOpenApi = IdempotencyOpenApi::new(&[create_order::IDEMPOTENCY]);
//!
//! #[derive(utoipa::OpenApi)]
//! #[openapi(paths(create_order), modifiers(&IDEMPOTENCY))]
//! struct ApiDoc;
//! # }
//! ```
//!
//! # Guarantees and limits
//!
//! * The handler of a protected request runs while its record holds a lease (30 s by
//!   default) that is renewed every third of it until its record is complete (a streamed
//!   body may take longer than the lease), so a slow handler is not run twice.
//! * The commit is fenced by the lease token: a request that lost its lease never
//!   overwrites another request's record.
//! * The handler runs to its end: a client that disconnects does not cancel it (its run goes
//!   on on a task of its own), and its response is committed for the retry.
//! * The commit happens before the response is complete, so a retry issued after a response
//!   arrived gets the replay once that commit landed; a commit the store refused or did not
//!   answer is retried in the background while the response goes out, its key locked
//!   (409 meanwhile, never a second run) until it lands (README, "Reliability"). A body that is known at once is committed before the
//!   response is sent; a streamed body (server-sent events, NDJSON progress) is forwarded
//!   chunk by chunk as the handler produces it, and committed before its last chunk (known
//!   size) or its end (unknown size) reaches the client. A response whose status is stored
//!   completes its record even when its body is too large, fails or panics midway (the
//!   replay then has the status and headers only): the handler ran, so it never runs again.
//!   A stream that outgrows the stored-body limit completes its record then and stops
//!   renewing its lease, so an endless stream holds nothing; one whose client left is read
//!   on to its end (or the limit) and committed, or committed without a body once it has
//!   produced nothing for a lease.
//! * Every store operation is bounded by the store timeout (2 s). If `begin` times out (or
//!   its client goes away), its token is abandoned in the background
//!   ([`IdempotencyStore::abandon`]): the store remembers it, so that `begin`, landing late
//!   in whatever order, creates nothing. If the commit fails, the response is sent anyway
//!   and the commit is retried in the background, the lease renewed meanwhile, until it
//!   lands or the record's ttl has passed, while retries get 409: only a lost in-flight
//!   record (evicted, deleted, or expired with a lease that could not be renewed) frees the
//!   key for a second run, and it is logged and counted ([`Idempotency::lost_records`]).
//!   A commit that finds its record lost and the key free (no request holds it) writes the
//!   completed record anew, so a later retry gets the replay. A commit that landed in the
//!   background is looked at again a second later and sent again if the store still holds
//!   the in-flight record (a node that took it and lost it in a failover).
//! * Each worker takes on at most [`DEFAULT_MAX_IN_FLIGHT`] keyed requests at once, at most
//!   [`DEFAULT_MAX_DETACHED`] of them without their client ([`Idempotency::max_in_flight`],
//!   [`Idempotency::max_detached`]); beyond that new keyed requests get 503 with
//!   `Retry-After` at once, and nothing already running is cancelled. A commit retried in
//!   the background counts as detached until it lands (and that second look answers), so
//!   failing commits cannot pile up with their responses.
//! * Actix's graceful stop does not wait for a keyed request whose client left (it has no
//!   connection), and its workers drop what they still run once they stop: drain first
//!   ([`Idempotency::drain`]), then stop the server, so that such a handler finishes and
//!   its response is committed.
//! * A keyed request whose [`KeyScope`] cannot be determined is refused (400), never stored
//!   in a key space shared with other principals.
//! * Records of another version of this crate are never taken over: an in-flight one is in
//!   flight, a completed one this version cannot decode is a store error (503).

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The crate's docs above link the Redis store's types, which a build without the `redis`
// feature does not have; its docs show them as plain names.
#![cfg_attr(not(feature = "redis"), allow(rustdoc::broken_intra_doc_links))]
mod background_retry;
mod body;
mod built_in_box;
mod capture;
mod engine;
mod error;
mod fingerprint;
mod gathered_hasher;
mod inspect;
mod instrument;
mod key;
mod log_interval;
mod lost_record;
#[cfg(feature = "metrics")]
mod metric_handles;
mod middleware;
#[cfg(feature = "utoipa")]
mod openapi;
mod policy;
mod problem_type;
mod protected_route;
mod record;
mod rendered_error;
mod replay;
mod replay_cache;
mod route_label;
mod run_to_completion;
mod scope;
mod store;
#[cfg(feature = "postgres")]
mod transaction;
mod work_in_progress;
mod workload;

pub use body::IdempotentBody;
pub use engine::FailMode;
pub use error::IdempotencyError;
pub use fingerprint::{Fingerprint, FingerprintParts};
pub use idempotency_macros::idempotent;
pub use inspect::{InspectionError, Inspector};
pub use instrument::{
    EvictionSource, Outcome, UNMATCHED_ROUTE, describe_metrics, record_evictions,
};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LENGTH};
pub use middleware::{
    Idempotency, IdempotencyFuture, IdempotencyMiddleware, IdempotentRoute,
    IdempotentRouteMiddleware,
};
#[cfg(feature = "utoipa")]
pub use openapi::{
    IdempotencyOpenApi, KEY_PATTERN, PROBLEM_SCHEMA, document_operation, problem_schema,
};
pub use policy::{
    DEFAULT_LEASE, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_STORED_BODY, DEFAULT_TTL,
    IdempotencyPolicy, MAX_DURATION, MIN_LEASE, Policy,
};
pub use protected_route::ProtectedRoute;
pub use record::{RECORD_VERSION, RecordError, StoredResponse};
pub use replay::{BODY_OMITTED_HEADER, REPLAYED_HEADER, ReplayedHeaders};
pub use replay_cache::ReplayCache;
pub use scope::{KeyScope, StorageKey};
pub use store::{
    BeginOutcome, Deletion, IdempotencyStore, LeaseToken, MemoryStore, MemoryStoreBuilder,
    RecordSnapshot, RecordState, StoreError,
};
#[cfg(feature = "postgres")]
pub use store::{DEFAULT_TABLE, EXPIRY_BATCH, PostgresPool, PostgresStore, TableNameError};
#[cfg(feature = "redis-cluster")]
pub use store::{RedisClusterClient, RedisClusterStore};
#[cfg(feature = "redis")]
pub use store::{RedisPool, RedisStore, ReplicatedWrites};
#[cfg(feature = "postgres")]
pub use transaction::IdempotentTransaction;
pub use workload::{DEFAULT_MAX_DETACHED, DEFAULT_MAX_IN_FLIGHT};

/// What `#[idempotent(transactional)]` makes of the route's policy: `.transactional()`, which
/// only the `postgres` feature has. The attribute cannot see this crate's features, so the
/// check is here.
#[cfg(feature = "postgres")]
#[doc(hidden)]
#[macro_export]
macro_rules! __transactional {
    ($policy:expr) => {
        $policy.transactional()
    };
}

/// Without the `postgres` feature, a compile error that says so (rather than "no method
/// named `transactional`").
#[cfg(not(feature = "postgres"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __transactional {
    ($policy:expr) => {
        ::core::compile_error!(
            "#[idempotent(transactional)] needs the `postgres` feature of idempotency-actix \
             (features = [\"postgres\"] in Cargo.toml) and Idempotency::postgres(store)"
        )
    };
}

/// The doctests of the build without `postgres` (`cargo test -p idempotency-actix --doc
/// --no-default-features`, which CI runs): `#[idempotent(transactional)]` does not compile
/// there, while the same route without `transactional` does, so the attribute alone is
/// what fails it. (The message is checked against its text by
/// `tests/without_postgres.rs`, a `trybuild` test of that build.)
///
/// ```compile_fail
/// use actix_web::{HttpResponse, post};
/// use idempotency_actix::idempotent;
///
/// #[idempotent(transactional)]
/// #[post("/ledger")]
/// async fn book() -> HttpResponse {
///     HttpResponse::Created().finish()
/// }
/// # fn main() {}
/// ```
///
/// ```
/// use actix_web::{HttpResponse, post};
/// use idempotency_actix::idempotent;
///
/// #[idempotent]
/// #[post("/ledger")]
/// async fn book() -> HttpResponse {
///     HttpResponse::Created().finish()
/// }
/// # fn main() {}
/// ```
#[cfg(all(doctest, not(feature = "postgres")))]
pub struct TransactionalNeedsPostgres;

/// What `#[idempotent]`'s generated code calls, and what its tests check it against. Not
/// public API: may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::__transactional as transactional;
    pub use crate::engine::SAFE_METHODS;
    pub use crate::middleware::IdempotentRoute;
    pub use crate::policy::IdempotencyPolicy;
    pub use crate::protected_route::ProtectedRoute;
    pub use ::core::time::Duration;
}
