//! [`ServerConfig`]: the reference server's environment variables, checked before it starts.

use std::ffi::OsString;
use std::num::{NonZeroU32, NonZeroUsize};

use actix_web::http::Method;
use idempotency_actix::PostgresStore;
use tracing_subscriber::filter::LevelFilter;

/// The methods `IDEMPOTENCY_METHODS` may name: the unsafe ones (safe methods are never
/// protected, and an unknown name is more likely a typo than an extension method).
pub const PROTECTABLE_METHODS: [Method; 4] =
    [Method::POST, Method::PUT, Method::PATCH, Method::DELETE];

/// The most workers Actix runs: `HttpServer::workers` panics on more, so `WORKERS` above it
/// is refused like any other invalid value.
pub const MAX_WORKERS: usize = 512;

/// How the reference server runs, read from its environment.
///
/// | variable | meaning | default |
/// |---|---|---|
/// | `BIND` | address to listen on: IP address or host name, and port; port 0 picks a free port | `127.0.0.1:8080` |
/// | `REDIS_URL` | Redis store through a bb8 pool | unset: in-memory store |
/// | `DATABASE_URL` | PostgreSQL store (schema migrated at start) and the `/ledger` routes | unset |
/// | `REDIS_CLUSTER_URLS` | comma-separated seed node URLs: Redis Cluster store (not with `REDIS_URL`) | unset |
/// | `IDEMPOTENCY_REPLICAS` | N, in digits: replicated writes, each write waits for N replicas (strict, 500 ms); needs a Redis store | unset: off |
/// | `IDEMPOTENCY` | `on`, or `off` for no middleware at all (the benchmark baseline; the middleware's other variables are then ignored, though a malformed value is still refused) | `on` |
/// | `IDEMPOTENCY_METHODS` | comma-separated methods whose untagged routes are protected too, e.g. `POST,PATCH`, with no empty entry (`,`, `POST,`); not `POST` with `DATABASE_URL` (it would claim the transactional `POST /ledger` outside its transaction) | none |
/// | `IDEMPOTENCY_PREFIX` | prefix of every storage key, to keep apps or test runs apart on one Redis | the crate's (`idempotency:`) |
/// | `WORKERS` | number of Actix workers, 1 to 512 ([`MAX_WORKERS`]), in digits (not `+2`) | Actix's default (one per core) |
/// | `LOG_LEVEL` | the least severe level of the log on stderr: `off`, `error`, `warn`, `info`, `debug` or `trace` | `warn` |
/// | `REPLAY_CACHE` | `on`: answer replays from an in-process [`ReplayCache`](idempotency_actix::ReplayCache) of 64 MiB; needs a store variable (the in-memory store needs no cache) | `off` |
///
/// An empty variable counts as unset. At most one store variable may be set: `REDIS_URL`,
/// `REDIS_CLUSTER_URLS` or `DATABASE_URL`.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// `BIND`.
    pub bind: String,
    /// `REDIS_URL`.
    pub redis_url: Option<String>,
    /// `DATABASE_URL`.
    pub database_url: Option<String>,
    /// `REDIS_CLUSTER_URLS`, split at commas.
    pub redis_cluster_urls: Option<Vec<String>>,
    /// `IDEMPOTENCY_REPLICAS`.
    pub replicas: Option<NonZeroU32>,
    /// `IDEMPOTENCY`: whether the middleware is installed at all.
    pub idempotency: bool,
    /// `IDEMPOTENCY_METHODS`.
    pub protect_methods: Vec<Method>,
    /// `IDEMPOTENCY_PREFIX`.
    pub key_prefix: Option<String>,
    /// `WORKERS`.
    pub workers: Option<NonZeroUsize>,
    /// `REPLAY_CACHE`: whether completed records are cached in process.
    pub replay_cache: bool,
    /// `LOG_LEVEL`: the least severe level the reference server logs on stderr.
    pub log_level: LevelFilter,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:8080".to_owned(),
            redis_url: None,
            database_url: None,
            redis_cluster_urls: None,
            replicas: None,
            idempotency: true,
            protect_methods: Vec::new(),
            key_prefix: None,
            workers: None,
            replay_cache: false,
            log_level: LevelFilter::WARN,
        }
    }
}

/// Every field, but a store URL only as whether it is set: a URL may hold a password, and
/// what is formatted with `{:?}` ends up in logs.
impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |url: bool| if url { "(set, not shown)" } else { "(unset)" };
        f.debug_struct("ServerConfig")
            .field("bind", &self.bind)
            .field("redis_url", &set(self.redis_url.is_some()))
            .field("database_url", &set(self.database_url.is_some()))
            .field(
                "redis_cluster_urls",
                &set(self.redis_cluster_urls.is_some()),
            )
            .field("replicas", &self.replicas)
            .field("idempotency", &self.idempotency)
            .field("protect_methods", &self.protect_methods)
            .field("key_prefix", &self.key_prefix)
            .field("workers", &self.workers)
            .field("replay_cache", &self.replay_cache)
            .field("log_level", &self.log_level)
            .finish()
    }
}

/// An environment variable with a value the reference server does not accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The variable.
    pub variable: &'static str,
    /// Its value, lossily decoded; empty for the variables whose values are URLs
    /// ([`URL_VARIABLES`]), as a URL may hold a password and errors end up in logs.
    pub value: String,
    /// What it should be.
    pub expected: String,
}

/// The variables whose values are URLs, which may hold a password: an error never shows
/// their values.
pub const URL_VARIABLES: [&str; 3] = ["REDIS_URL", "REDIS_CLUSTER_URLS", "DATABASE_URL"];

impl ConfigError {
    fn new(variable: &'static str, value: &str, expected: String) -> Self {
        let value = if URL_VARIABLES.contains(&variable) {
            String::new()
        } else {
            value.to_owned()
        };
        Self {
            variable,
            value,
            expected,
        }
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if URL_VARIABLES.contains(&self.variable) {
            return write!(
                f,
                "invalid {} (its value is not shown, as it may hold a password): expected {}",
                self.variable, self.expected
            );
        }
        write!(
            f,
            "invalid {}={:?}: expected {}",
            self.variable, self.value, self.expected
        )
    }
}

impl std::error::Error for ConfigError {}

impl ServerConfig {
    /// Reads the configuration from the process environment.
    ///
    /// # Errors
    ///
    /// When a variable is set to a value that is not accepted (see the table above).
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var_os(name))
    }

    /// Reads the configuration from `lookup` (a variable name to its value, if set).
    ///
    /// # Errors
    ///
    /// When a variable is set to a value that is not accepted (see the table above).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Self, ConfigError> {
        let var = |variable: &'static str, expected: &str| -> Result<Option<String>, ConfigError> {
            match lookup(variable) {
                None => Ok(None),
                Some(value) => match value.into_string() {
                    Ok(value) if value.trim().is_empty() => Ok(None),
                    Ok(value) => Ok(Some(value.trim().to_owned())),
                    Err(value) => Err(ConfigError::new(
                        variable,
                        &value.to_string_lossy(),
                        format!("{expected} (in UTF-8)"),
                    )),
                },
            }
        };
        let invalid = |variable: &'static str, value: &str, expected: &str| {
            ConfigError::new(variable, value, expected.to_owned())
        };
        let mut config = Self::default();

        const BIND: &str = "an address and port such as 127.0.0.1:8080, [::1]:8080 or \
                            localhost:8080 (port 0 picks a free one)";
        if let Some(bind) = var("BIND", BIND)? {
            if !is_bind_address(&bind) {
                return Err(invalid("BIND", &bind, BIND));
            }
            config.bind = bind;
        }
        config.redis_url = var("REDIS_URL", "a Redis URL such as redis://127.0.0.1:6379")?;
        config.database_url = var(
            "DATABASE_URL",
            "a PostgreSQL URL such as postgres://postgres@127.0.0.1/postgres",
        )?;
        // Each names a store; two of them leave the choice unclear.
        let stores = [
            ("REDIS_URL", config.redis_url.clone()),
            (
                "REDIS_CLUSTER_URLS",
                var("REDIS_CLUSTER_URLS", "seed node URLs")?,
            ),
            ("DATABASE_URL", config.database_url.clone()),
        ];
        let set: Vec<_> = stores.iter().filter(|(_, value)| value.is_some()).collect();
        if let [_, (second, Some(value)), ..] = set.as_slice() {
            let names: Vec<&str> = set.iter().map(|(name, _)| *name).collect();
            return Err(invalid(
                second,
                value,
                &format!(
                    "at most one store variable, but {} are set",
                    names.join(" and ")
                ),
            ));
        }
        const SEEDS: &str = "comma-separated Redis URLs of cluster nodes";
        if let Some(value) = var("REDIS_CLUSTER_URLS", SEEDS)? {
            if config.redis_url.is_some() {
                return Err(invalid(
                    "REDIS_CLUSTER_URLS",
                    &value,
                    "unset when REDIS_URL is set (one store at a time)",
                ));
            }
            let seeds: Vec<String> = value
                .split(',')
                .map(str::trim)
                .filter(|seed| !seed.is_empty())
                .map(str::to_owned)
                .collect();
            if seeds.is_empty() {
                return Err(invalid("REDIS_CLUSTER_URLS", &value, SEEDS));
            }
            config.redis_cluster_urls = Some(seeds);
        }
        const SWITCH: &str = "on or off";
        let switch = |variable: &'static str, default: bool| -> Result<bool, ConfigError> {
            match var(variable, SWITCH)? {
                None => Ok(default),
                Some(value) => match value.to_ascii_lowercase().as_str() {
                    "on" => Ok(true),
                    "off" => Ok(false),
                    _ => Err(invalid(variable, &value, SWITCH)),
                },
            }
        };
        config.idempotency = switch("IDEMPOTENCY", true)?;
        // With the middleware off, its variables are read (a malformed value is still an
        // error) but nothing is asked of the store they would need: they are ignored.
        const REPLICAS: &str =
            "a positive number of replicas, with REDIS_URL or REDIS_CLUSTER_URLS";
        if let Some(value) = var("IDEMPOTENCY_REPLICAS", REPLICAS)? {
            let replicas = parse_count(&value)
                .ok_or_else(|| invalid("IDEMPOTENCY_REPLICAS", &value, REPLICAS))?;
            let redis = config.redis_url.is_some() || config.redis_cluster_urls.is_some();
            if config.idempotency && !redis {
                return Err(invalid("IDEMPOTENCY_REPLICAS", &value, REPLICAS));
            }
            config.replicas = Some(replicas);
        }

        config.replay_cache = switch("REPLAY_CACHE", false)?;
        let memory_store = config.redis_url.is_none()
            && config.redis_cluster_urls.is_none()
            && config.database_url.is_none();
        if config.idempotency && config.replay_cache && memory_store {
            // The cache only keeps what a store's replay reports a remaining ttl for; the
            // in-memory store answers from the process already and reports none.
            return Err(invalid(
                "REPLAY_CACHE",
                "on",
                "off with the in-memory store, which answers replays from this process and \
                 needs no replay cache (set REDIS_URL, REDIS_CLUSTER_URLS or DATABASE_URL to \
                 use one)",
            ));
        }

        let methods_expected = format!(
            "a comma-separated list of {}",
            PROTECTABLE_METHODS.map(|m| m.to_string()).join(", ")
        );
        if let Some(value) = var("IDEMPOTENCY_METHODS", &methods_expected)? {
            for name in value.split(',').map(str::trim) {
                // `,` or `POST,,PUT` is a typo, and one that can turn protection off: refused
                // rather than read as fewer methods.
                if name.is_empty() {
                    return Err(invalid(
                        "IDEMPOTENCY_METHODS",
                        &value,
                        &format!(
                            "{methods_expected}, with no empty entries (leave it unset to \
                             protect no untagged route)"
                        ),
                    ));
                }
                let method = PROTECTABLE_METHODS
                    .iter()
                    .find(|method| method.as_str().eq_ignore_ascii_case(name))
                    .ok_or_else(|| invalid("IDEMPOTENCY_METHODS", &value, &methods_expected))?;
                if !config.protect_methods.contains(method) {
                    config.protect_methods.push(method.clone());
                }
            }
            // `POST /ledger` is transactional: its record is claimed inside its transaction.
            // The app-level layer would claim every POST before routing, outside any
            // transaction, and the route would answer each one with 500.
            let conflicts = config.idempotency
                && config.database_url.is_some()
                && config.protect_methods.contains(&Method::POST);
            if conflicts {
                return Err(invalid(
                    "IDEMPOTENCY_METHODS",
                    &value,
                    "no POST when DATABASE_URL is set: protecting untagged POST routes would \
                     claim the transactional POST /ledger outside its transaction, and every \
                     POST /ledger would answer 500; leave POST out (tagged routes stay \
                     protected) or unset DATABASE_URL",
                ));
            }
        }

        config.key_prefix = var("IDEMPOTENCY_PREFIX", "a key prefix")?;
        // Checked here, not only by the store once the workers build their apps: the server
        // would have said it listens, and then stopped (status 1).
        if let Some(prefix) = &config.key_prefix
            && config.database_url.is_some()
            && prefix.len() > PostgresStore::MAX_KEY_PREFIX_BYTES
        {
            return Err(invalid(
                "IDEMPOTENCY_PREFIX",
                &format!("{}…", prefix.chars().take(32).collect::<String>()),
                &format!(
                    "at most {} bytes with DATABASE_URL (the table's index holds no longer \
                     keys); this one is {} bytes",
                    PostgresStore::MAX_KEY_PREFIX_BYTES,
                    prefix.len()
                ),
            ));
        }

        const LEVEL: &str = "one of off, error, warn, info, debug, trace";
        if let Some(value) = var("LOG_LEVEL", LEVEL)? {
            config.log_level = [
                LevelFilter::OFF,
                LevelFilter::ERROR,
                LevelFilter::WARN,
                LevelFilter::INFO,
                LevelFilter::DEBUG,
                LevelFilter::TRACE,
            ]
            .into_iter()
            // By name only: `LevelFilter`'s own parser also takes digits and an empty string.
            .find(|level| level.to_string().eq_ignore_ascii_case(&value))
            .ok_or_else(|| invalid("LOG_LEVEL", &value, LEVEL))?;
        }

        const COUNT: &str = "a number of workers from 1 to 512";
        if let Some(value) = var("WORKERS", COUNT)? {
            let workers: NonZeroUsize =
                parse_count(&value).ok_or_else(|| invalid("WORKERS", &value, COUNT))?;
            // Actix panics at start on more (`HttpServer::workers`).
            if workers.get() > MAX_WORKERS {
                return Err(invalid("WORKERS", &value, COUNT));
            }
            config.workers = Some(workers);
        }
        Ok(config)
    }
}

/// A count written in decimal digits alone: `str::parse` also takes a leading `+`, which
/// is more likely a mistake than a way to write a number here.
fn parse_count<T: std::str::FromStr>(value: &str) -> Option<T> {
    let digits = !value.is_empty() && value.bytes().all(|byte| byte.is_ascii_digit());
    digits.then(|| value.parse().ok()).flatten()
}

/// Whether `BIND` has the form of an address to listen on: an IP address and port
/// (`127.0.0.1:8080`, `[::1]:8080`) or a host name and port (`localhost:8080`, resolved when
/// the server binds, so a name that does not resolve is a failure to start, not a
/// configuration error).
fn is_bind_address(value: &str) -> bool {
    if value.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = value.rsplit_once(':') else {
        return false;
    };
    // A host name: letters, digits, `-` and `.`, and not all digits (that is an IPv4
    // address, and this one did not parse).
    let is_name = host
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && host.chars().any(|c| c.is_ascii_alphabetic());
    // The port in digits alone, as after an IP address (`u16`'s parser also takes a `+`).
    is_name && parse_count::<u16>(port).is_some()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<ServerConfig, ConfigError> {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(name, value)| ((*name).to_owned(), OsString::from(value)))
            .collect();
        ServerConfig::from_lookup(|name| vars.get(name).cloned())
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(parse(&[]), Ok(ServerConfig::default()));
    }

    #[test]
    fn reads_every_variable() {
        let config = parse(&[
            ("BIND", "127.0.0.1:0"),
            ("REDIS_URL", "redis://127.0.0.1:6379"),
            ("IDEMPOTENCY", "OFF"),
            ("IDEMPOTENCY_METHODS", "post, patch,POST"),
            ("IDEMPOTENCY_PREFIX", "test:"),
            ("WORKERS", "2"),
            ("REPLAY_CACHE", "on"),
            ("LOG_LEVEL", "Debug"),
        ])
        .expect("valid");
        assert_eq!(config.bind, "127.0.0.1:0");
        assert_eq!(config.redis_url.as_deref(), Some("redis://127.0.0.1:6379"));
        assert!(!config.idempotency);
        assert_eq!(config.protect_methods, [Method::POST, Method::PATCH]);
        assert_eq!(config.key_prefix.as_deref(), Some("test:"));
        assert_eq!(config.workers.map(NonZeroUsize::get), Some(2));
        let most = parse(&[("WORKERS", "512")]).expect("Actix's most");
        assert_eq!(most.workers.map(NonZeroUsize::get), Some(MAX_WORKERS));
        assert!(config.replay_cache);
        assert_eq!(config.log_level, LevelFilter::DEBUG);
    }

    #[test]
    fn with_the_middleware_off_its_variables_need_no_store() {
        let config = parse(&[
            ("IDEMPOTENCY", "off"),
            ("REPLAY_CACHE", "on"),
            ("IDEMPOTENCY_REPLICAS", "1"),
        ])
        .expect("ignored, not refused");
        assert!(!config.idempotency);
        assert!(config.replay_cache);
        assert_eq!(config.replicas.map(NonZeroU32::get), Some(1));
        // A malformed value is still refused.
        let error = parse(&[("IDEMPOTENCY", "off"), ("REPLAY_CACHE", "yes")]).expect_err("yes");
        assert_eq!(error.variable, "REPLAY_CACHE");
    }

    #[test]
    fn two_stores_are_refused() {
        for (first, second) in [
            ("REDIS_URL", "DATABASE_URL"),
            ("REDIS_CLUSTER_URLS", "DATABASE_URL"),
            ("REDIS_URL", "REDIS_CLUSTER_URLS"),
        ] {
            let error = parse(&[(first, "x://:secret-a@a"), (second, "x://:secret-b@b")])
                .expect_err(second);
            assert!(error.to_string().contains(first), "{error}");
            assert!(error.to_string().contains(second), "{error}");
            // Errors end up in logs: a URL's password never shows.
            assert!(
                !format!("{error} {error:?}").contains("secret"),
                "{error:?}"
            );
        }
        let config = parse(&[("DATABASE_URL", "postgres://app:secret@127.0.0.1/app")]);
        let shown = format!("{config:?}");
        assert!(!shown.contains("secret"), "{shown}");
        let config = parse(&[("DATABASE_URL", "postgres://postgres@127.0.0.1/postgres")]);
        assert_eq!(
            config.expect("one store").database_url.as_deref(),
            Some("postgres://postgres@127.0.0.1/postgres")
        );
    }

    #[test]
    fn reads_the_cluster_seeds_and_replicas() {
        let config = parse(&[
            (
                "REDIS_CLUSTER_URLS",
                "redis://127.0.0.1:7000, redis://127.0.0.1:7001,",
            ),
            ("IDEMPOTENCY_REPLICAS", "1"),
        ])
        .expect("valid");
        assert_eq!(
            config.redis_cluster_urls,
            Some(vec![
                "redis://127.0.0.1:7000".to_owned(),
                "redis://127.0.0.1:7001".to_owned()
            ])
        );
        assert_eq!(config.replicas.map(NonZeroU32::get), Some(1));
    }

    #[test]
    fn refuses_two_stores_and_replicas_without_redis() {
        let both = parse(&[
            ("REDIS_URL", "redis://127.0.0.1:6379"),
            ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:7000"),
        ])
        .expect_err("two stores");
        assert_eq!(both.variable, "REDIS_CLUSTER_URLS");
        let memory = parse(&[("IDEMPOTENCY_REPLICAS", "1")]).expect_err("no Redis");
        assert_eq!(memory.variable, "IDEMPOTENCY_REPLICAS");
        for value in ["0", "-1", "+1", "one"] {
            let error = parse(&[
                ("REDIS_URL", "redis://127.0.0.1:6379"),
                ("IDEMPOTENCY_REPLICAS", value),
            ])
            .expect_err(value);
            assert_eq!(error.variable, "IDEMPOTENCY_REPLICAS");
        }
        let no_seeds = parse(&[("REDIS_CLUSTER_URLS", " , ")]).expect_err("no seeds");
        assert_eq!(no_seeds.variable, "REDIS_CLUSTER_URLS");
    }

    #[test]
    fn post_is_not_protected_beside_the_transactional_ledger() {
        const DATABASE: (&str, &str) = ("DATABASE_URL", "postgres://postgres@127.0.0.1/postgres");
        for methods in ["POST", "put,Post"] {
            let error = parse(&[DATABASE, ("IDEMPOTENCY_METHODS", methods)]).expect_err(methods);
            assert_eq!(error.variable, "IDEMPOTENCY_METHODS");
            assert!(error.to_string().contains("POST /ledger"), "{error}");
        }
        let others = parse(&[DATABASE, ("IDEMPOTENCY_METHODS", "PUT,PATCH,DELETE")]);
        assert_eq!(others.expect("no POST").protect_methods.len(), 3);
        // Without the middleware nothing is claimed; without a database there is no ledger.
        let off = parse(&[
            DATABASE,
            ("IDEMPOTENCY", "off"),
            ("IDEMPOTENCY_METHODS", "POST"),
        ]);
        assert!(off.is_ok(), "{off:?}");
        let redis = parse(&[
            ("REDIS_URL", "redis://127.0.0.1:6379"),
            ("IDEMPOTENCY_METHODS", "POST"),
        ]);
        assert!(redis.is_ok(), "{redis:?}");
    }

    #[test]
    fn a_replay_cache_needs_a_store_outside_the_process() {
        let memory = parse(&[("REPLAY_CACHE", "on")]).expect_err("memory store");
        assert_eq!(memory.variable, "REPLAY_CACHE");
        assert!(memory.to_string().contains("in-memory store"), "{memory}");
        assert!(!parse(&[("REPLAY_CACHE", "off")]).expect("off").replay_cache);
        for (store, url) in [
            ("REDIS_URL", "redis://127.0.0.1:6379"),
            ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:7000"),
            ("DATABASE_URL", "postgres://postgres@127.0.0.1/postgres"),
        ] {
            let config = parse(&[(store, url), ("REPLAY_CACHE", "on")]).expect(store);
            assert!(config.replay_cache, "{store}");
        }
    }

    #[test]
    fn empty_counts_as_unset() {
        assert_eq!(
            parse(&[("REDIS_URL", ""), ("IDEMPOTENCY", " "), ("WORKERS", "")]),
            Ok(ServerConfig::default())
        );
    }

    #[test]
    fn reads_bind_addresses_and_refuses_what_is_none() {
        for value in [
            "127.0.0.1:0",
            "0.0.0.0:8080",
            "[::1]:8080",
            "localhost:8080",
        ] {
            let config = parse(&[("BIND", value)]).expect(value);
            assert_eq!(config.bind, value);
        }
        for value in [
            "not-an-address",
            "127.0.0.1:99999",
            "127.0.0.1",
            ":8080",
            "localhost:http",
            // A sign before the port, refused after an IP address, is refused after a host
            // name too (it was taken there, as `u16`'s parser takes it).
            "localhost:+8080",
            "127.0.0.1:+8080",
            "::1:8080",
            "999.0.0.1:80",
        ] {
            let error = parse(&[("BIND", value)]).expect_err(value);
            assert_eq!(error.variable, "BIND", "{value}");
        }
    }

    #[test]
    fn refuses_invalid_values_naming_the_variable() {
        for (variable, value) in [
            ("IDEMPOTENCY", "maybe"),
            ("REPLAY_CACHE", "yes"),
            ("IDEMPOTENCY_METHODS", "POST,GET"),
            ("IDEMPOTENCY_METHODS", "PSOT"),
            ("IDEMPOTENCY_METHODS", ","),
            ("IDEMPOTENCY_METHODS", "POST,"),
            ("IDEMPOTENCY_METHODS", "POST,,PUT"),
            ("WORKERS", "0"),
            ("WORKERS", "two"),
            ("WORKERS", "+2"),
            ("WORKERS", "2 2"),
            ("WORKERS", "513"),
            ("WORKERS", "99999999999"),
            ("LOG_LEVEL", "3"),
            ("LOG_LEVEL", "warning"),
        ] {
            let error = parse(&[(variable, value)]).expect_err(value);
            assert_eq!(error.variable, variable);
            assert!(
                error
                    .to_string()
                    .starts_with(&format!("invalid {variable}="))
            );
        }
    }
}
