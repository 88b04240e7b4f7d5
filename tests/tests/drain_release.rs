//! `Idempotency::drain`, and a client that leaves while its request gives back the key it
//! found free: the release goes on to its end without the client, the drain waits for it,
//! and the retry finds the key free (503 `shutting-down` again, never 409 for a lease).
//! Real sockets, an in-process server on a memory store whose releases are slow.
//!
//! And a process that stops before such a release lands: the key stays locked only for a
//! short lease, not the route's.
//!
//! And a client that leaves while that release is on its way is counted by what it was
//! refused with, `shutting_down`, not as `client_gone`.
//!
//! And a client that leaves while its request's `begin` is on its way, before the drain:
//! the `begin` lands, its reply finds no request, and its token is abandoned in the
//! background; the drain waits for that abandon's first attempt, so the key is free once
//! the drain returns (a process that stopped then used to leave it locked for a lease, 30 s
//! on the reference server, with no handler running).
//!
//! Tests in a binary of their own: a drain is for the whole process and for good (each
//! test drains; neither minds the other's).

#![allow(clippy::unwrap_used)]
// Each test holds its turn (a plain mutex, on its own runtime thread) for its whole run.
#![allow(clippy::await_holding_lock)]

use std::io::Write;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpServer};
use idempotency_actix::{Idempotency, IdempotencyPolicy, Inspector, KeyScope, RecordState};
use idempotency_actix_tests::{FaultyStore, GatedRoutes, Reply, reset};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// This binary's recorder, installed by the first test that asks for it.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: std::sync::OnceLock<Snapshotter> = std::sync::OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().unwrap();
        snapshotter
    })
}

/// `idempotency_requests_total{route="/quick"}` by outcome, counted since the last call.
fn quick_outcomes() -> Vec<(String, u64)> {
    let mut outcomes = Vec::new();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let (_, key) = key.into_parts();
        let label = |name: &str| {
            key.labels()
                .find(|label| label.key() == name)
                .map(|label| label.value().to_owned())
        };
        if let (DebugValue::Counter(count), Some(outcome)) = (value, label("outcome"))
            && key.name() == "idempotency_requests_total"
            && label("route").as_deref() == Some("/quick")
            && count > 0
        {
            outcomes.push((outcome, count));
        }
    }
    outcomes.sort();
    outcomes
}

/// One worker serving `routes` on `store` (a lease of 30 s), on a loopback port: its
/// address, its handle and the task that runs it.
fn start(
    store: &FaultyStore,
    routes: &GatedRoutes,
) -> (
    std::net::SocketAddr,
    actix_web::dev::ServerHandle,
    actix_rt::task::JoinHandle<std::io::Result<()>>,
) {
    let (store, routes) = (store.clone(), routes.clone());
    let server = HttpServer::new(move || {
        let policy = IdempotencyPolicy::default().lease(Duration::from_secs(30));
        App::new()
            .wrap(
                Idempotency::new(store.clone())
                    .policy(policy)
                    .scope(KeyScope::global()),
            )
            .configure(routes.configure())
    })
    .workers(1)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .unwrap();
    let addr = server.addrs()[0];
    let server = server.run();
    (addr, server.handle(), actix_rt::spawn(server))
}

/// Held by each test for its whole run: both send requests to `/quick`, whose counts
/// [`quick_outcomes`] reads.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `POST /quick` with `Idempotency-Key: key` to the server at `addr`.
async fn post_quick(addr: std::net::SocketAddr, key: &str) -> Reply {
    let reply = awc::Client::default()
        .post(format!("http://{addr}/quick"))
        .insert_header(("idempotency-key", key))
        .send()
        .await
        .unwrap();
    Reply::read(reply).await.unwrap()
}

/// Asserts that `reply` is what a new key gets while draining: the 503 `shutting-down`
/// problem.
fn assert_shutting_down(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(
        reply.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
}

/// Sends `POST /quick` with `Idempotency-Key: key` on a socket of its own to the server at
/// `addr`, without reading the reply: the socket, for the test to [`reset`].
fn send_quick(addr: std::net::SocketAddr, key: &str) -> std::net::TcpStream {
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    write!(
        socket,
        "POST /quick HTTP/1.1\r\nHost: test\r\nIdempotency-Key: {key}\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    socket
}

#[actix_rt::test]
async fn a_key_given_back_while_draining_is_released_though_its_client_left() {
    let _turn = one_at_a_time();
    // A release takes half a second to reach the store, as on a slow Redis.
    let store = FaultyStore {
        release_delay: Duration::from_millis(500),
        ..FaultyStore::default()
    };
    let routes = GatedRoutes::default();
    let quick_runs = routes.quick_runs.clone();
    let (addr, handle, server) = start(&store, &routes);
    snapshotter();
    quick_outcomes(); // what the other test counted

    // Nothing is in progress yet: the drain starts and ends at once.
    assert_eq!(Idempotency::drain(Duration::from_secs(30)).await, 0);
    // A new key: found free while draining, so given back; its client resets the connection
    // while the release is on its way.
    let socket = send_quick(addr, "left");
    store.releases.wait_for(1).await;
    reset(socket);

    // The drain waits for the release, which goes on without the client...
    assert_eq!(Idempotency::drain(Duration::from_secs(30)).await, 0);
    // ...so the key is free: its retry is given back too, not told to wait for a run that
    // does not exist.
    assert_shutting_down(&post_quick(addr, "left").await);
    assert_eq!(quick_runs.get(), 0, "a handler ran while draining");
    // Both refused, the request whose client left included (not `client_gone`).
    assert_eq!(
        quick_outcomes(),
        vec![("shutting_down".to_owned(), 2)],
        "the request whose client left is counted as refused"
    );

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}

/// A new key found free while draining, whose release never lands (the process stopped
/// first): the key is locked only for the short lease of a `begin` sent while draining
/// (2 s), not the route's 30 s, so its retry after that is given back again (503
/// `shutting-down`) rather than answered 409. It used to answer 409 for the whole lease.
#[actix_rt::test]
async fn a_key_whose_release_is_lost_while_draining_is_locked_only_briefly() {
    let _turn = one_at_a_time();
    let store = FaultyStore::default();
    // Every release is lost, those sent again in the background too.
    store
        .lost_releases
        .store(u32::MAX, std::sync::atomic::Ordering::SeqCst);
    let routes = GatedRoutes::default();
    let quick_runs = routes.quick_runs.clone();
    let (addr, handle, server) = start(&store, &routes);
    Idempotency::drain(Duration::from_secs(30)).await;

    let first = post_quick(addr, "lost-release").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert!(store.releases.get() >= 1);
    // The lock its lost release left: a retry meanwhile is told the key is in flight.
    let meanwhile = post_quick(addr, "lost-release").await;
    assert_eq!(meanwhile.status, StatusCode::CONFLICT, "{meanwhile:?}");
    actix_rt::time::sleep(Duration::from_millis(2_500)).await;
    assert_shutting_down(&post_quick(addr, "lost-release").await);
    assert_eq!(quick_runs.get(), 0, "a handler ran while draining");

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}

/// A client that leaves while its `begin` is on its way, then a drain: the drain waits for
/// the abandon of the `begin`'s token, and the key is free once it returns.
#[actix_rt::test]
async fn a_drain_waits_for_the_abandon_of_a_begin_whose_client_left() {
    let _turn = one_at_a_time();
    // The `begin` reaches the store at once and answers half a second later; an abandon
    // reaches the store a fifth of a second after it is sent.
    let store = FaultyStore {
        begin_reply_delay: Duration::from_millis(500),
        abandon_delay: Duration::from_millis(200),
        ..FaultyStore::default()
    };
    let routes = GatedRoutes::default();
    let quick_runs = routes.quick_runs.clone();
    let (addr, handle, server) = start(&store, &routes);

    // Its `begin` has locked the key; the client resets the connection before the reply.
    let socket = send_quick(addr, "left-in-begin");
    store.begins.wait_for(1).await;
    let inspector = Inspector::new(store.inner.clone());
    let locked = inspector.lookup(b"", "left-in-begin").await.unwrap();
    assert_eq!(
        locked.map(|record| record.state),
        Some(RecordState::InFlight),
        "the begin did not lock the key"
    );
    reset(socket);
    // Actix drops the request's future when it reads the reset; the abandon is sent then.
    actix_rt::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        store.abandons.get(),
        0,
        "the abandon landed before the drain"
    );

    assert_eq!(Idempotency::drain(Duration::from_secs(30)).await, 0);
    assert_eq!(
        store.abandons.get(),
        1,
        "the drain returned before the abandon landed"
    );
    let after = inspector.lookup(b"", "left-in-begin").await.unwrap();
    assert!(after.is_none(), "the key is still locked: {after:?}");
    // A retry finds the key free: refused as every new key is while draining, not 409.
    assert_shutting_down(&post_quick(addr, "left-in-begin").await);
    assert_eq!(quick_runs.get(), 0, "a handler ran");

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}
