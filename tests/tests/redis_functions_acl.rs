//! A Redis user that may not run `FUNCTION LOAD`, on a server of the test's own: while the
//! server lacks the store's functions, nothing could fence a commit, renew a lease or give a
//! key back, so a handler that ran would leave its key locked until the lease ran out and
//! then run again for a retry. So keyed requests are refused with 503 before any handler
//! runs; once someone who may loads the functions, the same user is served (it needs
//! `FCALL`, not `FUNCTION`). On Redis, Valkey, and a Redis Cluster of its own.
//!
//! Meanwhile the store opens a connection again (and looks for the functions) once per retry
//! interval (1 s) at most, however many requests it refuses: a flood of keyed requests is no
//! flood of connections, `FUNCTION LOAD`s and errors in the log against the server.

// Each test holds its turn for its whole run on its own runtime thread: the lock only makes
// the other tests of this binary wait.
#![allow(clippy::await_holding_lock)]

use std::io::Write;
use std::rc::Rc;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use futures_util::future::join_all;
use idempotency_actix::{
    Idempotency, IdempotencyPolicy, RedisClusterClient, RedisClusterStore, RedisStore,
    ReplicatedWrites,
};
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::{FloodServer, PrivateRedis};
use redis::aio::MultiplexedConnection;

/// The ACL of a user that may do everything but `FUNCTION` (so it may `FCALL`).
const NO_FUNCTION_LOAD: [&str; 7] = ["SETUSER", "app", "on", "nopass", "~*", "+@all", "-function"];

/// Adds the user `app` of [`NO_FUNCTION_LOAD`] to `redis`, on a connection as the default
/// user, which it gives.
async fn add_the_user_who_cannot_load(redis: &PrivateRedis) -> MultiplexedConnection {
    let mut admin = redis.connection().await;
    let _: () = redis::cmd("ACL")
        .arg(&NO_FUNCTION_LOAD[..])
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    admin
}

/// Adds the user `app` of [`NO_FUNCTION_LOAD`] to every node of `cluster`, and gives a
/// client of the cluster as that user.
fn add_the_user_who_cannot_load_to_the_cluster(cluster: &RedisCluster) -> RedisClusterClient {
    for port in cluster.ports() {
        let _: () = redis::cmd("ACL")
            .arg(&NO_FUNCTION_LOAD[..])
            .query(&mut cluster.connection(port))
            .expect("ACL SETUSER");
    }
    let app_urls: Vec<String> = cluster
        .ports()
        .iter()
        .map(|port| format!("redis://app:any@127.0.0.1:{port}"))
        .collect();
    RedisClusterStore::client(app_urls).expect("a client for the app user")
}

/// The URL of `user` (any password: the user has none) on `redis`.
fn url_of(redis: &PrivateRedis, user: &str) -> String {
    format!("redis://{user}:any@127.0.0.1:{}", redis.port())
}

/// How many keyed requests are refused while the functions are missing, in batches of
/// [`AT_ONCE`] sent together.
const REFUSED: usize = 200;
/// How many of them are in flight at once.
const AT_ONCE: usize = 20;
/// The pause after each batch: the refusals span three retry intervals (1 s) and more.
const PAUSE: Duration = Duration::from_millis(350);
/// How long the store may take to serve requests once the functions are loaded: its retry
/// interval (1 s) with room for a loaded machine.
const SERVED_WITHIN: Duration = Duration::from_secs(5);

/// Held by each test of this file for its whole run, on its own runtime thread (so the
/// blocking lock holds up only the tests waiting for their turn): `cargo test` runs a file's
/// tests side by side in one process, and some count the errors the process logs for missing
/// functions. Those run [`alone`]; the others, which count nothing and each start servers of
/// their own, run [`beside_each_other`].
static TURNS: RwLock<()> = RwLock::new(());

/// The turn of a test that no other test of this file may run beside.
fn alone() -> RwLockWriteGuard<'static, ()> {
    TURNS.write().unwrap_or_else(PoisonError::into_inner)
}

/// The turn of a test that counts nothing the process logs: it runs beside the other such
/// tests, never beside one that runs [`alone`].
fn beside_each_other() -> RwLockReadGuard<'static, ()> {
    TURNS.read().unwrap_or_else(PoisonError::into_inner)
}

#[actix_web::test]
async fn a_user_who_cannot_load_the_functions_is_refused_until_they_are_loaded() {
    let _turn = alone();
    refused_until_the_functions_are_loaded(PrivateRedis::start().await).await;
}

/// The same on Valkey ≥ 8.1, whose commits need no function (`SET … IFEQ`) but whose
/// renewals and releases do.
#[actix_web::test]
async fn a_valkey_user_who_cannot_load_the_functions_is_refused_until_they_are_loaded() {
    let _turn = alone();
    refused_until_the_functions_are_loaded(PrivateRedis::start_valkey(&[]).await).await;
}

async fn refused_until_the_functions_are_loaded(redis: PrivateRedis) {
    let mut admin = add_the_user_who_cannot_load(&redis).await;

    let pool = RedisStore::pool(&url_of(&redis, "app")).expect("a pool for the app user");
    let app = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    // The store's own connection: one connection per attempt.
    refused_with_no_run(&app, &[redis.port()], 1).await;
    let keys: u64 = redis::cmd("DBSIZE")
        .query_async(&mut admin)
        .await
        .expect("DBSIZE");
    assert_eq!(keys, 0, "refused requests left records behind");

    // An app connecting as the default user loads the functions on its first request.
    let admin_pool = RedisStore::pool(&redis.url()).expect("a pool for the default user");
    let loader = FloodServer::start(move || Idempotency::redis(admin_pool.clone()), 64);
    served_once_loaded(&app, &loader).await;
}

/// The same on a Redis Cluster of its own (3 primaries, 3 replicas), whose functions no
/// one has loaded yet.
#[actix_web::test]
async fn a_cluster_user_who_cannot_load_the_functions_is_refused_until_they_are_loaded() {
    let _turn = alone();
    let cluster = RedisCluster::start();
    // A cluster connection connects to a seed for the slot map, then to every node.
    let connections_per_attempt = cluster.ports().len() + 1;
    cluster_user_refused_until_the_functions_are_loaded(cluster, connections_per_attempt).await;
}

/// The same on a cluster that announces its nodes by hostname
/// (`cluster-preferred-endpoint-type hostname`, as behind TLS or in Kubernetes), whose
/// connections know the nodes by those names: the store asked each primary by the IP
/// `CLUSTER NODES` gives, no node answered, each was counted as able to call the
/// functions, and every handler ran with nothing to fence its commit or renew its lease
/// (a retry after the lease ran it again; cluster review).
#[actix_web::test]
async fn a_cluster_announcing_hostnames_refuses_a_user_who_cannot_load_the_functions() {
    let _turn = alone();
    let cluster = RedisCluster::start();
    for port in cluster.ports() {
        for (setting, value) in [
            ("cluster-announce-hostname", "localhost"),
            ("cluster-preferred-endpoint-type", "hostname"),
        ] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(setting)
                .arg(value)
                .query(&mut cluster.connection(port))
                .expect("CONFIG SET");
        }
    }
    // Until every node has gossiped its hostname, a slot map may still name an IP (each
    // node's IP stays in the map as metadata after its endpoint).
    let announced = Instant::now() + Duration::from_secs(10);
    for port in cluster.ports() {
        loop {
            let slots: redis::Value = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query(&mut cluster.connection(port))
                .expect("CLUSTER SLOTS");
            let by_hostname = format!("{slots:?}").matches("\"localhost\"").count();
            if by_hostname == cluster.ports().len() {
                break;
            }
            assert!(
                Instant::now() < announced,
                "{port} still announces IPs: {slots:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Twice as many connections per attempt as by IP here (12 for 6 nodes, 4 attempts in
    // 200 requests): the seeds, named by IP, are not the nodes the slot map names.
    let connections_per_attempt = 2 * cluster.ports().len();
    cluster_user_refused_until_the_functions_are_loaded(cluster, connections_per_attempt).await;
}

/// [`refused_until_the_functions_are_loaded`] on `cluster`, whose connections each open
/// at most `connections_per_attempt` connections to its nodes.
async fn cluster_user_refused_until_the_functions_are_loaded(
    cluster: RedisCluster,
    connections_per_attempt: usize,
) {
    let client = add_the_user_who_cannot_load_to_the_cluster(&cluster);
    let app = FloodServer::start(move || Idempotency::redis_cluster(client.clone()), 64);
    refused_with_no_run(&app, &cluster.ports(), connections_per_attempt).await;

    let admin_client = cluster.client();
    let loader = FloodServer::start(move || Idempotency::redis_cluster(admin_client.clone()), 64);
    served_once_loaded(&app, &loader).await;
}

/// The functions deleted from the server under a connection the store already uses
/// (`FUNCTION FLUSH`, `FUNCTION DELETE`), for a user who may not load them again: the step
/// that finds them missing has run its handler unfenced. The requests after it are refused
/// with 503 before any handler runs, as where the functions were missing when the
/// connection opened, rather than each running its handler and leaving its key to run
/// again. The first step to need them is the release of a failed request's key, on every
/// server.
#[actix_web::test]
async fn functions_deleted_under_an_open_connection_refuse_the_requests_after_the_first() {
    let _turn = beside_each_other();
    deleted_under_an_open_connection(PrivateRedis::start().await, FirstStep::Release).await;
}

/// The same on Redis 8.6, which has `SET … IFEQ` but is committed to by function (see
/// `docs/redis-8-set-ifeq.md`).
#[actix_web::test]
async fn on_redis_8_functions_deleted_under_an_open_connection_refuse_the_requests_after_the_first()
{
    let _turn = beside_each_other();
    deleted_under_an_open_connection(PrivateRedis::start_redis8(&[]).await, FirstStep::Release)
        .await;
}

/// The same on Redis 7, where the commit of a request served is the first step to find
/// them missing: that request's handler has run, unfenced.
#[actix_web::test]
async fn on_redis_7_functions_deleted_under_an_open_connection_are_found_by_the_commit() {
    let _turn = beside_each_other();
    deleted_under_an_open_connection(PrivateRedis::start_redis7(&[]).await, FirstStep::Commit)
        .await;
}

/// The functions loaded on `redis` by an app of the default user, then deleted under the
/// connection of an app of the user who may not load them, `first` the first request after.
async fn deleted_under_an_open_connection(redis: PrivateRedis, first: FirstStep) {
    let mut admin = add_the_user_who_cannot_load(&redis).await;
    let admin_pool = RedisStore::pool(&redis.url()).expect("a pool for the default user");
    let loader = FloodServer::start(move || Idempotency::redis(admin_pool.clone()), 64);
    assert_eq!(
        loader.post("/orders", "load").await.status,
        StatusCode::CREATED
    );

    let pool = RedisStore::pool(&url_of(&redis, "app")).expect("a pool for the app user");
    let app = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    only_the_request_that_finds_them_gone_runs(&app, first, async {
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .expect("FUNCTION FLUSH");
    })
    .await;
}

/// The same with replicated writes, where `begin` and `commit` wait for the replica on
/// connections of their own (spares): those kept from earlier requests must not let
/// handlers run once the functions are found missing.
#[actix_web::test]
async fn functions_deleted_under_open_replicated_connections_refuse_the_requests_after_the_first() {
    let _turn = beside_each_other();
    deleted_under_open_replicated_connections(PrivateRedis::start().await, FirstStep::Release)
        .await;
}

/// The same on Redis 7, where the commit, on a spare connection, finds them missing.
#[actix_web::test]
async fn on_redis_7_functions_deleted_under_open_replicated_connections_are_found_by_the_commit() {
    let _turn = beside_each_other();
    deleted_under_open_replicated_connections(
        PrivateRedis::start_redis7(&[]).await,
        FirstStep::Commit,
    )
    .await;
}

async fn deleted_under_open_replicated_connections(redis: PrivateRedis, first: FirstStep) {
    let mut replicated = ReplicatedWithAUserWhoCannotLoad::start(redis).await;
    let store = replicated.app_store();
    let app = FloodServer::start(move || Idempotency::new(store()), 64);
    only_the_request_that_finds_them_gone_runs(&app, first, async {
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query_async(&mut replicated.admin)
            .await
            .expect("FUNCTION FLUSH");
    })
    .await;
}

/// A private primary with one replica, the user `app` who may not `FUNCTION LOAD` on it,
/// and the functions loaded there by a request to an app of the default user: where the
/// tests with replicated writes (to the one replica, waiting up to 1 s) start.
struct ReplicatedWithAUserWhoCannotLoad {
    /// The primary.
    redis: PrivateRedis,
    _replica: PrivateRedis,
    /// A connection to the primary as the default user.
    admin: MultiplexedConnection,
    /// The app of the default user that loaded the functions, kept running.
    _loader: FloodServer,
}

impl ReplicatedWithAUserWhoCannotLoad {
    /// The replicated writes of every store of these tests.
    const WRITES: ReplicatedWrites = ReplicatedWrites::new(1, Duration::from_secs(1));

    /// With `redis` as the primary.
    async fn start(redis: PrivateRedis) -> Self {
        let replica = PrivateRedis::start_replica_of(&redis).await;
        let admin = add_the_user_who_cannot_load(&redis).await;
        let store = Self::store_of(&redis.url(), "the default user");
        let loader = FloodServer::start(move || Idempotency::new(store()), 64);
        assert_eq!(
            loader.post("/orders", "load").await.status,
            StatusCode::CREATED
        );
        Self {
            redis,
            _replica: replica,
            admin,
            _loader: loader,
        }
    }

    /// A new store of the user `app` on the primary for each call.
    fn app_store(&self) -> impl Fn() -> RedisStore + Clone + Send + use<> {
        Self::store_of(&url_of(&self.redis, "app"), "the app user")
    }

    /// A new store for each call on a pool of `url` (whose user is `who`), with
    /// [`WRITES`](Self::WRITES).
    fn store_of(url: &str, who: &str) -> impl Fn() -> RedisStore + Clone + Send + use<> {
        let pool =
            RedisStore::pool(url).unwrap_or_else(|error| panic!("a pool for {who}: {error}"));
        move || RedisStore::new(pool.clone()).replicated_writes(Self::WRITES)
    }
}

/// The same on a Redis Cluster of its own, the functions deleted from every primary (and
/// so from their replicas) under the store's cluster connection.
#[actix_web::test]
async fn functions_deleted_under_an_open_cluster_connection_refuse_the_requests_after_the_first() {
    let _turn = beside_each_other();
    deleted_under_an_open_cluster_connection(RedisCluster::start(), FirstStep::Release).await;
}

/// The same on a Redis 7 cluster, where the commit finds them missing.
#[actix_web::test]
async fn on_redis_7_functions_deleted_under_an_open_cluster_connection_are_found_by_the_commit() {
    let _turn = beside_each_other();
    deleted_under_an_open_cluster_connection(RedisCluster::start_redis7(), FirstStep::Commit).await;
}

async fn deleted_under_an_open_cluster_connection(cluster: RedisCluster, first: FirstStep) {
    let client = add_the_user_who_cannot_load_to_the_cluster(&cluster);
    let admin_client = cluster.client();
    let loader = FloodServer::start(move || Idempotency::redis_cluster(admin_client.clone()), 64);
    assert_eq!(
        loader.post("/orders", "load").await.status,
        StatusCode::CREATED
    );

    let app = FloodServer::start(move || Idempotency::redis_cluster(client.clone()), 64);
    only_the_request_that_finds_them_gone_runs(&app, first, async {
        for primary in cluster.primaries() {
            let _: () = redis::cmd("FUNCTION")
                .arg("FLUSH")
                .query(&mut cluster.connection(primary.port))
                .expect("FUNCTION FLUSH");
        }
    })
    .await;
}

/// A primary added to a Redis 7 cluster whose functions were loaded before it joined, and
/// given slots: it has no functions (a reshard moves keys, not functions), and for a user
/// who may not load them no step on the keys it holds could be fenced. The store's probe
/// asks every primary that serves slots, so keyed requests are refused (503, no handler
/// run) until someone who may loads them, as where every primary lacks them. It asked one
/// node at random, which mostly had them: the keys on the new primary ran their handlers,
/// unfenced, and ran them again for a retry after the lease. (Three attempts, a retry
/// interval apart, each probing anew.)
#[actix_web::test]
async fn a_primary_added_without_the_functions_refuses_a_user_who_cannot_load_them() {
    let _turn = beside_each_other();
    let cluster = RedisCluster::start_redis7();
    let admin_client = cluster.client();
    let loader = FloodServer::start(move || Idempotency::redis_cluster(admin_client.clone()), 64);
    assert_eq!(
        loader.post("/orders", "load").await.status,
        StatusCode::CREATED
    );
    let from = cluster.primaries()[0].port;
    let added = cluster.add_empty_primary();
    cluster.move_slots(from, added, 200);
    let client = add_the_user_who_cannot_load_to_the_cluster(&cluster);

    let app = FloodServer::start(move || Idempotency::redis_cluster(client.clone()), 64);
    for attempt in 0..3 {
        let keys: Vec<String> = (0..10).map(|n| format!("added-{attempt}-{n}")).collect();
        let replies = join_all(keys.iter().map(|key| app.post("/orders", key))).await;
        for (key, reply) in keys.iter().zip(replies) {
            assert_eq!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{key}: {reply:?}"
            );
        }
        actix_rt::time::sleep(Duration::from_millis(1_100)).await;
    }
    assert_eq!(app.runs.get(), 0, "a handler ran with nothing to fence it");
}

/// The first keyed request after the functions are deleted, whose step finds them missing.
#[derive(Clone, Copy, Debug)]
enum FirstStep {
    /// `POST /fail`, whose 500 is not stored: its key is given back by the `release`
    /// function, on every server. (A request served would be committed by a plain
    /// `SET … IFEQ` on Valkey ≥ 8.1, which needs no function.)
    Release,
    /// `POST /orders`, served: its commit is a function call on Redis (every version).
    Commit,
}

/// A key served and replayed by `app`, then the functions deleted (`flush`) under the
/// connections it uses, for a user who may not load them: the request `first` whose step
/// finds them missing has run its handler (its response goes out all the same), and the
/// next keyed requests get 503 with no handler run.
async fn only_the_request_that_finds_them_gone_runs(
    app: &FloodServer,
    first: FirstStep,
    flush: impl std::future::Future<Output = ()>,
) {
    let served = app.post("/orders", "served").await;
    assert_eq!(served.status, StatusCode::CREATED, "{served:?}");
    assert!(app.post("/orders", "served").await.is_replay());
    flush.await;
    // The runs of `/orders` and of `/fail` so far.
    let runs = match first {
        FirstStep::Release => {
            let found = app.post("/fail", "found-missing").await;
            assert_eq!(found.status, StatusCode::INTERNAL_SERVER_ERROR, "{found:?}");
            (1, 1)
        }
        FirstStep::Commit => {
            let found = app.post("/orders", "found-missing").await;
            assert_eq!(found.status, StatusCode::CREATED, "{found:?}");
            (2, 0)
        }
    };
    assert_eq!((app.runs.get(), app.failed_runs.get()), runs);
    for i in 0..5 {
        let key = format!("after-{i}");
        let refused = app.post("/orders", &key).await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{first:?}, {key}: {refused:?}"
        );
    }
    assert_eq!(
        (app.runs.get(), app.failed_runs.get()),
        runs,
        "handlers ran whose commits nothing could fence"
    );
}

/// What the store logs when a connection finds the functions missing and cannot load them.
const MISSING_FUNCTIONS_LOGGED: &str = "lacks this crate's functions";

/// [`REFUSED`] keyed requests to `app` get 503, and no handler runs; meanwhile the servers on
/// `ports` see the store look for the functions (`FCALL_RO`) once per retry interval (1 s)
/// at most, on as many new connections as `connections_per_attempt` allows each time (with
/// no retry interval: about twice per request, and each time on new connections).
async fn refused_with_no_run(app: &FloodServer, ports: &[u16], connections_per_attempt: usize) {
    let mut counters: Vec<redis::Connection> = ports.iter().map(|port| counter(*port)).collect();
    let before = tally(&mut counters);
    let logged_before = errors_logged(MISSING_FUNCTIONS_LOGGED);
    let started = Instant::now();
    for batch in 0..REFUSED / AT_ONCE {
        let keys: Vec<String> = (0..AT_ONCE)
            .map(|i| format!("charge-{}", batch * AT_ONCE + i))
            .collect();
        let replies = join_all(keys.iter().map(|key| app.post("/orders", key))).await;
        for (key, refused) in keys.iter().zip(replies) {
            assert_eq!(
                refused.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{key}: {refused:?}"
            );
        }
        actix_rt::time::sleep(PAUSE).await;
    }
    let elapsed = started.elapsed();
    let after = tally(&mut counters);
    let logged = errors_logged(MISSING_FUNCTIONS_LOGGED) - logged_before;
    assert_eq!(app.runs.get(), 0, "a handler ran with nothing to fence it");

    let (connections, probes) = (
        after.connections - before.connections,
        after.probes - before.probes,
    );
    // The first attempt, one more per whole interval elapsed, and one for an interval that
    // ran out between two batches.
    let attempts = 2 + elapsed.as_secs();
    eprintln!(
        "{REFUSED} refused requests in {elapsed:?}: {connections} connections, {probes} probes, \
         {logged} errors logged for the missing functions"
    );
    // At 0 s, and again once 1 s and 2 s have passed: the store keeps trying.
    assert!(
        probes >= 3,
        "{probes} probes for the functions in {elapsed:?}: the store gave up"
    );
    assert!(
        probes <= attempts,
        "{probes} probes for the functions for {REFUSED} refused requests in {elapsed:?}"
    );
    assert!(
        connections <= attempts * connections_per_attempt as u64,
        "{connections} connections for {REFUSED} refused requests in {elapsed:?}"
    );
    assert_eq!(logged, probes, "one error in the log per attempt");
}

/// Once `loader` (a user who may) has loaded the functions with a request of its own, `app`
/// runs a new key once (within its retry interval; until then it is refused, with no run)
/// and replays it.
async fn served_once_loaded(app: &FloodServer, loader: &FloodServer) {
    assert_eq!(
        loader.post("/orders", "load").await.status,
        StatusCode::CREATED
    );
    let loaded = Instant::now();
    let first = loop {
        let reply = app.post("/orders", "charge-1").await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE || loaded.elapsed() > SERVED_WITHIN {
            break reply;
        }
        assert_eq!(app.runs.get(), 0, "a refused request ran");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "{:?} after loading: {first:?}",
        loaded.elapsed()
    );
    let replay = app.post("/orders", "charge-1").await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(app.runs.get(), 1);
}

/// A connection to the node on `port` as the default user, to read its counts.
fn counter(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("a valid URL")
        .get_connection()
        .unwrap_or_else(|error| panic!("node {port}: {error}"))
}

/// What servers counted, summed over them.
#[derive(Clone, Copy)]
struct Tally {
    /// Connections they accepted (`total_connections_received`).
    connections: u64,
    /// `FCALL_RO`s they were sent (run or refused): the store's probes for its functions.
    probes: u64,
}

/// The counts of the servers `counters` are connected to.
fn tally(counters: &mut [redis::Connection]) -> Tally {
    let mut tally = Tally {
        connections: 0,
        probes: 0,
    };
    for counter in counters {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .arg("commandstats")
            .query(counter)
            .expect("INFO stats commandstats");
        for line in info.lines() {
            if let Some(count) = line.strip_prefix("total_connections_received:") {
                tally.connections += count.trim().parse::<u64>().expect("a count");
            }
            if let Some(stats) = line.strip_prefix("cmdstat_fcall_ro:") {
                tally.probes += stats
                    .split(',')
                    .filter_map(|stat| {
                        stat.strip_prefix("calls=")
                            .or_else(|| stat.strip_prefix("rejected_calls="))
                    })
                    .map(|count| count.trim().parse::<u64>().expect("a count"))
                    .sum::<u64>();
            }
        }
    }
    tally
}

/// How many errors logged so far (by any test of this process: nextest runs each in a
/// process of its own) hold `marker`.
fn errors_logged(marker: &str) -> u64 {
    let log = error_log().lock().expect("the log");
    let logged = String::from_utf8_lossy(&log);
    logged.lines().filter(|line| line.contains(marker)).count() as u64
}

/// Every error this process logged, from the first call on.
fn error_log() -> &'static Mutex<Vec<u8>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::ERROR)
            .with_ansi(false)
            .with_writer(move || LogWriter(Arc::clone(&sink)))
            .init();
        log
    })
}

/// Appends what is logged to a shared buffer.
struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("the log").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The same where the functions are found missing first by a step on the shared connection
/// (a renewal, opening it: with replicated writes `begin` and `commit` go on spare
/// connections only): the spare kept from before must not let the handlers after it run.
#[actix_web::test]
async fn functions_found_missing_by_a_renewal_refuse_the_begins_on_kept_spare_connections() {
    let _turn = alone();
    let mut replicated = ReplicatedWithAUserWhoCannotLoad::start(PrivateRedis::start().await).await;
    let store = replicated.app_store();
    // A short lease: the slow run renews it every 300 ms.
    let policy = IdempotencyPolicy::default().lease(Duration::from_millis(900));
    let app = Rc::new(FloodServer::start(
        move || Idempotency::new(store()).policy(policy.clone()),
        64,
    ));
    let slow = actix_rt::spawn({
        let app = Rc::clone(&app);
        async move { app.post("/slow", "slow").await }
    });
    app.slow_runs.wait_for(1).await;
    let logged_before = errors_logged(MISSING_FUNCTIONS_LOGGED);
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut replicated.admin)
        .await
        .expect("FUNCTION FLUSH");
    // Its renewals find the functions missing (and say so in the log): waited for, so that
    // a late renewal cannot leave the next `begin` to a spare connection kept from before.
    let deadline = Instant::now() + Duration::from_secs(10);
    while errors_logged(MISSING_FUNCTIONS_LOGGED) == logged_before {
        assert!(
            Instant::now() < deadline,
            "no renewal found the functions missing in 10 s"
        );
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    let after = app.post("/orders", "after").await;
    app.gate.open();
    let slow = slow.await.expect("the slow request");
    assert_eq!(slow.status, StatusCode::CREATED, "{slow:?}");
    assert_eq!(after.status, StatusCode::SERVICE_UNAVAILABLE, "{after:?}");
    assert_eq!(
        app.runs.get(),
        0,
        "a handler ran whose commit nothing could fence"
    );
}
