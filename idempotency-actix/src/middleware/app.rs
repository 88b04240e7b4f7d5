//! [`Idempotency`]: the store, the defaults, and method-based protection.

use std::future::{Ready, ready};
use std::rc::Rc;
use std::time::Duration;

use actix_service::{Service, Transform, forward_ready};
use actix_web::HttpMessage;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::http::header::HeaderName;

use super::{IdempotencyFuture, pass_through, process};
use crate::engine::{Claimed, Engine, EngineHandle, FailMode, Response, Settings, is_safe_method};
use crate::fingerprint::FingerprintParts;
use crate::policy::checked;
use crate::replay::ReplayedHeaders;
use crate::replay_cache::ReplayCache;
use crate::scope::KeyScope;
use crate::store::{DynStore, IdempotencyStore, MemoryStore};

/// Idempotency middleware: makes retries of protected requests safe.
///
/// Wrap the `App` (or a scope or resource) in it to give every route below a store and the
/// defaults. Routes tagged with [`#[idempotent]`](crate::idempotent) (or wrapped in
/// [`IdempotentRoute`](crate::IdempotentRoute)) are protected with their own policy; untagged
/// routes are protected only for the methods named with
/// [`protect_methods`](Self::protect_methods) (none by default). `GET`, `HEAD`, `OPTIONS`
/// and `TRACE` are never touched.
///
/// A request is processed once even when both this layer and a route layer apply: the
/// outer one takes it, and the route's ttl and storage options still apply at commit.
///
/// Built per worker inside the `HttpServer::new` closure: it holds `Rc`s, and the stores
/// it wraps are shared handles (a bb8 pool, a [`MemoryStore`]).
///
/// # Examples
///
/// ```
/// use actix_web::{App, HttpResponse, http::Method, post, web};
/// use idempotency_actix::{Idempotency, idempotent};
///
/// #[idempotent(ttl = "24h")]
/// #[post("/orders")]
/// async fn create_order(body: web::Bytes) -> HttpResponse {
///     HttpResponse::Created().body(body)
/// }
///
/// let app = App::new()
///     .wrap(Idempotency::memory().protect_methods([Method::PATCH]))
///     .service(create_order);
/// ```
pub struct Idempotency {
    store: Rc<dyn DynStore>,
    settings: Settings,
    methods: Vec<Method>,
}

impl Idempotency {
    /// Idempotency on any [`IdempotencyStore`].
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self {
            store: Rc::new(store),
            settings: Settings::default(),
            methods: Vec::new(),
        }
    }

    /// Idempotency on Redis through a bb8 pool of bb8-redis connections.
    ///
    /// See [`RedisStore`](crate::RedisStore) for the protocol and
    /// [`RedisStore::pool`](crate::RedisStore::pool) for a pool that skips bb8's `PING` on
    /// checkout.
    #[cfg(feature = "redis")]
    pub fn redis(pool: crate::store::RedisPool) -> Self {
        Self::new(crate::store::RedisStore::new(pool))
    }

    /// Idempotency on Redis Cluster through one shared async cluster connection per worker.
    ///
    /// See [`RedisClusterStore`](crate::RedisClusterStore) for how it connects and
    /// [`RedisClusterStore::client`](crate::RedisClusterStore::client) for a client with
    /// the timeouts it wants. For replicated writes, build the store and use
    /// [`Idempotency::new`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, RedisClusterStore};
    ///
    /// let client = RedisClusterStore::client(["redis://127.0.0.1:7000"]).expect("a valid URL");
    /// let app = App::new().wrap(Idempotency::redis_cluster(client));
    /// ```
    #[cfg(feature = "redis-cluster")]
    pub fn redis_cluster(client: crate::store::RedisClusterClient) -> Self {
        Self::new(crate::store::RedisClusterStore::new(client))
    }

    /// Idempotency on the process-wide in-memory store ([`MemoryStore::shared`]): for
    /// development, tests and single-instance apps. Every worker (and every app in the
    /// process) that uses it shares one store.
    pub fn memory() -> Self {
        Self::new(MemoryStore::shared())
    }

    /// Also protects untagged routes for these methods (safe methods are ignored).
    #[must_use]
    pub fn protect_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().filter(|m| !is_safe_method(m)).collect();
        self
    }

    /// The request header that carries the key (default `Idempotency-Key`).
    ///
    /// # Panics
    ///
    /// Panics if `name` is not a valid header name (a configuration mistake).
    #[must_use]
    pub fn header(mut self, name: &str) -> Self {
        self.settings.header = HeaderName::try_from(name)
            .unwrap_or_else(|_| panic!("Idempotency::header: {name:?} is not a header name"));
        self
    }

    /// The prefix of every storage key (default `idempotency:`): separates apps, or tests,
    /// that share one Redis.
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.prefix = prefix.into();
        self
    }

    /// Whose key a request's key is (default: one key space for the app).
    #[must_use]
    pub fn scope(mut self, scope: KeyScope) -> Self {
        self.settings.scope = scope;
        self
    }

    /// Which parts of a request are fingerprinted (default: method, path, query, body).
    #[must_use]
    pub fn fingerprint(mut self, parts: FingerprintParts) -> Self {
        self.settings.fingerprint = parts;
        self
    }

    /// Which response headers are replayed (default: all but cookies, `Date`, hop-by-hop
    /// and framing headers).
    #[must_use]
    pub fn replayed_headers(mut self, headers: ReplayedHeaders) -> Self {
        self.settings.replayed_headers = headers;
        self
    }

    /// What happens when the store fails (default [`FailMode::Closed`]: 503).
    #[must_use]
    pub fn on_store_error(mut self, mode: FailMode) -> Self {
        self.settings.fail_mode = mode;
        self
    }

    /// How long any store operation may take before it counts as failed (default 2 s).
    ///
    /// # Panics
    ///
    /// If the duration is zero or over [`MAX_DURATION`](crate::MAX_DURATION).
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.settings.store_timeout = checked(timeout);
        self
    }

    /// What `Retry-After` advises on 409 and 503 answers (default 1 s).
    #[must_use]
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.settings.retry_after = delay;
        self
    }

    /// How long completed responses are replayed, unless a route says otherwise (default
    /// 24 h).
    ///
    /// # Panics
    ///
    /// If the duration is zero or over [`MAX_DURATION`](crate::MAX_DURATION).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.settings.defaults.ttl = checked(ttl);
        self
    }

    /// How long an in-flight record holds its key without renewal (default 30 s; renewed
    /// every third of it while the handler runs).
    ///
    /// # Panics
    ///
    /// If the duration is zero or over [`MAX_DURATION`](crate::MAX_DURATION).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.defaults.lease = checked(lease);
        self
    }

    /// Refuses protected requests without a key (400), unless a route says otherwise.
    #[must_use]
    pub fn require_key(mut self) -> Self {
        self.settings.defaults.required = true;
        self
    }

    /// The largest body a keyed request may send (default 1 MiB; 413 above).
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.settings.defaults.max_request_body = bytes;
        self
    }

    /// The largest response body that is stored (default 1 MiB).
    #[must_use]
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.settings.defaults.max_stored_body = bytes;
        self
    }

    /// A retry that finds its key in flight waits up to `bound` for the first request to
    /// finish and replays its response, instead of answering 409 at once (the default).
    /// The store is polled meanwhile (every 20 ms, backing off to 250 ms).
    ///
    /// # Panics
    ///
    /// If the duration is zero or over [`MAX_DURATION`](crate::MAX_DURATION).
    #[must_use]
    pub fn wait_for_completion(mut self, bound: Duration) -> Self {
        self.settings.defaults.wait_for_completion = Some(checked(bound));
        self
    }

    /// Answers replays from `cache`, in process, when it holds the completed record (no
    /// store round trip), and caches the completed records the store returns, each for the
    /// rest of its TTL. Off by default; see [`ReplayCache`] for what it trades.
    ///
    /// Pass a clone of one cache to every worker's `Idempotency` so they share it.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{Idempotency, ReplayCache};
    ///
    /// let cache = ReplayCache::with_max_bytes(32 * 1024 * 1024);
    /// let idempotency = Idempotency::memory().replay_cache(cache.clone());
    /// ```
    #[must_use]
    pub fn replay_cache(mut self, cache: ReplayCache) -> Self {
        self.settings.replay_cache = Some(cache);
        self
    }

    /// Stores and replays responses with status >= 400 too (by default they release the
    /// key so a retry runs again).
    #[must_use]
    pub fn store_errors(mut self) -> Self {
        self.settings.defaults.store_errors = true;
        self
    }
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("header", &self.settings.header)
            .field("prefix", &self.settings.prefix)
            .field("methods", &self.methods)
            .field("defaults", &self.settings.defaults)
            .finish_non_exhaustive()
    }
}

impl<S, B> Transform<S, ServiceRequest> for Idempotency
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = Response<B>;
    type Error = actix_web::Error;
    type Transform = IdempotencyMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            engine: Rc::new(Engine {
                store: Rc::clone(&self.store),
                settings: self.settings.clone(),
            }),
            methods: Rc::from(self.methods.as_slice()),
        }))
    }
}

/// The service [`Idempotency`] wraps around the app.
pub struct IdempotencyMiddleware<S> {
    service: Rc<S>,
    engine: Rc<Engine>,
    methods: Rc<[Method]>,
}

impl<S, B> Service<ServiceRequest> for IdempotencyMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = Response<B>;
    type Error = actix_web::Error;
    type Future = IdempotencyFuture<S, B>;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        if is_safe_method(req.method()) {
            return pass_through(&*self.service, req);
        }
        let claimed = {
            let mut extensions = req.extensions_mut();
            extensions.insert(EngineHandle(Rc::clone(&self.engine)));
            extensions.contains::<Claimed>()
        };
        if claimed || !self.methods.contains(req.method()) {
            return pass_through(&*self.service, req);
        }
        let policy = self.engine.settings.defaults.clone();
        process(
            Rc::clone(&self.engine),
            policy,
            req,
            Rc::clone(&self.service),
        )
    }
}
