//! [`Idempotency`]: the store, the defaults, and method-based protection.

use std::future::{Ready, ready};
use std::rc::Rc;
use std::sync::Once;
use std::time::Duration;

use actix_service::{Service, Transform, forward_ready};
use actix_web::HttpMessage;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::http::header::HeaderName;

use super::{IdempotencyFuture, answer, pass_through, process, refuse_claimed_further_out};
use crate::engine::{Engine, EngineHandle, FailMode, Response, Settings, is_safe_method};
use crate::fingerprint::FingerprintParts;
use crate::log_interval::LogInterval;
use crate::policy::{IdempotencyPolicy, checked};
use crate::replay::ReplayedHeaders;
use crate::replay_cache::ReplayCache;
use crate::route_label::RouteLabels;
use crate::scope::KeyScope;
use crate::store::{DynStore, IdempotencyStore, MemoryStore, MemoryStoreBuilder};
use crate::workload::Workload;

/// Idempotency middleware: makes retries of protected requests safe.
///
/// Wrap the `App` (or a scope or resource) in it to give every route below a store and the
/// defaults. Routes tagged with [`#[idempotent]`](crate::idempotent) (or wrapped in
/// [`IdempotentRoute`](crate::IdempotentRoute)) are protected with their own policy; untagged
/// routes are protected only for the methods named with
/// [`protect_methods`](Self::protect_methods) (none by default). The safe methods, `GET`,
/// `HEAD`, `OPTIONS`, `TRACE` and `QUERY`, are never touched.
///
/// A request is processed once even when both this layer and a route layer apply: the
/// outer one takes it, and the route's ttl and storage options still apply at commit.
///
/// Response compression belongs outside it: wrap `Compress` *after* `Idempotency`
/// (`.wrap(Idempotency::memory()).wrap(Compress::default())`; Actix runs the last `wrap`
/// first), so records keep the identity body and every answer is encoded for its own
/// client. The other order would store the first client's `Content-Encoding` and replay it
/// to clients that cannot decode it.
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
    /// Whether the app called [`scope`](Self::scope); if not, a warning says at start that
    /// keys are shared by all callers.
    scope_chosen: bool,
}

impl Idempotency {
    /// Idempotency on any [`IdempotencyStore`].
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let store = MemoryStore::new();
    /// let app = test::init_service(
    ///     App::new()
    ///         .wrap(Idempotency::new(store.clone()).protect_methods([Method::POST]))
    ///         .route("/orders", web::post().to(HttpResponse::Created)),
    /// )
    /// .await;
    /// let order = test::TestRequest::post()
    ///     .uri("/orders")
    ///     .insert_header(("Idempotency-Key", "o-1"));
    /// assert_eq!(test::call_service(&app, order.to_request()).await.status(), 201);
    /// assert_eq!(store.len(), 1); // the completed record, replayed to every retry
    /// # });
    /// ```
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self {
            store: Rc::new(store),
            settings: Settings::default(),
            methods: Vec::new(),
            scope_chosen: false,
        }
    }

    /// Idempotency on Redis through a bb8 pool of bb8-redis connections.
    ///
    /// See [`RedisStore`](crate::RedisStore) for the protocol and
    /// [`RedisStore::pool`](crate::RedisStore::pool) for a pool that skips bb8's `PING` on
    /// checkout.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, RedisStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = RedisStore::pool("redis://127.0.0.1:6379")?; // connects on first use
    /// let app = App::new().wrap(Idempotency::redis(pool));
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    pub fn redis(pool: impl Into<crate::store::RedisPool>) -> Self {
        Self::new(crate::store::RedisStore::new(pool))
    }

    /// Idempotency on PostgreSQL: durable records, and the store of transactional routes
    /// (see `PostgresStore` and
    /// `IdempotentTransaction`).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, PostgresStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PostgresStore::pool("postgres://app@127.0.0.1/app")?; // connects on first use
    /// let app = App::new().wrap(Idempotency::postgres(PostgresStore::new(pool)));
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "postgres")]
    pub fn postgres(store: crate::store::PostgresStore) -> Self {
        Self::new(store)
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
    ///
    /// The store holds at most 64 MiB; when full, it evicts completed records, which
    /// shortens their keys' idempotency window (see [`MemoryStore`]).
    /// [`memory_with`](Self::memory_with) sets another budget.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, post, test};
    /// use idempotency_actix::{Idempotency, REPLAYED_HEADER, idempotent};
    ///
    /// #[idempotent]
    /// #[post("/orders")]
    /// async fn create_order() -> HttpResponse {
    ///     HttpResponse::Created().body("order 7")
    /// }
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let app = App::new().wrap(Idempotency::memory()).service(create_order);
    /// let app = test::init_service(app).await;
    /// let order = || {
    ///     test::TestRequest::post()
    ///         .uri("/orders")
    ///         .insert_header(("Idempotency-Key", "memory-doc"))
    /// };
    /// assert_eq!(test::call_service(&app, order().to_request()).await.status(), 201);
    /// let retry = test::call_service(&app, order().to_request()).await;
    /// assert_eq!(retry.headers().get(REPLAYED_HEADER).unwrap(), "true");
    /// assert_eq!(test::read_body(retry).await, "order 7");
    /// # });
    /// ```
    pub fn memory() -> Self {
        Self::new(MemoryStore::shared())
    }

    /// Idempotency on the process-wide in-memory store with these settings
    /// ([`MemoryStoreBuilder::shared`]): every worker (and every app in the process) that
    /// passes the same settings shares one store.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, MemoryStore};
    ///
    /// let app = App::new().wrap(Idempotency::memory_with(
    ///     MemoryStore::builder().max_bytes(256 * 1024 * 1024),
    /// ));
    /// ```
    pub fn memory_with(settings: MemoryStoreBuilder) -> Self {
        Self::new(settings.shared())
    }

    /// Also protects untagged routes for these methods (the safe methods, `GET`, `HEAD`,
    /// `OPTIONS`, `TRACE` and `QUERY`, are ignored).
    ///
    /// This layer then takes such requests before routing, so it decides for every route
    /// under it: another `Idempotency` further in (on a scope) that would protect one of them
    /// (by its own `protect_methods`, or on a tagged route) answers it 500 and logs why,
    /// rather than being passed over; keep the two layers' methods apart.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use actix_web::http::Method;
    /// use idempotency_actix::Idempotency;
    ///
    /// let app = App::new().wrap(Idempotency::memory().protect_methods([Method::POST, Method::PATCH]));
    /// ```
    #[must_use]
    pub fn protect_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().filter(|m| !is_safe_method(m)).collect();
        self
    }

    /// The request header that carries the key (default `Idempotency-Key`): a
    /// [`HeaderName`], or a string checked to be one.
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name (for a `&str`:
    /// [`InvalidHeaderName`](actix_web::http::header::InvalidHeaderName)).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::Idempotency;
    ///
    /// let idempotency = Idempotency::memory().header("x-request-key")?;
    /// assert!(Idempotency::memory().header("not a header").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn header<N: TryInto<HeaderName>>(mut self, name: N) -> Result<Self, N::Error> {
        self.settings.header = name.try_into()?;
        Ok(self)
    }

    /// The most characters a key may have (default [`MAX_KEY_LENGTH`](crate::MAX_KEY_LENGTH),
    /// 255, as DESIGN's key rules and common APIs have it); a longer key is answered 400
    /// (`invalid-key`) and runs nothing. For clients whose keys are longer (a signed token,
    /// a composite business id). Whatever its length, a key is stored as a 32-byte digest, so
    /// the limit costs no store memory; a key longer than the server's limit on a request's
    /// head (Actix refuses a head over 32 KiB with 431) never reaches the middleware. Count
    /// the key without the sf-string quotes and escapes; document the same limit with
    /// `IdempotencyOpenApi::max_key_length` (feature `utoipa`).
    ///
    /// # Panics
    ///
    /// If `characters` is zero (no key could be taken).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::Idempotency;
    ///
    /// # #[actix_web::main]
    /// # async fn main() {
    /// let idempotency = Idempotency::memory().max_key_length(512);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Created))).await;
    /// let send = |key: String| test::TestRequest::post().insert_header(("Idempotency-Key", key));
    /// let taken = test::call_service(&app, send("k".repeat(512)).to_request()).await;
    /// assert_eq!(taken.status(), 201);
    /// let refused = test::call_service(&app, send("k".repeat(513)).to_request()).await;
    /// assert_eq!(refused.status(), 400);
    /// # }
    /// ```
    #[must_use]
    pub fn max_key_length(mut self, characters: usize) -> Self {
        assert!(
            characters > 0,
            "Idempotency::max_key_length must be at least 1"
        );
        self.settings.max_key_length = characters;
        self
    }

    /// The prefix of every storage key (default `idempotency:`): separates apps, or tests,
    /// that share one Redis. On Redis Cluster it should hold no hash tag (`{…}`): the
    /// records would all hash to that tag's one slot, on one primary.
    ///
    /// # Panics
    ///
    /// On a [`MemoryStore`] whose shard share (its budget over its shards) cannot hold one
    /// in-flight record under a key with this prefix: the store would refuse every new key
    /// (503). The store's builder checks the share against prefixes of up to 64 bytes; a
    /// longer prefix may need a larger budget or fewer shards.
    ///
    /// On a `PostgresStore` (given to `Idempotency::postgres` or [`Idempotency::new`]),
    /// for a prefix over 2 628 bytes (its keys must fit an entry of the table's primary key
    /// index) or with a NUL byte (which PostgreSQL's `text` cannot hold): every keyed
    /// request would fail (503).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, Inspector, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let idempotency = Idempotency::new(store.clone()).key_prefix("shop:");
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// let request = test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    /// test::call_service(&app, request.to_request()).await;
    ///
    /// let inspector = Inspector::new(store);
    /// assert!(inspector.clone().key_prefix("shop:").lookup(b"", "k").await?.is_some());
    /// assert!(inspector.lookup(b"", "k").await?.is_none()); // nothing under `idempotency:`
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.prefix = prefix.into();
        if let Some(memory) = self.store.as_any().downcast_ref::<MemoryStore>() {
            memory.check_key_prefix(&self.settings.prefix);
        }
        #[cfg(feature = "postgres")]
        if let Some(postgres) = self
            .store
            .as_any()
            .downcast_ref::<crate::store::PostgresStore>()
        {
            postgres.check_key_prefix(&self.settings.prefix);
        }
        self
    }

    /// Whose key a request's key is: scope keys by the authenticated principal, so that
    /// callers never share a key space (see [`KeyScope`] for the patterns).
    ///
    /// Without this call there is one key space for all callers, and the first app built
    /// in the process logs a warning saying so; `.scope(KeyScope::global())` keeps one key
    /// space on purpose and silences it.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, KeyScope, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let by_tenant = KeyScope::header("x-tenant-id")?;
    /// let idempotency = Idempotency::new(MemoryStore::new()).scope(by_tenant);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// let request = || test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    /// let scoped = request().insert_header(("x-tenant-id", "acme"));
    /// assert_eq!(test::call_service(&app, scoped.to_request()).await.status(), 200);
    /// // A keyed request whose scope cannot be determined is refused:
    /// assert_eq!(test::call_service(&app, request().to_request()).await.status(), 400);
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn scope(mut self, scope: KeyScope) -> Self {
        self.settings.scope = scope;
        self.scope_chosen = true;
        self
    }

    /// Which parts of a request are fingerprinted (default: method, path, query, body).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{FingerprintParts, Idempotency, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let parts = FingerprintParts::default().header("api-version")?;
    /// let idempotency = Idempotency::new(MemoryStore::new()).fingerprint(parts);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// let request = |version: &'static str| {
    ///     let request = test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    ///     request.insert_header(("api-version", version)).to_request()
    /// };
    /// assert_eq!(test::call_service(&app, request("1")).await.status(), 200);
    /// // The same key for another API version is another request: 422.
    /// assert_eq!(test::call_service(&app, request("2")).await.status(), 422);
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn fingerprint(mut self, parts: FingerprintParts) -> Self {
        self.settings.fingerprint = parts;
        self
    }

    /// Which response headers are replayed (default: all but cookies, `Date`, hop-by-hop
    /// and framing headers).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, MemoryStore, ReplayedHeaders};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let headers = ReplayedHeaders::only(["location"])?;
    /// let idempotency = Idempotency::new(MemoryStore::new()).replayed_headers(headers);
    /// let handler = || async {
    ///     HttpResponse::Created()
    ///         .insert_header(("location", "/orders/7"))
    ///         .insert_header(("x-trace", "a1"))
    ///         .finish()
    /// };
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(handler))).await;
    /// let request =
    ///     || test::TestRequest::post().insert_header(("Idempotency-Key", "k")).to_request();
    /// test::call_service(&app, request()).await;
    /// let replay = test::call_service(&app, request()).await;
    /// assert_eq!(replay.headers().get("location").unwrap(), "/orders/7");
    /// assert!(replay.headers().get("x-trace").is_none());
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn replayed_headers(mut self, headers: ReplayedHeaders) -> Self {
        self.settings.replayed_headers = headers;
        self
    }

    /// What happens when the store fails (default [`FailMode::Closed`]: 503).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{FailMode, Idempotency};
    ///
    /// assert_eq!(FailMode::default(), FailMode::Closed);
    /// // Availability over safety: while the store fails, handlers run unprotected.
    /// let app = App::new().wrap(Idempotency::memory().on_store_error(FailMode::Open));
    /// ```
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
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::App;
    /// use idempotency_actix::Idempotency;
    ///
    /// let app = App::new().wrap(Idempotency::memory().store_timeout(Duration::from_millis(500)));
    /// ```
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.settings.store_timeout = checked(timeout);
        self
    }

    /// What `Retry-After` advises on 409 and 503 answers (default 1 s), sent in whole
    /// seconds rounded up (1.5 s is sent as 2).
    ///
    /// # Panics
    ///
    /// If the duration is zero or over [`MAX_DURATION`](crate::MAX_DURATION).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{
    ///     Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, LeaseToken, MemoryStore,
    ///     StorageKey,
    /// };
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// // Another request holds the key `k` (as the middleware would have locked it):
    /// let key = StorageKey::new("idempotency:", b"", &IdempotencyKey::parse(b"k")?);
    /// let print = Fingerprint::compute(&Method::POST, "/", "", b"", []);
    /// store.begin(&key, &print, &LeaseToken::generate(), Duration::from_secs(30)).await?;
    ///
    /// let idempotency = Idempotency::new(store).retry_after(Duration::from_millis(1500));
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// let request = test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    /// let conflict = test::call_service(&app, request.to_request()).await;
    /// assert_eq!(conflict.status(), 409);
    /// assert_eq!(conflict.headers().get("retry-after").unwrap(), "2"); // rounded up
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.settings.retry_after = checked(delay);
        self
    }

    /// The defaults of every route below: `policy`'s options, on top of the crate's defaults
    /// (ttl 24 h, lease 30 s, key optional, 1 MiB request and stored bodies, errors not
    /// stored, no waiting). A route's own [`IdempotencyPolicy`] overrides them. Calling this
    /// twice applies both, the later one winning where both set an option.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, IdempotencyPolicy, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let defaults = IdempotencyPolicy::default().ttl(Duration::from_secs(3600)).required();
    /// let idempotency = Idempotency::new(MemoryStore::new()).policy(defaults);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// // Keys are required now: a request without one is refused.
    /// let keyless = test::TestRequest::post().to_request();
    /// assert_eq!(test::call_service(&app, keyless).await.status(), 400);
    /// # });
    /// ```
    #[must_use]
    pub fn policy(mut self, policy: IdempotencyPolicy) -> Self {
        self.settings.defaults = policy.apply_to(&self.settings.defaults);
        self
    }

    /// The most keyed requests one worker processes at once (default
    /// [`DEFAULT_MAX_IN_FLIGHT`](crate::DEFAULT_MAX_IN_FLIGHT), 1024), counting those whose
    /// client went away. Beyond it new keyed requests get a 503 problem with `Retry-After` at
    /// once; requests already running are never cancelled. Keyless requests are not counted,
    /// nor a keyed request whose body is still arriving: it takes its slot once the body is
    /// in, so clients that stall their uploads cannot fill the cap.
    ///
    /// # Panics
    ///
    /// If `requests` is zero (a configuration mistake: nothing could be protected).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{DEFAULT_MAX_IN_FLIGHT, Idempotency};
    ///
    /// assert_eq!(DEFAULT_MAX_IN_FLIGHT, 1024);
    /// // A small instance: at most 64 keyed requests at once per worker.
    /// let app = App::new().wrap(Idempotency::memory().max_in_flight(64));
    /// ```
    #[must_use]
    pub fn max_in_flight(mut self, requests: usize) -> Self {
        assert!(
            requests > 0,
            "Idempotency::max_in_flight must be at least 1"
        );
        self.settings.limits.max_in_flight = requests;
        self
    }

    /// The most keyed requests one worker keeps running after their client went away
    /// (default [`DEFAULT_MAX_DETACHED`](crate::DEFAULT_MAX_DETACHED), 256): their handlers
    /// finish and commit, so the client's retry gets the replay. While that many are
    /// running, new keyed requests get a 503 problem with `Retry-After` at once, so clients
    /// that connect, send and hang up cannot pile up unbounded work. (Over HTTP/2 Actix runs
    /// each stream to its end whatever its client does, so such a request stays in flight,
    /// bounded by [`max_in_flight`](Self::max_in_flight), never detached.)
    ///
    /// A commit that failed and is retried in the background (the response went out
    /// meanwhile) counts here too, until it lands: it holds the stored response, and a store
    /// that takes `begin`s but fails their commits must not pile those up either.
    ///
    /// # Panics
    ///
    /// If `requests` is zero.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{DEFAULT_MAX_DETACHED, Idempotency};
    ///
    /// assert_eq!(DEFAULT_MAX_DETACHED, 256);
    /// let app = App::new().wrap(Idempotency::memory().max_in_flight(256).max_detached(32));
    /// ```
    #[must_use]
    pub fn max_detached(mut self, requests: usize) -> Self {
        assert!(requests > 0, "Idempotency::max_detached must be at least 1");
        self.settings.limits.max_detached = requests;
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
    /// # #[cfg(feature = "redis")]
    /// use idempotency_actix::{Idempotency, RedisStore, ReplayCache};
    ///
    /// # #[cfg(feature = "redis")]
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = RedisStore::pool("redis://127.0.0.1:6379")?; // connects on first use
    /// let cache = ReplayCache::with_max_bytes(32 * 1024 * 1024);
    /// let idempotency = Idempotency::redis(pool).replay_cache(cache.clone());
    /// # Ok(())
    /// # }
    /// # #[cfg(not(feature = "redis"))] fn main() {}
    /// ```
    #[must_use]
    pub fn replay_cache(mut self, cache: ReplayCache) -> Self {
        self.settings.replay_cache = Some(cache);
        self
    }

    /// How many in-flight records this process has lost since it started: requests whose
    /// handler ran while their record vanished from the store (a renewal or the commit
    /// answered "not held", most likely because Redis evicted the record under memory
    /// pressure). Each is also logged as an error; a retry of such a request may run its
    /// handler again, unless the commit found the key still free and wrote the completed
    /// record anew. Counted for the whole process, every app and worker included.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::Idempotency;
    ///
    /// assert_eq!(Idempotency::lost_records(), 0);
    /// ```
    pub fn lost_records() -> u64 {
        crate::lost_record::total()
    }

    /// Drains this process's keyed work before it stops: from now on no handler runs for a
    /// new key, in any app or worker (such a request gives the key back and gets a 503
    /// problem, [`IdempotencyError::ShuttingDown`], with `Retry-After` and
    /// `Connection: close`, so that its retry reaches another instance; failing closed, a
    /// `begin` that fails gets the failed store's 503 with `Connection: close` too), while
    /// replays, 409s and 422s are answered as ever; and this waits until no keyed work is in
    /// progress, or until `timeout`. Returns how much keyed work was still in progress
    /// then: 0 once drained. There is no way back: call it when the process is about to
    /// stop, then stop the server.
    ///
    /// Keyed work is a keyed request from the moment its body has arrived until its response
    /// is committed or its key released, whether or not its client is still there, a
    /// commit retried in the background, and the first attempt of the background abandon
    /// of a `begin` that did not answer (its client left, or it timed out): a stop right
    /// after such a client left would otherwise leave the key locked for a lease. (Not the
    /// abandon's later attempts: they may go on for a whole lease while the store is down,
    /// and what they guard against, a late `begin`, only locks a key for a lease.)
    ///
    /// Why: Actix's graceful stop waits only for requests whose connection is open, then
    /// its worker threads end and drop what they still run. A keyed request whose client
    /// left runs on without a connection (its handler to its end, its response committed
    /// for the retry), so a stop without a drain cuts that handler short (a payment half
    /// made) and leaves its key locked (409) until its lease ends. Refusing to start new
    /// handlers meanwhile is what lets the drain end. Requests without a key, and routes
    /// that are not protected, are served as before.
    ///
    /// Listen for SIGTERM (what Kubernetes, systemd and Docker send) and SIGINT yourself,
    /// with Actix's handling off (`HttpServer::disable_signals`): Actix's own starts its
    /// stop at once. Fail the readiness probe while draining
    /// ([`is_draining`](Self::is_draining)), and give the deployment's grace period room
    /// for the drain and the stop after it. Await it on the Actix runtime.
    ///
    /// [`IdempotencyError::ShuttingDown`]: crate::IdempotencyError::ShuttingDown
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::pin::pin;
    /// use std::time::Duration;
    ///
    /// use actix_web::rt::signal::unix::{SignalKind, signal};
    /// use actix_web::{App, HttpServer, rt};
    /// use futures_util::future::select;
    /// use idempotency_actix::Idempotency;
    ///
    /// #[actix_web::main]
    /// async fn main() -> std::io::Result<()> {
    ///     let server = HttpServer::new(|| App::new().wrap(Idempotency::memory()))
    ///         .disable_signals()
    ///         .bind("127.0.0.1:8080")?
    ///         .run();
    ///     let handle = server.handle();
    ///     let mut terminate = signal(SignalKind::terminate())?;
    ///     let mut interrupt = signal(SignalKind::interrupt())?;
    ///     rt::spawn(async move {
    ///         select(pin!(terminate.recv()), pin!(interrupt.recv())).await;
    ///         let left = Idempotency::drain(Duration::from_secs(20)).await;
    ///         if left > 0 {
    ///             eprintln!("stopping with {left} pieces of keyed work in progress");
    ///         }
    ///         handle.stop(true).await; // then Actix's graceful stop
    ///     });
    ///     server.await
    /// }
    /// ```
    pub async fn drain(timeout: Duration) -> usize {
        crate::work_in_progress::drain(timeout).await
    }

    /// Whether [`drain`](Self::drain) has been called in this process: for a readiness
    /// probe to fail, so that the load balancer sends new requests elsewhere.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{HttpResponse, get};
    /// use idempotency_actix::Idempotency;
    ///
    /// #[get("/ready")]
    /// async fn ready() -> HttpResponse {
    ///     if Idempotency::is_draining() {
    ///         HttpResponse::ServiceUnavailable().finish()
    ///     } else {
    ///         HttpResponse::Ok().finish()
    ///     }
    /// }
    /// ```
    pub fn is_draining() -> bool {
        crate::work_in_progress::draining()
    }
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("header", &self.settings.header)
            .field("prefix", &self.settings.prefix)
            .field("methods", &self.methods)
            .field("scope", &self.settings.scope)
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
        if !self.scope_chosen {
            warn_once_keys_are_shared();
        }
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            engine: Rc::new(Engine {
                store: Rc::clone(&self.store),
                settings: self.settings.clone(),
                workload: Workload::new(self.settings.limits),
                store_failures: LogInterval::new(),
            }),
            methods: Rc::from(self.methods.as_slice()),
            route_labels: Rc::default(),
        }))
    }
}

/// Logs, once per process (not per worker or app), that an app never chose a key scope.
fn warn_once_keys_are_shared() {
    static WARNED: Once = Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "idempotency: no key scope chosen, so idempotency keys are shared by all callers: \
             one caller can replay another's response or block its key. Scope keys by the \
             authenticated principal with `Idempotency::scope(KeyScope::from_fn(..))`, or \
             choose `KeyScope::global()` explicitly to keep one key space"
        );
    });
}

/// The service [`Idempotency`] wraps around the app.
///
/// # Examples
///
/// ```
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use actix_web::dev::{Service, Transform};
/// use actix_web::http::Method;
/// use actix_web::{App, test};
/// use idempotency_actix::{Idempotency, IdempotencyMiddleware, MemoryStore};
///
/// // `wrap` makes one per worker around the app's routes:
/// let app = App::new().wrap(Idempotency::memory());
///
/// // A test can make one around any service (here one that answers 200):
/// let idempotency = Idempotency::new(MemoryStore::new()).protect_methods([Method::POST]);
/// let middleware: IdempotencyMiddleware<_> =
///     idempotency.new_transform(test::ok_service()).await.map_err(|()| "no middleware")?;
/// let request = || test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
/// assert_eq!(middleware.call(request().to_srv_request()).await?.status(), 200);
/// let replay = middleware.call(request().to_srv_request()).await?;
/// assert_eq!(replay.headers().get("idempotent-replayed").unwrap(), "true");
/// # Ok(())
/// # }
/// ```
pub struct IdempotencyMiddleware<S> {
    service: Rc<S>,
    engine: Rc<Engine>,
    methods: Rc<[Method]>,
    route_labels: Rc<RouteLabels>,
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
        let protects = self.methods.contains(req.method());
        let claimed = {
            let mut extensions = req.extensions_mut();
            match extensions.get_mut::<EngineHandle>() {
                // An outer layer's: this one is now the nearest. A claim it made stays its
                // own, taken with its store and settings, so the routes further in must not
                // take it for this layer's.
                Some(handle) => {
                    handle.engine = Rc::clone(&self.engine);
                    handle.claimed_further_out = handle.claimed.is_some();
                    handle.claimed.is_some()
                }
                None => {
                    extensions.insert(EngineHandle::new(&self.engine));
                    false
                }
            }
        };
        if claimed && protects {
            return answer::<S, B>(refuse_claimed_further_out(req));
        }
        if claimed || !protects {
            return pass_through(&*self.service, req);
        }
        let policy = self.engine.settings.defaults.clone();
        process(
            Rc::clone(&self.engine),
            policy,
            req,
            Rc::clone(&self.service),
            &self.route_labels,
        )
    }
}
