//! Shared helpers of the end-to-end tests: Redis connections with clear failure messages,
//! unique key prefixes, and handler-run counters.

pub mod cluster;
pub mod keyed_app;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_actix::{RedisPool, RedisStore};

/// How to start Redis, printed whenever a test cannot reach it.
pub const START_REDIS: &str = "start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no (or set REDIS_URL)";

/// The Redis the tests use: `REDIS_URL`, or `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A plain connection to the test Redis, for inspecting what the store wrote.
///
/// # Panics
///
/// When Redis does not answer, with a message that says how to start it.
pub async fn redis_connection() -> redis::aio::MultiplexedConnection {
    let url = redis_url();
    let client = redis::Client::open(url.as_str())
        .unwrap_or_else(|error| panic!("REDIS_URL {url:?} is not a Redis URL: {error}"));
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|error| panic!("Redis at {url} is not reachable ({error}); {START_REDIS}"));
    let pong: String = redis::cmd("PING")
        .query_async(&mut connection)
        .await
        .unwrap_or_else(|error| {
            panic!("Redis at {url} does not answer PING ({error}); {START_REDIS}")
        });
    assert_eq!(pong, "PONG");
    connection
}

/// A bb8 pool on the test Redis, checked to answer.
///
/// # Panics
///
/// When Redis does not answer, with a message that says how to start it.
pub async fn redis_pool() -> RedisPool {
    redis_connection().await;
    RedisStore::pool(&redis_url()).expect("valid Redis URL")
}

/// A key prefix no other test (or earlier run) uses.
pub fn unique_prefix(test: &str) -> String {
    format!("test:{test}:{}:", uuid::Uuid::new_v4().simple())
}

/// The keys under `prefix` (with SCAN, never KEYS).
pub async fn keys_under(
    connection: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

/// Counts how many times a handler ran; clones share the count.
#[derive(Debug, Clone, Default)]
pub struct RunCounter(Arc<AtomicUsize>);

impl RunCounter {
    /// Records one run and returns the count after it.
    pub fn record(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// How many runs were recorded.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Waits until at least `runs` runs were recorded: an event to wait for instead of a
    /// fixed sleep, so tests keep their order on a loaded machine.
    ///
    /// # Panics
    ///
    /// After 10 s without that many runs: a test never hangs.
    pub async fn wait_for(&self, runs: usize) {
        for _ in 0..1_000 {
            if self.get() >= runs {
                return;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!(
            "the handler ran {} times in 10 s, expected {runs}",
            self.get()
        );
    }
}

/// A `redis-server` of the test's own on a free loopback port, stopped when dropped: for
/// tests that count commands, or stop, pause or restart Redis (never the shared server).
#[derive(Debug)]
pub struct PrivateRedis {
    child: std::process::Child,
    port: u16,
}

impl PrivateRedis {
    /// Starts one and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed or does not start within 10 s.
    pub async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let server = Self {
            child: spawn_redis_server(port, &[]),
            port,
        };
        server.wait_until_it_answers().await;
        server
    }

    /// Starts one as a replica of `primary` and waits until it is in sync with it.
    ///
    /// # Panics
    ///
    /// When it does not start, or is not in sync within 10 s.
    pub async fn start_replica_of(primary: &PrivateRedis) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let primary_port = primary.port.to_string();
        let replica = Self {
            child: spawn_redis_server(port, &["--replicaof", "127.0.0.1", &primary_port]),
            port,
        };
        replica.wait_until_it_answers().await;
        for _ in 0..100 {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut replica.connection().await)
                .await
                .expect("INFO replication");
            if info.contains("master_link_status:up") {
                return replica;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("the replica on port {port} did not sync within 10 s");
    }

    /// Kills the server (like a crash: nothing is kept, it keeps nothing on disk).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port, empty, and waits until it answers.
    pub async fn restart(&mut self) {
        self.stop();
        self.child = spawn_redis_server(self.port, &[]);
        self.wait_until_it_answers().await;
    }

    async fn wait_until_it_answers(&self) {
        for _ in 0..100 {
            if self.answers_ping().await {
                return;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!(
            "redis-server on port {} did not answer within 10 s",
            self.port
        );
    }

    async fn answers_ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
            return false;
        };
        let pong: redis::RedisResult<String> =
            redis::cmd("PING").query_async(&mut connection).await;
        pong.is_ok()
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A plain connection to it.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("valid URL")
            .get_multiplexed_async_connection()
            .await
            .expect("private redis-server answers")
    }

    /// How many times each command ran since the last call, then resets the counts.
    ///
    /// Read from `INFO commandstats`, which counts both what clients send and what scripts
    /// run inside the server (an `EVALSHA` and the hash commands of its script); the
    /// `INFO`/`CONFIG` calls this makes and connection handshakes are left out.
    pub async fn take_command_counts(&self) -> std::collections::BTreeMap<String, u64> {
        let mut connection = self.connection().await;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut connection)
            .await
            .expect("INFO commandstats");
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut connection)
            .await
            .expect("CONFIG RESETSTAT");
        info.lines()
            .filter_map(|line| {
                let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = stats.split(',').find_map(|s| s.strip_prefix("calls="))?;
                Some((name.to_owned(), calls.parse().ok()?))
            })
            .filter(|(name, _)| {
                let command = name.split('|').next().unwrap_or_default();
                !BOOKKEEPING.contains(&command)
            })
            .collect()
    }
}

fn spawn_redis_server(port: u16, extra: &[&str]) -> std::process::Child {
    std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(extra)
        .args(["--save", "", "--appendonly", "no"])
        // DEBUG SLEEP simulates a stalled server in the fault-injection tests.
        .args(["--enable-debug-command", "yes"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|error| {
            panic!("cannot run redis-server ({error}); install it with: apt-get install -y redis-server")
        })
}

/// Commands of test bookkeeping and connection set-up, left out of the counts.
const BOOKKEEPING: [&str; 4] = ["info", "config", "hello", "client"];

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The reference server (`examples/reference_server.rs`, DESIGN §11) as a child process of
/// the test, killed when dropped.
///
/// The first use in a test binary builds it with `cargo build --example reference_server`
/// (once; later uses wait for that build). Each server listens on a free loopback port with
/// 2 workers; its configuration comes from the environment variables a test passes, and
/// every other reference-server variable the test process may have is removed.
#[derive(Debug)]
pub struct ReferenceServer {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    stderr: Arc<std::sync::Mutex<String>>,
}

/// The environment variables the reference server reads.
const REFERENCE_SERVER_VARIABLES: [&str; 9] = [
    "BIND",
    "REDIS_URL",
    "REDIS_CLUSTER_URLS",
    "IDEMPOTENCY_REPLICAS",
    "REPLAY_CACHE",
    "IDEMPOTENCY",
    "IDEMPOTENCY_METHODS",
    "IDEMPOTENCY_PREFIX",
    "WORKERS",
];

impl ReferenceServer {
    /// The reference server's executable, built on first use.
    ///
    /// # Panics
    ///
    /// When cargo cannot build it, with cargo's messages.
    pub fn executable() -> &'static std::path::Path {
        static EXECUTABLE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
        EXECUTABLE.get_or_init(build_reference_server)
    }

    /// A command that runs the reference server on `127.0.0.1:0` with 2 workers and none of
    /// the caller's reference-server variables; add `env` to configure it.
    pub fn command() -> std::process::Command {
        let mut command = std::process::Command::new(Self::executable());
        for variable in REFERENCE_SERVER_VARIABLES {
            command.env_remove(variable);
        }
        command.env("BIND", "127.0.0.1:0").env("WORKERS", "2");
        command
    }

    /// Starts one with these variables set (on top of [`command`](Self::command)) and waits
    /// for its `listening on http://ADDR` line.
    ///
    /// # Panics
    ///
    /// When it exits or stays silent for 30 s instead, with what it wrote on stderr.
    pub fn start(env: &[(&str, &str)]) -> Self {
        let mut command = Self::command();
        command.envs(env.iter().copied());
        Self::spawn(command)
    }

    /// Starts `command` (see [`command`](Self::command)) and waits for its
    /// `listening on http://ADDR` line.
    ///
    /// # Panics
    ///
    /// When it exits or stays silent for 30 s instead, with what it wrote on stderr.
    pub fn spawn(mut command: std::process::Command) -> Self {
        use std::io::{BufRead, Read};

        let mut child = command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start the reference server: {error}"));
        let stderr = Arc::new(std::sync::Mutex::new(String::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let stderr = Arc::clone(&stderr);
            std::thread::spawn(move || {
                let mut chunk = [0; 4096];
                while let Ok(read @ 1..) = pipe.read(&mut chunk) {
                    if let Ok(mut text) = stderr.lock() {
                        text.push_str(&String::from_utf8_lossy(&chunk[..read]));
                    }
                }
            });
        }
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("stdout is piped");
        // Reads the address, then drains stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut addr_tx = Some(addr_tx);
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = line.trim().strip_prefix("listening on http://")
                    && let Some(addr_tx) = addr_tx.take()
                {
                    let _ = addr_tx.send(addr.to_owned());
                }
            }
        });
        let addr = addr_rx.recv_timeout(std::time::Duration::from_secs(30));
        let mut server = Self {
            child,
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            stderr,
        };
        match addr {
            Ok(addr) => {
                server.addr = addr.parse().unwrap_or_else(|error| {
                    panic!("reference server printed a bad address {addr:?}: {error}")
                });
                server
            }
            Err(_) => {
                // Give it a moment to finish writing why it stopped.
                std::thread::sleep(std::time::Duration::from_millis(200));
                let status = server.child.try_wait().ok().flatten();
                panic!(
                    "the reference server did not print `listening on http://ADDR` (exit status: {status:?}); stderr:\n{}",
                    server.stderr()
                )
            }
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The URL of `path_and_query` on it.
    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://{}{path_and_query}", self.addr)
    }

    /// What it wrote on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .map(|text| text.clone())
            .unwrap_or_default()
    }
}

impl Drop for ReferenceServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cargo build --example reference_server` in the workspace and returns the path of
/// the executable cargo reports.
fn build_reference_server() -> std::path::PathBuf {
    build_example("reference_server")
}

/// The executable of the example `name` of the examples package, built on first use per
/// test binary.
///
/// # Panics
///
/// When cargo cannot build it, with cargo's messages.
pub fn example_executable(name: &'static str) -> std::path::PathBuf {
    static BUILT: std::sync::Mutex<Vec<(&str, std::path::PathBuf)>> =
        std::sync::Mutex::new(Vec::new());
    let mut built = BUILT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, path)) = built.iter().find(|(built, _)| *built == name) {
        return path.clone();
    }
    let path = build_example(name);
    built.push((name, path.clone()));
    path
}

fn build_example(name: &str) -> std::path::PathBuf {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests package lives in the workspace");
    let output = std::process::Command::new(env!("CARGO"))
        .current_dir(workspace)
        .args(["build", "-p", "idempotency-actix-examples"])
        .args(["--example", name])
        .arg("--message-format=json-render-diagnostics")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("cannot run cargo to build the reference server: {error}"));
    if !output.status.success() {
        panic!(
            "cargo build --example {name} failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| {
            message["reason"] == "compiler-artifact" && message["target"]["name"] == name
        })
        .find_map(|message| message["executable"].as_str().map(std::path::PathBuf::from))
        .unwrap_or_else(|| {
            panic!(
                "cargo built no {name} executable:\n{}",
                String::from_utf8_lossy(&output.stderr)
            )
        })
}

/// One HTTP answer as the tests read it: status, headers and the whole body.
#[derive(Debug)]
pub struct Reply {
    /// The status.
    pub status: actix_web::http::StatusCode,
    /// The headers.
    pub headers: actix_web::http::header::HeaderMap,
    /// The body bytes.
    pub body: actix_web::web::Bytes,
}

impl Reply {
    /// Reads `response` whole (up to 16 MiB).
    ///
    /// # Errors
    ///
    /// When the body cannot be read (a connection that broke mid-body).
    pub async fn read<S>(
        mut response: awc::ClientResponse<S>,
    ) -> Result<Self, awc::error::PayloadError>
    where
        S: futures_util::Stream<Item = Result<actix_web::web::Bytes, awc::error::PayloadError>>
            + Unpin,
    {
        let body = response.body().limit(16 * 1024 * 1024).await?;
        Ok(Self {
            status: response.status(),
            headers: response.headers().clone(),
            body,
        })
    }

    /// The header `name`, if present.
    ///
    /// # Panics
    ///
    /// When its value is not visible ASCII.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|value| value.to_str().expect("a visible-ASCII header value"))
    }

    /// The body as JSON.
    ///
    /// # Panics
    ///
    /// When it is not JSON, with the body.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {:?}", self.body))
    }

    /// Whether it carries `Idempotent-Replayed: true`.
    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}
