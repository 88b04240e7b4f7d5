//! The reference app: the routes, counters and configuration of the reference server
//! (DESIGN §11), shared by `examples/reference_server.rs` and `examples/demo.rs`.
//!
//! | route | protection | what it does |
//! |---|---|---|
//! | `POST /orders` | `#[idempotent]` | JSON `{"item", "qty"}` → 201 `{"id", "item", "qty", "seq"}`, `Location`, `Set-Cookie`; `?delay_ms=N` sleeps |
//! | `POST /payments` | `#[idempotent(ttl = "2s", required)]` | any JSON → 200 `{"payment_id", "seq"}` |
//! | `POST /flaky` | `#[idempotent]` | `?status=N` \[200\] → N `{"seq", "status"}`; `?panic=1` panics |
//! | `PUT /profile` | `#[idempotent]` | 200 `{"seq"}` |
//! | `POST /large` | `#[idempotent]` | `?bytes=N` → 200 with N bytes of `application/octet-stream` |
//! | `POST /untagged` | none (see `IDEMPOTENCY_METHODS`) | 200 `{"seq"}` |
//! | `GET /stats` | none | the counters: `{"orders", "payments", "flaky", "profile", "large", "untagged"}` |
//! | `GET /metrics` | none | the middleware's metrics, Prometheus text format |
//! | `GET /openapi.json` | none | the OpenAPI 3.1 document of every route here |
//! | `POST /ledger` | `#[idempotent(transactional)]`, with `DATABASE_URL` only | JSON `{"amount"}` → one row in table `ledger` through the request's transaction, 201 `{"entry_id", "amount", "seq"}`; `X-Crash: before_commit` / `after_commit` aborts the process |
//! | `GET /ledger` | none, with `DATABASE_URL` only | `{"rows"}`: the committed rows of `ledger` |
//!
//! `/orders`, `/payments`, `/flaky`, `/profile`, `/large`, `/untagged` and `POST /ledger` count
//! the runs of their handlers (`GET` routes count nothing); `seq` is the count after this run.
//! The counters live in one [`Counters`] (`POST /ledger`'s in [`LedgerRuns`]) shared by all
//! workers. Idempotency keys are scoped by the caller named in [`PRINCIPAL_HEADER`] (`X-User`).

mod config;
mod ledger;
mod metrics;
mod openapi;
mod routes;

use std::net::SocketAddr;

use actix_web::dev::{Server, ServiceRequest};
use actix_web::http::header::HeaderName;
use actix_web::{App, HttpResponse, HttpServer, web};
use idempotency_actix::{
    Idempotency, KeyScope, PostgresStore, RedisClusterClient, RedisClusterStore, RedisPool,
    RedisStore, ReplayCache, ReplicatedWrites,
};

pub use self::config::{
    ConfigError, MAX_WORKERS, PROTECTABLE_METHODS, ServerConfig, URL_VARIABLES,
};
pub use self::ledger::{
    CRASH_HEADER, LEDGER_SCHEMA, LedgerEntry, LedgerRows, LedgerRuns, NewEntry,
};
pub use self::routes::{
    Counters, FlakyAnswer, MAX_DELAY_MS, MAX_LARGE_BYTES, NewOrder, Order, Payment, Seq, Stats,
};

/// The reference server's routes without any idempotency, as its `IDEMPOTENCY=off` app
/// registers them; they need a [`Counters`] in the app's data. For apps that wrap a layer of
/// their own around the same handlers: the load benchmark's comparator
/// (`examples/unguarded_layer.rs`).
///
/// ```
/// use actix_web::{App, web};
/// use idempotency_actix_examples::reference_app::{self, Counters};
///
/// let app = App::new()
///     .app_data(web::Data::new(Counters::default()))
///     .configure(reference_app::unprotected_routes);
/// # drop(app);
/// ```
pub fn unprotected_routes(config: &mut web::ServiceConfig) {
    routes::unprotected(config);
}

/// How long each write waits for its replicas with `IDEMPOTENCY_REPLICAS` set.
pub const REPLICA_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// How long a graceful stop waits for the requests in progress before it drops them (and a
/// drain for the keyed work before the stop): the
/// longest handler the server has (`POST /orders?delay_ms=60000`) plus 30 s for the store
/// and the response.
pub const SHUTDOWN_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(MAX_DELAY_MS / 1000 + 30);

/// The size of the replay cache with `REPLAY_CACHE=on`.
pub const REPLAY_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// The header that names the caller. The reference server has no authentication of its own:
/// it trusts this header as a gateway that authenticated the caller would set, and scopes
/// idempotency keys by it, so two users never share a key. Requests without it belong to the
/// principal `anonymous`; a repeated one cannot be attributed and a keyed request with it is
/// refused (400).
pub const PRINCIPAL_HEADER: &str = "x-user";

/// [`PRINCIPAL_HEADER`] as a header name, built once: a lookup by `&str` parses the name
/// on every request.
const PRINCIPAL: HeaderName = HeaderName::from_static(PRINCIPAL_HEADER);

/// The principal a request's idempotency keys belong to (see [`PRINCIPAL_HEADER`]).
fn principal(req: &ServiceRequest) -> Option<String> {
    let mut values = req.headers().get_all(&PRINCIPAL);
    match (values.next(), values.next()) {
        (None, _) => Some("anonymous".to_owned()),
        (Some(user), None) => Some(match user.to_str() {
            Ok(user) => format!("user:{user}"),
            // Not visible ASCII (a name in UTF-8, say): its bytes in hex, in a space of their
            // own, so no two names share a scope (a lossy decoding would merge some).
            Err(_) => {
                user.as_bytes()
                    .iter()
                    .fold(String::from("user-bytes:"), |mut scope, byte| {
                        scope.push_str(&format!("{byte:02x}"));
                        scope
                    })
            }
        }),
        (Some(_), Some(_)) => None,
    }
}

/// A plain-text answer of a handler here (a 400 for a query out of range, a database
/// error), `text/plain; charset=utf-8` as the spec documents it and as Actix's extractors
/// answer theirs: a body without a `Content-Type` leaves clients to guess.
fn plain_text(status: actix_web::http::StatusCode, message: impl Into<String>) -> HttpResponse {
    HttpResponse::build(status)
        .content_type(actix_web::http::header::ContentType::plaintext())
        .body(message.into())
}

/// The store the reference app runs on.
#[derive(Clone)]
enum Store {
    /// The process-wide in-memory store (`REDIS_URL` unset).
    Memory,
    /// Redis through a bb8 pool (`REDIS_URL` set).
    Redis(RedisPool, Option<ReplicatedWrites>),
    /// Redis Cluster (`REDIS_CLUSTER_URLS` set).
    RedisCluster(Box<RedisClusterClient>, Option<ReplicatedWrites>),
    /// PostgreSQL (`DATABASE_URL` set).
    Postgres(PostgresStore),
}

impl Store {
    fn describe(&self) -> String {
        let (store, replication) = match self {
            Self::Memory => return "in-memory store".to_owned(),
            Self::Postgres(_) => return "PostgreSQL store".to_owned(),
            Self::Redis(_, replication) => ("Redis store", replication),
            Self::RedisCluster(_, replication) => ("Redis Cluster store", replication),
        };
        match replication {
            Some(writes) => format!(
                "{store} with writes replicated to {} replicas",
                writes.replicas()
            ),
            None => store.to_owned(),
        }
    }

    /// The middleware on this store (called once per worker).
    fn idempotency(&self) -> Idempotency {
        match self {
            Self::Memory => Idempotency::memory(),
            Self::Postgres(store) => Idempotency::postgres(store.clone()),
            Self::Redis(pool, replication) => {
                let store = RedisStore::new(pool.clone());
                Idempotency::new(match replication {
                    Some(writes) => store.replicated_writes(*writes),
                    None => store,
                })
            }
            Self::RedisCluster(client, replication) => {
                let store = RedisClusterStore::new((**client).clone());
                Idempotency::new(match replication {
                    Some(writes) => store.replicated_writes(*writes),
                    None => store,
                })
            }
        }
    }
}

/// Why the reference server could not start.
#[derive(Debug)]
pub enum StartError {
    /// `REDIS_URL` is not a Redis URL.
    RedisUrl(String),
    /// `DATABASE_URL` is not a PostgreSQL URL, or the schema could not be migrated.
    Database(String),
    /// `REDIS_CLUSTER_URLS` are not Redis URLs.
    RedisClusterUrls(String),
    /// `BIND` could not be bound (in use, or a host name that does not resolve).
    Bind {
        /// The address asked for.
        address: String,
        /// Why binding failed.
        error: std::io::Error,
    },
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RedisUrl(error) => write!(f, "invalid REDIS_URL: {error}"),
            Self::Database(error) => write!(f, "DATABASE_URL: {error}"),
            Self::RedisClusterUrls(error) => write!(f, "invalid REDIS_CLUSTER_URLS: {error}"),
            Self::Bind { address, error } => write!(f, "cannot listen on BIND={address}: {error}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::RedisUrl(_) | Self::Database(_) | Self::RedisClusterUrls(_) => None,
            Self::Bind { error, .. } => Some(error),
        }
    }
}

/// A reference server that is bound and serving.
pub struct Running {
    /// The server: await it to run until it stops, or stop it through its handle.
    pub server: Server,
    /// The addresses it listens on (the real port when `BIND` asked for port 0).
    pub addrs: Vec<SocketAddr>,
    /// The counters its handlers increment (the same numbers `GET /stats` reports).
    pub counters: web::Data<Counters>,
    /// A one-line description of the set-up, for logs: store, protection, prefix, workers.
    pub summary: String,
}

/// Binds and starts the reference server for `config`.
///
/// Call it inside an Actix system (`#[actix_web::main]`, `actix_web::rt::System`), then
/// await or spawn [`Running::server`]. The server handles no signals itself (Actix's own
/// handling would drop the requests in progress on SIGINT): its owner stops it through
/// [`Server::handle`] after draining the keyed work (`Idempotency::drain`, which a stop
/// does not wait for when a client left), and a graceful stop lets requests in progress
/// finish, and commit, for up to [`SHUTDOWN_TIMEOUT`]. With Redis (and idempotency on) it checks the
/// connection once and warns on stderr when Redis does not answer; the server starts anyway
/// and answers protected requests with 503 until Redis is up. With PostgreSQL it migrates
/// the store's table and creates table `ledger` (both if missing), and deletes expired
/// records every minute.
///
/// # Errors
///
/// When `REDIS_URL` is not a Redis URL, `DATABASE_URL` is not a PostgreSQL URL or its
/// database cannot be migrated, or `BIND` cannot be bound.
pub async fn start(config: &ServerConfig) -> Result<Running, StartError> {
    let replication = config
        .replicas
        .map(|replicas| ReplicatedWrites::new(replicas.get(), REPLICA_WAIT));
    let store = match (
        &config.database_url,
        &config.redis_url,
        &config.redis_cluster_urls,
    ) {
        (Some(url), _, _) => {
            let database = |error: &dyn std::fmt::Display| StartError::Database(error.to_string());
            let pool = PostgresStore::pool(url).map_err(|error| database(&error))?;
            let store = PostgresStore::new(pool);
            if config.idempotency {
                store.migrate().await.map_err(|error| database(&error))?;
                actix_web::rt::spawn(store.clone().expire_periodically(EXPIRY_PERIOD));
            }
            ledger::create_ledger(store.connection_pool())
                .await
                .map_err(|error| database(&error))?;
            Store::Postgres(store)
        }
        (None, Some(url), _) => {
            let pool =
                RedisStore::pool(url).map_err(|error| StartError::RedisUrl(error.to_string()))?;
            // With IDEMPOTENCY=off the URL is still checked, but Redis is never contacted.
            if config.idempotency {
                warn_if_unreachable(&pool).await;
            }
            Store::Redis(pool, replication)
        }
        (None, None, Some(seeds)) => {
            let client = RedisClusterStore::client(seeds.iter().map(String::as_str))
                .map_err(|error| StartError::RedisClusterUrls(error.to_string()))?;
            if config.idempotency {
                warn_if_cluster_unreachable(&client).await;
            }
            Store::RedisCluster(Box::new(client), replication)
        }
        (None, None, None) => Store::Memory,
    };
    let counters = web::Data::new(Counters::default());
    let ledger_runs = web::Data::new(LedgerRuns::default());
    let database = match &store {
        Store::Postgres(store) => Some(web::Data::new(store.connection_pool().clone())),
        _ => None,
    };
    let summary = summary(config, &store);
    let spec = openapi::document(config);
    metrics::handle();

    // Two server types: with the middleware, and without any (the benchmark baseline).
    macro_rules! serve {
        ($server:expr) => {{
            let mut server = $server
                .disable_signals()
                .shutdown_timeout(SHUTDOWN_TIMEOUT.as_secs());
            if let Some(workers) = config.workers {
                server = server.workers(workers.get());
            }
            let server = server
                .bind(&config.bind)
                .map_err(|error| StartError::Bind {
                    address: config.bind.clone(),
                    error,
                })?;
            let addrs = server.addrs();
            (server.run(), addrs)
        }};
    }

    let (server, addrs) = if config.idempotency {
        let (counters, ledger_runs, database, spec) = (
            counters.clone(),
            ledger_runs.clone(),
            database.clone(),
            spec.clone(),
        );
        let methods = config.protect_methods.clone();
        let prefix = config.key_prefix.clone();
        // One cache for the process, shared by every worker.
        let replay_cache = config
            .replay_cache
            .then(|| ReplayCache::with_max_bytes(REPLAY_CACHE_BYTES));
        serve!(HttpServer::new(move || {
            let mut idempotency = store.idempotency();
            idempotency = idempotency.scope(KeyScope::from_fn(principal));
            if let Some(prefix) = &prefix {
                idempotency = idempotency.key_prefix(prefix.clone());
            }
            if let Some(cache) = &replay_cache {
                idempotency = idempotency.replay_cache(cache.clone());
            }
            let mut app = App::new()
                .app_data(counters.clone())
                .app_data(ledger_runs.clone())
                .app_data(spec.clone())
                .wrap(idempotency.protect_methods(methods.clone()))
                .configure(routes::protected);
            if let Some(pool) = &database {
                app = app.app_data(pool.clone()).configure(ledger::protected);
            }
            app
        }))
    } else {
        let (counters, ledger_runs, database) =
            (counters.clone(), ledger_runs.clone(), database.clone());
        let spec = spec.clone();
        serve!(HttpServer::new(move || {
            let mut app = App::new()
                .app_data(counters.clone())
                .app_data(ledger_runs.clone())
                .app_data(spec.clone())
                .configure(routes::unprotected);
            if let Some(pool) = &database {
                app = app.app_data(pool.clone()).configure(ledger::unprotected);
            }
            app
        }))
    };
    Ok(Running {
        server,
        addrs,
        counters,
        summary,
    })
}

/// How often the PostgreSQL store's expired records are deleted.
const EXPIRY_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// Warns on stderr when Redis does not answer within 2 s, with why (a refused connection,
/// a wrong password): the pool's own `get` would only say that it timed out.
async fn warn_if_unreachable(pool: &RedisPool) {
    warn_unless_connected("Redis at REDIS_URL", pool.dedicated_connection()).await;
}

/// Warns on stderr when the cluster does not answer within 2 s.
async fn warn_if_cluster_unreachable(client: &RedisClusterClient) {
    warn_unless_connected(
        "Redis Cluster at REDIS_CLUSTER_URLS",
        client.get_async_connection(),
    )
    .await;
}

/// Warns on stderr, naming `what`, when `connecting` fails or takes over 2 s.
async fn warn_unless_connected<T, E: std::fmt::Display>(
    what: &str,
    connecting: impl std::future::Future<Output = Result<T, E>>,
) {
    let why =
        match actix_web::rt::time::timeout(std::time::Duration::from_secs(2), connecting).await {
            Ok(Ok(_)) => return,
            Ok(Err(error)) => error.to_string(),
            Err(_) => "no answer within 2 s".to_owned(),
        };
    eprintln!("warning: {what} does not answer ({why}); protected requests get 503 until it does");
}

fn summary(config: &ServerConfig, store: &Store) -> String {
    if !config.idempotency {
        // Accepted, so that `IDEMPOTENCY=off` alone switches the middleware off, but said.
        let ignored: Vec<&str> = [
            ("REPLAY_CACHE", config.replay_cache),
            ("IDEMPOTENCY_METHODS", !config.protect_methods.is_empty()),
            ("IDEMPOTENCY_REPLICAS", config.replicas.is_some()),
            ("IDEMPOTENCY_PREFIX", config.key_prefix.is_some()),
        ]
        .into_iter()
        .filter_map(|(variable, set)| set.then_some(variable))
        .collect();
        return if ignored.is_empty() {
            "idempotency off (no middleware)".to_owned()
        } else {
            format!(
                "idempotency off (no middleware); ignored: {}",
                ignored.join(", ")
            )
        };
    }
    let methods = if config.protect_methods.is_empty() {
        "tagged routes only".to_owned()
    } else {
        let names: Vec<&str> = config.protect_methods.iter().map(|m| m.as_str()).collect();
        format!("tagged routes and untagged {}", names.join(", "))
    };
    let prefix = config.key_prefix.as_deref().unwrap_or("idempotency:");
    let workers = config
        .workers
        .map_or_else(|| "default".to_owned(), |n| n.to_string());
    let cache = if config.replay_cache {
        ", replay cache on"
    } else {
        ""
    };
    format!(
        "{}, protecting {methods}, key prefix {prefix:?}, workers {workers}{cache}",
        store.describe()
    )
}
