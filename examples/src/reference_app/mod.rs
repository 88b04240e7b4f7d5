//! The reference app: the routes, counters and configuration of the reference server
//! (DESIGN §11), shared by `examples/reference_server.rs` and `examples/demo.rs`.
//!
//! | route | protection | what it does |
//! |---|---|---|
//! | `POST /orders` | `#[idempotent]` | JSON `{"item", "qty"}` → 201 `{"id", "item", "qty", "seq"}`, `Location`, `Set-Cookie`; `?delay_ms=N` sleeps |
//! | `POST /payments` | `#[idempotent(ttl = "2s", required)]` | any JSON → 200 `{"payment_id", "seq"}` |
//! | `POST /flaky` | `#[idempotent]` | `?status=N` [200] → N `{"seq", "status"}`; `?panic=1` panics |
//! | `PUT /profile` | `#[idempotent]` | 200 `{"seq"}` |
//! | `POST /large` | `#[idempotent]` | `?bytes=N` → 200 with N bytes of `application/octet-stream` |
//! | `POST /untagged` | none (see `IDEMPOTENCY_METHODS`) | 200 `{"seq"}` |
//! | `GET /stats` | none | the counters: `{"orders", "payments", "flaky", "profile", "large", "untagged"}` |
//!
//! Each route but `/stats` counts the runs of its handler; `seq` is the count after this run.
//! The counters live in one [`Counters`] shared by all workers.

mod config;
mod routes;

use std::net::SocketAddr;

use actix_web::dev::Server;
use actix_web::{App, HttpServer, web};
use idempotency_actix::{
    Idempotency, RedisClusterClient, RedisClusterStore, RedisPool, RedisStore, ReplayCache,
    ReplicatedWrites,
};

pub use self::config::{ConfigError, PROTECTABLE_METHODS, ServerConfig};
pub use self::routes::{Counters, MAX_LARGE_BYTES, NewOrder, Stats};

/// How long each write waits for its replicas with `IDEMPOTENCY_REPLICAS` set.
pub const REPLICA_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The size of the replay cache with `REPLAY_CACHE=on`.
pub const REPLAY_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// The store the reference app runs on.
#[derive(Clone)]
enum Store {
    /// The process-wide in-memory store (`REDIS_URL` unset).
    Memory,
    /// Redis through a bb8 pool (`REDIS_URL` set).
    Redis(RedisPool, Option<ReplicatedWrites>),
    /// Redis Cluster (`REDIS_CLUSTER_URLS` set).
    RedisCluster(Box<RedisClusterClient>, Option<ReplicatedWrites>),
}

impl Store {
    fn describe(&self) -> String {
        let (store, replication) = match self {
            Self::Memory => return "in-memory store".to_owned(),
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
    /// `REDIS_CLUSTER_URLS` are not Redis URLs.
    RedisClusterUrls(String),
    /// `BIND` could not be bound.
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
            Self::RedisClusterUrls(error) => write!(f, "invalid REDIS_CLUSTER_URLS: {error}"),
            Self::Bind { address, error } => write!(f, "cannot listen on BIND={address}: {error}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::RedisUrl(_) | Self::RedisClusterUrls(_) => None,
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
/// await or spawn [`Running::server`]. With Redis (and idempotency on) it checks the
/// connection once and warns on stderr when Redis does not answer; the server starts anyway
/// and answers protected requests with 503 until Redis is up.
///
/// # Errors
///
/// When `REDIS_URL` is not a Redis URL or `BIND` cannot be bound.
pub async fn start(config: &ServerConfig) -> Result<Running, StartError> {
    let replication = config
        .replicas
        .map(|replicas| ReplicatedWrites::new(replicas.get(), REPLICA_WAIT));
    let store = match (&config.redis_url, &config.redis_cluster_urls) {
        (Some(url), _) => {
            let pool =
                RedisStore::pool(url).map_err(|error| StartError::RedisUrl(error.to_string()))?;
            // With IDEMPOTENCY=off the URL is still checked, but Redis is never contacted.
            if config.idempotency {
                warn_if_unreachable(&pool).await;
            }
            Store::Redis(pool, replication)
        }
        (None, Some(seeds)) => {
            let client = RedisClusterStore::client(seeds.iter().map(String::as_str))
                .map_err(|error| StartError::RedisClusterUrls(error.to_string()))?;
            if config.idempotency {
                warn_if_cluster_unreachable(&client).await;
            }
            Store::RedisCluster(Box::new(client), replication)
        }
        (None, None) => Store::Memory,
    };
    let counters = web::Data::new(Counters::default());
    let summary = summary(config, &store);

    // Two server types: with the middleware, and without any (the benchmark baseline).
    macro_rules! serve {
        ($server:expr) => {{
            let mut server = $server;
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
        let counters = counters.clone();
        let methods = config.protect_methods.clone();
        let prefix = config.key_prefix.clone();
        // One cache for the process, shared by every worker.
        let replay_cache = config
            .replay_cache
            .then(|| ReplayCache::with_max_bytes(REPLAY_CACHE_BYTES));
        serve!(HttpServer::new(move || {
            let mut idempotency = store.idempotency();
            if let Some(prefix) = &prefix {
                idempotency = idempotency.key_prefix(prefix.clone());
            }
            if let Some(cache) = &replay_cache {
                idempotency = idempotency.replay_cache(cache.clone());
            }
            App::new()
                .app_data(counters.clone())
                .wrap(idempotency.protect_methods(methods.clone()))
                .configure(routes::protected)
        }))
    } else {
        let counters = counters.clone();
        serve!(HttpServer::new(move || {
            App::new()
                .app_data(counters.clone())
                .configure(routes::unprotected)
        }))
    };
    Ok(Running {
        server,
        addrs,
        counters,
        summary,
    })
}

/// Warns on stderr when Redis does not answer within 2 s (the pool's connection timeout).
async fn warn_if_unreachable(pool: &RedisPool) {
    if let Err(error) = pool.get().await {
        eprintln!(
            "warning: Redis at REDIS_URL does not answer ({error}); protected requests get 503 until it does"
        );
    }
}

/// Warns on stderr when the cluster does not answer within 2 s.
async fn warn_if_cluster_unreachable(client: &RedisClusterClient) {
    let connected = actix_web::rt::time::timeout(
        std::time::Duration::from_secs(2),
        client.get_async_connection(),
    )
    .await;
    match connected {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => eprintln!(
            "warning: Redis Cluster at REDIS_CLUSTER_URLS does not answer ({error}); protected requests get 503 until it does"
        ),
        Err(_) => eprintln!(
            "warning: Redis Cluster at REDIS_CLUSTER_URLS does not answer within 2 s; protected requests get 503 until it does"
        ),
    }
}

fn summary(config: &ServerConfig, store: &Store) -> String {
    if !config.idempotency {
        return "idempotency off (no middleware)".to_owned();
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
