//! Shared helpers of the end-to-end tests: Redis connections with clear failure messages,
//! unique key prefixes, and handler-run counters.

pub mod cluster;
pub mod keyed_app;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_actix::{RedisPool, RedisStore};

mod faulty_store;
mod flood;
mod gated_routes;
mod post_twice;
mod proxy;
mod replica_sync;
mod servers;
mod temporary_directory;
mod test_redis;

pub use faulty_store::FaultyStore;
pub use flood::FloodServer;
pub use gated_routes::{GatedRoutes, post_quick};
pub use post_twice::post_twice;
pub use proxy::MovableAddress;
pub use servers::{redis7_server, redis8_server, redis8_url, valkey_server, valkey_url};
pub use temporary_directory::TemporaryDirectory;

/// What to do when the test Redis does not answer, printed whenever a test cannot reach it
/// (with `REDIS_URL` unset the tests start their own server, so this names the variable).
pub const START_REDIS: &str = "check that REDIS_URL names a running Redis, or unset it: the tests then use 127.0.0.1:6379 or start their own redis-server (apt-get install -y redis-server)";

/// The Redis the tests use: `REDIS_URL` when set; else `redis://127.0.0.1:6379` when a
/// server answers there; else a private `redis-server` this test process starts for its run
/// (stopped when the process exits). Decided once per test process.
///
/// # Panics
///
/// When no server answers and `redis-server` is not installed, with the install hint.
pub fn redis_url() -> String {
    test_redis::url()
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

/// A bb8 pool on this test process's private Valkey (≥ 8.1, see [`valkey_url`]).
///
/// # Panics
///
/// When `valkey-server` is missing or older than 8.1, with the install hint.
pub fn valkey_pool() -> RedisPool {
    RedisStore::pool(&valkey_url()).expect("valid Redis URL")
}

/// A bb8 pool on this test process's private Redis ≥ 8.4 (see [`redis8_url`]).
///
/// # Panics
///
/// When no Redis ≥ 8.4 is found, with the install hint.
pub fn redis8_pool() -> RedisPool {
    RedisStore::pool(&redis8_url()).expect("valid Redis URL")
}

/// Whether the server behind `connection` takes `SET … IFEQ` (Valkey ≥ 8.1, Redis ≥ 8.4),
/// whether or not the store sends it there (Valkey only): one without it refuses the
/// command as a syntax error. The
/// `SET` names a key of its own that does not exist, so it writes nothing either way.
///
/// # Panics
///
/// When the server answers anything else.
pub async fn takes_conditional_set(connection: &mut redis::aio::MultiplexedConnection) -> bool {
    let reply: redis::RedisResult<redis::Value> = redis::cmd("SET")
        .arg(format!("{}probe", unique_prefix("takes_conditional_set")))
        .arg("written")
        .arg("IFEQ")
        .arg("expected")
        .query_async(connection)
        .await;
    match reply {
        Ok(redis::Value::Nil) => true,
        Err(error) if error.code() == Some("ERR") && error.detail() == Some("syntax error") => {
            false
        }
        other => panic!("SET … IFEQ on a missing key answered {other:?}"),
    }
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

/// Closes `socket` with a reset (RST) rather than a plain close, as a client that gives up
/// does: Actix then drops the request's future at once (after a plain close it lets the
/// future finish).
///
/// # Panics
///
/// When the socket refuses a zero linger time.
pub fn reset(socket: std::net::TcpStream) {
    // A zero linger time makes closing the socket send a reset.
    socket2::SockRef::from(&socket)
        .set_linger(Some(std::time::Duration::ZERO))
        .expect("a zero linger time");
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

/// A gate that handlers wait at until the test opens it: an event to wait for instead of a
/// fixed sleep, so a request stays in flight exactly as long as the test needs.
#[derive(Debug, Clone, Default)]
pub struct Gate(Arc<std::sync::atomic::AtomicBool>);

impl Gate {
    /// Lets every waiting and later handler through.
    pub fn open(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether the gate is open.
    pub fn is_open(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Waits until the gate is open, or 30 s at most, so a failing test never leaves a
    /// handler hanging.
    pub async fn wait(&self) {
        for _ in 0..3_000 {
            if self.is_open() {
                return;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

/// A `redis-server` of the test's own on a free loopback port, stopped when dropped: for
/// tests that count commands, or stop, pause or restart Redis (never the shared server).
#[derive(Debug)]
pub struct PrivateRedis {
    child: std::process::Child,
    /// The server binary (`redis-server`, a Redis 8 one or a `valkey-server`), kept for
    /// restarts.
    server: PathBuf,
    port: u16,
    /// Configuration arguments given on top of the defaults, kept for restarts.
    extra_args: Vec<String>,
}

impl PrivateRedis {
    /// Starts one and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed or does not start within 10 s.
    pub async fn start() -> Self {
        Self::start_with_args(&[]).await
    }

    /// Starts one with these `redis-server` arguments on top of the defaults (e.g.
    /// `["--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru"]`), kept on restarts,
    /// and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed or does not start within 10 s.
    pub async fn start_with_args(extra_args: &[&str]) -> Self {
        Self::start_server(PathBuf::from("redis-server"), extra_args).await
    }

    /// Starts a Valkey (≥ 8.1, see [`valkey_server`]) instead, which has `SET … IFEQ`, with
    /// these arguments on top of the defaults, and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When `valkey-server` is missing or older than 8.1 (with the install hint), or does
    /// not start within 10 s.
    pub async fn start_valkey(extra_args: &[&str]) -> Self {
        Self::start_server(valkey_server(), extra_args).await
    }

    /// Starts a Redis ≥ 8.4 (see [`redis8_server`]) instead, which has `SET … IFEQ`, with
    /// these arguments on top of the defaults, and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When no Redis ≥ 8.4 is found (with the install hint), or it does not start within
    /// 10 s.
    pub async fn start_redis8(extra_args: &[&str]) -> Self {
        Self::start_server(redis8_server(), extra_args).await
    }

    /// Starts a Redis without `SET … IFEQ` (7.0 to 8.2, see [`redis7_server`]), which
    /// commits by function, with these arguments on top of the defaults, and waits until it
    /// answers `PING`: for the tests of that commit, whatever `redis-server` the `PATH` has.
    ///
    /// # Panics
    ///
    /// When none is found (with the install hint), or it does not start within 10 s.
    pub async fn start_redis7(extra_args: &[&str]) -> Self {
        Self::start_server(redis7_server(), extra_args).await
    }

    async fn start_server(server: PathBuf, extra_args: &[&str]) -> Self {
        let extra_args: Vec<String> = extra_args.iter().map(|&arg| arg.to_owned()).collect();
        for _ in 0..PORT_TRIES {
            let port = free_loopback_port();
            let mut started = Self {
                child: spawn_redis_server(&server, port, &extra_args),
                server: server.clone(),
                port,
                extra_args: extra_args.clone(),
            };
            if started.wait_until_it_answers().await {
                return started;
            }
        }
        panic!(
            "{} could not listen on any of {PORT_TRIES} free loopback ports",
            server.display()
        );
    }

    /// Starts one as a replica of `primary` and waits until it has caught up as its
    /// primary's `WAIT` counts it, so that a test's first replicated write may follow at
    /// once (its link up is not enough: until the replica's first acknowledgement, a `WAIT`
    /// counts no replica).
    ///
    /// # Panics
    ///
    /// When it does not start, or has not caught up within 20 s.
    pub async fn start_replica_of(primary: &PrivateRedis) -> Self {
        let extra_args = vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            primary.port.to_string(),
        ];
        for _ in 0..PORT_TRIES {
            let port = free_loopback_port();
            let mut started = Self {
                child: spawn_redis_server(&primary.server, port, &extra_args),
                server: primary.server.clone(),
                port,
                extra_args: extra_args.clone(),
            };
            if started.wait_until_it_answers().await {
                replica_sync::wait_until_in_sync(primary, &started).await;
                return started;
            }
        }
        panic!("the replica could not listen on any of {PORT_TRIES} free loopback ports");
    }

    /// Kills the server (like a crash: nothing is kept, it keeps nothing on disk).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops its process (SIGSTOP) until [`resume`](Self::resume), and returns once it is
    /// stopped: a server that hangs with its sockets open. What is sent to it queues; it
    /// answers nothing and, as a replica, applies and acknowledges nothing. The stall lasts
    /// until the test ends it, however slowly a loaded machine runs the test meanwhile (a
    /// `DEBUG SLEEP` of some length can end before the test has done what needed the
    /// server stalled).
    ///
    /// # Panics
    ///
    /// When `kill` fails, or the process is not seen stopped within 10 s.
    pub fn pause(&self) {
        pause_process(
            self.child.id(),
            &format!("redis-server on port {}", self.port),
        );
    }

    /// Wakes it after [`pause`](Self::pause) (SIGCONT): it goes on with what queued
    /// meanwhile.
    ///
    /// # Panics
    ///
    /// When `kill` fails.
    pub fn resume(&self) {
        signal_process(
            self.child.id(),
            "-CONT",
            &format!("redis-server on port {}", self.port),
        );
    }

    /// Starts it again on the same port, empty, and waits until it answers.
    pub async fn restart(&mut self) {
        self.stop();
        self.child = spawn_redis_server(&self.server, self.port, &self.extra_args);
        assert!(
            self.wait_until_it_answers().await,
            "port {} was taken while its redis-server was down",
            self.port
        );
    }

    /// Stops it and starts `server` (another binary: an upgrade, or a downgrade) in its
    /// place, on the same port, with the same arguments, empty, and waits until it answers.
    pub async fn replace_with(&mut self, server: PathBuf) {
        self.server = server;
        self.restart().await;
    }

    /// Waits until this server's own process answers on its port: true once it does,
    /// false if it exited first (the port it was given was taken in the meantime, by an
    /// outgoing connection or another test's server, which must not be mistaken for it).
    async fn wait_until_it_answers(&mut self) -> bool {
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if self.answers_as_itself().await {
                return true;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!(
            "redis-server on port {} did not answer within 10 s",
            self.port
        );
    }

    /// Whether the server on its port answers and is this one's process (`INFO server`'s
    /// `process_id`).
    async fn answers_as_itself(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
            return false;
        };
        let info: redis::RedisResult<String> = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut connection)
            .await;
        info.is_ok_and(|info| info_names_process(&info, self.child.id()))
    }

    /// Whether it is Valkey, as `HELLO`'s `server` field names it (the store commits by
    /// `SET … IFEQ` on Valkey ≥ 8.1 only).
    pub async fn is_valkey(&self) -> bool {
        let hello: redis::Value = redis::cmd("HELLO")
            .query_async(&mut self.connection().await)
            .await
            .expect("HELLO");
        let redis::Value::Array(fields) = hello else {
            panic!("HELLO answered {hello:?}");
        };
        fields.chunks_exact(2).any(|pair| {
            pair[0] == redis::Value::BulkString(b"server".to_vec())
                && pair[1] == redis::Value::BulkString(b"valkey".to_vec())
        })
    }

    /// Whether it takes `SET … IFEQ` (Valkey ≥ 8.1, Redis ≥ 8.4; see
    /// [`takes_conditional_set`]).
    pub async fn takes_conditional_set(&self) -> bool {
        takes_conditional_set(&mut self.connection().await).await
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

    /// The value of `field` in its `INFO` output (e.g. `evicted_keys`, `used_memory`).
    ///
    /// # Panics
    ///
    /// When it does not answer or has no such field.
    pub async fn info_field(&self, field: &str) -> String {
        let mut connection = self.connection().await;
        let info: String = redis::cmd("INFO")
            .query_async(&mut connection)
            .await
            .expect("INFO");
        info.lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .unwrap_or_else(|| panic!("INFO has no field {field}"))
            .trim()
            .to_owned()
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
        command_counts_in(&info, &[])
    }
}

/// The calls of each command in `info` (an `INFO commandstats` reply), the bookkeeping
/// commands ([`BOOKKEEPING`], and `also_left_out`) left out.
pub fn command_counts_in(
    info: &str,
    also_left_out: &[&str],
) -> std::collections::BTreeMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|s| s.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .filter(|(name, _)| {
            let command = name.split('|').next().unwrap_or_default();
            !BOOKKEEPING.contains(&command) && !also_left_out.contains(&command)
        })
        .collect()
}

/// Whether `info` (an `INFO server` reply) is that of the server process `pid`: a server
/// started on a port another one took in the meantime exits, and the other answers there.
pub(crate) fn info_names_process(info: &str, pid: u32) -> bool {
    let pid = pid.to_string();
    info.lines()
        .any(|line| line.strip_prefix("process_id:").map(str::trim) == Some(pid.as_str()))
}

/// Stops process `pid` (SIGSTOP) and waits until it is stopped (`ps` shows state `T`):
/// `kill` only leaves the signal pending, and until the process is taken off the CPU it
/// may still act on what it had read (a replica acknowledge what it had applied).
/// `what` names it in a panic.
pub(crate) fn pause_process(pid: u32, what: &str) {
    signal_process(pid, "-STOP", what);
    let started = std::time::Instant::now();
    loop {
        let state = std::process::Command::new("ps")
            .args(["-o", "stat=", "-p", &pid.to_string()])
            .output()
            .expect("ps runs");
        if String::from_utf8_lossy(&state.stdout)
            .trim_start()
            .starts_with('T')
        {
            return;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{what} (pid {pid}) not stopped 10 s after SIGSTOP: ps says {:?}",
            String::from_utf8_lossy(&state.stdout)
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Sends `signal` (`kill`'s argument: `-STOP`, `-CONT`) to process `pid`, which `what`
/// names in a panic.
pub(crate) fn signal_process(pid: u32, signal: &str, what: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {signal} {pid} ({what})");
}

/// How many free ports a private server is tried on before a test gives up.
const PORT_TRIES: usize = 5;

/// A loopback port free at the time of asking; a server started on it may still find it
/// taken (see [`PrivateRedis::wait_until_it_answers`]).
pub(crate) fn free_loopback_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

fn spawn_redis_server<S: AsRef<std::ffi::OsStr>>(
    server: &Path,
    port: u16,
    extra_args: &[S],
) -> std::process::Child {
    let dir = private_redis_dir(port);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|error| panic!("cannot create {}: {error}", dir.display()));
    std::process::Command::new(server)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        // A replica loads its primary's data from the socket, and whatever a server might
        // still write (`DEBUG RELOAD`'s dump) goes to a directory of its own, never into the
        // checkout nor where another server, of another version, would load it at start.
        .args(["--repl-diskless-load", "on-empty-db"])
        .arg("--dir")
        .arg(&dir)
        // DEBUG SLEEP simulates a stalled server in the fault-injection tests.
        .args(["--enable-debug-command", "yes"])
        .args(extra_args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "cannot run {} ({error}); install it with: apt-get install -y redis-server",
                server.display()
            )
        })
}

/// The working directory of the private server on `port`, removed when it is dropped.
fn private_redis_dir(port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("idempotency-actix-test-redis-{port}"))
}

/// Commands of test bookkeeping and connection set-up, left out of the counts.
const BOOKKEEPING: [&str; 4] = ["info", "config", "hello", "client"];

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(private_redis_dir(self.port));
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
    /// The thread that copies its stderr into `stderr`; it ends when the process has exited
    /// and the pipe is drained.
    stderr_reader: Option<std::thread::JoinHandle<()>>,
}

/// The environment variables the reference server reads.
const REFERENCE_SERVER_VARIABLES: [&str; 11] = [
    "BIND",
    "LOG_LEVEL",
    "REDIS_URL",
    "REDIS_CLUSTER_URLS",
    "DATABASE_URL",
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
        let stderr_reader = child.stderr.take().map(|mut pipe| {
            let stderr = Arc::clone(&stderr);
            std::thread::spawn(move || {
                let mut chunk = [0; 4096];
                while let Ok(read @ 1..) = pipe.read(&mut chunk) {
                    if let Ok(mut text) = stderr.lock() {
                        text.push_str(&String::from_utf8_lossy(&chunk[..read]));
                    }
                }
            })
        });
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
            stderr_reader,
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

    /// Waits up to 10 s for it to exit by itself (it aborted, say); its exit status, or
    /// `None` if it is still running. Once it has exited, [`stderr`](Self::stderr) holds
    /// all it wrote (its last lines may still be in the pipe when it exits).
    pub fn wait_for_exit(&mut self) -> Option<std::process::ExitStatus> {
        for _ in 0..200 {
            if let Ok(Some(status)) = self.child.try_wait() {
                if let Some(reader) = self.stderr_reader.take() {
                    let _ = reader.join();
                }
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }

    /// Sends it `signal` (a name `kill -s` knows: `TERM`, `INT`) with kill(1).
    ///
    /// # Panics
    ///
    /// When kill(1) cannot be run or fails (the process is gone).
    pub fn signal(&self, signal: &str) {
        let sent = std::process::Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .unwrap_or_else(|error| panic!("cannot run kill: {error}"));
        assert!(sent.success(), "kill -s {signal} failed: {sent}");
    }

    /// Kills it at once (SIGKILL: like a crash, nothing is flushed or finished).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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

/// Builds the example `reference_server` (see [`example_executable`]) and returns the path
/// of the executable cargo reports.
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

/// Runs `cargo build --workspace --examples` and returns the path cargo reports for the
/// executable of the example `name`.
fn build_example(name: &str) -> std::path::PathBuf {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests package lives in the workspace");
    let output = std::process::Command::new(env!("CARGO"))
        .current_dir(workspace)
        // Every example of the workspace, not `-p … --example name`: this selection resolves
        // the features (and the debug info of shared units) that `cargo test --workspace`
        // does, so after the README's test command the build is already fresh. A
        // package-only build would compile actix-web and this crate once more (about a
        // minute of CI time).
        .args(["build", "--workspace", "--examples"])
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

/// How to start PostgreSQL, printed whenever a test cannot reach it.
pub const START_POSTGRES: &str = "start it with: pg_ctlcluster --skip-systemctl-redirect \
     $(ls /etc/postgresql) main start (install it first with: apt-get install -y postgresql), \
     or set DATABASE_URL to a server where user may CREATE DATABASE";

/// The PostgreSQL server the tests use, as a URL of its maintenance database:
/// `DATABASE_URL`, or `postgres://postgres@127.0.0.1:5432/postgres` (trust auth).
pub fn postgres_admin_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.trim().is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A database of one test's own on the test PostgreSQL server, created empty and dropped
/// (with whatever connections are left) when this is dropped, also when the test fails.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates one, named after this process and a random suffix.
    ///
    /// Its sessions commit without waiting for the WAL to reach the disk
    /// (`synchronous_commit = off`): what they commit is seen by every other session at once,
    /// as before, and only a crash of the server itself could lose it, which no test makes.
    /// Waiting for the disk made each write as slow as the machine's other I/O: with a
    /// compiler writing beside the tests (CI's lints), the PostgreSQL lease tests'
    /// renewals, 50 ms each by design, took long enough for leases to lapse.
    ///
    /// # Panics
    ///
    /// When PostgreSQL does not answer or refuses, with a message that says how to start it.
    pub async fn create() -> Self {
        let name = format!(
            "idempotency_test_{}_{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let admin = admin_connection().await;
        drop_leftovers(&admin).await;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap_or_else(|error| panic!("cannot create the test database {name}: {error}"));
        // A statement of its own: several in one message make one transaction, which
        // `CREATE DATABASE` refuses.
        admin
            .batch_execute(&format!(
                "ALTER DATABASE \"{name}\" SET synchronous_commit = off"
            ))
            .await
            .unwrap_or_else(|error| panic!("cannot configure the test database {name}: {error}"));
        let url = database_url(&postgres_admin_url(), &name);
        Self { name, url }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A plain connection to it, for what a test inspects.
    ///
    /// # Panics
    ///
    /// When it does not answer.
    pub async fn connection(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// A migrated store on it (table `idempotency_records`).
    ///
    /// # Panics
    ///
    /// When it does not answer.
    pub async fn store(&self) -> idempotency_actix::PostgresStore {
        let pool = idempotency_actix::PostgresStore::pool(&self.url).expect("a valid URL");
        let store = idempotency_actix::PostgresStore::new(pool);
        store.migrate().await.expect("migrate the test database");
        store
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop may run inside a test's runtime: do the I/O on a thread of its own.
        let dropped = std::thread::spawn(move || {
            actix_rt::System::new().block_on(async move {
                admin_connection()
                    .await
                    .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop the test database {}", self.name);
        }
    }
}

/// Drops the test databases of test processes that are gone (killed before they could drop
/// their own), so none pile up.
async fn drop_leftovers(admin: &tokio_postgres::Client) {
    let Ok(rows) = admin
        .query(
            "SELECT datname FROM pg_database WHERE datname LIKE 'idempotency\\_test\\_%'",
            &[],
        )
        .await
    else {
        return;
    };
    for name in rows.iter().map(|row| row.get::<_, String>(0)) {
        let pid = name
            .split('_')
            .nth(2)
            .and_then(|pid| pid.parse::<u32>().ok());
        let gone = pid.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
        if gone {
            // Another process may be dropping it at the same time: either one does.
            let _ = admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                .await;
        }
    }
}

/// `url` with its database replaced by `database` (a URL of the form
/// `postgres://user@host:port/db?options`).
fn database_url(url: &str, database: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let base = match base.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('/') {
            Some((authority, _)) => format!("{scheme}://{authority}"),
            None => base.to_owned(),
        },
        None => panic!("DATABASE_URL must be a URL (postgres://user@host:port/db), not {url:?}"),
    };
    if query.is_empty() {
        format!("{base}/{database}")
    } else {
        format!("{base}/{database}?{query}")
    }
}

async fn admin_connection() -> tokio_postgres::Client {
    connect(&postgres_admin_url()).await
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|error| {
            panic!("PostgreSQL at {url} is not reachable ({error}); {START_POSTGRES}")
        });
    actix_rt::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// One HTTP/1.1 exchange over a plain socket, for what awc cannot show: a final 1xx status,
/// the exact framing headers, or the first chunk of a body before its last is produced.
///
/// Every read gives up after 10 s with a panic, so a response that never comes fails the
/// test instead of hanging it.
pub struct RawExchange {
    reader: std::io::BufReader<std::net::TcpStream>,
}

/// The status line and headers of a [`RawExchange`]'s response.
#[derive(Debug)]
pub struct RawHead {
    /// The status code.
    pub status: u16,
    /// The headers, names in lowercase, in the order received.
    pub headers: Vec<(String, String)>,
}

impl RawHead {
    /// The first header `name` (lowercase), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(candidate, _)| candidate == name)
            .map(|(_, value)| value.as_str())
    }
}

impl RawExchange {
    /// Sends `POST path` with `headers`, an empty body and `Connection: close` to `addr`.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn post(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Self {
        let mut headers = headers.to_vec();
        headers.push(("Content-Length", "0"));
        Self::post_partial(addr, path, &headers, b"")
    }

    /// Sends `POST path` with `headers` (its `Content-Length` among them) and
    /// `Connection: close` to `addr`, followed by `body` (which may stop short of the length
    /// the headers declare: the rest can follow through [`stream`](Self::stream)).
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn post_partial(
        addr: std::net::SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Self {
        use std::io::Write;
        let stream = std::net::TcpStream::connect(addr)
            .unwrap_or_else(|error| panic!("connect to {addr}: {error}"));
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .expect("set a read timeout");
        let mut request = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        let mut request = request.into_bytes();
        request.extend_from_slice(body);
        (&stream)
            .write_all(&request)
            .unwrap_or_else(|error| panic!("send to {addr}: {error}"));
        Self {
            reader: std::io::BufReader::new(stream),
        }
    }

    /// The connection, to send more of the request on.
    pub fn stream(&mut self) -> &mut std::net::TcpStream {
        self.reader.get_mut()
    }

    /// Reads the status line and the headers.
    ///
    /// # Panics
    ///
    /// When they do not arrive within 10 s or are not HTTP/1.1.
    pub fn read_head(&mut self) -> RawHead {
        use std::io::BufRead;
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            self.reader
                .read_line(&mut line)
                .unwrap_or_else(|error| panic!("reading the response head: {error}"));
            assert!(
                !line.is_empty(),
                "the connection closed inside the head: {lines:?}"
            );
            let line = line.trim_end().to_owned();
            if line.is_empty() {
                break;
            }
            lines.push(line);
        }
        let status = lines[0]
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP/1.1 status line: {:?}", lines[0]));
        let headers = lines[1..]
            .iter()
            .map(|line| {
                let (name, value) = line.split_once(':').expect("a header line");
                (name.to_ascii_lowercase(), value.trim().to_owned())
            })
            .collect();
        RawHead { status, headers }
    }

    /// Reads what the server sends next (at least one byte), as framed on the wire.
    ///
    /// # Panics
    ///
    /// When nothing arrives within 10 s or the connection closed.
    pub fn read_some(&mut self) -> Vec<u8> {
        use std::io::Read;
        let mut buffer = vec![0; 64 * 1024];
        let read = self
            .reader
            .read(&mut buffer)
            .unwrap_or_else(|error| panic!("reading the response: {error}"));
        assert!(read > 0, "the connection closed");
        buffer.truncate(read);
        buffer
    }

    /// Reads everything until the server closes the connection, as framed on the wire.
    ///
    /// # Panics
    ///
    /// When the server does not close it within 10 s of the last byte.
    pub fn read_to_end(&mut self) -> Vec<u8> {
        use std::io::Read;
        let mut rest = Vec::new();
        self.reader
            .read_to_end(&mut rest)
            .unwrap_or_else(|error| panic!("reading the response to its end: {error}"));
        rest
    }
}
