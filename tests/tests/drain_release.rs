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
//! Tests in a binary of their own: a drain is for the whole process and for good (each
//! test drains; neither minds the other's).

#![allow(clippy::unwrap_used)]
// Each test holds its turn (a plain mutex, on its own runtime thread) for its whole run.
#![allow(clippy::await_holding_lock)]

use std::io::Write;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpServer};
use idempotency_actix::{Idempotency, IdempotencyPolicy, KeyScope};
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
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    write!(
        socket,
        "POST /quick HTTP/1.1\r\nHost: test\r\nIdempotency-Key: left\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    store.releases.wait_for(1).await;
    reset(socket);

    // The drain waits for the release, which goes on without the client...
    assert_eq!(Idempotency::drain(Duration::from_secs(30)).await, 0);
    // ...so the key is free: its retry is given back too, not told to wait for a run that
    // does not exist.
    let client = awc::Client::default();
    let retry = client
        .post(format!("http://{addr}/quick"))
        .insert_header(("idempotency-key", "left"))
        .send()
        .await
        .unwrap();
    let retry = Reply::read(retry).await.unwrap();
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert_eq!(
        retry.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
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

    let client = awc::Client::default();
    let post = || async {
        let reply = client
            .post(format!("http://{addr}/quick"))
            .insert_header(("idempotency-key", "lost-release"))
            .send()
            .await
            .unwrap();
        Reply::read(reply).await.unwrap()
    };
    let first = post().await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert!(store.releases.get() >= 1);
    // The lock its lost release left: a retry meanwhile is told the key is in flight.
    let meanwhile = post().await;
    assert_eq!(meanwhile.status, StatusCode::CONFLICT, "{meanwhile:?}");
    actix_rt::time::sleep(Duration::from_millis(2_500)).await;
    let retry = post().await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert_eq!(
        retry.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
    assert_eq!(quick_runs.get(), 0, "a handler ran while draining");

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}
