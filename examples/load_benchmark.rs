//! The load benchmark (DESIGN §10): the reference server in every mode against stores of the
//! benchmark's own, loaded by `wrk`, each figure next to the unprotected baseline of the same
//! run. Run it with
//!
//! ```sh
//! cargo run --release -p idempotency-actix-examples --example load_benchmark
//! BENCH_MODES=postgres,cluster BENCH_SECONDS=3 cargo run --release -p idempotency-actix-examples --example load_benchmark
//! ```
//!
//! It builds the reference server (release; the comparator too when the `unguarded` modes
//! are asked for), starts one `redis-server` of its own on a free loopback port (never
//! 6379), and for each mode starts the reference server (or the comparator) with
//! `WORKERS=1`, warms it up, and runs `wrk -t1 -c32` against `POST /orders` (or
//! `POST /ledger`, JSON `{"amount":1}`, where named). Modes, by their `BENCH_MODES` name:
//!
//! | `BENCH_MODES` | mode | server | requests |
//! |---|---|---|---|
//! | (always) | baseline | `IDEMPOTENCY=off`, measured before and after every mode | a new key each |
//! | `redis` | Redis, new key | `REDIS_URL` | a new key each |
//! | `redis` | Redis, replay | `REDIS_URL` | one key, completed before the run |
//! | `redis` | Redis, replay, cache | `REDIS_URL`, `REPLAY_CACHE=on` | one key, completed before the run |
//! | `memory` | memory, new key, after 1 000 000 keys | in-memory store (64 MiB, full and evicting by then) | a new key each; the warm-up sends at least 1 000 000 first |
//! | `memory` | memory, replay | in-memory store | one key, completed before the run |
//! | `redis` | Redis, no key | `REDIS_URL` | no key (the route is protected, the key optional) |
//! | `unguarded` | unguarded layer, new key | the comparator `examples/unguarded_layer.rs`, `REDIS_URL` | a new key each |
//! | `unguarded` | unguarded layer, replay | the same | one key, completed before the run |
//! | `replicated` | Redis + 1 replica, new key | `REDIS_URL`, `IDEMPOTENCY_REPLICAS=1`; a `redis-server --replicaof` the private one, started for this mode only | a new key each |
//! | `cluster` | Redis Cluster, new key | `REDIS_CLUSTER_URLS`: a private cluster of 3 primaries (no replicas) | a new key each |
//! | `cluster` | Redis Cluster, replay | the same | one key, completed before the run |
//! | `postgres` | PostgreSQL, new key | `DATABASE_URL`: a fresh database | a new key each |
//! | `postgres` | PostgreSQL, replay | the same | one key, completed before the run |
//! | `postgres` | PostgreSQL, `POST /ledger`, new key | the same; the transactional route, its row inserted in the request's transaction | a new key each |
//! | `postgres` | baseline `POST /ledger` | `IDEMPOTENCY=off`, `DATABASE_URL`: the handler inserts its row in a transaction of its own; before and after the `/ledger` mode | a new key each |
//!
//! `BENCH_MODES` is a comma-separated list of those names (default: all of them), to
//! shorten a run; the baseline always runs. The `unguarded` modes run the comparator, the
//! design of the simplest idempotency layers (`GET`, run, `SET … NX EX`; no lock in flight,
//! no fingerprint, no fence: not safe to use) around the reference server's own handlers on
//! the same private Redis, against the same baseline, so that one run shows what this
//! crate's guarantees cost next to it. The cluster's nodes are `redis-server
//! --cluster-enabled yes` on free loopback ports at most 55535 (their bus ports add 10000),
//! joined by `redis-cli --cluster create`; the database is created with `psql` on the server
//! at `BENCH_DATABASE_URL` [`postgres://postgres@127.0.0.1:5432/postgres`] and dropped at
//! the end. When something a mode needs is missing (no PostgreSQL answers, the cluster or
//! the replica does not start), its modes are skipped and a `skipped:` line says why, before
//! the run and again under the table.
//!
//! Every mode runs the same `wrk` Lua script (only the key and, for `/ledger`, the body
//! differ), so the load tool costs the same everywhere. Each mode's ratio is to the mean of
//! the baselines of its route measured just before and just after it (the baseline rows' own
//! ratios are to the mean of all baselines of their route, a measure of how steady the
//! machine was). Printed per mode: requests per second and its ratio to the baseline, p99
//! latency, server CPU per request (`/proc/PID/stat` user + system time over the run ÷
//! requests), Redis CPU per request (`INFO cpu`, summed over every node: the cluster's
//! primaries, the replica) and Redis commands per request (`INFO commandstats` of the
//! primaries, without the replicas' `REPLCONF`), wrk's CPU per request (this process's
//! waited-for children), "status ≥ 400, socket errors": wrk's count of responses with a
//! status of 400 or more (wrk counts `status > 399` and nothing else, so a 1xx or 3xx
//! response is not counted; no Lua `response()` callback checks more, since that would
//! make wrk parse every response in Lua and change its CPU per request) and of its
//! connect, read, write and timeout errors (both should be 0; a line under the table sums
//! them over every measured run, the rounds not shown included), and
//! "steal": the share of the machine's CPU time (`/proc/stat`, all CPUs) that the hypervisor
//! gave to something else during the run, which slows every process measured without
//! showing in their CPU times (a round with a few percent of it is a disturbed one).
//! "× baseline by CPU" is the ratio of two throughput bounds, mode over baseline, each
//! computed from the CPU the processes spend per request: requests per second can exceed
//! neither what the machine's cores give all three processes (server, Redis, wrk) together,
//! nor what one core gives each process that runs on one thread (the server with
//! `WORKERS=1`, wrk with `-t1`, and a single Redis server; a cluster's or a replicated
//! mode's nodes are counted together only). It is what the throughput ratio comes to when
//! no process ever waits for another, and steady while other processes load the machine
//! (the req/s ratio is not). PostgreSQL's own CPU is not measured (its server is shared), so
//! for the PostgreSQL modes that ratio counts the server and wrk only, and the Redis columns
//! show `—`.
//!
//! `BENCH_ROUNDS=N` runs the whole sequence N times (each mode with the baselines around it
//! every round) and prints, for each mode, the round whose ratio is the median, with the
//! lowest and highest ratio of all rounds in the last column: on a machine whose speed drifts
//! from one minute to the next, one run of 8 s can land a few hundredths either side of a
//! target by chance, and the spread shows how far.
//!
//! Environment: `BENCH_SECONDS` [8] per mode, `BENCH_ROUNDS` [1], `BENCH_CONNECTIONS` [32],
//! `BENCH_MODES` [all], `BENCH_DATABASE_URL` [`postgres://postgres@127.0.0.1:5432/postgres`],
//! `BENCH_REDIS_SERVER` [`redis-server`]: the binary of every Redis server it starts (the
//! private one, the replica, the cluster's nodes), e.g. `valkey-server`, where the
//! single-server store commits by one `SET … IFEQ` instead of a function (the cluster
//! store commits by function on every server).
//! `MIMALLOC_PAGE_FULL_RETAIN` [0]: passed to the reference server and the comparator, which
//! run on mimalloc. With mimalloc's default (2), a run could pay about 2 500 instructions
//! per request (a tenth of an unprotected one) for a fresh allocator page per request, or
//! not, by chance, in any mode whose handler runs, the baseline included: Actix's JSON
//! extractor takes an 8 KiB buffer per request and frees it; mimalloc keeps up to that
//! many *full* pages of a small size in the size's queue, and frees a page that empties
//! at once unless it is alone in its queue; so when full pages of the connections' own
//! 8 KiB buffers stayed in the queue, the page the extractor's buffer had to itself was
//! freed with it and made anew for the next request. With 0 none of the runs counted paid
//! it, and ratios compare the middleware's work, not the allocator's luck
//! (`docs/performance.md`, "The allocator's page per request").
//! Needs `wrk`, `redis-server` and `redis-cli` (`apt-get install -y wrk redis-server`); the
//! PostgreSQL modes need `psql` (`apt-get install -y postgresql-client`) and a server to
//! connect to.
//!
//! A Redis figure that cannot be read (`redis-cli` fails, or `INFO` answers without the
//! field) stops the run with an error naming the command; it never reads as 0. SIGINT
//! (Ctrl-C) or SIGTERM stops the run too (within 20 ms while `wrk` runs, which is killed):
//! the reference server, every `redis-server` it started (the private one, the replica, the
//! cluster's nodes) are stopped, the database is dropped and the working directory removed,
//! as at the end of a run, and it exits with 128 plus the signal's number. The private
//! Redis keeps every key of every mode and round of a run (nothing flushes it between
//! them), and so does the database.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};

use idempotency_actix_examples::StopSignals;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// How the requests of a mode carry their key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// A new key for every request.
    New,
    /// One key, completed before the run: every request is a replay.
    Replay,
    /// No key at all.
    None,
}

/// The store a mode's server uses, and so what the benchmark must have started for it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// No store to start: the in-memory store, or no middleware at all.
    Nothing,
    /// The private `redis-server` (`REDIS_URL`).
    Redis,
    /// The private `redis-server` with a replica of its own (`REDIS_URL`,
    /// `IDEMPOTENCY_REPLICAS=1`).
    RedisReplicated,
    /// The private 3-primary Redis Cluster (`REDIS_CLUSTER_URLS`).
    RedisCluster,
    /// A fresh database on the PostgreSQL server (`DATABASE_URL`).
    Postgres,
    /// The private `redis-server` (`REDIS_URL`), through the comparator
    /// (`examples/unguarded_layer.rs`) instead of the reference server.
    UnguardedRedis,
}

/// The route a mode loads, and so the baseline it is compared with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// `POST /orders`: the baseline is the unprotected route without any store.
    Orders,
    /// `POST /ledger`: the baseline is the unprotected route, which inserts its row in a
    /// transaction of its own.
    Ledger,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Self::Orders => "/orders",
            Self::Ledger => "/ledger",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Self::Orders => r#"{"item":"book","qty":1}"#,
            Self::Ledger => r#"{"amount":1}"#,
        }
    }

    fn baseline(self) -> &'static Mode {
        match self {
            Self::Orders => &BASELINE,
            Self::Ledger => &LEDGER_BASELINE,
        }
    }
}

struct Mode {
    name: &'static str,
    /// The `BENCH_MODES` name that selects it.
    group: &'static str,
    env: &'static [(&'static str, &'static str)],
    backend: Backend,
    route: Route,
    keys: Keys,
    /// The target ratio to the baseline (DESIGN §10), if there is one.
    target: Option<f64>,
    /// How many requests (new keys) the warm-up sends at least before the measured run:
    /// the memory store is measured once a million keys have gone through it (full, and
    /// evicting), not while it fills.
    keys_before: u64,
}

const BASELINE: Mode = Mode {
    name: "baseline (IDEMPOTENCY=off)",
    group: "baseline",
    env: &[("IDEMPOTENCY", "off")],
    backend: Backend::Nothing,
    route: Route::Orders,
    keys: Keys::New,
    target: None,
    keys_before: 0,
};

const LEDGER_BASELINE: Mode = Mode {
    name: "baseline POST /ledger (IDEMPOTENCY=off, PostgreSQL)",
    group: "baseline",
    env: &[("IDEMPOTENCY", "off")],
    backend: Backend::Postgres,
    route: Route::Ledger,
    keys: Keys::New,
    target: None,
    keys_before: 0,
};

/// The `BENCH_MODES` names, in the order the modes run.
const GROUPS: [&str; 6] = [
    "redis",
    "memory",
    "unguarded",
    "replicated",
    "cluster",
    "postgres",
];

const MODES: [Mode; 14] = [
    Mode {
        name: "Redis, new key",
        group: "redis",
        env: &[],
        backend: Backend::Redis,
        route: Route::Orders,
        keys: Keys::New,
        target: Some(0.50),
        keys_before: 0,
    },
    Mode {
        name: "Redis, replay",
        group: "redis",
        env: &[],
        backend: Backend::Redis,
        route: Route::Orders,
        keys: Keys::Replay,
        target: Some(0.65),
        keys_before: 0,
    },
    Mode {
        name: "Redis, replay, REPLAY_CACHE=on",
        group: "redis",
        env: &[("REPLAY_CACHE", "on")],
        backend: Backend::Redis,
        route: Route::Orders,
        keys: Keys::Replay,
        target: Some(0.90),
        keys_before: 0,
    },
    Mode {
        name: "memory, new key, after 1 000 000 keys",
        group: "memory",
        env: &[],
        backend: Backend::Nothing,
        route: Route::Orders,
        keys: Keys::New,
        target: Some(0.60),
        keys_before: 1_000_000,
    },
    Mode {
        name: "memory, replay",
        group: "memory",
        env: &[],
        backend: Backend::Nothing,
        route: Route::Orders,
        keys: Keys::Replay,
        target: Some(0.90),
        keys_before: 0,
    },
    Mode {
        name: "Redis, no key (protected route)",
        group: "redis",
        env: &[],
        backend: Backend::Redis,
        route: Route::Orders,
        keys: Keys::None,
        target: Some(0.95),
        keys_before: 0,
    },
    Mode {
        name: "unguarded layer, new key",
        group: "unguarded",
        env: &[],
        backend: Backend::UnguardedRedis,
        route: Route::Orders,
        keys: Keys::New,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "unguarded layer, replay",
        group: "unguarded",
        env: &[],
        backend: Backend::UnguardedRedis,
        route: Route::Orders,
        keys: Keys::Replay,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "Redis + 1 replica, new key, IDEMPOTENCY_REPLICAS=1",
        group: "replicated",
        env: &[("IDEMPOTENCY_REPLICAS", "1")],
        backend: Backend::RedisReplicated,
        route: Route::Orders,
        keys: Keys::New,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "Redis Cluster (3 primaries), new key",
        group: "cluster",
        env: &[],
        backend: Backend::RedisCluster,
        route: Route::Orders,
        keys: Keys::New,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "Redis Cluster (3 primaries), replay",
        group: "cluster",
        env: &[],
        backend: Backend::RedisCluster,
        route: Route::Orders,
        keys: Keys::Replay,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "PostgreSQL, new key",
        group: "postgres",
        env: &[],
        backend: Backend::Postgres,
        route: Route::Orders,
        keys: Keys::New,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "PostgreSQL, replay",
        group: "postgres",
        env: &[],
        backend: Backend::Postgres,
        route: Route::Orders,
        keys: Keys::Replay,
        target: None,
        keys_before: 0,
    },
    Mode {
        name: "PostgreSQL, POST /ledger, new key (transactional)",
        group: "postgres",
        env: &[],
        backend: Backend::Postgres,
        route: Route::Ledger,
        keys: Keys::New,
        target: None,
        keys_before: 0,
    },
];

/// What one mode measured.
struct Measured {
    /// The most requests per second the CPU the processes spent per request allows (see the
    /// module docs, "× baseline by CPU").
    cpu_bound_per_second: f64,
    per_second: f64,
    p99: Duration,
    /// Responses with a status of 400 or more (wrk's `errors.status`, which counts
    /// `status > 399` only: a 1xx or 3xx response is not counted).
    status_errors: u64,
    /// wrk's socket errors: connect, read, write and timeout.
    socket_errors: u64,
    server_cpu_per_request: Duration,
    wrk_cpu_per_request: Duration,
    redis_cpu_per_request: Option<Duration>,
    redis_commands_per_request: Option<f64>,
    /// The share of the machine's CPU time that the hypervisor gave to something else
    /// during the run (`steal`).
    steal: f64,
}

fn main() -> ExitCode {
    if let Err(error) = listen_for_stop_signals() {
        eprintln!("load_benchmark: cannot listen for SIGINT and SIGTERM: {error}");
        return ExitCode::FAILURE;
    }
    let result = run();
    // `run` has returned, so what it started is stopped (its guards' `Drop`): the reference
    // server, every Redis server, the database dropped (or a line above saying it could not
    // be), the working directory removed.
    if let Some((name, number)) = stop_signal() {
        eprintln!(
            "load_benchmark: {name}: run stopped; the servers it started are stopped and its \
             database, if it made one, dropped"
        );
        return ExitCode::from(128 + number);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("load_benchmark: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The number of the first SIGINT or SIGTERM received, 0 while none has come.
static STOP_SIGNAL: AtomicU8 = AtomicU8::new(0);

/// The stop signal received, if one has come: its name and number.
fn stop_signal() -> Option<(&'static str, u8)> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        2 => Some(("SIGINT", 2)),
        15 => Some(("SIGTERM", 15)),
        number => Some(("a stop signal", number)),
    }
}

/// An error if a stop signal has come: every long wait checks it, so that `run` returns
/// and the guards of what it started (`Server`, `Redis`, `RedisCluster`, `Database`,
/// `WorkDir`) stop and remove it.
fn check_stop() -> Result<(), Error> {
    match stop_signal() {
        Some((name, _)) => Err(format!("stopped by {name}").into()),
        None => Ok(()),
    }
}

/// From now on, SIGINT and SIGTERM no longer end this process: a thread of its own records
/// the first in [`STOP_SIGNAL`], and the run stops at its next [`check_stop`] (within
/// [`POLL`] while it waits for `wrk`, which is then killed). Children get the default
/// handling back when they start.
fn listen_for_stop_signals() -> Result<(), Error> {
    let (listening, ready) = std::sync::mpsc::channel::<std::io::Result<()>>();
    std::thread::Builder::new()
        .name("stop-signals".to_owned())
        .spawn(move || {
            let runtime = match actix_web::rt::Runtime::new() {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = listening.send(Err(error));
                    return;
                }
            };
            runtime.block_on(async move {
                let mut signals = match StopSignals::listen() {
                    Ok(signals) => signals,
                    Err(error) => {
                        let _ = listening.send(Err(error));
                        return;
                    }
                };
                let _ = listening.send(Ok(()));
                loop {
                    let (_, number) = signals.next().await;
                    // The first one counts; a second (Ctrl-C twice) does not cut the cleanup.
                    let _ =
                        STOP_SIGNAL.compare_exchange(0, number, Ordering::SeqCst, Ordering::SeqCst);
                }
            });
        })?;
    ready
        .recv()
        .map_err(|_| "the signal thread ended before listening")??;
    Ok(())
}

/// How often a wait for a child checks for a stop signal.
const POLL: Duration = Duration::from_millis(20);

/// Waits for `child` to exit; if a stop signal comes first, kills it and returns an error.
/// A child started as the leader of a process group of its own (`group`; see
/// [`own_process_group`]) is stopped with its whole group (SIGTERM), so that what it
/// started (cargo's `rustc`) does not run on.
fn wait_or_stop(child: &mut Child, group: bool) -> Result<ExitStatus, Error> {
    loop {
        if let Some(status) = child.try_wait()? {
            // A Ctrl-C reaches the child too (wrk ends its run early on SIGINT).
            check_stop()?;
            return Ok(status);
        }
        if let Err(stopped) = check_stop() {
            if !(group && stop_process_group(child.id())) {
                let _ = child.kill();
            }
            let _ = child.wait();
            return Err(stopped);
        }
        std::thread::sleep(POLL);
    }
}

/// Makes the child `command` starts the leader of a process group of its own.
fn own_process_group(command: &mut Command) -> &mut Command {
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(command, 0);
    command
}

/// Sends SIGTERM to the process group `leader` leads (with `kill`, which procps and every
/// Unix have); whether it was sent.
fn stop_process_group(leader: u32) -> bool {
    cfg!(unix)
        && Command::new("kill")
            .args(["-s", "TERM", "--", &format!("-{leader}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
}

/// `command.output()`, but stopped (the child killed) by a stop signal.
fn output_or_stop(command: &mut Command) -> Result<Output, Error> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Read both pipes while waiting, so the child never blocks on a full one.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|pipe| Box::new(pipe) as _));
    let stderr = drain(child.stderr.take().map(|pipe| Box::new(pipe) as _));
    let status = wait_or_stop(&mut child, false)?;
    Ok(Output {
        status,
        stdout: stdout.join().map_err(|_| "a pipe reader panicked")?,
        stderr: stderr.join().map_err(|_| "a pipe reader panicked")?,
    })
}

/// The benchmark's working directory (the servers' current directory, the cluster's node
/// files, the wrk script, the server log), removed when dropped: after the servers, which
/// are declared after it.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create() -> Result<Self, Error> {
        let path =
            std::env::temp_dir().join(format!("idempotency-load-benchmark-{}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(Self(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `BENCH_MODES` names asked for (all of them when unset or empty).
fn selected_groups() -> Result<Vec<&'static str>, Error> {
    let asked = std::env::var("BENCH_MODES").unwrap_or_default();
    if asked.trim().is_empty() {
        return Ok(GROUPS.to_vec());
    }
    asked
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| {
            GROUPS
                .iter()
                .copied()
                .find(|group| group.eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    format!(
                        "BENCH_MODES names {name:?}; the modes are {}",
                        GROUPS.join(",")
                    )
                    .into()
                })
        })
        .collect()
}

fn run() -> Result<(), Error> {
    let redis_server = redis_server();
    for (tool, package) in [
        ("wrk", "wrk"),
        (redis_server.as_str(), "redis-server"),
        ("redis-cli", "redis-tools"),
    ] {
        if Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Err(format!("`{tool}` is not installed: apt-get install -y {package}").into());
        }
    }
    let seconds: u64 = env_number("BENCH_SECONDS", 8)?;
    let connections: u64 = env_number("BENCH_CONNECTIONS", 32)?;
    let rounds: u64 = env_number("BENCH_ROUNDS", 1)?.max(1);
    let groups = selected_groups()?;
    let server = build_example("reference_server")?;
    let unguarded = if groups.contains(&"unguarded") {
        Some(build_example("unguarded_layer")?)
    } else {
        None
    };
    // Declared before every server, so dropped (removed) after them.
    let work_dir = WorkDir::create()?;
    let work = work_dir.0.clone();
    let redis = Redis::start(&work, &[])?;
    // What a group needs but is missing: its modes are skipped, with the reason printed.
    let cluster = if groups.contains(&"cluster") {
        RedisCluster::start(&work).map_err(|error| format!("no Redis Cluster: {error}"))
    } else {
        Err("not selected".to_owned())
    };
    let database = if groups.contains(&"postgres") {
        Database::create().map_err(|error| format!("no PostgreSQL: {error}"))
    } else {
        Err("not selected".to_owned())
    };

    println!(
        "wrk -t1 -c{connections} -d{seconds}s, POST /orders (POST /ledger where named), WORKERS=1, {PAGE_FULL_RETAIN}={}, private {} on port {}",
        page_full_retain(),
        server_version(&redis_server),
        redis.port
    );
    if let Ok(cluster) = &cluster {
        println!(
            "private Redis Cluster (3 primaries, no replicas) on ports {}",
            cluster.ports().join(",")
        );
    }
    if let Ok(database) = &database {
        println!("PostgreSQL: fresh database {}", database.url);
    }
    println!("BENCH_MODES={}", groups.join(","));
    let mut skipped = Vec::new();
    let missing = [
        ("cluster", cluster.as_ref().err()),
        ("postgres", database.as_ref().err()),
    ];
    for (group, reason) in missing {
        if let Some(reason) = reason
            && groups.contains(&group)
        {
            let line = format!("skipped: the {group} modes ({reason})");
            println!("{line}");
            skipped.push(line);
        }
    }
    println!("load before: {}", load_average());
    let load = Load {
        server: &server,
        unguarded: unguarded.as_deref(),
        work: &work,
        redis: &redis,
        replica: None,
        cluster: cluster.as_ref().ok(),
        database: database.as_ref().ok(),
        seconds,
        connections,
    };
    // The baseline runs before and after every mode; each mode is compared with the mean of
    // the two baselines around it, so a change in the machine's load during the run (other
    // processes) moves both sides of a ratio alike. A mode on `POST /ledger` has a baseline
    // of its own (the unprotected route, which writes its row too).
    let mut baselines: Vec<(Route, Vec<Measured>)> = vec![(Route::Orders, Vec::new())];
    let mut last_baseline = None;
    // Each mode's runs, one per round, each with the baseline around it.
    let mut results: Vec<(&Mode, Vec<(Measured, Baseline)>)> = Vec::new();
    for round in 1..=rounds {
        if rounds > 1 {
            eprintln!("load_benchmark: round {round} of {rounds}");
        }
        for mode in MODES.iter().filter(|mode| groups.contains(&mode.group)) {
            check_stop()?;
            let ready = match mode.backend {
                Backend::RedisCluster => load.cluster.is_some(),
                Backend::Postgres => load.database.is_some(),
                _ => true,
            };
            if !ready {
                continue;
            }
            let replica = if mode.backend == Backend::RedisReplicated {
                match Redis::start_replica(&work, &redis) {
                    Ok(replica) => Some(replica),
                    Err(error) => {
                        let line = format!("skipped: {} (no replica: {error})", mode.name);
                        println!("{line}");
                        skipped.push(line);
                        continue;
                    }
                }
            } else {
                None
            };
            let mode_load = Load {
                replica: replica.as_ref(),
                ..load
            };
            let route_index = match baselines.iter().position(|(route, _)| *route == mode.route) {
                Some(index) => index,
                None => {
                    baselines.push((mode.route, Vec::new()));
                    baselines.len() - 1
                }
            };
            if last_baseline != Some(mode.route) {
                let before = load.measure(mode.route.baseline())?;
                baselines[route_index].1.push(before);
            }
            let measured = mode_load.measure(mode)?;
            drop(replica);
            let after = load.measure(mode.route.baseline())?;
            baselines[route_index].1.push(after);
            last_baseline = Some(mode.route);
            let around = &baselines[route_index].1[baselines[route_index].1.len() - 2..];
            let baseline = Baseline {
                per_second: (around[0].per_second + around[1].per_second) / 2.0,
                cpu_bound: (around[0].cpu_bound_per_second + around[1].cpu_bound_per_second) / 2.0,
            };
            match results
                .iter_mut()
                .find(|(known, _)| std::ptr::eq(*known, mode))
            {
                Some((_, runs)) => runs.push((measured, baseline)),
                None => results.push((mode, vec![(measured, baseline)])),
            }
        }
    }
    if baselines[0].1.is_empty() {
        baselines[0].1.push(load.measure(&BASELINE)?);
    }
    println!("load after: {}", load_average());

    println!();
    println!(
        "| mode | req/s | × baseline (target) | × baseline by CPU | p99 | server CPU / req | Redis CPU / req | wrk CPU / req | Redis commands / req | status ≥ 400, socket errors | steal | rounds: × baseline, lowest–highest |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (route, measured) in &baselines {
        let count = measured.len() as f64;
        let mean = Baseline {
            per_second: measured.iter().map(|b| b.per_second).sum::<f64>() / count,
            cpu_bound: measured.iter().map(|b| b.cpu_bound_per_second).sum::<f64>() / count,
        };
        let label = match route {
            Route::Orders => "baseline",
            Route::Ledger => "baseline POST /ledger",
        };
        for (i, measured) in measured.iter().enumerate() {
            print_row(&format!("{label} {}", i + 1), measured, &mean, None, "—");
        }
    }
    for (mode, runs) in &mut results {
        // The run of median ratio stands for the mode; the spread says how steady it was.
        let ratio = |(run, baseline): &(Measured, Baseline)| run.per_second / baseline.per_second;
        runs.sort_by(|a, b| ratio(a).total_cmp(&ratio(b)));
        let spread = match (runs.first(), runs.last()) {
            (Some(lowest), Some(highest)) if runs.len() > 1 => format!(
                "{}: {:.2}–{:.2}×",
                runs.len(),
                ratio(lowest),
                ratio(highest)
            ),
            _ => "1".to_owned(),
        };
        let (measured, baseline) = &runs[(runs.len() - 1) / 2];
        print_row(mode.name, measured, baseline, mode.target, &spread);
    }
    for line in &skipped {
        println!("{line}");
    }
    // Over every measured run, not only the rounds shown (warm-ups not counted). wrk counts
    // a response as an error only for a status of 400 or more: a 1xx or 3xx would pass.
    let all_runs = baselines.iter().flat_map(|(_, runs)| runs.iter()).chain(
        results
            .iter()
            .flat_map(|(_, runs)| runs.iter().map(|(run, _)| run)),
    );
    let (status_errors, socket_errors) = all_runs.fold((0, 0), |(status, socket), run| {
        (status + run.status_errors, socket + run.socket_errors)
    });
    println!(
        "All measured runs: {status_errors} responses with a status of 400 or more, \
         {socket_errors} socket errors (wrk counts no other status as an error)."
    );
    // What it started is stopped by its guards, in the reverse order of their declaration:
    // the database, the cluster, the private Redis, then the working directory.
    Ok(())
}

/// The baseline a mode is compared with.
struct Baseline {
    per_second: f64,
    /// Its [`Measured::cpu_bound_per_second`].
    cpu_bound: f64,
}

fn print_row(
    name: &str,
    measured: &Measured,
    baseline: &Baseline,
    target: Option<f64>,
    rounds: &str,
) {
    let ratio = measured.per_second / baseline.per_second;
    let ratio = match target {
        // A third decimal where two would round a miss up to its target.
        Some(target) if ratio < target && format!("{ratio:.2}") == format!("{target:.2}") => {
            format!("{ratio:.3}× (≥ {target:.2}, missed)")
        }
        Some(target) => format!(
            "{ratio:.2}× (≥ {target:.2}{})",
            if ratio >= target { "" } else { ", missed" }
        ),
        None => format!("{ratio:.2}×"),
    };
    let by_cpu = measured.cpu_bound_per_second / baseline.cpu_bound;
    let micros = |duration: Duration| format!("{:.1} µs", duration.as_secs_f64() * 1e6);
    println!(
        "| {name} | {:.0} | {ratio} | {by_cpu:.2}× | {:.2} ms | {} | {} | {} | {} | {}, {} | {:.1} % | {rounds} |",
        measured.per_second,
        measured.p99.as_secs_f64() * 1e3,
        micros(measured.server_cpu_per_request),
        measured
            .redis_cpu_per_request
            .map_or("—".to_owned(), micros),
        micros(measured.wrk_cpu_per_request),
        measured
            .redis_commands_per_request
            .map_or("—".to_owned(), |commands| format!("{commands:.2}")),
        measured.status_errors,
        measured.socket_errors,
        measured.steal * 100.0,
    );
}

/// The binary of the benchmark's Redis servers: `BENCH_REDIS_SERVER`, e.g. `valkey-server`,
/// else `redis-server`.
fn redis_server() -> String {
    std::env::var("BENCH_REDIS_SERVER")
        .ok()
        .filter(|server| !server.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// mimalloc's option that keeps full pages in their size class's queue (see the module's
/// docs), set for the reference server and the comparator.
const PAGE_FULL_RETAIN: &str = "MIMALLOC_PAGE_FULL_RETAIN";

/// The value of [`PAGE_FULL_RETAIN`] for the servers: the environment's, else 0.
fn page_full_retain() -> String {
    std::env::var(PAGE_FULL_RETAIN)
        .ok()
        .filter(|value| !value.is_empty())
        .unwrap_or_else(|| "0".to_owned())
}

/// `server --version`, shortened to its name and version (`Redis server v=7.0.15`).
fn server_version(server: &str) -> String {
    Command::new(server)
        .arg("--version")
        .output()
        .map(|output| {
            String::from_utf8_lossy(&output.stdout)
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| server.to_owned())
}

fn env_number(name: &str, default: u64) -> Result<u64, Error> {
    match std::env::var(name) {
        Ok(value) => Ok(value
            .parse()
            .map_err(|_| format!("{name}={value:?} is not a number"))?),
        Err(_) => Ok(default),
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|line| {
            line.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Builds the example `name` (release; the reference server, the comparator) and returns the
/// path cargo built it at: read from cargo's own report of the build, not guessed from this
/// executable's directory, which for a benchmark run without `--release` holds a debug
/// build of it (perhaps stale) that would be measured instead.
fn build_example(name: &str) -> Result<PathBuf, Error> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    // A group of its own, so that a stop signal stops its `rustc`s too.
    let mut child = own_process_group(&mut Command::new(cargo))
        .args([
            "build",
            "--release",
            "-p",
            "idempotency-actix-examples",
            "--example",
            name,
            "--message-format=json-render-diagnostics",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()?;
    // Read as it comes (one line per crate built, more than a pipe holds).
    let report = child.stdout.take().ok_or("no output from cargo")?;
    let wanted = name.to_owned();
    let reader = std::thread::spawn(move || {
        BufReader::new(report)
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| executable_of(&line, &wanted))
            .last()
    });
    let status = wait_or_stop(&mut child, true)?;
    if !status.success() {
        return Err(format!("building the example {name} failed").into());
    }
    let path = reader
        .join()
        .map_err(|_| "reading cargo's report failed")?
        .ok_or_else(|| format!("cargo named no executable for the example {name}"))?;
    if !path.exists() {
        return Err(format!("no {name} at {}", path.display()).into());
    }
    Ok(path)
}

/// The executable of the example `name` in `line`, a message of cargo's JSON report, if
/// that is what the line reports.
fn executable_of(line: &str, name: &str) -> Option<PathBuf> {
    let message: serde_json::Value = serde_json::from_str(line).ok()?;
    if message["reason"] != "compiler-artifact" || message["target"]["name"] != name {
        return None;
    }
    message["executable"].as_str().map(PathBuf::from)
}

/// A `redis-server` of the benchmark's own, on a free loopback port.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    /// Starts `redis-server` on a free loopback port with `args` added, nothing persisted.
    fn start(work: &Path, args: &[&str]) -> Result<Self, Error> {
        Self::start_on(work, free_port()?, args)
    }

    fn start_on(work: &Path, port: u16, args: &[&str]) -> Result<Self, Error> {
        let child = Command::new(redis_server())
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(args)
            .current_dir(work)
            .stdout(Stdio::null())
            .spawn()?;
        let redis = Self { child, port };
        redis.wait_for("to answer PING", |redis| {
            Ok(redis.cli(&["PING"])?.trim() == "PONG")
        })?;
        Ok(redis)
    }

    /// Starts a replica of `primary` and waits until it is in sync.
    fn start_replica(work: &Path, primary: &Self) -> Result<Self, Error> {
        let primary_port = primary.port.to_string();
        let replica = Self::start(work, &["--replicaof", "127.0.0.1", &primary_port])?;
        replica.wait_for("to sync with its primary", |replica| {
            Ok(replica
                .cli(&["INFO", "replication"])?
                .contains("master_link_status:up"))
        })?;
        Ok(replica)
    }

    /// Polls `ready` until it holds, for at most 30 s.
    fn wait_for(
        &self,
        what: &str,
        ready: impl Fn(&Self) -> Result<bool, Error>,
    ) -> Result<(), Error> {
        let started = Instant::now();
        while !ready(self).unwrap_or(false) {
            check_stop()?;
            if started.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "redis-server on port {} did not {what} within 30 s",
                    self.port
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli -e -p PORT args…`'s output; an error naming the command if it cannot
    /// connect or the server answers an error (`-e` makes that exit with a failure).
    fn cli(&self, args: &[&str]) -> Result<String, Error> {
        let port = self.port.to_string();
        let command = || format!("`redis-cli -p {port} {}`", args.join(" "));
        let output = Command::new("redis-cli")
            .args(["-e", "-p", &port])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|error| format!("{} could not run: {error}", command()))?;
        let stdout = String::from_utf8(output.stdout)
            .map_err(|_| format!("{} answered something not UTF-8", command()))?;
        if !output.status.success() {
            let said = format!("{stdout} {}", String::from_utf8_lossy(&output.stderr));
            return Err(format!(
                "{} failed ({}): {}",
                command(),
                output.status,
                said.split_whitespace().collect::<Vec<_>>().join(" ")
            )
            .into());
        }
        Ok(stdout)
    }

    /// `INFO section`, checked to be that section (a server that answers nothing for it
    /// would otherwise read as zeros).
    fn info(&self, section: &str) -> Result<String, Error> {
        let info = self.cli(&["INFO", section])?;
        if !info
            .lines()
            .any(|line| line.trim().eq_ignore_ascii_case(&format!("# {section}")))
        {
            return Err(format!(
                "`redis-cli -p {} INFO {section}` answered without its section: {:?}",
                self.port,
                info.chars().take(200).collect::<String>()
            )
            .into());
        }
        Ok(info)
    }

    /// User + system CPU time of the server so far.
    fn cpu(&self) -> Result<Duration, Error> {
        let info = self.info("cpu")?;
        let field = |name: &str| -> Result<f64, Error> {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|value| value.trim().parse().ok())
                .ok_or_else(|| {
                    format!(
                        "`redis-cli -p {} INFO cpu` answered without a number for {name}",
                        self.port
                    )
                    .into()
                })
        };
        Ok(Duration::from_secs_f64(
            field("used_cpu_sys")? + field("used_cpu_user")?,
        ))
    }

    /// Whether it is a primary (a replica's command counts repeat its primary's writes).
    fn is_primary(&self) -> Result<bool, Error> {
        let info = self.info("replication")?;
        match info
            .lines()
            .find_map(|line| line.trim().strip_prefix("role:"))
        {
            Some(role) => Ok(role == "master"),
            None => Err(format!(
                "`redis-cli -p {} INFO replication` answered without a role",
                self.port
            )
            .into()),
        }
    }

    /// Commands run since the last reset (what clients sent and what scripts ran), leaving
    /// out this benchmark's own `INFO`/`CONFIG` and the replicas' `REPLCONF`; then resets
    /// the counts.
    fn take_commands(&self) -> Result<BTreeMap<String, u64>, Error> {
        let info = self.info("commandstats")?;
        let reset = self.cli(&["CONFIG", "RESETSTAT"])?;
        if reset.trim() != "OK" {
            return Err(format!(
                "`redis-cli -p {} CONFIG RESETSTAT` answered {:?}, not OK",
                self.port,
                reset.trim()
            )
            .into());
        }
        let mut commands = BTreeMap::new();
        for line in info.lines().map(str::trim) {
            let Some(stats) = line.strip_prefix("cmdstat_") else {
                continue;
            };
            let calls = stats.split_once(':').and_then(|(name, stats)| {
                // A subcommand (`config|resetstat`) counts as its command.
                let name = name.split('|').next().unwrap_or(name);
                let calls = stats.split(',').find_map(|s| s.strip_prefix("calls="))?;
                Some((name, calls.parse::<u64>().ok()?))
            });
            let (name, calls) = calls.ok_or_else(|| {
                format!(
                    "`redis-cli -p {} INFO commandstats`: unreadable line {line:?}",
                    self.port
                )
            })?;
            if !["info", "config", "replconf"].contains(&name) {
                *commands.entry(name.to_owned()).or_insert(0) += calls;
            }
        }
        Ok(commands)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A private Redis Cluster: 3 primaries, no replicas, each node a `redis-server
/// --cluster-enabled yes` on a free loopback port. Dropping it stops the nodes.
struct RedisCluster {
    nodes: Vec<Redis>,
}

/// The highest data port a cluster node may use: its cluster bus listens on port + 10000.
const MAX_CLUSTER_PORT: u16 = 55_535;

impl RedisCluster {
    fn start(work: &Path) -> Result<Self, Error> {
        let mut nodes: Vec<Redis> = Vec::new();
        for _ in 0..3 {
            let port = free_cluster_port(&nodes)?;
            let config = format!("nodes-{port}.conf");
            nodes.push(Redis::start_on(
                work,
                port,
                &["--cluster-enabled", "yes", "--cluster-config-file", &config],
            )?);
        }
        let cluster = Self { nodes };
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(
                cluster
                    .ports()
                    .iter()
                    .map(|port| format!("127.0.0.1:{port}")),
            )
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()?;
        if !output.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&output.stdout)
            )
            .into());
        }
        for node in &cluster.nodes {
            node.wait_for("to report cluster_state:ok", |node| {
                Ok(node.cli(&["CLUSTER", "INFO"])?.contains("cluster_state:ok"))
            })?;
        }
        Ok(cluster)
    }

    fn ports(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| node.port.to_string())
            .collect()
    }

    /// The seed URLs for `REDIS_CLUSTER_URLS`.
    fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(Redis::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A free loopback port at most [`MAX_CLUSTER_PORT`] whose bus port is free too, not used by
/// `taken`.
fn free_cluster_port(taken: &[Redis]) -> Result<u16, Error> {
    for _ in 0..1_000 {
        let port = free_port()?;
        if port <= MAX_CLUSTER_PORT
            && !taken.iter().any(|node| node.port == port)
            && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return Ok(port);
        }
    }
    Err(format!("no free loopback port pair at or below {MAX_CLUSTER_PORT}").into())
}

/// A fresh database on the PostgreSQL server at `BENCH_DATABASE_URL`, created with `psql`
/// and dropped when this is dropped.
struct Database {
    /// Where to connect to create and drop it.
    admin_url: String,
    name: String,
    /// Its URL, for `DATABASE_URL`.
    url: String,
}

impl Database {
    fn create() -> Result<Self, Error> {
        let admin_url = std::env::var("BENCH_DATABASE_URL")
            .ok()
            .filter(|url| !url.is_empty())
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let name = format!("idempotency_load_benchmark_{}", std::process::id());
        psql(&admin_url, &format!("CREATE DATABASE {name}"))
            .map_err(|error| format!("cannot create a database at {admin_url}: {error}"))?;
        let url = with_database(&admin_url, &name);
        Ok(Self {
            admin_url,
            name,
            url,
        })
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        let dropped = psql(
            &self.admin_url,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
        if let Err(error) = dropped {
            eprintln!(
                "load_benchmark: could not drop database {}: {error}",
                self.name
            );
        }
    }
}

/// Runs one SQL statement with `psql`; its error output on failure.
fn psql(url: &str, sql: &str) -> Result<(), Error> {
    let output = Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql])
        .env("PGCONNECT_TIMEOUT", "5")
        .stdin(Stdio::null())
        .output()
        .map_err(|error| {
            format!("cannot run psql ({error}): apt-get install -y postgresql-client")
        })?;
    if output.status.success() {
        Ok(())
    } else {
        // On one line, so the printed reason for a skip stays one line.
        let error = String::from_utf8_lossy(&output.stderr);
        Err(error
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .into())
    }
}

/// `url` with its database name replaced by `name` (query parameters kept).
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, ""), |(base, query)| (base, query));
    let authority_start = base.find("://").map_or(0, |index| index + 3);
    let server = match base[authority_start..].find('/') {
        Some(slash) => &base[..authority_start + slash],
        None => base,
    };
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    format!("{server}/{name}{query}")
}

/// Everything a measurement needs.
#[derive(Clone, Copy)]
struct Load<'a> {
    server: &'a Path,
    /// The comparator (`examples/unguarded_layer.rs`), when its modes were asked for.
    unguarded: Option<&'a Path>,
    work: &'a Path,
    redis: &'a Redis,
    /// The replica of `redis`, while a mode with replicated writes runs.
    replica: Option<&'a Redis>,
    cluster: Option<&'a RedisCluster>,
    database: Option<&'a Database>,
    seconds: u64,
    connections: u64,
}

impl Load<'_> {
    fn measure(&self, mode: &Mode) -> Result<Measured, Error> {
        eprintln!("load_benchmark: {} ...", mode.name);
        let prefix = format!(
            "bench-{}:",
            mode.name.replace([' ', ',', '(', ')', '='], "")
        );
        let binary = match mode.backend {
            Backend::UnguardedRedis => self.unguarded.ok_or("the comparator was not built")?,
            _ => self.server,
        };
        let mut command = Command::new(binary);
        command
            .env("BIND", "127.0.0.1:0")
            .env("WORKERS", "1")
            .env("IDEMPOTENCY_PREFIX", &prefix)
            .env_remove("REDIS_URL")
            .env_remove("REDIS_CLUSTER_URLS")
            .env_remove("DATABASE_URL")
            .env_remove("IDEMPOTENCY_REPLICAS")
            .env_remove("REPLAY_CACHE")
            .env_remove("IDEMPOTENCY")
            .env_remove("IDEMPOTENCY_METHODS")
            .env_remove("LOG_LEVEL");
        match mode.backend {
            Backend::Nothing => {}
            Backend::Redis | Backend::RedisReplicated | Backend::UnguardedRedis => {
                command.env("REDIS_URL", self.redis.url());
            }
            Backend::RedisCluster => {
                let cluster = self.cluster.ok_or("no Redis Cluster")?;
                command.env("REDIS_CLUSTER_URLS", cluster.urls());
            }
            Backend::Postgres => {
                let database = self.database.ok_or("no PostgreSQL database")?;
                command.env("DATABASE_URL", &database.url);
            }
        }
        command.env(PAGE_FULL_RETAIN, page_full_retain());
        for (name, value) in mode.env {
            command.env(name, value);
        }
        let server = Server::start(command, &self.work.join("server.log"))?;

        let fixed_key = "load-benchmark-replay";
        if mode.keys == Keys::Replay {
            let first = post(server.addr, mode.route, fixed_key)?;
            let again = post(server.addr, mode.route, fixed_key)?;
            if !first.starts_with("HTTP/1.1 201")
                || !again
                    .to_ascii_lowercase()
                    .contains("idempotent-replayed: true")
            {
                return Err(format!("the replay key did not replay:\n{first}\n{again}").into());
            }
        }
        let script = self.work.join("request.lua");
        std::fs::write(&script, lua_script(mode.keys, fixed_key, mode.route))?;
        let url = format!("http://{}{}", server.addr, mode.route.path());

        // Warm up (connections, caches, the script load), then measure.
        let nodes = self.redis_nodes(mode.backend);
        let mut warmed = self.wrk(&script, &url, 1)?.requests;
        while warmed < mode.keys_before {
            warmed += self.wrk(&script, &url, 5)?.requests;
        }
        let server_cpu = process_cpu(server.child.id())?;
        let redis_cpu_before = redis_cpu(&nodes)?;
        redis_commands(&nodes)?;
        let wrk_cpu = children_cpu()?;
        let machine = MachineCpu::now()?;
        let run = self.wrk(&script, &url, self.seconds)?;
        let steal = MachineCpu::now()?.stolen_since(machine);
        let wrk_cpu = children_cpu()?.saturating_sub(wrk_cpu);
        let server_cpu = process_cpu(server.child.id())?.saturating_sub(server_cpu);
        let redis_cpu = redis_cpu(&nodes)?.saturating_sub(redis_cpu_before);
        let commands = redis_commands(&nodes)?;
        drop(server);

        let requests = run.requests.max(1);
        let per_request = |total: Duration| total / u32::try_from(requests).unwrap_or(u32::MAX);
        let touches_redis = !nodes.is_empty();
        let one_thread_each: Vec<Duration> = [server_cpu, wrk_cpu]
            .into_iter()
            .chain((nodes.len() == 1).then_some(redis_cpu))
            .collect();
        Ok(Measured {
            cpu_bound_per_second: cpu_bound_per_second(
                per_request(server_cpu + redis_cpu + wrk_cpu),
                one_thread_each.into_iter().map(per_request),
            ),
            per_second: run.requests as f64 / run.duration.as_secs_f64(),
            p99: run.p99,
            status_errors: run.status_errors,
            socket_errors: run.socket_errors,
            server_cpu_per_request: per_request(server_cpu),
            wrk_cpu_per_request: per_request(wrk_cpu),
            redis_cpu_per_request: touches_redis.then(|| per_request(redis_cpu)),
            redis_commands_per_request: touches_redis.then(|| commands as f64 / requests as f64),
            steal,
        })
    }

    /// The Redis servers a mode's server talks to, replicas included.
    fn redis_nodes(&self, backend: Backend) -> Vec<&Redis> {
        match backend {
            Backend::Nothing | Backend::Postgres => Vec::new(),
            Backend::Redis | Backend::UnguardedRedis => vec![self.redis],
            Backend::RedisReplicated => std::iter::once(self.redis).chain(self.replica).collect(),
            Backend::RedisCluster => self
                .cluster
                .map(|cluster| cluster.nodes.iter().collect())
                .unwrap_or_default(),
        }
    }

    fn wrk(&self, script: &Path, url: &str, seconds: u64) -> Result<WrkRun, Error> {
        let output = output_or_stop(
            Command::new("wrk")
                .args(["-t1", &format!("-c{}", self.connections)])
                .args([&format!("-d{seconds}s"), "--timeout", "5s", "-s"])
                .arg(script)
                .arg(url),
        )?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout
            .lines()
            .find_map(|line| line.strip_prefix("BENCH "))
            .ok_or_else(|| format!("wrk printed no summary:\n{stdout}"))?;
        let fields: BTreeMap<&str, u64> = line
            .split_whitespace()
            .filter_map(|field| {
                let (name, value) = field.split_once('=')?;
                Some((name, value.parse().ok()?))
            })
            .collect();
        let field = |name: &str| {
            fields
                .get(name)
                .copied()
                .ok_or_else(|| format!("wrk summary without {name}: {line}"))
        };
        Ok(WrkRun {
            requests: field("requests")?,
            duration: Duration::from_micros(field("duration_us")?),
            p99: Duration::from_micros(field("p99_us")?),
            status_errors: field("status_errors")?,
            socket_errors: field("socket_errors")?,
        })
    }
}

/// User + system CPU time of `nodes` so far, together.
/// The most requests per second that CPU per request allows: `total` (every process) on all
/// of the machine's cores, and each of `one_thread_each` (a process on one thread) on one.
fn cpu_bound_per_second(total: Duration, one_thread_each: impl Iterator<Item = Duration>) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    one_thread_each
        .map(|per_request| 1.0 / per_request.as_secs_f64())
        .fold(cores / total.as_secs_f64(), f64::min)
}

fn redis_cpu(nodes: &[&Redis]) -> Result<Duration, Error> {
    nodes.iter().map(|node| node.cpu()).sum()
}

/// The commands the primaries among `nodes` ran since the last call (see
/// [`Redis::take_commands`]), together; resets every node's counts.
fn redis_commands(nodes: &[&Redis]) -> Result<u64, Error> {
    let mut total = 0;
    for node in nodes {
        let primary = node.is_primary()?;
        let commands: u64 = node.take_commands()?.values().sum();
        if primary {
            total += commands;
        }
    }
    Ok(total)
}

struct WrkRun {
    requests: u64,
    duration: Duration,
    p99: Duration,
    /// See [`Measured::status_errors`].
    status_errors: u64,
    /// See [`Measured::socket_errors`].
    socket_errors: u64,
}

/// The wrk script: the same per-request work in every mode, only the key differs. It prints
/// one `BENCH` line that the benchmark reads.
fn lua_script(keys: Keys, fixed_key: &str, route: Route) -> String {
    let key = match keys {
        Keys::New => "headers['Idempotency-Key'] = prefix .. counter".to_owned(),
        Keys::Replay => format!("headers['Idempotency-Key'] = '{fixed_key}'"),
        Keys::None => "headers['Idempotency-Key'] = nil".to_owned(),
    };
    format!(
        r#"
local counter = 0
local prefix = string.format("%x-%x-", os.time(), math.random(0, 2^30))
local headers = {{ ["Content-Type"] = "application/json" }}
local body = '{body}'

request = function()
  counter = counter + 1
  {key}
  return wrk.format("POST", nil, headers, body)
end

-- summary.errors.status counts responses with a status > 399 only (wrk's own count; a
-- response() callback here would make wrk parse every response in Lua, at a CPU cost).
done = function(summary, latency, requests)
  local socket = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout
  io.write(string.format(
    "BENCH requests=%d duration_us=%d p99_us=%d status_errors=%d socket_errors=%d\n",
    summary.requests, summary.duration, latency:percentile(99), summary.errors.status, socket))
end
"#,
        body = route.body()
    )
}

/// A reference server, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(mut command: Command, log: &Path) -> Result<Self, Error> {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(addr) = line.strip_prefix("listening on http://") {
                        break addr.parse()?;
                    }
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = std::fs::read_to_string(log).unwrap_or_default();
                    return Err(format!("the server did not start:\n{log}").into());
                }
            }
        };
        // Keep reading stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Ok(Self { child, addr })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One keyed `POST` of `route` (to complete the replay key before a run); the raw response.
fn post(addr: SocketAddr, route: Route, key: &str) -> Result<String, Error> {
    let (path, body) = (route.path(), route.body());
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nIdempotency-Key: {key}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// User + system CPU time of process `pid` (all its threads) so far.
fn process_cpu(pid: u32) -> Result<Duration, Error> {
    // utime and stime are fields 14 and 15.
    proc_stat_cpu(&format!("/proc/{pid}/stat"), 14)
}

/// User + system CPU time of this process's children that have exited and been waited for
/// (each wrk run).
fn children_cpu() -> Result<Duration, Error> {
    // cutime and cstime are fields 16 and 17.
    proc_stat_cpu("/proc/self/stat", 16)
}

/// The sum of fields `field` and `field + 1` (1-based) of a `/proc/*/stat` file, in clock
/// ticks, as a duration.
fn proc_stat_cpu(path: &str, field: usize) -> Result<Duration, Error> {
    let stat = std::fs::read_to_string(path)?;
    // Fields after the command name (which may hold spaces) start with the state, field 3.
    let after_name = stat.rsplit_once(')').ok_or("unreadable /proc stat")?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields
        .get(field - 3)
        .zip(fields.get(field - 2))
        .and_then(|(user, system)| Some(user.parse::<u64>().ok()? + system.parse::<u64>().ok()?))
        .ok_or("unreadable /proc stat")?;
    Ok(Duration::from_secs_f64(
        ticks as f64 / clock_ticks_per_second(),
    ))
}

/// The machine's CPU time so far, all CPUs together, from the first line of `/proc/stat`,
/// in clock ticks.
#[derive(Clone, Copy)]
struct MachineCpu {
    /// Time a CPU of this machine wanted to run and the hypervisor ran something else.
    steal: u64,
    total: u64,
}

impl MachineCpu {
    fn now() -> Result<Self, Error> {
        let stat = std::fs::read_to_string("/proc/stat")?;
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .and_then(|line| line.strip_prefix("cpu "))
            .ok_or("unreadable /proc/stat")?
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|_| "unreadable /proc/stat")?;
        // user nice system idle iowait irq softirq steal, then guest time, which user and
        // nice already count.
        Ok(Self {
            steal: ticks.get(7).copied().unwrap_or(0),
            total: ticks.iter().take(8).sum(),
        })
    }

    /// The share of the CPU time since `before` that was stolen.
    fn stolen_since(self, before: Self) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            return 0.0;
        }
        self.steal.saturating_sub(before.steal) as f64 / total as f64
    }
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .and_then(|ticks| ticks.trim().parse().ok())
        .unwrap_or(100.0)
}
