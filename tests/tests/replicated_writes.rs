//! Replicated writes on the single-server Redis store, against a private primary with one
//! replica: each write waits for the replica; when it is down, strict refuses new keys
//! (503, the handler does not run) while replays go on, and `or_warn` goes on. The
//! cluster store runs the same protocol in `redis_cluster_failover` and the acceptance
//! suite. Each replica has acknowledged a write before the test's first request
//! ([`PrivateRedis::start_replica_of`] waits for it): until then its primary holds back the stream to a replica
//! that just synced, and a `WAIT` counts no replica (a flaky 503 under load).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use idempotency_actix::{
    BeginOutcome, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, LeaseToken,
    RedisStore, ReplicatedWrites, StorageKey, StoredResponse,
};
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::{PrivateRedis, keys_under, unique_prefix};

fn app(primary: &PrivateRedis, writes: ReplicatedWrites, runs: &RunsByKey) -> (KeyedApp, String) {
    let pool = RedisStore::pool(&primary.url()).unwrap();
    let prefix = unique_prefix("replicated");
    let app = {
        let prefix = prefix.clone();
        KeyedApp::start(
            move || {
                let store = RedisStore::new(pool.clone()).replicated_writes(writes);
                Idempotency::new(store).key_prefix(prefix.clone())
            },
            runs.clone(),
        )
    };
    (app, prefix)
}

/// The `WAIT` timeout where the replica is down or missing: each write waits all of it.
const WAIT: Duration = Duration::from_millis(200);

/// The `WAIT` timeout where a test needs the replica, up, to acknowledge its writes: `WAIT`
/// answers as soon as it does, but a loaded machine (two busy loops on the two cores beside
/// the file's tests) kept it from acknowledging the first key within 200 ms in 3 of 35
/// runs (a 503, the store rightly reporting the lock not replicated). Well below the store
/// timeout (2 s), as `ReplicatedWrites` asks.
const WAIT_FOR_THE_REPLICA: Duration = Duration::from_secs(1);

/// On loopback a replica has every write within microseconds, `WAIT` or not: so each new
/// key's `WAIT`s are counted too, the lock's and the commit's, both answered before the
/// response arrived (the record's count alone also passed with commits that did not wait;
/// test review).
#[actix_web::test]
async fn with_the_replica_up_the_record_is_on_it_when_the_response_arrives() {
    let primary = PrivateRedis::start().await;
    let replica = PrivateRedis::start_replica_of(&primary).await;
    let runs = RunsByKey::default();
    let (app, prefix) = app(
        &primary,
        ReplicatedWrites::new(1, WAIT_FOR_THE_REPLICA),
        &runs,
    );

    for n in 0..20 {
        let key = format!("k{n}");
        primary.take_command_counts().await;
        let first = app.post(&key).await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{key}: {first:?}");
        let counts = primary.take_command_counts().await;
        assert_eq!(
            counts.get("wait"),
            Some(&2),
            "{key}: the lock and the commit each waited for the replica: {counts:?}"
        );
        assert_eq!(
            keys_under(&mut replica.connection().await, &prefix)
                .await
                .len(),
            n + 1,
            "the replica holds the record of {key} as its response arrives"
        );
        let replay = app.post(&key).await.unwrap();
        assert!(replay.is_replay());
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(runs.total(), 20);
}

/// The longest timeout `ReplicatedWrites::new` takes (365 days, as for every duration of
/// the middleware) is one Redis accepts: with the replica up, `WAIT` answers at once and the
/// key runs and replays. A longer one panics when built (a unit test of `replication.rs`):
/// Redis answered `ERR timeout is not an integer or out of range` to every replicated write
/// of a `Duration::MAX`, so every new key was a 503.
#[actix_web::test]
async fn the_longest_timeout_is_one_redis_accepts() {
    let primary = PrivateRedis::start().await;
    let _replica = PrivateRedis::start_replica_of(&primary).await;
    let runs = RunsByKey::default();
    let longest = ReplicatedWrites::new(1, idempotency_actix::MAX_DURATION);
    let (app, _prefix) = app(&primary, longest, &runs);

    let first = app.post("k").await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = app.post("k").await.unwrap();
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.total(), 1);
}

#[actix_web::test]
async fn strict_refuses_new_keys_while_the_replica_is_down_and_replays_go_on() {
    let primary = PrivateRedis::start().await;
    let mut replica = PrivateRedis::start_replica_of(&primary).await;
    let runs = RunsByKey::default();
    let (app, _prefix) = app(
        &primary,
        ReplicatedWrites::new(1, WAIT_FOR_THE_REPLICA),
        &runs,
    );
    let done = app.post("done").await.unwrap();
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");

    replica.stop();
    let refused = app.post("new").await.unwrap();
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.header("retry-after").is_some());
    assert_eq!(runs.of("new"), 0, "the handler did not run");
    let replay = app.post("done").await.unwrap();
    assert!(replay.is_replay(), "replays need no replica: {replay:?}");

    // Once a replica is back, the refused key runs (its lock was released).
    let _replica = PrivateRedis::start_replica_of(&primary).await;
    let created = app.create("new", 40).await.expect("served once replicated");
    assert!(!created.reply.is_replay());
    assert_eq!(runs.of("new"), 1);
}

/// A `begin` refused because no replica acknowledged its lock leaves no lock behind once its
/// 503 has arrived: a retry sent at once is refused again (503, the replica still missing),
/// not answered 409 "in progress" for a request that runs nothing; and another request's
/// `begin` (on a store without replicated writes, so that only the key's state decides)
/// takes the key. The lock was left on the primary until the engine's abandon, 50 ms later
/// in the background (or for a whole lease, where the process stopped first).
#[actix_web::test]
async fn a_begin_its_replicas_refused_leaves_no_lock_behind() {
    let primary = PrivateRedis::start().await;
    let runs = RunsByKey::default();
    let (app, prefix) = app(&primary, ReplicatedWrites::new(1, WAIT), &runs);

    let refused = app.post("k").await.expect("an answer");
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    let retry = app.post("k").await.expect("an answer");
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert_eq!(runs.of("k"), 0, "the handler did not run");

    let plain = RedisStore::new(RedisStore::pool(&primary.url()).expect("a valid Redis URL"));
    let key = StorageKey::new(
        &prefix,
        b"",
        &IdempotencyKey::parse(b"k").expect("a valid key"),
    );
    // The fingerprint of the app's requests for `k`.
    let print = Fingerprint::compute(&Method::POST, "/orders", "", br#"{"key":"k"}"#, []);
    let next = plain
        .begin(
            &key,
            &print,
            &LeaseToken::generate(),
            Duration::from_secs(30),
        )
        .await
        .expect("the store answers");
    assert_eq!(
        next,
        BeginOutcome::Acquired,
        "the refused lock was given back"
    );
}

#[actix_web::test]
async fn or_warn_goes_on_while_the_replica_is_down() {
    let primary = PrivateRedis::start().await;
    let mut replica = PrivateRedis::start_replica_of(&primary).await;
    replica.stop();
    let runs = RunsByKey::default();
    let (app, _prefix) = app(&primary, ReplicatedWrites::new(1, WAIT).or_warn(), &runs);

    let first = app.post("key").await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = app.post("key").await.unwrap();
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.of("key"), 1);
}

/// A primary with one replica and a store on it with strict replicated writes: both
/// of the store's spare connections have written a lock the replica acknowledged (`k1`,
/// `k2`, by `tokens[0]` and `tokens[1]`), and then the replica is stopped (SIGSTOP), still
/// connected: it falls behind until [`wake`](Self::wake).
///
/// The stall lasts until the test ends it. It was a `DEBUG SLEEP 2` on the replica, which
/// a loaded machine (the whole suite at once) could see end before the test had its last
/// write refused: the replica then had that write, and the store rightly reported it
/// replicated (`Ok(true)` for the retried commit on Redis 7, once in CI; 3 of 35 runs of
/// this file with two busy loops on the machine's two cores, each 2 s after the stall was
/// sent).
struct StalledReplica {
    _primary: PrivateRedis,
    replica: PrivateRedis,
    store: RedisStore,
    prefix: String,
    print: Fingerprint,
    lease: Duration,
    tokens: Vec<LeaseToken>,
}

/// The server a [`StalledReplica`] runs on, and how the store commits there.
#[derive(Clone, Copy, Debug)]
enum Server {
    /// Valkey ≥ 8.1: commits by `SET … IFEQ`; `WAIT` counts the connection's own writes.
    Valkey,
    /// Valkey ≥ 8.1 with commits by function: what Redis 7.2 and later (every Redis is
    /// committed to by function) and Valkey before 8.1 are to the store, a `WAIT` that
    /// counts the connection's own writes.
    ValkeyByFunction,
    /// Redis without `IFEQ` ([`PrivateRedis::start_redis7`], whatever the `PATH`'s
    /// `redis-server` is): commits by function; on Redis 7.0 `WAIT` counts the server's
    /// replication offset.
    Redis7,
}

impl StalledReplica {
    async fn start(test: &str, tokens: usize, server: Server) -> Self {
        Self::start_over_a_marker(test, tokens, server, false).await
    }

    /// [`start`](Self::start), where `over_a_marker` has `k1` taken over another token's
    /// marker: a token abandoned there first, whose marker the lock of `tokens[0]` carries.
    async fn start_over_a_marker(
        test: &str,
        tokens: usize,
        server: Server,
        over_a_marker: bool,
    ) -> Self {
        let primary = match server {
            Server::Valkey | Server::ValkeyByFunction => PrivateRedis::start_valkey(&[]).await,
            Server::Redis7 => PrivateRedis::start_redis7(&[]).await,
        };
        let replica = PrivateRedis::start_replica_of(&primary).await;
        let mut store = RedisStore::new(RedisStore::pool(&primary.url()).unwrap())
            .replicated_writes(ReplicatedWrites::new(1, Duration::from_millis(300)));
        if let Server::ValkeyByFunction = server {
            store = store.commits_by_function();
        }
        let setup = Self {
            store,
            prefix: unique_prefix(test),
            print: Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []),
            lease: Duration::from_secs(30),
            tokens: (0..tokens).map(|_| LeaseToken::generate()).collect(),
            _primary: primary,
            replica,
        };
        if over_a_marker {
            let abandoned = LeaseToken::generate();
            let key = setup.key("k1");
            assert!(
                setup
                    .store
                    .abandon(&key, &abandoned, setup.lease)
                    .await
                    .unwrap()
            );
        }
        // Two begins at once: the store keeps two spare connections for its replicated
        // writes.
        let (first, second) = futures_util::future::join(
            setup.begin_acknowledged("k1", 0),
            setup.begin_acknowledged("k2", 1),
        )
        .await;
        assert_eq!(first, BeginOutcome::Acquired);
        assert_eq!(second, BeginOutcome::Acquired);
        setup.replica.pause();
        setup
    }

    /// Ends the stall: the replica goes on with what queued meanwhile.
    fn wake(&self) {
        self.replica.resume();
    }

    fn key(&self, name: &str) -> StorageKey {
        StorageKey::new(
            &self.prefix,
            b"",
            &IdempotencyKey::parse(name.as_bytes()).unwrap(),
        )
    }

    /// [`begin`](Self::begin), sent again while the replica does not acknowledge it within
    /// the store's 300 ms `WAIT` (a resent `begin` finds its token's lock and has it counted
    /// again): before the test's own stall, a loaded machine can hold the replica up for
    /// that long (seen once in CI: `NotReplicated { step: "begin", acknowledged: 0 }`).
    async fn begin_acknowledged(&self, name: &str, token: usize) -> BeginOutcome {
        let mut last = None;
        for _ in 0..10 {
            match self.begin(name, token).await {
                Ok(outcome) => return outcome,
                Err(error) => last = Some(error),
            }
            actix_rt::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the replica acknowledged no begin of {name} in 10 tries: {last:?}");
    }

    /// Commits a 201 `paid`, kept for 60 s, at `name` for `tokens[token]`.
    async fn commit(
        &self,
        name: &str,
        token: usize,
    ) -> Result<bool, idempotency_actix::StoreError> {
        let response = StoredResponse::new(
            StatusCode::CREATED,
            Vec::new(),
            Some(Bytes::from_static(b"paid")),
        );
        let ttl = Duration::from_secs(60);
        let paid = self.key(name);
        let token = &self.tokens[token];
        self.store
            .commit(&paid, &self.print, token, &response, ttl)
            .await
    }

    async fn begin(
        &self,
        name: &str,
        token: usize,
    ) -> Result<BeginOutcome, idempotency_actix::StoreError> {
        self.store
            .begin(
                &self.key(name),
                &self.print,
                &self.tokens[token],
                self.lease,
            )
            .await
    }
}

/// Whether `attempt` answers `true` within 20 tries, 100 ms apart.
async fn eventually<F: std::future::Future<Output = bool>>(mut attempt: impl FnMut() -> F) -> bool {
    for _ in 0..20 {
        if attempt().await {
            return true;
        }
        actix_rt::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A commit of a lock that took its key over another token's marker on a server with
/// `SET … IFEQ`, which writes nothing over such a lock: the library's `commit` completes it,
/// and that write waits for the replica as any commit does: not reported replicated while the
/// replica stalls, and reported once it has caught up. (Without `IFEQ` the commit is that
/// function from the start, as for any key.)
async fn a_commit_over_a_marker_is_not_replicated_until_the_replica_has_it(server: Server) {
    let setup = StalledReplica::start_over_a_marker("commit-over-marker", 2, server, true).await;
    let commit = || setup.commit("k1", 0);
    let committed = commit().await;
    assert!(
        committed.is_err(),
        "reported replicated while the replica stalled: {committed:?}"
    );
    setup.wake();
    assert!(
        eventually(|| async { commit().await.is_ok_and(|held| held) }).await,
        "the retries never saw the record replicated"
    );
}

/// A commit retried after its replicas fell short, on a connection that wrote nothing: the
/// retry finds the record completed and writes nothing, so the record is written over
/// itself (`SET … IFEQ`, or the library's `rewrite`) for the `WAIT` behind it to count. (On
/// Redis 7.2 to 8.2 and Valkey before 8.1 a `WAIT` after the function commit that wrote
/// nothing passed at once: helper review, shown by `Server::ValkeyByFunction`.)
async fn a_retried_commit_is_not_replicated_until_the_replica_has_it(server: Server) {
    let setup = StalledReplica::start("retried-commit", 3, server).await;
    let commit = || setup.commit("k1", 0);
    assert!(
        commit().await.is_err(),
        "the replica has not acknowledged the commit"
    );

    // The engine retries it in the background while other requests use the spares: the
    // retry finds the record completed and writes nothing, and is on a connection that
    // wrote nothing either. It is not replicated as long as the replica is behind.
    let (_, retried) = futures_util::future::join(setup.begin("k3", 2), commit()).await;
    assert!(
        retried.is_err(),
        "reported replicated while the replica stalled: {retried:?}"
    );
    // Once the replica catches up, a retry is replicated (its first may still find it
    // behind).
    setup.wake();
    assert!(
        eventually(|| async { commit().await.is_ok_and(|held| held) }).await,
        "the retries never saw the record replicated"
    );
}

/// A `begin` sent again that finds its own lock: the lock is written over itself
/// (`SET … IFEQ`, or the library's `rewrite`) for the `WAIT` behind it to count.
async fn a_resent_begin_is_not_replicated_until_the_replica_has_it(server: Server) {
    let setup = StalledReplica::start("resent-begin", 4, server).await;
    let begin = || setup.begin("k3", 2);
    assert!(
        begin().await.is_err(),
        "the replica has not acknowledged the lock"
    );

    // The same begin sent again (as after a reconnection), on the other spare while another
    // request uses the first: it finds its own lock and writes nothing, on a connection
    // whose writes the replica all acknowledged. The lock is not on the replica yet.
    let (_, resent) = futures_util::future::join(setup.begin("k4", 3), begin()).await;
    assert!(
        resent.is_err(),
        "reported replicated while the replica stalled: {resent:?}"
    );
    // Once the replica catches up, the lock is reported held and replicated.
    setup.wake();
    assert!(
        eventually(|| async {
            begin()
                .await
                .is_ok_and(|outcome| outcome == BeginOutcome::Acquired)
        })
        .await,
        "the resent begins never saw the lock replicated"
    );
}

#[actix_web::test]
async fn on_valkey_a_retried_commit_is_not_replicated_until_the_replica_has_it() {
    a_retried_commit_is_not_replicated_until_the_replica_has_it(Server::Valkey).await;
}

#[actix_web::test]
async fn without_ifeq_a_retried_commit_is_not_replicated_until_the_replica_has_it() {
    a_retried_commit_is_not_replicated_until_the_replica_has_it(Server::ValkeyByFunction).await;
}

#[actix_web::test]
async fn on_redis_7_a_retried_commit_is_not_replicated_until_the_replica_has_it() {
    a_retried_commit_is_not_replicated_until_the_replica_has_it(Server::Redis7).await;
}

#[actix_web::test]
async fn on_valkey_a_resent_begin_is_not_replicated_until_the_replica_has_it() {
    a_resent_begin_is_not_replicated_until_the_replica_has_it(Server::Valkey).await;
}

#[actix_web::test]
async fn without_ifeq_a_resent_begin_is_not_replicated_until_the_replica_has_it() {
    a_resent_begin_is_not_replicated_until_the_replica_has_it(Server::ValkeyByFunction).await;
}

#[actix_web::test]
async fn on_redis_7_a_resent_begin_is_not_replicated_until_the_replica_has_it() {
    a_resent_begin_is_not_replicated_until_the_replica_has_it(Server::Redis7).await;
}

#[actix_web::test]
async fn on_valkey_a_commit_over_a_marker_is_not_replicated_until_the_replica_has_it() {
    a_commit_over_a_marker_is_not_replicated_until_the_replica_has_it(Server::Valkey).await;
}
